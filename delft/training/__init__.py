"""Training: run setup, the optimizer step, the schedule of batches, checkpoints and exact resume, Ctrl-C/SIGTERM,
the run lock, data-parallel over several processes, the memory plan, held-out accuracy during training, and the
``Trainer`` that ties them together (``training.trainer.run_training``).
"""
