"""End-to-end training-step benchmark: delft (CE, DEL, packing) against the pipelines users already run.

    flock /tmp/delft-cpu.lock python bench/train_bench.py      # CPU, ~10 min on 2 cores
    python bench/train_bench.py --gpu                          # GPU: random-init Qwen2 0.5B/1.5B/7B, nf4
    python bench/train_bench.py --gpu --sizes 0.5b --configs delft_del,liger_ce

Every configuration runs in a fresh subprocess on the same model, the same examples in the same order and the
same batch shapes, with the same LoRA (r=16, alpha 32, no dropout, all linear projections), AdamW (lr 2e-4),
gradient clipping at 1.0 and non-reentrant gradient checkpointing:

  delft_*      delft's own step: delft.training.step.optimizer_step with the recipe's delft.losses.loss.Loss
               (hidden states from the decoder, CE in checkpointed chunks over labelled rows, digit term from the
               ten digit rows); *_packed uses delft.data.collate_packed instead of padding.
  trainer_ce   the usual pipeline: transformers Trainer, model(labels=...) (full-vocabulary logits), peft LoRA;
               on GPU with peft's prepare_model_for_kbit_training, as most QLoRA tutorials do.
  trl_sft      TRL's SFTTrainer with the same LoRA (fp32 on CPU, use_cpu=True; its defaults on GPU).
  liger_ce     GPU only: Trainer + model(labels=...) with liger_kernel.transformers.apply_liger_kernel_to_qwen2
               (fused linear CE, RMSNorm, SwiGLU, RoPE), no fp32 upcasts: the memory bar of docs/gpu.md.
  paired       CPU: delft CE and DEL steps interleaved (ABBA) in one process, for the DEL-overhead target.

Peak memory: CPU peak RSS from resource.getrusage after /proc/self/clear_refs resets the high-water mark once the
model is loaded (so it is the training steps' peak, weights included); GPU torch.cuda.max_memory_allocated reset
after loading. tokens/s counts real (non-padding) tokens, the same for every configuration of a run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

CPU_SETUP = dict(model="smollm2-135m", batch=8, max_length=64, template="plain", n_examples=400, warmup=2, steps=12,
                 lr=2e-4, lora_r=16, lora_alpha=32, chunk_size=1024, gradient_checkpointing=True, seed=0)
CPU_CONFIGS = ("delft_ce", "delft_del", "delft_ce_packed", "delft_del_packed", "trainer_ce", "trl_sft", "paired")
GPU_SIZES = {  # the probe's Qwen2 shapes; batch shapes as docs/gpu.md's table
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, batch=8, seq=512),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, batch=4, seq=1024),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, batch=1, seq=4096),
    # for a dry run of the GPU code path on a CPU: DELFT_BENCH_DEVICE=cpu python bench/train_bench.py --gpu --sizes tiny
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1000, tie_word_embeddings=False, batch=2, seq=32),
}
DEVICE = os.environ.get("DELFT_BENCH_DEVICE", "cuda")  # of --gpu runs; "cpu" only to dry-run the code path
GPU_CONFIGS = ("delft_ce", "delft_del", "delft_del_chunked", "trainer_ce", "liger_ce", "trl_sft")
GPU_DIGITS, GPU_DOT = tuple(range(15, 25)), 13  # token ids playing '0'..'9' and '.' in the random models
PEERS = ("trainer_ce", "trl_sft", "liger_ce")


# ----------------------------------------------------------------------------- measuring


class Meter:
    """Step timer (wall and process CPU time) and peak memory since reset()."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.reset_ok = None
        self._t = None

    def sync(self):
        if self.gpu:
            import torch

            torch.cuda.synchronize()

    def reset(self):
        if self.gpu:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        self.base = current_rss()
        try:  # Linux: "5" resets the peak RSS the kernel reports (VmHWM, ru_maxrss) to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset_ok = True
        except OSError:
            self.reset_ok = False

    def begin(self):
        self.sync()
        self._t = (time.perf_counter(), time.process_time())

    def end(self):
        self.sync()
        w, c = self._t
        self.wall.append(time.perf_counter() - w)
        self.cpu.append(time.process_time() - c)

    def peak_bytes(self) -> int:
        if self.gpu:
            import torch

            return int(torch.cuda.max_memory_allocated())
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def summary(meter: Meter, warmup: int, tokens: list[int], positions: list[int], **extra) -> dict:
    wall, cpu = meter.wall[warmup:], meter.cpu[warmup:]
    tok = tokens[warmup:len(meter.wall)]
    pos = positions[warmup:len(meter.wall)]
    med_w, med_c = statistics.median(wall), statistics.median(cpu)
    mean_tok, mean_pos = statistics.mean(tok), statistics.mean(pos)
    return dict(step_s=med_w, step_cpu_s=med_c, tokens_per_step=mean_tok, positions_per_step=mean_pos,
                tokens_per_s=mean_tok / med_w, tokens_per_cpu_s=mean_tok / med_c, positions_per_s=mean_pos / med_w,
                peak_bytes=meter.peak_bytes(), before_steps_bytes=meter.base, peak_reset=meter.reset_ok,
                wall=wall, cpu=cpu, warmup_wall=meter.wall[:warmup], **extra)


# ----------------------------------------------------------------------------- data (same for every config)


def cpu_recipe(loss: str, packing: bool = False):
    from delft.recipe.schema import validate_recipe

    S = CPU_SETUP
    return validate_recipe({
        "model": {"name": S["model"], "device": "cpu", "dtype": "float32"},
        "quantization": {"mode": "none"},
        "lora": {"r": S["lora_r"], "alpha": S["lora_alpha"], "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"max_length": S["max_length"], "template": S["template"], "packing": packing, "val_size": 0,
                 "synthetic": {"n": S["n_examples"], "seed": 0}},
        "train": {"batch_size": S["batch"], "learning_rate": S["lr"], "seed": S["seed"],
                  "loss_chunk_size": S["chunk_size"], "gradient_checkpointing": S["gradient_checkpointing"],
                  "fused_loss": "off"},
        "loss": {"type": loss},
    })


def cpu_items():
    """delft's tokenized examples (plain template, completion-only labels) and the pad id."""

    from delft.training.setup import setup

    s = setup(cpu_recipe("del"))
    return s, s.train, s.tokenizer.pad_token_id


def pad_to(batch: dict, width: int, pad_id: int) -> dict:
    """delft.data.collate pads to the longest row; the benchmark pads every config to the same width."""
    import torch

    from delft.numbers.tokens import IGNORE

    n = batch["input_ids"].shape[1]
    if n >= width:
        return batch
    fill = {"input_ids": pad_id, "labels": IGNORE, "attention_mask": 0}
    return {k: torch.cat([v, torch.full((v.shape[0], width - n), fill[k], dtype=v.dtype)], 1) for k, v in batch.items()}


def gpu_batch(size: str, n_steps: int):
    """Random ids with digit runs (about a fifth of the tokens), labels on every position (as docs/gpu.md's probe)."""
    import torch

    cfg = GPU_SIZES[size]
    B, T, V = cfg["batch"], cfg["seq"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, V, (B, T), generator=g)
    for b in range(B):
        t = 2
        while t < T - 8:
            n = int(torch.randint(1, 7, (1,), generator=g))
            ids[b, t:t + n] = torch.tensor([GPU_DIGITS[int(d)] for d in torch.randint(0, 10, (n,), generator=g)])
            t += n + int(torch.randint(2, 12, (1,), generator=g))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    return [batch] * n_steps


def gpu_model_dir(size: str) -> Path:
    """Random-init Qwen2 of the given shape, saved once (bf16) with a stub tokenizer (TRL wants one)."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    path = Path(os.environ.get("DELFT_BENCH_MODELS", tempfile.gettempdir())) / f"delft-bench-qwen2-{size}"
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    shape = {k: v for k, v in GPU_SIZES[size].items() if k not in ("batch", "seq")}
    cfg = Qwen2Config(**shape, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    from tokenizers import Tokenizer, models

    core = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)
    return path


# ----------------------------------------------------------------------------- delft configurations


def run_delft(spec: dict) -> dict:
    import torch
    from rich.console import Console

    from delft.data.batches import collate, collate_packed
    from delft.losses.loss import Loss
    from delft.losses.registry import FUSED_CE
    from delft.training.step import optimizer_step

    config, gpu = spec["config"], spec["gpu"]
    loss_type = "ce" if config.startswith("delft_ce") else "del"
    packed = config.endswith("_packed")
    quiet = Console(file=open(os.devnull, "w"))
    if gpu:
        from delft.models.loading import apply_liger_layers, apply_lora, load_model
        from delft.models.sources import ModelRef
        from delft.numbers.digits import DigitVocab
        from delft.recipe.schema import validate_recipe

        size = spec["size"]
        recipe = validate_recipe({"lora": {"r": 16, "alpha": 32, "dropout": 0.0},
                                  "train": {"learning_rate": 2e-4, "loss_chunk_size": 1024,
                                            "fused_loss": "off" if config.endswith("_chunked") else "auto"},
                                  "loss": {"type": loss_type}})
        vocab = DigitVocab(GPU_DIGITS, GPU_DOT)
        device = DEVICE
        path = gpu_model_dir(size)
        torch.manual_seed(0)
        model = load_model(ModelRef(size, str(path), True), device, torch.bfloat16, "nf4", True)
        loss = Loss.from_recipe(recipe, vocab, device)
        if loss.fused:  # as delft train does: the same layer kernels as the Liger peer
            apply_liger_layers(model)
        model = apply_lora(model, recipe.lora, True)
        batches = gpu_batch(size, spec["warmup"] + spec["steps"])
    else:
        from delft.training.setup import build_model, setup

        recipe = cpu_recipe(loss_type, packed)
        s = setup(recipe)
        model, _, _ = build_model(s, quiet)
        loss, device = s.loss, "cpu"
        B, T, pad = CPU_SETUP["batch"], CPU_SETUP["max_length"], s.tokenizer.pad_token_id
        n = spec["warmup"] + spec["steps"]
        items = [s.train[i * B:(i + 1) * B] for i in range(n)]
        batches = [collate_packed(it, pad, T) if packed else pad_to(collate(it, pad), T, pad) for it in items]
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.train.learning_rate)
    tokens = [sum(len(x.input_ids) for x in it) for it in items] if not gpu else [b["input_ids"].numel() for b in batches]
    positions = [b["input_ids"].numel() for b in batches]
    meter = Meter(gpu and DEVICE == "cuda")
    meter.reset()
    losses = []
    for b in batches:
        meter.begin()
        out = optimizer_step(model, [b], loss, device)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        meter.end()
        losses.append(out["loss"])
    return summary(meter, spec["warmup"], tokens, positions, loss_first=losses[0], loss_last=losses[-1],
                   fused_ce=loss.path_ran == FUSED_CE, loss_path=loss.path_ran, loss_weight=loss.weight,
                   rows=batches[0]["input_ids"].shape[0],
                   width=batches[0]["input_ids"].shape[1])


def run_paired(spec: dict) -> dict:
    """delft CE, delft DEL and a plain `model(labels=...)` loop, interleaved on one model and the same batches.

    The order rotates every step, so drift on a shared machine cancels and what is left is the difference between
    the loss paths: the DEL term's own cost, and delft's hidden-state path against full-vocabulary logits.
    """
    import torch
    from rich.console import Console

    from delft.data.batches import collate, collate_packed
    from delft.losses.loss import Loss
    from delft.training.setup import build_model, setup
    from delft.training.step import optimizer_step

    quiet = Console(file=open(os.devnull, "w"))
    recipe = cpu_recipe("del")
    s = setup(recipe)
    model, _, _ = build_model(s, quiet)
    model.train()
    losses = {k: Loss.from_recipe(cpu_recipe(k), s.loss.vocab, "cpu") for k in ("ce", "del")}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.train.learning_rate)
    B, T, pad = CPU_SETUP["batch"], CPU_SETUP["max_length"], s.tokenizer.pad_token_id

    def hf_loop(b):
        model(**b).loss.backward()  # input_ids, attention_mask, labels: the model's own full-logits CE

    steps = {"ce": lambda b: optimizer_step(model, [b], losses["ce"], "cpu"),
             "del": lambda b: optimizer_step(model, [b], losses["del"], "cpu"),
             "hf_loop": hf_loop,
             "ce_packed": lambda b: optimizer_step(model, [b], losses["ce"], "cpu"),
             "del_packed": lambda b: optimizer_step(model, [b], losses["del"], "cpu")}
    names = list(steps) if spec["config"] == "paired" else ["ce_packed", "del_packed"]  # paired_packed
    times = {k: ([], []) for k in names}
    for i in range(spec["warmup"] + spec["steps"]):
        items = s.train[i * B:(i + 1) * B]  # every path sees the same examples
        padded, packed = pad_to(collate(items, pad), T, pad), collate_packed(items, pad, T)
        for k in names[i % len(names):] + names[:i % len(names)]:
            t0, c0 = time.perf_counter(), time.process_time()
            steps[k](packed if k.endswith("_packed") else padded)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= spec["warmup"]:
                times[k][0].append(time.perf_counter() - t0)
                times[k][1].append(time.process_time() - c0)
    med = statistics.median
    r = {f"{k}_{what}": med(v[j]) for k, v in times.items() for j, what in enumerate(("wall_s", "cpu_s"))}
    r["del_extra_packed_wall"] = r["del_packed_wall_s"] / r["ce_packed_wall_s"] - 1
    r["del_extra_packed_cpu"] = r["del_packed_cpu_s"] / r["ce_packed_cpu_s"] - 1
    r["paired_difference_packed_ms"] = 1000 * med([b - a for a, b in zip(times["ce_packed"][0], times["del_packed"][0])])
    r["steps"] = {k: {"wall": v[0], "cpu": v[1]} for k, v in times.items()}
    if spec["config"] == "paired_packed":
        return r
    r["del_extra_cpu"] = r["del_cpu_s"] / r["ce_cpu_s"] - 1
    r["del_extra_wall"] = r["del_wall_s"] / r["ce_wall_s"] - 1
    r["del_vs_hf_loop_speed_wall"] = r["hf_loop_wall_s"] / r["del_wall_s"]
    r["ce_vs_hf_loop_speed_wall"] = r["hf_loop_wall_s"] / r["ce_wall_s"]
    r["del_vs_hf_loop_speed_cpu"] = r["hf_loop_cpu_s"] / r["del_cpu_s"]
    return r


# ----------------------------------------------------------------------------- peer pipelines


def peer_model(spec: dict):
    """(model, tokenizer or None, train rows as dicts, tokens/positions per step) for the HF/TRL/Liger configs."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config, gpu = spec["config"], spec["gpu"]
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    n = spec["warmup"] + spec["steps"]
    if gpu:
        path = gpu_model_dir(spec["size"])
        if config == "liger_ce":
            from liger_kernel.transformers import apply_liger_kernel_to_qwen2

            apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=True)
        from transformers import BitsAndBytesConfig

        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=bnb,
                                                     device_map={"": 0 if DEVICE == "cuda" else "cpu"})
        tokenizer = AutoTokenizer.from_pretrained(path)
        batches = gpu_batch(spec["size"], n)
        rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(b["input_ids"].shape[0])]
        tokens = positions = [b["input_ids"].numel() for b in batches]
    else:
        from delft.models.sources import resolve_model
        from delft.numbers.tokens import IGNORE

        s, items, pad = cpu_items()
        path = resolve_model(CPU_SETUP["model"]).path
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = s.tokenizer
        B, T = CPU_SETUP["batch"], CPU_SETUP["max_length"]
        items = items[: n * B]
        rows = []
        for it in items:
            k = T - len(it.input_ids)
            rows.append({"input_ids": torch.tensor(it.input_ids + [pad] * k),
                         "attention_mask": torch.tensor([1] * len(it.input_ids) + [0] * k),
                         "labels": torch.tensor(it.labels + [IGNORE] * k)})
        tokens = [sum(len(x.input_ids) for x in items[i * B:(i + 1) * B]) for i in range(n)]
        positions = [B * T] * n
    if config == "trl_sft":
        return model, tokenizer, rows, tokens, positions, lora
    torch.manual_seed(0)
    if gpu and config == "trainer_ce":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.config.use_cache = False
    return get_peft_model(model, lora), tokenizer, rows, tokens, positions, None


def run_peer(spec: dict) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    config, gpu = spec["config"], spec["gpu"]
    model, tokenizer, rows, tokens, positions, lora = peer_model(spec)
    meter = Meter(gpu and DEVICE == "cuda")
    n = spec["warmup"] + spec["steps"]
    batch = GPU_SIZES[spec["size"]]["batch"] if gpu else CPU_SETUP["batch"]
    losses = []

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            meter.reset()

        def on_step_begin(self, args, state, control, **kw):
            meter.begin()

        def on_step_end(self, args, state, control, **kw):
            meter.end()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    common = dict(output_dir=tempfile.mkdtemp(prefix="delft-bench-"), per_device_train_batch_size=batch,
                  max_steps=n, learning_rate=2e-4, max_grad_norm=1.0, lr_scheduler_type="constant",
                  warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                  dataloader_num_workers=0, train_sampling_strategy="sequential", seed=0, optim="adamw_torch",
                  use_cpu=not gpu or DEVICE == "cpu", bf16=gpu and DEVICE == "cuda", fp16=False)
    if config == "trl_sft":
        import datasets
        from trl import SFTConfig, SFTTrainer

        ds = datasets.Dataset.from_list([{"input_ids": r["input_ids"].tolist(), "labels": r["labels"].tolist()}
                                         for r in rows])
        T = rows[0]["input_ids"].shape[0]
        # TRL's own defaults otherwise (fused LM head, entropy/accuracy metrics); on CPU fp32 like the rest
        args = SFTConfig(**common, max_length=T, pad_to_multiple_of=T, packing=False, gradient_checkpointing=True,
                         gradient_checkpointing_kwargs={"use_reentrant": False}, dataset_num_proc=None)
        trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer, peft_config=lora,
                             callbacks=[Timer()])
    else:
        args = TrainingArguments(**common, remove_unused_columns=False)
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Timer()])
    trainer.train()
    return summary(meter, spec["warmup"], tokens, positions, loss_first=losses[0] if losses else None,
                   loss_last=losses[-1] if losses else None, width=rows[0]["input_ids"].shape[0])


def child(spec: dict) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    torch.manual_seed(0)
    t0 = time.time()
    config = spec["config"]
    if config in ("paired", "paired_packed"):
        out = run_paired(spec)
    elif config.startswith("delft"):
        out = run_delft(spec)
    else:
        out = run_peer(spec)
    out.update(config=config, size=spec.get("size"), process_s=time.time() - t0)
    return out


# ----------------------------------------------------------------------------- orchestration and report


def run_child(spec: dict, timeout: int) -> dict:
    # default glibc malloc, as users run it (MALLOC_MMAP_THRESHOLD_=65536, used by loss_bench.py for tighter RSS,
    # makes every large allocation a page-faulting mmap and slowed these steps 1.7x)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TQDM_DISABLE="1",
               PYTHONWARNINGS="ignore", DELFT_CACHE=os.environ.get("DELFT_CACHE", str(Path.home() / ".cache/delft")))
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                              text=True, cwd=ROOT, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"config": spec["config"], "size": spec.get("size"), "error": f"timed out after {timeout} s"}
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"config": spec["config"], "size": spec.get("size"), "error": (proc.stderr or proc.stdout)[-3000:],
                "returncode": proc.returncode}
    out = json.loads(lines[-1])
    out["subprocess_s"] = time.time() - t0
    return out


def merge_rounds(runs: list[dict]) -> dict:
    """One result per configuration: medians over every round's timed steps, the largest peak memory."""
    good = [r for r in runs if "error" not in r]
    if not good or "wall" not in good[0]:
        return good[0] if good else runs[0]
    m = dict(good[0])
    m["wall"] = [x for r in good for x in r["wall"]]
    m["cpu"] = [x for r in good for x in r["cpu"]]
    m["step_s"], m["step_cpu_s"] = statistics.median(m["wall"]), statistics.median(m["cpu"])
    m["tokens_per_s"] = m["tokens_per_step"] / m["step_s"]
    m["tokens_per_cpu_s"] = m["tokens_per_step"] / m["step_cpu_s"]
    m["positions_per_s"] = m["positions_per_step"] / m["step_s"]
    m["peak_bytes"] = max(r["peak_bytes"] for r in good)
    m["rounds"] = [dict(step_s=r["step_s"], tokens_per_s=r["tokens_per_s"], peak_bytes=r["peak_bytes"],
                        wall=r["wall"], warmup_wall=r["warmup_wall"], process_s=r.get("process_s")) for r in good]
    m.pop("warmup_wall", None)
    m["failed_rounds"] = len(runs) - len(good)
    return m


def machine(gpu: bool) -> dict:
    import logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import peft
    import torch
    import transformers

    info = dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(), python=platform.python_version(),
                torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__,
                load_average_at_start=os.getloadavg())
    for mod in ("trl", "bitsandbytes", "liger_kernel"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "installed")
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            info[mod] = f"not available ({type(e).__name__})"
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    if gpu and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def gib(b) -> float:
    return b / 2**30


def ratios(res: dict, delft_names, peers, gpu: bool) -> dict:
    out = {}
    for d in delft_names:
        for p in peers:
            a, b = res.get(d), res.get(p)
            if not a or not b or "error" in a or "error" in b:
                continue
            out[f"{d}/{p}"] = dict(tokens_per_s=a["tokens_per_s"] / b["tokens_per_s"],
                                   tokens_per_cpu_s=a["tokens_per_cpu_s"] / b["tokens_per_cpu_s"],
                                   peak_memory=a["peak_bytes"] / b["peak_bytes"])
    return out


def target(name: str, value, limit, kind: str, unit: str = "x") -> dict:
    """kind 'min': value must be >= limit; 'max': value must be <= limit."""
    if value is None:
        return dict(target=name, value=None, limit=limit, met=None, note="not measured")
    met = value >= limit if kind == "min" else value <= limit
    miss = 0.0 if met else (limit - value if kind == "min" else value - limit)
    return dict(target=name, value=value, limit=limit, met=met, missed_by=miss, unit=unit)


def print_table(res: dict, names, gpu: bool, label: str):
    mem = "peak GPU GiB" if gpu else "peak RSS GiB"
    print(f"\n{label}")
    print(f"{'config':<20}{'s/step':>8}{'cpu s/step':>11}{'tokens/s':>10}{'pos/s':>9}{'rows x width':>14}{mem:>14}")
    for c in names:
        r = res.get(c)
        if r is None:
            continue
        if "error" in r:
            print(f"{c:<20}  FAILED: {r['error'].strip().splitlines()[-1][:100] if r['error'].strip() else '?'}")
            continue
        shape = f"{r.get('rows', '')}x{r.get('width', '')}" if r.get("rows") else f"-x{r.get('width', '')}"
        print(f"{c:<20}{r['step_s']:>8.2f}{r['step_cpu_s']:>11.2f}{r['tokens_per_s']:>10.1f}"
              f"{r['positions_per_s']:>9.0f}{shape:>14}{gib(r['peak_bytes']):>14.2f}")


def print_targets(targets: list[dict]):
    print("\ntargets")
    for t in targets:
        if t["met"] is None:
            print(f"  [--] {t['target']}: {t.get('note', 'not measured')}")
            continue
        v = f"{t['value']:+.2%}" if t["unit"] == "%" else f"{t['value']:.3f}x"
        lim = f"{t['limit']:+.0%}" if t["unit"] == "%" else f"{t['limit']:.2f}x"
        miss = "" if t["met"] else (f", missed by {t['missed_by']:.2%} points" if t["unit"] == "%"
                                     else f", missed by {t['missed_by']:.3f}x")
        print(f"  [{'ok' if t['met'] else 'MISS'}] {t['target']}: {v} (limit {lim}){miss}")


def main_cpu(args):
    t0 = time.time()
    configs = args.configs.split(",") if args.configs else list(CPU_CONFIGS)
    if "trl_sft" in configs:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("trl is not installed (pip install -e '.[bench]'): skipping trl_sft", file=sys.stderr)
            configs.remove("trl_sft")
    names = [c for c in configs if not c.startswith("paired")]
    runs: dict[str, list] = {c: [] for c in configs}
    # separate processes in rounds, the order reversed each round: a slow minute on the shared machine then lands
    # on different configurations and the median over all rounds' steps evens it out
    plan = [(r, c) for r in range(args.rounds) for c in (names if r % 2 == 0 else names[::-1])]
    plan += [(0, c) for c in configs if c.startswith("paired")]
    for r, c in plan:
        steps = args.steps if c.startswith("paired") else max(2, round(args.steps / args.rounds))
        spec = dict(config=c, gpu=False, warmup=args.warmup, steps=steps)
        print(f"[{time.time() - t0:5.0f} s] round {r + 1} {c} ...", file=sys.stderr, flush=True)
        out = run_child(spec, timeout=900)
        runs[c].append(out)
        if "error" in out:
            print(out["error"][-1500:], file=sys.stderr)
    res = {c: merge_rounds(v) for c, v in runs.items() if v}
    print(f"\nCPU: SmolLM2-135M fp32, LoRA r=16 all-linear, batch {CPU_SETUP['batch']} arithmetic examples "
          f"(plain template), padded to {CPU_SETUP['max_length']} unless packed; gradient checkpointing "
          f"{'on' if CPU_SETUP['gradient_checkpointing'] else 'off'}; median of {args.steps} steps "
          f"({args.rounds} fresh processes per configuration, {args.warmup} warmup steps each); {os.cpu_count()} CPUs")
    print_table(res, names, False, "per configuration")
    rat = ratios(res, [c for c in names if c.startswith("delft")], [p for p in PEERS if p in res], False)
    print("\nratios delft / peer (tokens/s: >1 = delft faster; memory: <1 = delft lighter)")
    for k, v in rat.items():
        print(f"  {k:<32} tokens/s {v['tokens_per_s']:.3f}x (cpu-time basis {v['tokens_per_cpu_s']:.3f}x)  "
              f"peak RSS {v['peak_memory']:.3f}x")
    ok = lambda c: c in res and "error" not in res[c]  # noqa: E731
    paired = res.get("paired") if ok("paired") else None
    sep = res["delft_del"]["step_cpu_s"] / res["delft_ce"]["step_cpu_s"] - 1 if ok("delft_del") and ok("delft_ce") else None
    targets = [
        target("delft DEL tokens/s >= usual pipeline (Trainer) tokens/s",
               rat.get("delft_del/trainer_ce", {}).get("tokens_per_s"), 1.0, "min"),
        target("delft CE tokens/s >= usual pipeline (Trainer) tokens/s",
               rat.get("delft_ce/trainer_ce", {}).get("tokens_per_s"), 1.0, "min"),
        target("delft DEL tokens/s >= TRL SFTTrainer tokens/s", rat.get("delft_del/trl_sft", {}).get("tokens_per_s"),
               1.0, "min"),
        target("delft DEL step speed / plain model(labels=...) loop (interleaved, same process)",
               paired["del_vs_hf_loop_speed_wall"] if paired else None, 1.0, "min"),
        target("DEL step extra time over delft's CE step (interleaved, wall)",
               paired["del_extra_wall"] if paired else None, 0.03, "max", "%"),
        target("DEL step extra time over delft's CE step, packed (interleaved, wall)",
               paired["del_extra_packed_wall"] if paired else None, 0.03, "max", "%"),
        dict(target="GPU: delft DEL peak <= 1.1x Liger CE-only peak", value=None, limit=1.1, met=None,
             note="pending a GPU session (bash bench/gpu_run.sh)"),
    ]
    if ok("paired_packed"):
        pp = res["paired_packed"]
        targets.insert(-1, target(f"DEL step extra time over delft's CE step, packed ({args.steps} interleaved pairs)",
                                  pp["del_extra_packed_wall"], 0.03, "max", "%"))
    print_targets(targets)
    if paired:
        print(f"  interleaved medians: delft CE {paired['ce_wall_s']:.2f} s, delft DEL {paired['del_wall_s']:.2f} s, "
              f"model(labels=...) {paired['hf_loop_wall_s']:.2f} s per step; DEL extra in CPU time "
              f"{paired['del_extra_cpu']:+.2%}" + (f"; separate processes {sep:+.2%}" if sep is not None else "")
              + f"; packed: CE {paired['ce_packed_wall_s']:.2f} s, DEL {paired['del_packed_wall_s']:.2f} s "
              f"(CPU time {paired['del_extra_packed_cpu']:+.2%})")
    if ok("delft_del_packed") and ok("delft_del"):
        print(f"\npacking: delft DEL packed/padded tokens/s {res['delft_del_packed']['tokens_per_s'] / res['delft_del']['tokens_per_s']:.2f}x "
              f"({res['delft_del_packed']['rows']} rows x {res['delft_del_packed']['width']} instead of "
              f"{res['delft_del']['rows']} x {res['delft_del']['width']})")
    first = {c: res[c].get("loss_first") for c in ("delft_ce", "trainer_ce", "trl_sft") if ok(c)}
    if first:
        print("\nsanity: first-step CE (same weights, same batch) " +
              ", ".join(f"{c} {v:.5f}" for c, v in first.items() if v is not None))
    report = dict(kind="cpu", machine=machine(False), first_step_ce=first, setup=dict(CPU_SETUP, warmup=args.warmup, steps=args.steps, rounds=args.rounds),
                  results=res, ratios=rat, targets=targets,
                  del_extra=dict(interleaved_cpu=paired and paired["del_extra_cpu"],
                                 interleaved_wall=paired and paired["del_extra_wall"], separate_processes_cpu=sep),
                  anchors_platform_md={"plain loop s/step": 6.36, "Trainer": 7.02, "TRL": 7.84,
                                       "delft-style labelled rows": 5.35, "note": "fp32, padded to 64, one run each"},
                  wall_s=time.time() - t0, load_average_at_end=os.getloadavg())
    out = Path(args.out or RESULTS / "train_bench_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out} ({report['wall_s']:.0f} s)")


def main_gpu(args):
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("--gpu needs a CUDA GPU visible to torch")
    t0 = time.time()
    sizes = args.sizes.split(",")
    configs = args.configs.split(",") if args.configs else list(GPU_CONFIGS)
    out = Path(args.out or RESULTS / "train_bench_gpu.json")
    report = json.loads(out.read_text()) if out.is_file() else {"kind": "gpu", "results": {}}
    report["machine"] = machine(True)
    report["device"] = DEVICE
    for size in sizes:
        gpu_model_dir(size)  # build once, outside the timed children
        res = report["results"].setdefault(size, {})
        for c in configs:
            spec = dict(config=c, gpu=True, size=size, warmup=args.warmup, steps=args.steps)
            print(f"[{time.time() - t0:5.0f} s] {size} {c} ...", file=sys.stderr, flush=True)
            res[c] = run_child(spec, timeout=args.timeout)
            if "error" in res[c]:
                print(res[c]["error"][-1500:], file=sys.stderr)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")  # partial results survive a timeout
    targets, all_ratios = [], {}
    for size, res in report["results"].items():
        shape = GPU_SIZES[size]
        print_table(res, GPU_CONFIGS, True, f"GPU {size} (random-init Qwen2, nf4 + LoRA r=16 all-linear, "
                                            f"{shape['batch']}x{shape['seq']})")
        rat = ratios(res, [c for c in GPU_CONFIGS if c.startswith("delft")], [p for p in PEERS if p in res], True)
        all_ratios[size] = rat
        for k, v in rat.items():
            print(f"  {k:<32} tokens/s {v['tokens_per_s']:.3f}x  peak GPU memory {v['peak_memory']:.3f}x")
        targets.append(target(f"{size}: delft DEL peak <= 1.1x Liger CE-only peak",
                              rat.get("delft_del/liger_ce", {}).get("peak_memory"), 1.1, "max"))
        targets.append(target(f"{size}: delft DEL tokens/s >= usual pipeline (Trainer)",
                              rat.get("delft_del/trainer_ce", {}).get("tokens_per_s"), 1.0, "min"))
        ce, de = res.get("delft_ce"), res.get("delft_del")
        extra = de["step_s"] / ce["step_s"] - 1 if ce and de and "error" not in ce and "error" not in de else None
        targets.append(target(f"{size}: DEL step extra time over delft CE", extra, 0.03, "max", "%"))
        # fused (Liger) and chunked paths: same model init, same batches, so the same losses up to bf16 rounding
        fu, ch = res.get("delft_del"), res.get("delft_del_chunked")
        both = fu and ch and "error" not in fu and "error" not in ch and fu.get("fused_ce")
        for at in ("loss_first", "loss_last"):
            gap = abs(fu[at] / ch[at] - 1) if both else None
            targets.append(target(f"{size}: fused vs chunked DEL path, {at} relative gap", gap, 0.01, "max", "%"))
    print_targets(targets)
    report.update(ratios=all_ratios, targets=targets, wall_s=time.time() - t0)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="random-init Qwen2 sizes on CUDA (nf4) instead of CPU")
    ap.add_argument("--sizes", default="0.5b,1.5b,7b", help="GPU sizes (comma-separated)")
    ap.add_argument("--configs", default=None, help="subset of configurations (comma-separated)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per configuration (GPU)")
    ap.add_argument("--rounds", type=int, default=2, help="CPU: fresh processes per configuration (steps split)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/train_bench_{cpu,gpu}.json)")
    args = ap.parse_args()
    if args.gpu:
        args.steps = args.steps or 6
        args.warmup = args.warmup if args.warmup is not None else 2
        main_gpu(args)
    else:
        args.steps = args.steps or CPU_SETUP["steps"]
        args.warmup = args.warmup if args.warmup is not None else CPU_SETUP["warmup"]
        main_cpu(args)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
    else:
        main()
