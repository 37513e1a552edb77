"""CPU benchmark: HF CE step vs delft chunked CE vs delft CE + DEL, same random model and batch.

    python bench/loss_bench.py            # ~2-3 minutes on 2 cores; writes bench/results/loss_bench_cpu.json

Each configuration runs in a fresh subprocess so its peak RSS (ru_maxrss) is its own. Children run with
MALLOC_MMAP_THRESHOLD_=65536: otherwise glibc keeps freed tensor memory in its heap and ru_maxrss mostly shows
fragmentation, not what the step needs. Torch uses one thread and each step reports wall and process CPU time:
on a shared machine CPU time is the stable measure. A further subprocess alternates delft CE and CE + DEL steps
so their difference is not swamped by drift. A step = forward + backward (no optimizer), random-init Llama, no
tokenizer (digit ids are given explicitly).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETUP = dict(vocab=32000, hidden=256, layers=4, intermediate=688, heads=4, batch=8, seq=128, prompt=32,
             chunk_size=256, warmup=2, steps=8, threads=1, seed=0)
DIGIT_IDS = tuple(range(100, 110))
DOT_ID = 110
CONFIGS = ("hf_ce", "delft_ce", "delft_ce_del")


def build():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from delft.numbers.tokens import IGNORE

    torch.manual_seed(SETUP["seed"])
    cfg = LlamaConfig(vocab_size=SETUP["vocab"], hidden_size=SETUP["hidden"], intermediate_size=SETUP["intermediate"],
                      num_hidden_layers=SETUP["layers"], num_attention_heads=SETUP["heads"],
                      num_key_value_heads=SETUP["heads"], max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).train()
    g = torch.Generator().manual_seed(SETUP["seed"])
    B, T = SETUP["batch"], SETUP["seq"]
    ids = torch.randint(200, SETUP["vocab"], (B, T), generator=g)
    for b in range(B):  # numbers like 4821, 3.75, 12.5.: about a fifth of the answer tokens are digits
        t = SETUP["prompt"] + 2
        while t < T - 8:
            n = int(torch.randint(1, 7, (1,), generator=g))
            run = [DIGIT_IDS[int(d)] for d in torch.randint(0, 10, (n,), generator=g)]
            if n > 2 and float(torch.rand(1, generator=g)) < 0.3:
                run[n // 2] = DOT_ID
            ids[b, t:t + n] = torch.tensor(run)
            t += n + int(torch.randint(8, 24, (1,), generator=g))
    labels = ids.clone()
    labels[:, :SETUP["prompt"]] = IGNORE
    return model, ids, labels


def step_fn(config, model, ids, labels):

    from delft.losses.loss import Loss
    from delft.numbers.digits import DigitVocab

    vocab = DigitVocab(DIGIT_IDS, DOT_ID)
    loss_fn = Loss("del", 0.3, vocab, chunk_size=SETUP["chunk_size"]) if config == "delft_ce_del" else \
        Loss("ce", 0.0, vocab, chunk_size=SETUP["chunk_size"])
    shifted = labels[:, 1:]
    counts = loss_fn.count(shifted)
    n_lab, n_dig = counts

    def step():
        model.zero_grad(set_to_none=True)
        if config == "hf_ce":
            loss = model(input_ids=ids, labels=labels).loss
        else:
            hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
            loss = loss_fn.combine(loss_fn.sums(hidden, model.lm_head, shifted), counts)
        loss.backward()
        return float(loss.detach())

    return step, n_lab, n_dig


def timed(step, n) -> tuple[list[float], list[float]]:
    """(wall seconds, process CPU seconds) per step."""
    wall, cpu = [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(config: str) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(SETUP["threads"])
    model, ids, labels = build()
    med = statistics.median
    if config == "paired":
        a, _, _ = step_fn("delft_ce", model, ids, labels)
        b, _, _ = step_fn("delft_ce_del", model, ids, labels)
        for _ in range(SETUP["warmup"]):
            a(), b()
        wa, ca, wb, cb = [], [], [], []
        for _ in range(SETUP["steps"]):
            w, c = timed(a, 1)
            wa += w
            ca += c
            w, c = timed(b, 1)
            wb += w
            cb += c
        return dict(config=config, delft_ce_wall_s=med(wa), delft_ce_del_wall_s=med(wb), delft_ce_cpu_s=med(ca),
                    delft_ce_del_cpu_s=med(cb), wall=dict(ce=wa, ce_del=wb), cpu=dict(ce=ca, ce_del=cb))
    step, n_lab, n_dig = step_fn(config, model, ids, labels)
    base = rss_mib()
    losses = [step() for _ in range(SETUP["warmup"])]
    wall, cpu = timed(step, SETUP["steps"])
    return dict(config=config, wall_s=med(wall), cpu_s=med(cpu), wall=wall, cpu=cpu, peak_rss_mib=rss_mib(),
                rss_before_steps_mib=base, loss=losses[0], n_labels=n_lab, n_digits=n_dig)


def run_child(config: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, __file__, "--child", config], capture_output=True, text=True, check=True,
                         cwd=ROOT, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    import torch

    t0 = time.time()
    results = {c: run_child(c) for c in CONFIGS}
    paired = run_child("paired")
    extra_sep = results["delft_ce_del"]["cpu_s"] / results["delft_ce"]["cpu_s"] - 1
    extra_paired = paired["delft_ce_del_cpu_s"] / paired["delft_ce_cpu_s"] - 1
    extra_paired_wall = paired["delft_ce_del_wall_s"] / paired["delft_ce_wall_s"] - 1
    report = dict(
        machine=dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                     cpu_count=os.cpu_count(), load_average=os.getloadavg(), python=platform.python_version(),
                     torch=torch.__version__),
        setup=SETUP, results=results, paired=paired,
        del_extra_over_delft_ce=dict(interleaved_cpu=extra_paired, interleaved_wall=extra_paired_wall,
                                     separate_processes_cpu=extra_sep, under_3_percent=extra_paired < 0.03),
        wall_s=time.time() - t0,
    )
    out = ROOT / "bench" / "results" / "loss_bench_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    tokens = SETUP["batch"] * SETUP["seq"]
    n = results["delft_ce"]
    print(f"{SETUP['batch']}x{SETUP['seq']} tokens, vocab {SETUP['vocab']}, hidden {SETUP['hidden']}, "
          f"{SETUP['layers']} layers; {n['n_labels']} labels, {n['n_digits']} digit labels; "
          f"chunk {SETUP['chunk_size']}; {SETUP['threads']} thread; median of {SETUP['steps']} steps after "
          f"{SETUP['warmup']} warmup; load average {os.getloadavg()[0]:.1f}")
    print(f"{'config':<14}{'cpu s/step':>11}{'wall s/step':>12}{'tok/s(cpu)':>11}{'peak RSS MiB':>14}{'step peak':>11}")
    for c in CONFIGS:
        r = results[c]
        print(f"{c:<14}{r['cpu_s']:>11.3f}{r['wall_s']:>12.3f}{tokens / r['cpu_s']:>11.0f}{r['peak_rss_mib']:>14.0f}"
              f"{r['peak_rss_mib'] - r['rss_before_steps_mib']:>+11.0f}")
    print(f"DEL extra over delft CE (interleaved, CPU time): {100 * extra_paired:+.2f}% "
          f"({paired['delft_ce_cpu_s']:.3f} vs {paired['delft_ce_del_cpu_s']:.3f} s; "
          f"wall {100 * extra_paired_wall:+.2f}%; "
          f"separate runs {100 * extra_sep:+.2f}%); under 3%: {'yes' if extra_paired < 0.03 else 'no'}")
    print(f"wrote {out.relative_to(ROOT)} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
    else:
        main()
