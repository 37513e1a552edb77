"""Issue 30's CUDA half, prepared for a session with a GPU (not run on one yet: no GPU was lent when it was written).

    python bench/gpu_full_ft.py                       # on the GPU machine: bf16 full fine-tuning, 3 optimizers
    python bench/gpu_full_ft.py --device cpu --steps 4 --optimizers adamw   # the CPU dry run of the same path

Full fine-tuning (`train.finetuning: full`) of a random-init Llama-style model (delft's `model.init: scratch`, so
the machine needs no network and no model download) with bf16 weights, once per optimizer: bitsandbytes' 32-bit
AdamW (fp32 moments), 8-bit AdamW and paged 8-bit AdamW. For each it records what `delft train` measured (peak
memory, tokens/s, the loss falling), what `delft recipe check --plan` estimated for the same recipe, the dtypes of
the optimizer's moments, and whether `delft export` verifies the run. Results: bench/results/
gpu_full_ft_<device>.json, copied to $OUT when the device tool sets it. Needs bitsandbytes on the GPU machine (see
bench/gpu_run.sh for installing wheels there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "study" / "scratch" / "del_prob.yaml"  # the scratch study's arm: CE + del_prob
# About 150M parameters: big enough that optimizer state dominates memory, small enough for minutes on one GPU.
ARCHITECTURE = {"hidden_size": 1024, "layers": 12, "heads": 16, "intermediate_size": 2816, "context": 48}


def overrides(device: str, optimizer: str, steps: int, out: Path) -> list[str]:
    dtype = "bfloat16" if device == "cuda" else "float32"  # the CPU path is fp32 (bf16 CPU matmuls are slow)
    sets = {"model.device": device, "model.dtype": dtype, "train.optimizer": optimizer, "train.max_steps": steps,
            "train.save_steps": steps, "train.eval_steps": steps, "train.logging_steps": max(1, steps // 4),
            "train.batch_size": 32, "data.synthetic.n": 4000, "output.dir": str(out)}
    sets.update({f"model.architecture.{k}": v for k, v in ARCHITECTURE.items()})
    return [f"{k}={v}" for k, v in sets.items()]


def planned(recipe) -> dict:
    """What `delft recipe check --plan` estimates for ``recipe`` (its numbers, not its table)."""
    import io

    from rich.console import Console

    from delft.planning.command import run_plan

    return run_plan(recipe, gpu_memory=None, console=Console(file=io.StringIO()))


def moment_dtypes(recipe) -> dict:
    """The weights' dtype and the optimizer's per-parameter state dtypes after one step, with delft's own model
    and optimizer builders for ``recipe`` (a finished run keeps no checkpoint to read them from)."""
    import torch
    from rich.console import Console

    from delft.training.setup import build_model, build_optimizer, setup

    s = setup(recipe)
    model, dtype, _ = build_model(s, Console(quiet=True))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(s, params, dtype)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    states = {str(v.dtype) for p in params for v in opt.state[p].values() if torch.is_tensor(v) and v.numel() > 1}
    return {"weights": str(params[0].dtype), "optimizer": type(opt).__name__, "moments": sorted(states)}


def one(device: str, optimizer: str, steps: int, work: Path) -> dict:
    from delft.recipe.files import load_recipe

    run = work / f"run-{optimizer}"
    sets = overrides(device, optimizer, steps, run)
    recipe = load_recipe(RECIPE, sets)
    row: dict = {"optimizer": optimizer, "device": device, "architecture": ARCHITECTURE, "steps": steps}
    try:
        plan = planned(recipe)
        row["plan_gb"] = {k: round(v / 2**30, 3) for k, v in plan["components"].items() if isinstance(v, (int, float))}
    except Exception as e:  # a refusal (8-bit on the CPU) is a result too
        row["plan_error"] = f"{type(e).__name__}: {e}"
    cmd = [sys.executable, "-m", "delft", "train", str(RECIPE), *[x for s in sets for x in ("--set", s)]]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    row.update(train_rc=done.returncode, train_s=round(time.perf_counter() - start, 1),
               train_tail=(done.stdout + done.stderr)[-1500:])
    if done.returncode != 0:
        return row
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    logged = [m for m in metrics if "loss" in m and "peak_mem_gb" in m]
    row.update(peak_mem_gb=max(m["peak_mem_gb"] for m in logged), tokens_per_s=logged[-1]["tokens_per_s"],
               first_loss=logged[0]["loss"], last_loss=logged[-1]["loss"], dtypes=moment_dtypes(recipe))
    if "plan_gb" in row:
        row["plan_over_measured"] = round(row["plan_gb"]["total"] / row["peak_mem_gb"], 3)
    export = subprocess.run([sys.executable, "-m", "delft", "export", str(run), "--out", str(work / f"export-"
                             f"{optimizer}")], cwd=REPO, capture_output=True, text=True)
    row.update(export_rc=export.returncode, export_tail=(export.stdout + export.stderr)[-800:])
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--optimizers", default="adamw,adamw_8bit,paged_adamw_8bit")
    ap.add_argument("--work", default="/tmp/delft_gpu_full_ft", help="run and export directories (removed first)")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    out = REPO / "bench" / "results" / f"gpu_full_ft_{args.device}.json"
    rows = []
    for optimizer in args.optimizers.split(","):
        rows.append(one(args.device, optimizer, args.steps, work))
        out.write_text(json.dumps(rows, indent=1) + "\n")  # each configuration as soon as it finishes
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("_tail")}), flush=True)
    if os.environ.get("OUT"):
        shutil.copy(out, os.environ["OUT"])
    return 0 if all(r["train_rc"] == 0 for r in rows if r["device"] == "cuda" or r["optimizer"] == "adamw") else 1


if __name__ == "__main__":
    sys.exit(main())
