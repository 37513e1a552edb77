"""The loss types a recipe can name, and the rule that picks the CE path: torch-free, for the recipe schema,
``delft recipe check --plan``, the loss factory (delft.losses) and the docs (docs/losses.md).

A new digit term is one LOSS_TYPES entry here plus one per-position function in delft.losses registered under
the same name (``@term_of("name")``); options it reads (like dist2's tau) are LossConfig fields named in
``params``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossType:
    name: str
    default_weight: float  # lambda when loss.weight is not given
    summary: str  # one line: what the term is
    params: tuple[str, ...] = ()  # LossConfig fields the term takes as keyword arguments
    place_weighted: bool = False  # the term reads DEL's place weight (loss.place_weights applies)
    replaces_ce: bool = False  # a weighting of CE itself (dft), no digit term: loss.weight does not apply

    @property
    def has_term(self) -> bool:
        return self.name != CE and not self.replaces_ce


CE, DFT = "ce", "dft"


# Default lambdas multiply a mean over the whole optimizer batch (loss.normalisation: global), so they are not
# the reference's lambda: docs/losses.md#normalisation-and-lambda gives the reference's effective weight (lambda x
# accumulation steps x GPUs). Why DEL's default is small and the quickstart uses del_prob: the measured runs are in
# docs/losses.md#the-default-weight-del-003 and docs/studies.md.
LOSS_TYPES: dict[str, LossType] = {t.name: t for t in (
    LossType("del", 0.03, "Digit Entropy Loss (reference form): place-weighted mean_k p_k * BCE(z_k, 1[k = y]) "
             "on raw digit logits", place_weighted=True),
    LossType("del_prob", 0.3, "shift-invariant DEL: place-weighted mean_k sg(p_k) * BCE(p_k, 1[k = y]) on the "
             "digit probabilities, weight detached", place_weighted=True),
    LossType("del_centered", 0.3, "shift-invariant DEL: place-weighted mean_k sg(p_k) * BCE(z_k - mean z, "
             "1[k = y]) on centred digit logits, weight detached", place_weighted=True),
    LossType("ntl_was", 0.3, "Number Token Loss, Wasserstein: sum_k p_k |k - y|"),
    LossType("ntl_mse", 0.3, "Number Token Loss, MSE: (sum_k p_k k - y)^2"),
    LossType("dist2", 0.1, "KL(q || p) to a soft target q_k ~ exp(-(k - y)^2 / tau)", params=("tau",)),
    LossType(DFT, 0.0, "Dynamic Fine-Tuning (arXiv 2508.05629): each label's CE weighted by the detached "
             "probability of the label, sg(p_y) * -log p_y, in place of CE, per label; no digit term (TRL's "
             "loss_type='dft')", replaces_ce=True),
    LossType(CE, 0.0, "cross-entropy only, no digit term"),
)}


def type_names(rule, joiner: str = ", ") -> str:
    """The loss types ``rule`` holds for, from the table."""
    return joiner.join(t.name for t in LOSS_TYPES.values() if rule(t))


# What loss.type chooses, said from the table (a type that is not CE + a digit term, dft, is not described as one):
# the recipe schema, the TRL config fields and axolotl's plugin describe the key with it.
LOSS_KINDS = (f"CE + weight x a digit term ({type_names(lambda t: t.has_term)}), a weighting of CE in its place "
              f"with no digit term ({type_names(lambda t: t.replaces_ce)}), or CE alone ({CE})")


# loss.normalisation: 'global' = CE per label and term per digit label of the whole optimizer batch (delft);
# 'reference' = the DEL reference under HF Trainer: term a mean per micro-batch, x accumulation steps x GPUs.
GLOBAL, REFERENCE = "global", "reference"


NORMALISATIONS = (GLOBAL, REFERENCE)


# The CE paths a training step can take (recorded in the run info as "loss_path").
CHUNKED_CE = "chunked_ce"  # pure torch: the output layer in checkpointed chunks of train.loss_chunk_size rows


FUSED_CE = "fused_linear_ce"  # Liger's fused linear cross-entropy (CUDA, or the Triton interpreter)


def fused_applies(mode: str, cuda: bool, liger: bool, interpreter: bool = False) -> tuple[bool, str]:
    """(use Liger's kernels?, why not, when train.fused_loss 'on' cannot be honoured; else "").

    'auto': on CUDA when liger-kernel is there. 'on': insists; also allowed on the CPU under the Triton
    interpreter (TRITON_INTERPRET=1), too slow to train with but the very same kernels, so tests can check the
    fused path against the chunked one. 'off': never. Training and the memory plan both decide with this.
    """
    if mode == "off":
        return False, ""
    if liger and (cuda or (mode == "on" and interpreter)):
        return True, ""
    if mode == "on":
        return False, ("liger-kernel is not installed (or Triton is missing)" if not liger else
                       "there is no CUDA device (and TRITON_INTERPRET=1 is not set)")
    return False, ""
