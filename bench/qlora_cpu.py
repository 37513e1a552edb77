"""QLoRA on the CPU against fp32 LoRA on SmolLM2-135M (issue 55 item 5): step time, peak RSS, weight bytes.

    flock /tmp/delft-cpu.lock python bench/qlora_cpu.py      # ~15 min on 2 busy cores: results/qlora_cpu.{json,md}
    python bench/qlora_cpu.py --rounds 2 --steps 1 --out /tmp/qlora_cpu.json   # a quick look

Both arms are recipes/quickstart.yaml on the CPU (model.dtype auto: fp32; its LoRA r=16 on every projection, its
loss, batch and data), one with quantization.mode none and one with nf4, built and stepped by delft's own code as
`delft train` runs it: setup, build_model, build_optimizer, the Trainer's batches (micro_batch_items + collate) and
its step (optimizer_step, gradient clipping, optimizer.step, zero_grad). Three measurements, each in a fresh process:

  step time    both arms loaded in one process and stepped in turns after one warm-up step each: every batch is
               stepped by one arm and right after by the other, the order swapped every pair (ABBA), so load
               from other work on the machine falls on both alike. The result is the median of the pairs' ratios
               nf4 / fp32, with each round's median and the ratio of the two arms' fastest steps. Wall and process
               CPU time.
  peak RSS     each arm alone in its own process: VmHWM once the model and optimizer are built (loading, and for
               nf4 quantising), then VmHWM reset (/proc/self/clear_refs) and read again after the same steps (the
               training steps' peak, weights included).
  weight bytes what the memory plan (delft.planning.memory.plan_memory: weights_nf4 + weights_16bit) predicts for
               each arm's base weights against what the loaded model holds: every non-LoRA parameter and buffer,
               and for each nf4 layer its quantisation state (absmax, the double-quantised absmax's own absmax and
               code tables, the nf4 code), each storage counted once (tied embeddings are one tensor).
"""

from __future__ import annotations

import argparse
import ctypes
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
ARMS = ("fp32", "nf4")
QUANT = {"fp32": "none", "nf4": "nf4"}
MiB = 2**20


# -- delft's own path


def arm_recipe(arm: str, extra: tuple = ()):
    from delft.recipe.files import load_recipe

    return load_recipe(QUICKSTART, ["model.device=cpu", f"quantization.mode={QUANT[arm]}", *extra])


class Arm:
    """One arm's model, optimizer and batches, built as delft.training.sft.load and Trainer.__init__ build them."""

    def __init__(self, arm: str):
        from rich.console import Console

        from delft.training.schedule import make_schedule
        from delft.training.setup import build_model, build_optimizer, setup

        self.name = arm
        self.recipe = arm_recipe(arm)
        self.s = setup(self.recipe)
        self.model, self.dtype, _ = build_model(self.s, Console(file=io.StringIO()))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.s, self.params, self.dtype)
        self.schedule = make_schedule(self.recipe, len(self.s.train))

    def batch(self, index: int) -> dict:
        from delft.data.batches import collate
        from delft.training.schedule import micro_batch_items

        items = micro_batch_items(self.s.train, self.recipe, self.schedule, index)
        return collate(items, self.s.tokenizer.pad_token_id)

    def step(self, index: int) -> tuple[float, float, float]:
        """One optimizer step on the Trainer's batch ``index``: (wall s, process CPU s, loss)."""
        import torch

        from delft.training.step import optimizer_step

        batch = self.batch(index)
        t0, c0 = time.perf_counter(), time.process_time()
        out = optimizer_step(self.model, [batch], self.s.loss, self.s.device)
        torch.nn.utils.clip_grad_norm_(self.params, self.recipe.train.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, time.process_time() - c0, out["loss"]


# -- weight bytes: held against planned


def held_bytes(model) -> dict:
    """Bytes the loaded base holds (LoRA excluded), each storage once: plain parameters and buffers, nf4 weights
    and their quantisation states."""
    from delft.models.loading import nf4_layers

    seen: dict = {}

    def add(kind: str, t) -> None:
        if t is not None and hasattr(t, "untyped_storage"):
            seen.setdefault(t.untyped_storage().data_ptr(), (kind, t.untyped_storage().nbytes()))

    nf4 = {id(m.weight) for _, m in nf4_layers(model)}
    for _, m in nf4_layers(model):
        q = m.weight.quant_state
        add("nf4_weights", m.weight)
        add("nf4_absmax", q.absmax)
        add("nf4_tables", q.code)
        add("nf4_tables", q.offset)
        if q.state2 is not None:
            add("nf4_nested_absmax", q.state2.absmax)
            add("nf4_tables", q.state2.code)
    for name, p in model.named_parameters():
        if "lora_" not in name and id(p) not in nf4:
            add("other_parameters", p)
    for name, b in model.named_buffers():
        if "lora_" not in name:
            add("buffers", b)
    out: dict = {}
    for kind, n in seen.values():
        out[kind] = out.get(kind, 0) + n
    out["total"] = sum(out.values())
    out["lora_parameters"] = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return out


def planned_bytes(arm: str) -> dict:
    """The plan's base weights for the arm's recipe with model.dtype float32 (what auto is on the CPU: the run's
    dtype), and for the recipe as written ("as_written": `delft recipe check --plan`, a GPU plan, so auto is bf16)."""
    from delft.planning.memory import lora_parameters, plan_memory
    from delft.planning.shapes import model_shape, read_model_config

    out: dict = {}
    for key, extra in (("as_run", ["model.dtype=float32"]), ("as_written", [])):
        recipe = arm_recipe(arm, extra)
        config, source = read_model_config(recipe)
        plan = plan_memory(config, recipe)
        out[key] = dict(weights_nf4=plan["weights_nf4"], weights_16bit=plan["weights_16bit"],
                        total=plan["weights_nf4"] + plan["weights_16bit"], model_dtype=recipe.model.dtype)
    out["lora_parameters"], out["config"] = lora_parameters(model_shape(config), recipe.lora), source
    return out


# -- the children


def proc_status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS


def rss_split() -> dict:
    """RSS now, and its anonymous and file-backed parts (safetensors weights that are still memory-mapped from the
    file count as file-backed: clean pages the kernel can drop under pressure and read again)."""
    return {k: proc_status(k) for k in ("VmRSS", "RssAnon", "RssFile")}


def child_memory(arm: str, steps: int) -> dict:
    """One arm alone: peak RSS of loading and of ``steps`` steps, and its weight bytes held against planned."""
    from delft.models.loading import check_nf4_exact

    rec: dict = {"arm": arm, "rss_before_load": proc_status("VmRSS")}
    reset_peak_rss()
    a = Arm(arm)
    rec["hwm_load"], rec["after_load"] = proc_status("VmHWM"), rss_split()
    reset_peak_rss()
    rec["losses"] = [a.step(i)[2] for i in range(steps)]
    rec["hwm_steps"], rec["after_steps"] = proc_status("VmHWM"), rss_split()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what RSS keeps that malloc holds free, apart from what is live
    rec["after_steps_trimmed"] = rss_split()
    check_nf4_exact(a.model)
    rec["held"], rec["planned"] = held_bytes(a.model), planned_bytes(arm)
    return rec


def child_timing(rounds: int, steps: int) -> dict:
    """Both arms in this process, stepped in turns (module docstring): a round is ``steps`` pairs of steps, each pair
    the two arms on the same batch, one right after the other, in the order ABBA..."""
    from delft.models.loading import check_nf4_exact

    arms = {name: Arm(name) for name in ARMS}
    warm = {name: a.step(0) for name, a in arms.items()}
    pairs = []
    for i in range(1, 1 + rounds * steps):
        order = ARMS if i % 2 else ARMS[::-1]
        pairs.append({"round": (i - 1) // steps, "order": list(order),
                      **{name: dict(zip(("wall", "cpu", "loss"), arms[name].step(i))) for name in order}})
    check_nf4_exact(arms["nf4"].model)
    return {"warmup": {k: dict(wall=v[0], cpu=v[1], loss=v[2]) for k, v in warm.items()}, "pairs": pairs,
            "batch_tokens": [int(arms["fp32"].batch(i)["attention_mask"].sum()) for i in range(1 + rounds * steps)]}


def run_child(args: list[str], timeout: int) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"child {args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


# -- the report


def timing_ratios(t: dict) -> dict:
    """nf4 / fp32 per pair (the same batch, back to back), the median over all pairs and each round's median; and the
    ratio of each arm's fastest step, the one least slowed by other work."""
    med = statistics.median
    out: dict = {}
    for clock in ("wall", "cpu"):
        per_pair = [p["nf4"][clock] / p["fp32"][clock] for p in t["pairs"]]
        rounds = sorted({p["round"] for p in t["pairs"]})
        per_round = [med([x for x, p in zip(per_pair, t["pairs"]) if p["round"] == r]) for r in rounds]
        fastest = min(p["nf4"][clock] for p in t["pairs"]) / min(p["fp32"][clock] for p in t["pairs"])
        out[clock] = dict(median=med(per_pair), low=min(per_round), high=max(per_round), per_round=per_round,
                          per_pair=per_pair, fastest_steps=fastest)
    return out


NF4_PARTS = ("nf4_weights", "nf4_absmax", "nf4_nested_absmax", "nf4_tables")


def weight_rows(mem: dict) -> list[dict]:
    """Planned against held base-weight bytes: the fp32 arm's, the nf4 arm's quantised layers and the rest."""
    f, q = mem["fp32"], mem["nf4"]
    quantised = sum(q["held"].get(k, 0) for k in NF4_PARTS)
    rest = q["held"]["total"] - quantised
    rows = [("fp32: every base weight", "weights_16bit", f["planned"], f["held"]["total"]),
            ("nf4: quantised layers (codes, absmax, tables)", "weights_nf4", q["planned"], quantised),
            ("nf4: the rest (embedding, norms, buffers)", "weights_16bit", q["planned"], rest),
            ("nf4: every base weight", "total", q["planned"], q["held"]["total"])]
    return [dict(what=what, held=held, plan=plan["as_run"][key], plan_as_written=plan["as_written"][key],
                 plan_over_held=plan["as_run"][key] / held) for what, key, plan, held in rows]


def memory_ratios(mem: dict) -> dict:
    f, q = mem["fp32"], mem["nf4"]
    return dict(peak_rss_steps=q["hwm_steps"] / f["hwm_steps"], peak_rss_load=q["hwm_load"] / f["hwm_load"],
                held_weights=q["held"]["total"] / f["held"]["total"], plan_vs_held=weight_rows(mem))


def machine() -> dict:
    import bitsandbytes
    import peft
    import torch
    import transformers

    flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
    return dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(), python=platform.python_version(),
                torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__,
                bitsandbytes=bitsandbytes.__version__, avx512_bf16="avx512_bf16" in flags,
                memory_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                load_average_at_start=os.getloadavg())


def mib(b: float) -> str:
    return f"{b / MiB:,.1f}"


def split(r: dict) -> str:
    return f"{mib(r['VmRSS'])} ({mib(r['RssAnon'])} + {mib(r['RssFile'])})"


def markdown(res: dict) -> str:
    m, t, r, mem, s = res["machine"], res["ratios"]["time"], res["ratios"]["memory"], res["memory"], res["setup"]
    rss = "\n".join(f"| {arm} | {mib(mem[arm]['hwm_load'])} | {split(mem[arm]['after_load'])} | "
                    f"{mib(mem[arm]['hwm_steps'])} | {split(mem[arm]['after_steps'])} | "
                    f"{split(mem[arm]['after_steps_trimmed'])} |" for arm in ARMS)
    weights = "\n".join(f"| {w['what']} | {mib(w['plan'])} | {mib(w['held'])} | {w['plan_over_held']:.4f} | "
                        f"{mib(w['plan_as_written'])} |" for w in r["plan_vs_held"])
    q = mem["nf4"]["held"]
    parts = ", ".join(f"{k.replace('_', ' ')} {mib(q[k])}" for k in NF4_PARTS if k in q)
    rounds = ", ".join(f"{x:.2f}" for x in t["wall"]["per_round"])
    return f"""# QLoRA (nf4) against fp32 LoRA on the CPU: SmolLM2-135M

Written by `bench/qlora_cpu.py` in {res['seconds']:.0f} s on {m['cpu_count']} CPU cores ({m['processor']},
AVX512-BF16 {'present' if m['avx512_bf16'] else 'absent'}), torch {m['torch']}, transformers {m['transformers']},
peft {m['peft']}, **bitsandbytes {m['bitsandbytes']}**. Both arms are recipes/quickstart.yaml on the CPU (model.dtype
auto: fp32; LoRA r=16 on the 7 projections, batch 8, its CE + DEL loss and data), quantization.mode none against nf4
(double-quantised scales, the layers kept off bitsandbytes' bf16 CPU layout as delft loads them), built and stepped
through delft's setup, build_model, build_optimizer, the Trainer's batches and optimizer_step with clipping.

**The machine was shared** with several other jobs on its {m['cpu_count']} cores (load average
{m['load_average_at_start'][0]:.1f} at the start, {res['load_average_at_end'][0]:.1f} at the end), so step times are
reported only as nf4 / fp32 ratios, measured with the two arms taking turns in one process after one warm-up step
each: {s['rounds']} rounds of {s['steps']} pairs, each pair the two arms' steps on the same batch back to back, the
order swapped every pair. The result is the median of the pairs' ratios; other work slows single steps several-fold,
so each round's median and the ratio of the two arms' fastest steps (the least disturbed) are shown beside it.

| nf4 / fp32 | median over pairs | lowest, highest round | fastest steps |
|---|---|---|---|
| step time (wall) | **{t['wall']['median']:.2f}x** | {t['wall']['low']:.2f}, {t['wall']['high']:.2f} | \
{t['wall']['fastest_steps']:.2f}x |
| step time (process CPU) | {t['cpu']['median']:.2f}x | {t['cpu']['low']:.2f}, {t['cpu']['high']:.2f} | \
{t['cpu']['fastest_steps']:.2f}x |
| peak RSS of the training steps | **{r['peak_rss_steps']:.2f}x** | each arm in its own process | |
| peak RSS of loading | {r['peak_rss_load']:.2f}x | each arm in its own process | |
| base weights held | **{r['held_weights']:.3f}x** | | |

Wall-time ratio per round: {rounds}.

Peak RSS, MiB, each arm alone in its own process: VmHWM, reset after loading, so the steps' column is the
{s['memory_steps']} training steps' peak, weights included. Beside it the RSS at three moments as anonymous +
file-backed memory: safetensors weights still memory-mapped from the model file are file-backed pages the kernel can
drop and read again, and RSS includes what glibc's malloc keeps free for reuse, which `malloc_trim(0)` at the end hands
back.

| arm | peak, loading | after loading | peak, {s['memory_steps']} steps | after the steps | \
after `malloc_trim(0)` |
|---|---|---|---|---|---|
{rss}

Base weights, MiB: the memory plan (`delft.planning.memory.plan_memory`'s weights_nf4 and weights_16bit) for the
arm's recipe with model.dtype float32, the dtype auto is on the CPU, against what the loaded model holds (every
non-LoRA parameter and buffer, and each nf4 layer's quantisation state, each storage once; nf4's quantised layers:
{parts}). The last column is the plan of the recipe as written, which `delft recipe check --plan` shows: a GPU plan,
where auto is bf16, so it counts the unquantised weights at 2 bytes where this CPU run holds 4.

| base weights | plan (fp32) | held | plan / held | plan as written (GPU, bf16) |
|---|---|---|---|---|
{weights}

LoRA parameters: {q['lora_parameters']:,} held, {mem['nf4']['planned']['lora_parameters']:,} planned.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="timing rounds (default 4)")
    ap.add_argument("--steps", type=int, default=3, help="pairs of steps in a round (default 3)")
    ap.add_argument("--memory-steps", type=int, default=2, help="steps in each arm's memory process (default 2)")
    ap.add_argument("--out", type=Path, default=RESULTS / "qlora_cpu.json", help="the JSON (the summary: .md)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        out = child_memory(rest[0], int(rest[1])) if kind == "memory" else child_timing(int(rest[0]), int(rest[1]))
        print(json.dumps(out))
        return
    start = time.time()
    setup = dict(recipe="recipes/quickstart.yaml", overrides=["model.device=cpu", "quantization.mode=none|nf4"],
                 rounds=args.rounds, steps=args.steps, memory_steps=args.memory_steps, shared_machine=True)
    res: dict = {"machine": machine(), "setup": setup}
    res["memory"] = {arm: run_child(["memory", arm, str(args.memory_steps)], 1800) for arm in ARMS}
    res["timing"] = run_child(["timing", str(args.rounds), str(args.steps)], 3600)
    res["ratios"] = {"time": timing_ratios(res["timing"]), "memory": memory_ratios(res["memory"])}
    res["load_average_at_end"], res["seconds"] = os.getloadavg(), time.time() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
