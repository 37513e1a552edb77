"""The digit-aware losses: per-position terms (DEL, its shift-invariant forms, NTL, DIST2), the output-layer pieces
that never build full-vocabulary logits, the one ``Loss`` object training uses (CE + weight x term, normalised over
the whole optimizer batch), and standalone ``nn.Module`` losses. ``delft.losses.registry`` is the torch-free
registry; the names below are imported on first use, so ``import delft.losses.registry`` loads no torch.
"""

from importlib import import_module

# public name -> the module that defines it (loaded on first access: the schema imports types without torch)
_EXPORTS = {
    "DigitLoss": "modules", "digit_term_sum": "modules",
    "DigitEntropyLoss": "modules", "NumberTokenLoss": "modules", "Dist2Loss": "modules",
    "full_logits_loss": "modules", "term_mean": "modules",
    "Loss": "loss", "Counts": "loss", "Sums": "loss",
    "TERMS": "terms", "term_of": "terms",
    "digit_logits": "heads", "chunked_ce_sum": "heads",
    "LOSS_TYPES": "registry",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'delft.losses' has no attribute {name!r}")
    return getattr(import_module(f"delft.losses.{_EXPORTS[name]}"), name)
