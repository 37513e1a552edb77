"""Per-rank memory of sharded training on the CPU: 2 FSDP2 ranks against 2 ddp ranks and against `--plan`'s figures.

    nice -n 10 python bench/fsdp_memory.py   # ~1-2 min on 2 busy cores: bench/results/fsdp_memory_cpu.{json,md}
    python bench/fsdp_memory.py --steps 2 --hidden 256 --layers 4 --out /tmp/fsdp_memory.json

A random-init Llama (delft's from-scratch model: recipe model.init scratch, char tokenizer, tied embeddings), fully
fine-tuned in float32 with AdamW on the CPU, trained twice by delft's own `run_training` under
`python -m torch.distributed.run --nproc-per-node 2` (gloo, one thread per rank): train.distributed fsdp, then ddp,
the same recipe otherwise (packed batches of batch x max_length tokens, gradient checkpointing, delft's defaults),
each launched twice: with glibc's malloc as users get it, and with MALLOC_MMAP_THRESHOLD_=65536.
Nothing in delft is changed: inside this script's workers only, delft.training.sft.build_model and the Trainer's
__init__ and train are wrapped to take the measurements around them. Per rank:

  local state   the exact bytes this rank holds after the steps: its parameters (DTensor.to_local() under fsdp), its
                gradients (read in the optimizer's pre-step hook of the last step, before zero_grad frees them) and
                AdamW's states (exp_avg, exp_avg_sq; the per-parameter step scalars counted apart). The padded
                storage FSDP2 allocates is recorded too.
  RSS growth    VmHWM (/proc/self/status) minus the RSS right before the model loads: the high-water mark is reset
                (/proc/self/clear_refs) before the load and again once the Trainer is built, so "load" is the
                loading and sharding and "steps" the training steps alone. Includes the allocator's behaviour
                (glibc's default keeps freed memory for reuse; with the mmap threshold every allocation over 64 KiB
                goes back to the system when freed, so RSS follows the live bytes more closely), fp32 compute (no
                bf16 MixedPrecisionPolicy on the CPU) and the optimizer's temporaries; there is no CUDA context.
                Context, not a pass/fail.

`--plan`'s figures come from delft.planning.command.run_plan (world size 2, a silent console) for the same recipes:
a CUDA plan. Its sharded state (weights + gradients + optimizer states per rank) should equal the measured local
state; its peak assumes bf16 gathers and activations and the CUDA allocator, so the RSS growth is shown beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MiB = 2**20
MODES = ("fsdp", "ddp")
# glibc's malloc as users get it, and with every allocation over 64 KiB its own mmap, returned to the system when
# freed: RSS then follows the live bytes more closely (bench/README.md: it slows steps down)
DEFAULT, MMAP = "glibc_default", "mmap_threshold_64k"
ALLOCATORS = {DEFAULT: {}, MMAP: {"MALLOC_MMAP_THRESHOLD_": "65536"}}


# -- the worker: one rank of a torchrun launch


def proc_status(key: str) -> int:
    """A /proc/self/status memory line (VmRSS, VmHWM, RssAnon, ...) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak_rss() -> None:
    """VmHWM back to the current RSS (clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def local_bytes(tensors) -> dict:
    """This rank's bytes of ``tensors`` (DTensors: the local shard): as numel x element size, and as the storages
    hold them (FSDP2 pads a shard's storage; each storage counted once)."""
    exact, seen = 0, {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        exact += t.numel() * t.element_size()
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return dict(bytes=exact, storage_bytes=sum(seen.values()), tensors=len(list(seen)))


def optimizer_bytes(optimizer) -> dict:
    moments, steps = [], []
    for state in optimizer.state.values():
        for key, value in state.items():
            if hasattr(value, "numel"):
                (steps if key == "step" else moments).append(value)
    return dict(moments=local_bytes(moments), step_scalars=local_bytes(steps))


def worker(recipe_path: Path, record: Path) -> None:
    """Train the recipe as `delft train` does (load_recipe, run_training), measuring this rank around it."""
    from rich.console import Console

    from delft.recipe.files import load_recipe
    from delft.training import sft
    from delft.training.stages import run_training

    rec: dict = {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
    build_model, init, train = sft.build_model, sft.Trainer.__init__, sft.Trainer.train

    def measured_build_model(s, console):
        rec["rss_before_load"] = proc_status("VmRSS")
        reset_peak_rss()
        return build_model(s, console)

    def measured_init(self, *args, **kwargs):
        init(self, *args, **kwargs)  # the model sharded (fsdp), the optimizer built
        rec["hwm_load"] = proc_status("VmHWM")
        rec["rss_after_setup"] = proc_status("VmRSS")
        rec["global_parameters"] = sum(p.numel() for p in self.model.parameters())

        def before_step(optimizer, args, kwargs):
            rec["grads"] = local_bytes([p.grad for p in self.params if p.grad is not None])

        self.optimizer.register_step_pre_hook(before_step)
        reset_peak_rss()

    def measured_train(self):
        start = time.perf_counter()
        train(self)
        rec["steps_s"] = round(time.perf_counter() - start, 1)
        rec["hwm_steps"] = proc_status("VmHWM")
        rec["rss_after_steps"] = proc_status("VmRSS")
        rec["rss_anon_after_steps"] = proc_status("RssAnon")
        rec["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # lifetime, not reset
        rec["params"] = local_bytes(list(self.model.parameters()))
        rec["optimizer"] = optimizer_bytes(self.optimizer)
        rec["steps"] = self.step
        (record / f"rank{rec['rank']}.json").write_text(json.dumps(rec, indent=2) + "\n")

    sft.build_model = measured_build_model
    sft.Trainer.__init__ = measured_init
    sft.Trainer.train = measured_train
    run_training(load_recipe(recipe_path), console=Console(stderr=True))


# -- the driver


def recipe_data(args, tmp: Path, mode: str) -> dict:
    return {"model": {"init": "scratch", "tokenizer": "char", "device": "cpu", "dtype": "float32",
                      "architecture": {"hidden_size": args.hidden, "layers": args.layers, "heads": args.heads,
                                       "intermediate_size": args.intermediate, "context": args.max_length}},
            "data": {"source": "synthetic", "format": "synthetic", "template": "plain", "packing": True,
                     "max_length": args.max_length, "val_size": 0,
                     "synthetic": {"n": 2000, "seed": 0, "ops": ["+"], "max_digits": 3, "decimal_fraction": 0,
                                   "negative_fraction": 0, "style": "compact"}},
            "train": {"finetuning": "full", "optimizer": "adamw", "distributed": mode, "max_steps": args.steps,
                      "batch_size": args.batch, "grad_accum": 1, "learning_rate": 1e-4, "warmup_ratio": 0.0,
                      "logging_steps": 1, "save_steps": 10_000, "eval_steps": 10_000, "seed": 0},
            "output": {"dir": str(tmp / "runs" / mode)}}


def launch(recipe_path: Path, record: Path, env: dict, log: Path) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).resolve()), "--worker", str(recipe_path), "--record", str(record)]
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n" + log.read_text()[-4000:])
    return time.perf_counter() - start


def plan(recipe) -> dict:
    """run_plan's components for ``recipe`` at world size 2, its table printed into nothing."""
    from rich.console import Console

    from delft.planning.command import run_plan

    return run_plan(recipe, None, Console(file=io.StringIO(), width=200), world_size=2)["components"]


def persistent_plan(mode: str, est: dict) -> int:
    """The plan's weights + gradients + optimizer states per rank."""
    if mode == "fsdp":
        return est["sharded_state"]
    return est["weights_nf4"] + est["weights_16bit"] + est["lora_optimizer"]


def rss(rec: dict) -> dict:
    """The RSS figures of one rank's record, as growth over its RSS right before the model loaded."""
    base = rec["rss_before_load"]
    return {"load_peak": rec["hwm_load"] - base, "after_setup": rec["rss_after_setup"] - base,
            "steps_peak": rec["hwm_steps"] - base, "after_steps": rec["rss_after_steps"] - base}


def summarise(mode: str, est: dict, recs: dict) -> dict:
    """One rank's measurements under every allocator setting (``recs``: ALLOCATORS' names to records) beside the
    plan's figures."""
    rec = recs[DEFAULT]
    state = rec["params"]["bytes"] + rec["grads"]["bytes"] + rec["optimizer"]["moments"]["bytes"]
    same = all(r[k] == rec[k] for r in recs.values() for k in ("params", "grads", "optimizer"))
    planned = persistent_plan(mode, est)
    growth = {name: rss(r) for name, r in recs.items()}
    return {"rank": rec["rank"],
            "measured": {"params_local": rec["params"]["bytes"], "grads_local": rec["grads"]["bytes"],
                         "adamw_moments_local": rec["optimizer"]["moments"]["bytes"],
                         "adamw_step_scalars": rec["optimizer"]["step_scalars"]["bytes"],
                         "persistent_state": state,
                         "persistent_state_storage": rec["params"]["storage_bytes"] + rec["grads"]["storage_bytes"]
                         + rec["optimizer"]["moments"]["storage_bytes"],
                         "persistent_state_same_under_every_allocator": same,
                         "rss_growth": growth},
            "plan": {"persistent_state": planned, "peak_allocated": est["peak_allocated"], "total": est["total"]},
            "state_measured_over_plan": round(state / planned, 4),
            "rss_steps_peak_over_plan_peak_allocated": {name: round(g["steps_peak"] / est["peak_allocated"], 3)
                                                        for name, g in growth.items()},
            "raw": recs}


def machine() -> dict:
    import torch
    import transformers

    mem = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "memory_gib": round(int(mem.split()[1]) / 2**20, 1),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def mib(x: float) -> str:
    return f"{x / MiB:,.1f}"


def span(values: list, fmt: str) -> str:
    """'a' when every value prints alike, else 'min-max'."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def markdown(out: dict) -> str:
    fs = out["runs"]["fsdp"]["ranks"]
    rows = ["| run, rank | plan: weights + grads + AdamW | measured local state | measured / plan | "
            "plan: peak allocated (total) | RSS growth, steps (load), glibc default | RSS growth, steps (load), "
            "`MALLOC_MMAP_THRESHOLD_=65536` |", "|---|---|---|---|---|---|---|"]
    for mode in MODES:
        for r in out["runs"][mode]["ranks"]:
            m, p, g = r["measured"], r["plan"], r["measured"]["rss_growth"]
            rows.append(f"| {mode}, rank {r['rank']} | {mib(p['persistent_state'])} | {mib(m['persistent_state'])} | "
                        f"{r['state_measured_over_plan']:.4f} | {mib(p['peak_allocated'])} ({mib(p['total'])}) | "
                        + " | ".join(f"{mib(g[a]['steps_peak'])} ({mib(g[a]['load_peak'])})" for a in ALLOCATORS)
                        + " |")
    s = out["setup"]
    ratios = span([r["state_measured_over_plan"] for r in fs], ".4f")
    over = {a: span([r["rss_steps_peak_over_plan_peak_allocated"][a] for r in fs], ".2f") for a in ALLOCATORS}
    rss_half = out["fsdp_over_ddp_rss_steps_peak"]
    text = f"""# FSDP2 per-rank memory on the CPU against `--plan`

Written by `bench/fsdp_memory.py` in {out['wall_s']:.0f} s: {s['model']} ({s['parameters']:,} parameters), full
fine-tuning in float32 with AdamW, {s['steps']} steps of {s['batch']} x {s['max_length']} packed tokens per rank, 2
torchrun ranks (gloo, one thread each) on {out['machine']['cpus']} CPUs, each run twice: with glibc's malloc as
users get it and with `MALLOC_MMAP_THRESHOLD_=65536` (freed memory goes back to the system). MiB per rank; "load"
is the loading and sharding, "steps" the training steps.

{chr(10).join(rows)}

Measured: each rank's own bytes after the steps (parameter shards via `DTensor.to_local()`, gradient shards at the
last optimizer step, AdamW's two moments) and its peak RSS minus its RSS right before the model loaded. The fsdp
ranks hold {ratios} x the plan's sharded state (weights + gradients + optimizer states) and
{out['fsdp_over_ddp_persistent_state']:.3f} x what a ddp rank holds: sharding over 2 ranks halved the persistent
state. Their RSS growth during the steps is {over[MMAP]} x the plan's peak allocated with the mmap threshold
({rss_half[MMAP]:.2f} x a ddp rank's), and {over[DEFAULT]} x with glibc's default ({rss_half[DEFAULT]:.2f} x a ddp
rank's), which keeps freed memory for reuse rather than returning it. Neither is a like-for-like figure: the CPU
run gathers and computes in fp32 (the plan counts CUDA's bf16 MixedPrecisionPolicy), RSS includes the optimizer's
temporaries and the allocator's behaviour, and there is no CUDA context, allocator slack or NCCL buffer (the plan's
total adds them); the load column's peak (the whole model before sharding) is not in the plan. It is context, not
a pass/fail.

CUDA figures: not measured yet; they wait for a GPU.
"""
    paragraphs = [p if p.startswith(("#", "|")) else textwrap.fill(" ".join(p.split()), 116)
                  for p in text.strip().split("\n\n")]
    return "\n\n".join(paragraphs) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="micro-batch per rank (packed rows)")
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fsdp_memory_cpu.json")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.record)
    if os.nice(0) < 10:
        os.nice(10 - os.nice(0))  # the ranks inherit it
    start = time.perf_counter()
    facts = machine()
    from delft.models.scratch import scratch_model_ref
    from delft.planning import command  # noqa: F401 - the plan's code as this run reads it (another may edit it)
    from delft.recipe.files import load_recipe

    plan_source = (ROOT / "delft" / "planning" / "fsdp.py").read_bytes()

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DELFT_CACHE": str(tmp / "cache")}
        os.environ["DELFT_CACHE"] = env["DELFT_CACHE"]
        runs = {}
        for mode in MODES:
            path = tmp / f"{mode}.yaml"
            path.write_text(yaml.safe_dump(recipe_data(args, tmp, mode)))
            recipe = load_recipe(path)
            scratch_model_ref(recipe)  # the random init written once, before the ranks load it
            recs, walls = {0: {}, 1: {}}, {}
            for name, extra in ALLOCATORS.items():
                record = tmp / f"record_{mode}_{name}"
                record.mkdir()
                shutil.rmtree(tmp / "runs" / mode, ignore_errors=True)
                walls[name] = round(launch(path, record, {**env, **extra}, tmp / f"{mode}_{name}.log"), 1)
                for r in recs:
                    recs[r][name] = json.loads((record / f"rank{r}.json").read_text())
            est = plan(recipe)
            ranks = [summarise(mode, est, recs[r]) for r in recs]
            runs[mode] = {"wall_s": walls, "plan": est, "ranks": ranks}
            print(f"{mode}: {walls} s; " + "; ".join(
                f"rank {r['rank']}: state {mib(r['measured']['persistent_state'])} MiB measured, "
                f"{mib(r['plan']['persistent_state'])} planned ({r['state_measured_over_plan']:.4f}x), RSS growth "
                + ", ".join(f"{mib(g['steps_peak'])}" for g in r["measured"]["rss_growth"].values())
                + f" MiB ({', '.join(ALLOCATORS)}) vs planned peak allocated {mib(r['plan']['peak_allocated'])}"
                for r in ranks), flush=True)
    fsdp_state = sum(r["measured"]["persistent_state"] for r in runs["fsdp"]["ranks"])
    ddp_state = sum(r["measured"]["persistent_state"] for r in runs["ddp"]["ranks"])
    out = {"machine": facts,
           "setup": {"model": f"random-init Llama (model.init scratch, char tokenizer, tied embeddings), hidden "
                              f"{args.hidden}, {args.layers} layers, {args.heads} heads, intermediate "
                              f"{args.intermediate}",
                     "parameters": runs["fsdp"]["ranks"][0]["raw"][DEFAULT]["global_parameters"], "dtype": "float32",
                     "finetuning": "full", "optimizer": "adamw", "steps": args.steps, "batch": args.batch,
                     "max_length": args.max_length, "packing": True, "gradient_checkpointing": True,
                     "world_size": 2, "backend": "gloo", "threads_per_rank": 1, "nice": os.nice(0),
                     "recipe": recipe_data(args, Path("TMP"), "fsdp | ddp")},
           "how": " ".join(" ".join(__doc__.split("\n\n")[2:5]).split()),
           "plan_source_sha256": hashlib.sha256(plan_source).hexdigest(),
           "runs": runs,
           "fsdp_over_ddp_persistent_state": round(fsdp_state / ddp_state, 4),
           "fsdp_over_ddp_rss_steps_peak": {a: round(sum(r["measured"]["rss_growth"][a]["steps_peak"]
                                                         for r in runs["fsdp"]["ranks"])
                                                     / sum(r["measured"]["rss_growth"][a]["steps_peak"]
                                                           for r in runs["ddp"]["ranks"]), 3) for a in ALLOCATORS},
           "cuda": {"measured": None, "status": "not measured yet; the CUDA figures wait for a GPU"},
           "wall_s": round(time.perf_counter() - start, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(out))
    print(markdown(out))
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out} and its .md")


if __name__ == "__main__":
    main()
