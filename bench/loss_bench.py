"""CPU benchmark: HF CE step vs delft chunked CE vs delft CE + DEL, same random model and batch.

    python bench/loss_bench.py            # ~2-3 minutes on 2 cores; writes bench/results/loss_bench_cpu.json

Each configuration runs in a fresh subprocess so its peak RSS (ru_maxrss) is its own; a further subprocess
alternates delft CE and CE + DEL steps so their time difference is not swamped by drift on a shared machine.
A step = forward + backward (no optimizer), random-init Llama, no tokenizer (digit ids are given explicitly).
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
             chunk_size=256, warmup=2, steps=10, seed=0)
DIGIT_IDS = tuple(range(100, 110))
DOT_ID = 110
CONFIGS = ("hf_ce", "delft_ce", "delft_ce_del")


def build():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

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
    labels[:, :SETUP["prompt"]] = -100
    return model, ids, labels


def step_fn(config, model, ids, labels):
    import torch

    from delft.digits import DigitVocab
    from delft.losses import LossSpec, count_items, loss_sums

    vocab = DigitVocab(DIGIT_IDS, DOT_ID)
    spec = LossSpec("del", 0.3, 1.0, vocab) if config == "delft_ce_del" else LossSpec("ce", 0.0, 1.0, None)
    shifted = labels[:, 1:]
    n_lab, n_dig = count_items(shifted, vocab)

    def step():
        model.zero_grad(set_to_none=True)
        if config == "hf_ce":
            loss = model(input_ids=ids, labels=labels).loss
        else:
            hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
            s = loss_sums(hidden, model.lm_head, shifted, spec, SETUP["chunk_size"])
            loss = s["ce_sum"] / n_lab
            if spec.has_term:
                loss = loss + spec.weight * s["term_sum"] / n_dig
        loss.backward()
        return float(loss.detach())

    return step, n_lab, n_dig


def timed(step, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(config: str) -> dict:
    sys.path.insert(0, str(ROOT))
    model, ids, labels = build()
    if config == "paired":
        a, _, _ = step_fn("delft_ce", model, ids, labels)
        b, _, _ = step_fn("delft_ce_del", model, ids, labels)
        for _ in range(SETUP["warmup"]):
            a(), b()
        ta, tb = [], []
        for _ in range(SETUP["steps"]):
            ta += timed(a, 1)
            tb += timed(b, 1)
        return dict(config=config, delft_ce_s=statistics.median(ta), delft_ce_del_s=statistics.median(tb),
                    ce_times=ta, del_times=tb)
    step, n_lab, n_dig = step_fn(config, model, ids, labels)
    base = rss_mib()
    losses = [step() for _ in range(SETUP["warmup"])]
    times = timed(step, SETUP["steps"])
    return dict(config=config, median_s=statistics.median(times), times=times, peak_rss_mib=rss_mib(),
                rss_before_steps_mib=base, loss=losses[0], n_labels=n_lab, n_digits=n_dig)


def run_child(config: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", config], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    import torch

    t0 = time.time()
    results = {c: run_child(c) for c in CONFIGS}
    paired = run_child("paired")
    extra_sep = results["delft_ce_del"]["median_s"] / results["delft_ce"]["median_s"] - 1
    extra_paired = paired["delft_ce_del_s"] / paired["delft_ce_s"] - 1
    report = dict(
        machine=dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                     cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(), python=platform.python_version(),
                     torch=torch.__version__),
        setup=SETUP, results=results, paired=paired,
        del_extra_over_delft_ce=dict(separate_processes=extra_sep, interleaved=extra_paired,
                                     under_3_percent=extra_paired < 0.03),
        wall_s=time.time() - t0,
    )
    out = ROOT / "bench" / "results" / "loss_bench_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    tokens = SETUP["batch"] * SETUP["seq"]
    n = results["delft_ce"]
    print(f"{SETUP['batch']}x{SETUP['seq']} tokens, vocab {SETUP['vocab']}, hidden {SETUP['hidden']}, "
          f"{SETUP['layers']} layers; {n['n_labels']} labels, {n['n_digits']} digit labels; "
          f"chunk {SETUP['chunk_size']}; median of {SETUP['steps']} steps after {SETUP['warmup']} warmup")
    print(f"{'config':<14}{'s/step':>9}{'tok/s':>9}{'peak RSS MiB':>14}{'(before steps)':>16}")
    for c in CONFIGS:
        r = results[c]
        print(f"{c:<14}{r['median_s']:>9.3f}{tokens / r['median_s']:>9.0f}{r['peak_rss_mib']:>14.0f}"
              f"{r['rss_before_steps_mib']:>16.0f}")
    print(f"DEL extra over delft CE: {100 * extra_paired:+.2f}% interleaved "
          f"({paired['delft_ce_s']:.3f} vs {paired['delft_ce_del_s']:.3f} s), {100 * extra_sep:+.2f}% separate runs; "
          f"under 3%: {'yes' if extra_paired < 0.03 else 'no'}")
    print(f"wrote {out.relative_to(ROOT)} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
    else:
        main()
