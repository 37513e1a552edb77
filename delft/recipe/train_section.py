"""The recipe's train and grpo sections: the stage, the optimizer and its facts (which ones are bitsandbytes' 8-bit
AdamWs), the schedule, checkpoints, sharding, early stopping, and GRPO's sampling and rewards."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from delft.recipe.section import Section

EIGHT_BIT_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")  # bitsandbytes' blockwise 8-bit AdamW (paged or not)


class EarlyStoppingConfig(Section):
    metric: Literal["val_loss", "heldout_accuracy"] = Field(
        "val_loss", description="What is watched: the validation loss (every train.eval_steps; lower is better) or "
        "the held-out exact match (every train.accuracy_steps; higher is better).")
    patience: int = Field(3, gt=0, description="Stop after this many measurements in a row without an improvement.")
    min_delta: float = Field(0.0, ge=0, description="An improvement must beat the last counted one by more than "
                             "this to reset patience; the best step is always the lowest (highest) measured.")


class TrainConfig(Section):
    stage: Literal["sft", "grpo"] = Field(
        "sft", description="sft: supervised fine-tuning on the completions; grpo: reinforcement learning from "
        "verifiable numeric rewards on the data's prompts (TRL's GRPOTrainer; the grpo section).")
    finetuning: Literal["lora", "full"] = Field(
        "lora", description="lora: train a LoRA adapter (the lora section) on the frozen base; full: train every "
        "weight (the paper's setting; the run saves a standalone model, no merge step).")
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "sgd"] = Field(
        "adamw", description="adamw: AdamW with fp32 states (bitsandbytes' 32-bit AdamW when weights are bf16/fp16, "
        "so the states stay fp32); adamw_8bit: bitsandbytes' 8-bit AdamW (a quarter of the state memory); "
        "paged_adamw_8bit: the same, its states paged to CPU memory under pressure (CUDA only; adamw_8bit runs on "
        "the CPU too); sgd: plain SGD with momentum (no state without momentum).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's beta1 and beta2 (the AdamW optimizers).")
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd only: momentum (0: none).")
    snapshot_steps: list[int] = Field(
        default_factory=list, description="Steps at which a copy of the model (or adapter) is kept in "
        "snapshots/step-N of the run, for learning curves (delft study's curve evaluates them).")
    max_steps: Optional[int] = Field(None, gt=0, description="Optimizer steps; overrides epochs when set.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training set (when max_steps is unset).")
    batch_size: int = Field(8, gt=0, description="Examples per micro-batch.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate (LoRA likes 1e-4..5e-4).")
    lr_scheduler: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="After warmup: cosine or linear decay to 0, constant, or wsd (warmup-stable-decay: "
        "constant, then a cosine decay over the last decay_ratio of the steps).")
    decay_ratio: float = Field(0.1, gt=0, le=1, description="wsd only: the share of steps spent decaying at the end.")
    neftune_alpha: Optional[float] = Field(
        None, gt=0, description="NEFTune (arXiv 2310.05914, as TRL and transformers' Trainer have it): uniform noise "
        "of magnitude alpha / sqrt(positions x hidden size) on the input embeddings while training (e.g. 5); "
        "unset: off.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Share of steps spent warming up linearly.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping (0 = off).")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seeds the LoRA init, data order and dropout (0 to "
                      "2**32 - 1, numpy's range).")
    gradient_checkpointing: bool = Field(True, description="Recompute activations in backward (less memory).")
    distributed: Literal["ddp", "fsdp"] = Field(
        "ddp", description="With several processes (--nproc, torchrun): ddp keeps the whole model on every rank and "
        "sums the trainable gradients; fsdp shards weights, gradients and optimizer states over the ranks with "
        "PyTorch's FSDP2 (fully_shard per decoder layer, then the model), for models that outgrow one card "
        "(docs/distributed.md). fsdp needs a launcher, and no nf4.")
    cpu_offload: bool = Field(False, description="fsdp on CUDA only: keep the sharded weights, gradients and "
                              "optimizer states in CPU memory between uses (FSDP2's CPUOffloadPolicy; slower).")
    logging_steps: int = Field(5, gt=0, description="Steps between log lines (metrics.jsonl).")
    eval_steps: int = Field(50, gt=0, description="Steps between validation-loss evaluations.")
    save_steps: int = Field(100, gt=0, description="Steps between checkpoints.")
    keep_checkpoints: int = Field(2, gt=0, description="Most recent checkpoints kept.")
    loss_chunk_size: int = Field(1024, gt=0, description="Tokens per chunk of the output layer (memory vs speed).")
    fused_loss: Literal["auto", "on", "off"] = Field(
        "auto", description="Liger's fused linear cross-entropy on CUDA with Triton; 'off' = pure-torch chunks.")
    accuracy_steps: int = Field(
        0, ge=0, description="Steps between held-out greedy exact-match measurements (0 = off); see accuracy_examples.")
    accuracy_examples: int = Field(
        32, gt=0, description="Problems in that held-out slice: the first N of the eval set (as delft eval --limit N).")

    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Experiment trackers that get every metrics.jsonl row, the recipe as the "
        "run's config and the loss plot: tensorboard (run_dir/tensorboard), wandb (offline unless WANDB_MODE says "
        "otherwise), mlflow (run_dir/mlruns unless MLFLOW_TRACKING_URI); each an extra. metrics.jsonl stays the "
        "source of truth.")
    early_stopping: Optional[EarlyStoppingConfig] = Field(
        None, description="Stop when the metric stops improving ({metric, patience, min_delta}); unset: train to "
        "the end.")
    keep_best: bool = Field(False, description="Write the best measurement's model (or adapter) at the end instead "
                            "of the last one (the early_stopping metric, else val_loss); delft_run.json says which "
                            "step and why.")

    @model_validator(mode="after")
    def _optimizer_keys(self):
        fields = type(self).model_fields
        if self.optimizer != "sgd" and self.momentum != fields["momentum"].default:
            raise ValueError("momentum only applies to optimizer sgd (AdamW has betas)")
        if self.optimizer == "sgd" and self.betas != fields["betas"].default:
            raise ValueError("betas only apply to the AdamW optimizers, not sgd (it has momentum)")
        if self.lr_scheduler != "wsd" and self.decay_ratio != fields["decay_ratio"].default:
            raise ValueError("decay_ratio only applies to lr_scheduler wsd")
        metric = self.early_stopping.metric if self.early_stopping else ("val_loss" if self.keep_best else None)
        if metric == "heldout_accuracy" and not self.accuracy_steps:
            raise ValueError("early_stopping.metric heldout_accuracy is measured every train.accuracy_steps: set it")
        if self.cpu_offload and self.distributed != "fsdp":
            raise ValueError("cpu_offload moves FSDP's shards to CPU memory: it needs distributed: fsdp")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must each be in [0, 1), not {list(self.betas)}")
        late = [s for s in self.snapshot_steps if self.max_steps is not None and s > self.max_steps]
        if late:  # never taken; with epochs train checks once the data gives the total (schedule.check_snapshot_steps)
            raise ValueError(f"snapshot_steps {late[:5]} come after train.max_steps {self.max_steps}, so they would "
                             f"never be taken: give steps of at most {self.max_steps}")
        return self

    @field_validator("snapshot_steps")
    @classmethod
    def _snapshots(cls, steps: list[int]) -> list[int]:
        if any(s <= 0 for s in steps):
            raise ValueError("snapshot steps are optimizer steps, 1 or more")
        return sorted(set(steps))


class GrpoConfig(Section):
    num_generations: int = Field(4, ge=2, description="Completions sampled per prompt (the group GRPO normalises "
                                 "rewards within).")
    max_completion_length: int = Field(32, gt=0, description="Tokens per sampled completion.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the completions.")
    beta: float = Field(0.0, ge=0, description="KL penalty to the reference model (0: no reference model kept).")
    reward: Literal["exact", "partial"] = Field(
        "exact", description="exact: 1 when delft's answer scorer finds the gold number, else 0; partial: exact plus "
        "partial_alpha x the place-weighted share of right digits, each normalised within its group before the sum.")
    partial_alpha: float = Field(0.2, ge=0, le=1, description="Weight of the digit share in the partial reward.")
    reward_functions: list[str] = Field(default_factory=list, description="More TRL reward functions, as "
                                        "'module:function' (weight 1 each), after delft's.")
    aux_mu: float = Field(0.0, ge=0, description="mu: the auxiliary term's weight, mu x (CE + loss.weight x the digit "
                          "term) on the gold solutions of the same prompts (0: GRPO alone).")
    aux_mu_end: Optional[float] = Field(None, ge=0, description="Decay mu linearly to this by the last step "
                                        "(CHORD: 0.9 -> 0.05); unset: constant.")
