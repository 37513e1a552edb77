"""Does delft's from-scratch path learn arithmetic slower than a minimal PyTorch loop? (issue 39)

Both paths train the same 0.8M Llama (recipes/study/scratch/base.yaml's shape, delft's char tokenizer, the config
delft.models.scratch builds) on the same problems in the same format ("a+b=" -> "c", answer most-significant digit
first, EOS after it), with the same lr, batch and schedule. Both are scored the same way: every 100 steps, greedy
decoding of the answer up to EOS on 200 held-out problems (none of them a training problem), exact integer match,
by `exact_match` below. The minimal loop is scored in process; the delft run writes a snapshot every 100 steps
(train.snapshot_steps), which this script scores afterwards with the same function. delft's own held-out measurement
(train.accuracy_steps, its last-number extraction) is kept beside it as a cross-check.

    python bench/scratch_speed.py --data                 # the problem files (also written on demand)
    python bench/scratch_speed.py --minimal 0            # one run of the minimal loop, seed 0
    python bench/scratch_speed.py --delft 0              # one run of `delft train` on the same problems
    python bench/scratch_speed.py --minimal 0 --like clip,wd0   # the minimal loop with delft's settings switched in
    python bench/scratch_speed.py --delft 1 --variant newline   # delft with the audit's newline after the prompt
    python bench/scratch_speed.py --summary              # steps-to-50 % per path, Mann-Whitney

Each run appends (or replaces) its row in bench/results/scratch_speed.json. Run at most two at a time on the shared
2-core machine; each uses one thread.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
import yaml
from transformers import LlamaForCausalLM, get_cosine_schedule_with_warmup

from delft.evaluation.metrics import EXACT_MATCH
from delft.models.scratch import char_tokenizer, llama_config
from delft.recipe.schema import Recipe
from delft.rundir import snapshot_path

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "runs" / "scratch_speed"  # regenerated from the seeds; runs/ is not tracked
TRAIN, HELDOUT = DATA / "train.jsonl", DATA / "heldout.jsonl"
RESULTS = HERE / "results" / "scratch_speed.json"
N_TRAIN, N_HELDOUT, DATA_SEED = 20_000, 200, 0
STEPS, EVERY, BATCH, LR, WARMUP = 1500, 100, 64, 1e-3, 0.02
MAX_NEW = 8  # longest answer is 4 digits, then EOS
THRESHOLD = 0.5
# Switches that move the minimal loop toward delft's settings one at a time (issue 39's factor search).
LIKE = {"clip": "gradient clipping at 1.0 (delft's train.max_grad_norm default)",
        "wd0": "no weight decay (delft's train.weight_decay default; torch's AdamW has 0.01)",
        "order": "delft's data order (the rows shuffled by random.Random(seed), then by random.Random(seed * 7919 + "
                 "epoch) each epoch)"}


# Variants of delft's recipe (--delft SEED --variant NAME) that show what the audit's delft run differed in.
VARIANTS = {"newline": "data.separator '\\n' (delft's rendering of plain prompts before data.separator existed)",
            "default_loss": "loss unset: delft's default, CE + 0.03 x DEL's digit term"}


# -- problems

def operand(rng: random.Random) -> int:
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def write_data() -> None:
    """20,000 training problems from one seed and 200 held-out ones from another, none of them a training problem."""
    if TRAIN.is_file() and HELDOUT.is_file():
        return
    DATA.mkdir(parents=True, exist_ok=True)
    rng = random.Random(DATA_SEED)
    train = [(operand(rng), operand(rng)) for _ in range(N_TRAIN)]
    seen, held = set(train), []
    rng = random.Random(DATA_SEED + 1)
    while len(held) < N_HELDOUT:
        p = (operand(rng), operand(rng))
        if p not in seen:
            seen.add(p)
            held.append(p)
    for path, rows in ((TRAIN, train), (HELDOUT, held)):
        path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n"
                                for a, b in rows))


def read_rows(path: Path) -> list[tuple[str, str]]:
    return [(r["prompt"], r["completion"]) for r in map(json.loads, path.read_text().splitlines())]


# -- the shared model shape and scorer

def recipe_dict(seed: int, out_dir: str) -> dict:
    """The delft recipe of a run; the minimal loop takes its model config from the same recipe."""
    snapshots = list(range(EVERY, STEPS + 1, EVERY))
    plain = {"format": "prompt_completion", "template": "plain", "separator": "", "val_size": 0}
    return {
        "model": {"init": "scratch", "tokenizer": "char", "device": "cpu", "dtype": "float32",
                  "architecture": {"hidden_size": 128, "layers": 4, "heads": 4, "intermediate_size": 384,
                                   "context": 48}},
        "data": {"source": str(TRAIN), **plain, "max_length": 40},
        "train": {"finetuning": "full", "max_steps": STEPS, "batch_size": BATCH, "learning_rate": LR,
                  "lr_scheduler": "cosine", "warmup_ratio": WARMUP, "gradient_checkpointing": False, "seed": seed,
                  "logging_steps": EVERY, "eval_steps": STEPS, "save_steps": STEPS, "accuracy_steps": EVERY,
                  "accuracy_examples": N_HELDOUT, "snapshot_steps": snapshots},
        "eval": {"data": {"source": str(HELDOUT), **plain}, "limit": N_HELDOUT, "max_new_tokens": MAX_NEW,
                 "batch_size": N_HELDOUT},
        "loss": {"type": "ce"},  # the minimal loop's objective (delft's default adds DEL's digit term)
        "output": {"dir": out_dir},
    }


@torch.no_grad()
def exact_match(model, tok, rows: list[tuple[str, str]]) -> float:
    """Greedy decoding up to EOS (at most MAX_NEW tokens), prompts of one length together (no padding), and the
    text before EOS compared with the answer as an integer."""
    was = model.training
    model.eval()
    by_len: dict[int, list] = {}
    for prompt, answer in rows:
        ids = tok.encode(prompt, add_special_tokens=False)
        by_len.setdefault(len(ids), []).append((ids, int(answer)))
    right = 0
    for group in by_len.values():
        ids = torch.tensor([g[0] for g in group])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for row, (_, gold) in zip(out[:, ids.shape[1]:].tolist(), group):
            cut = row[:row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
            text = tok.decode(cut)
            right += bool(re.fullmatch(r"\d+", text)) and int(text) == gold
    model.train(was)
    return right / len(rows)


# -- the minimal loop

def batches(rows: list, seed: int, epoch: int, like: set[str]) -> list[list]:
    if "order" in like:
        order = list(range(len(rows)))
        random.Random(seed * 7919 + epoch).shuffle(order)
    else:
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    return [[rows[i] for i in order[k:k + BATCH]] for k in range(0, len(order), BATCH)]


def encode(batch: list, tok) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and labels on the answer and EOS only."""
    seqs = []
    for prompt, answer in batch:
        p = tok.encode(prompt, add_special_tokens=False)
        c = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
        seqs.append((p + c, [-100] * len(p) + c))
    width = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    labels = torch.full((len(seqs), width), -100)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, lab) in enumerate(seqs):
        ids[i, :len(s)], labels[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), torch.tensor(lab), 1
    return ids, mask, labels


def run_minimal(seed: int, like: set[str]) -> list[dict]:
    tok = char_tokenizer()
    torch.manual_seed(seed)  # as delft.models.scratch builds the init for train.seed
    model = LlamaForCausalLM(llama_config(Recipe.model_validate(recipe_dict(seed, "unused")), tok))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **({"weight_decay": 0.0} if "wd0" in like else {}))
    sched = get_cosine_schedule_with_warmup(opt, round(WARMUP * STEPS), STEPS)
    rows, held = read_rows(TRAIN), read_rows(HELDOUT)
    if "order" in like:  # delft.data.pipeline.build_datasets shuffles the examples once before the epochs
        random.Random(seed).shuffle(rows)
    model.train()
    step, epoch, curve = 0, 0, []
    while step < STEPS:
        for batch in batches(rows, seed, epoch, like):
            ids, mask, labels = encode(batch, tok)
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            if "clip" in like:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % EVERY == 0:
                curve.append({"step": step, "exact": exact_match(model, tok, held)})
                print(f"minimal seed {seed} step {step} exact {curve[-1]['exact']:.3f}", flush=True)
            if step == STEPS:
                break
        epoch += 1
    return curve


# -- delft's path

def run_delft(seed: int, variant: str = "") -> tuple[list[dict], list[dict]]:
    """`delft train` on the recipe; (curve scored here from the snapshots, delft's own held-out curve). The
    newline variant is scored on prompts ending in the newline it trained on."""
    work = Path(tempfile.mkdtemp(prefix=f"scratch_speed_delft{seed}_"))
    try:
        recipe, spec = work / "recipe.yaml", recipe_dict(seed, str(work / "run"))
        if variant == "newline":
            spec["data"]["separator"] = spec["eval"]["data"]["separator"] = "\n"
        if variant == "default_loss":
            del spec["loss"]
        recipe.write_text(yaml.safe_dump(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        subprocess.run(["delft", "train", str(recipe)], check=True, env=env, stdout=subprocess.DEVNULL)
        own = [{"step": r["step"], "exact": r[EXACT_MATCH.heldout]}
               for r in map(json.loads, (work / "run" / "metrics.jsonl").read_text().splitlines())
               if EXACT_MATCH.heldout in r]
        tok, held, curve = char_tokenizer(), read_rows(HELDOUT), []
        if variant == "newline":
            held = [(prompt + "\n", answer) for prompt, answer in held]
        for step in range(EVERY, STEPS + 1, EVERY):
            model = LlamaForCausalLM.from_pretrained(snapshot_path(work / "run", step))
            curve.append({"step": step, "exact": exact_match(model, tok, held)})
        return curve, own
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- results

def save_row(row: dict) -> None:
    """Replace this (path, seed, like) row in the results file, under a lock (two runs write at once)."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(DATA / "results.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": []}
        key = (row["path"], row["seed"], row.get("like", ""))
        data["runs"] = [r for r in data["runs"] if (r["path"], r["seed"], r.get("like", "")) != key] + [row]
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")


def first_at(curve: list[dict], level: float) -> int | None:
    return next((c["step"] for c in curve if c["exact"] >= level), None)


def path_summary(rows: list[dict]) -> dict:
    """One path's runs: steps to 50 % (and 25 %; None = never within STEPS), their median counting never as
    later than any step, the final and mean exact match."""
    steps = [r["first_step_50"] for r in rows]
    ranked = sorted(s if s is not None else math.inf for s in steps)
    median = (ranked[(len(ranked) - 1) // 2] + ranked[len(ranked) // 2]) / 2 if ranked else None
    return {"seeds": [r["seed"] for r in rows], "steps_to_50": steps,
            "passed_50": sum(s is not None for s in steps),
            "median_steps_to_50": None if median is None or math.isinf(median) else median,
            "steps_to_25": [first_at(r["curve"], 0.25) for r in rows],
            "final_exact": [r["curve"][-1]["exact"] for r in rows],
            "mean_exact_over_curve": [round(sum(c["exact"] for c in r["curve"]) / len(r["curve"]), 4) for r in rows]}


def summary(like: str = "") -> dict:
    """Both paths' summaries and two tests: Mann-Whitney on steps to 50 % (never ranks last, tied; the exact
    permutation distribution), and, since a seed gives both paths the same init, Wilcoxon's signed-rank test on
    the per-seed differences in final exact match (exact)."""
    from scipy.stats import PermutationMethod, mannwhitneyu, wilcoxon

    data = json.loads(RESULTS.read_text())
    by = {p: sorted((r for r in data["runs"] if r["path"] == p and r.get("like", "") == (like if p == "minimal"
                                                                                          else "")),
                    key=lambda r: r["seed"]) for p in ("minimal", "delft")}
    out = {p: path_summary(rows) for p, rows in by.items()}
    never = STEPS + EVERY  # a run that never passes ranks after every run that does
    a = [s if s is not None else never for s in out["minimal"]["steps_to_50"]]
    b = [s if s is not None else never for s in out["delft"]["steps_to_50"]]
    if len(set(a + b)) > 1:
        test = mannwhitneyu(a, b, method=PermutationMethod(n_resamples=10**5))
        out["mann_whitney_steps_to_50"] = {"U_minimal": float(test.statistic), "p_two_sided": float(test.pvalue),
                                           "never_counts_as": never}
    paired = {r["seed"]: r["curve"][-1]["exact"] for r in by["delft"]}
    diffs = [paired[r["seed"]] - r["curve"][-1]["exact"] for r in by["minimal"] if r["seed"] in paired]
    if diffs and any(diffs):
        w = wilcoxon(diffs, method="exact" if 0 not in diffs else "auto")
        out["wilcoxon_final_exact_delft_minus_minimal"] = {"differences": [round(d, 3) for d in diffs],
                                                           "delft_higher": sum(d > 0 for d in diffs),
                                                           "p_two_sided": float(w.pvalue)}
    if not like:
        data["summary"] = out
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return out


def main() -> None:
    global STEPS, RESULTS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", action="store_true", help="write the problem files only")
    ap.add_argument("--minimal", type=int, metavar="SEED", help="run the minimal loop with this seed")
    ap.add_argument("--delft", type=int, metavar="SEED", help="run delft train with this seed")
    ap.add_argument("--like", default="", help=f"minimal loop only: switch in delft's settings ({', '.join(LIKE)})")
    ap.add_argument("--variant", default="", choices=["", *VARIANTS], help="delft only: a recipe variant")
    ap.add_argument("--summary", action="store_true", help="summarise the results file")
    ap.add_argument("--steps", type=int, default=STEPS, help="optimizer steps (a smoke test: --steps 200 --out X)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file")
    args = ap.parse_args()
    STEPS, RESULTS = args.steps, args.out
    torch.set_num_threads(1)
    write_data()
    like = set(filter(None, args.like.split(",")))
    if like - set(LIKE):
        sys.exit(f"--like: unknown {sorted(like - set(LIKE))}; choose from {list(LIKE)}")
    start = time.time()
    if args.minimal is not None:
        curve = run_minimal(args.minimal, like)
        row = {"path": "minimal", "seed": args.minimal, "like": ",".join(sorted(like)), "curve": curve}
    elif args.delft is not None:
        curve, own = run_delft(args.delft, args.variant)
        row = {"path": "delft", "seed": args.delft, "like": args.variant, "curve": curve, "delft_heldout_curve": own}
    else:
        if args.summary:
            summary(",".join(sorted(like)))
        return
    row.update(first_step_50=first_at(curve, THRESHOLD), seconds=round(time.time() - start))
    save_row(row)
    print(f"{row['path']} seed {row['seed']} {row.get('like', '')}: first step >= 50 %: {row['first_step_50']}")


if __name__ == "__main__":
    main()
