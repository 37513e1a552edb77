"""delft's digit losses in the pipelines people already use: transformers' ``Trainer`` (``integrations.hf``:
``DigitTrainer`` and ``DigitLossMixin``), TRL's ``SFTTrainer`` (``integrations.trl``: ``DigitSFTTrainer``) and
axolotl (``integrations.axolotl``: a plugin). Each builds on the library's own extension points (a Trainer
subclass, axolotl's ``BasePlugin``), normalises the loss over the whole optimizer batch as delft's own loop does,
and never builds full-vocabulary logits. Nothing here is imported by the CLI.
"""
