"""Data-parallel training on the CPU: 2 torchrun processes (gloo) against 1 process, same global batch.

    flock /tmp/delft-cpu.lock python bench/ddp_bench.py            # writes bench/results/ddp_cpu.json
    python bench/ddp_bench.py --steps 20 --hidden 256 --layers 4

Three runs of the same recipe on a random-init tiny Llama (tests/tiny.py), each in a fresh subprocess:
  one_1thread   `delft train`, grad_accum 2, OMP_NUM_THREADS=1
  one_2threads  the same with OMP_NUM_THREADS=2 (one process using both cores)
  two_procs     `python -m torch.distributed.run --nproc-per-node 2 -m delft train`, grad_accum 1, one thread each
tokens/s is delft's own log figure (real tokens of all ranks per optimizer step, median over the steps after
the first); wall_s includes start-up and model loading. The adapters are compared too: the largest absolute
difference between two_procs and one_1thread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def recipe(tmp: Path, model: Path, name: str, grad_accum: int, steps: int, batch: int) -> Path:
    data = {"model": {"name": str(model), "device": "cpu"}, "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
            "data": {"synthetic": {"n": 400, "max_digits": 4}, "max_length": 64, "val_size": 0},
            "train": {"max_steps": steps, "batch_size": batch, "grad_accum": grad_accum, "logging_steps": 1,
                      "save_steps": 10_000, "learning_rate": 1e-3, "warmup_ratio": 0.0},
            "output": {"dir": str(tmp / name)}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(cmd: list[str], threads: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-2000:])
    return time.perf_counter() - start


def tokens_per_s(run_dir: Path) -> float:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]
    return statistics.median(rates)


def max_adapter_diff(a: Path, b: Path) -> float:
    from helpers import adapter_weights

    wa, wb = adapter_weights(a), adapter_weights(b)
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8, help="micro-batch per process")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ddp_cpu.json")
    args = ap.parse_args()
    from tiny import save_tiny

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = save_tiny(tmp / "model", hidden=args.hidden, layers=args.layers)
        results = {}
        for name, threads in (("one_1thread", 1), ("one_2threads", 2)):
            path = recipe(tmp, model, name, 2, args.steps, args.batch)
            wall = run([sys.executable, "-m", "delft", "train", str(path)], threads)
            results[name] = {"wall_s": round(wall, 1), "tokens_per_s": round(tokens_per_s(tmp / name))}
        two = recipe(tmp, model, "two_procs", 1, args.steps, args.batch)
        wall = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    "-m", "delft", "train", str(two)], 1)
        results["two_procs"] = {"wall_s": round(wall, 1), "tokens_per_s": round(tokens_per_s(tmp / "two_procs"))}
        diff = max_adapter_diff(tmp / "one_1thread", tmp / "two_procs")
    import torch

    out = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
           "setup": {"model": f"tiny llama, hidden {args.hidden}, {args.layers} layers", "steps": args.steps,
                     "global_batch": f"{args.batch} x 2 micro-batches (1 process) = {args.batch} x 1 x 2 ranks",
                     "max_length": 64},
           "runs": results,
           "two_vs_one_1thread_tokens_per_s": round(results["two_procs"]["tokens_per_s"]
                                                    / results["one_1thread"]["tokens_per_s"], 2),
           "two_vs_one_2threads_tokens_per_s": round(results["two_procs"]["tokens_per_s"]
                                                     / results["one_2threads"]["tokens_per_s"], 2),
           "adapter_max_abs_diff_two_vs_one": diff}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
