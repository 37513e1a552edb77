"""Training: ``delft train``'s stages (``training.stages.STAGES``: the SFT loop in ``training.sft``, GRPO on TRL in
``training.grpo``) and the run lifecycle they share (``training.run``: the lock, new/resume/replace, the run info,
the final save, Ctrl-C/SIGTERM), with run setup, the optimizer step, the schedule of batches, checkpoints and exact
resume, data-parallel over several processes, held-out accuracy during training and early stopping.
"""
