"""The llama.cpp check of GGUF files: the same prompts through transformers (fp32) and through llama.cpp, their
logits compared, llama.cpp's tokenisation compared with the training tokenizer's.

llama.cpp runs in a child process (``python -m delft.export.gguf_check``), never inside delft's: a llama.cpp that
dies (SIGILL on a CPU that advertises an instruction it then traps, a segfault) then ends that child, and delft
reports it in one paragraph, keeps the files it has, and can resume the GGUF phase later.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console

from delft import children
from delft.children import describe_exit
from delft.data.templates import render_chat
from delft.export.report import CHECK_PROMPTS
from delft.models.loading import load_tokenizer, using_model


@dataclass
class CheckInputs:
    """What both sides see: token ids from the HF tokenizer, so tokenisation can neither hide nor cause a
    difference in the logits; llama.cpp's own tokenisation of the same texts is compared separately."""

    texts: list  # the check prompts, then the chat prompt of the greedy answer
    ids: list  # token ids of each text (special tokens as the HF tokenizer adds them)
    stop: set  # end-of-turn token ids

    @property
    def prompts(self) -> list:
        return self.ids[:-1]

    @property
    def chat(self) -> list:
        return self.ids[-1]


def check_inputs(tokenizer) -> CheckInputs:
    texts = list(CHECK_PROMPTS)
    if getattr(tokenizer, "chat_template", None):
        texts.append(render_chat(tokenizer, [{"role": "user", "content": CHECK_PROMPTS[0]}], add_generation_prompt=True))
    else:
        texts.append(CHECK_PROMPTS[0])
    ids = [tokenizer(t)["input_ids"] for t in texts[:-1]]
    ids.append(tokenizer(texts[-1], add_special_tokens=False)["input_ids"])  # the template wrote its specials
    stop = {tokenizer.eos_token_id}
    if "<|im_end|>" in tokenizer.get_vocab():
        stop.add(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return CheckInputs(texts, ids, {s for s in stop if s is not None})


def reference_outputs(model, inputs: CheckInputs) -> tuple[list, list[int]]:
    """transformers' logits per prompt (numpy, positions x vocab) and its greedy continuation of the chat."""
    import torch

    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([p])).logits[0].float().numpy() for p in inputs.prompts]
        out, past, step = [], None, torch.tensor([inputs.chat])
        for _ in range(GREEDY_TOKENS):
            o = model(input_ids=step, past_key_values=past, use_cache=True)
            past, tok = o.past_key_values, int(o.logits[0, -1].argmax())
            if tok in inputs.stop:
                break
            out.append(tok)
            step = torch.tensor([[tok]])
    return logits, out


class LlamaCrashed(Exception):
    """llama.cpp's child process died (a signal, or a non-zero exit) while checking ``file``."""

    def __init__(self, file: str, returncode: int, tail: str):
        self.file, self.returncode, self.tail = file, returncode, tail
        super().__init__(f"{file}: {describe_exit(returncode)}")


# The child's command line; tests put a stand-in that crashes the way llama.cpp can.
CHILD = [sys.executable, "-m", "delft.export.gguf_check"]


def llama_outputs(path: Path, inputs: CheckInputs, lora: Optional[Path] = None) -> tuple[list, list[int], bool]:
    """The same in llama.cpp (the GGUF, plus a LoRA GGUF), and whether its tokenizer gives the HF ids: run in a
    child process, so that llama.cpp dying ends only the child (LlamaCrashed)."""
    import numpy as np

    here = str(Path(__file__).resolve().parents[2])  # this delft, whatever else is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="delft-gguf-check-") as tmp:
        request, result = Path(tmp) / "inputs.json", Path(tmp) / "outputs.npz"
        request.write_text(json.dumps({"texts": inputs.texts, "ids": inputs.ids, "stop": sorted(inputs.stop)}))
        cmd = [*CHILD, str(path), str(request), str(result)] + ([str(lora)] if lora else [])
        proc = children.run(cmd, (tmp,), capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not result.is_file():
            tail = " | ".join((proc.stderr or "").strip().splitlines()[-3:])
            raise LlamaCrashed((lora or path).name, proc.returncode, tail)
        data = np.load(result)
        n = len(inputs.prompts)
        return ([data[f"logits{i}"] for i in range(n)], [int(t) for t in data["greedy"]],
                bool(data["same_tokens"]))


def _llama_outputs_here(path: Path, inputs: CheckInputs, lora: Optional[Path]) -> tuple[list, list[int], bool]:
    """The child's work: load the GGUF in llama.cpp, score the prompts, answer the chat greedily."""
    import numpy as np
    from llama_cpp import Llama

    n_ctx = max(len(p) for p in inputs.ids) + GREEDY_TOKENS + 8
    llm = Llama(model_path=str(path), lora_path=str(lora) if lora else None, logits_all=True, n_ctx=n_ctx,
                n_threads=os.cpu_count() or 1, verbose=False)
    try:
        same_tokens = all(_llama_tokens(llm, text, ids, i == len(inputs.texts) - 1)
                          for i, (text, ids) in enumerate(zip(inputs.texts, inputs.ids)))
        logits = []
        for p in inputs.prompts:
            llm.reset()
            llm.eval(p)
            logits.append(np.array(llm.scores[:len(p)], dtype=np.float32))
        llm.reset()
        llm.eval(inputs.chat)
        out = []
        for _ in range(GREEDY_TOKENS):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            if tok in inputs.stop:
                break
            out.append(tok)
            llm.eval([tok])
        return logits, out, same_tokens
    finally:
        llm.close()
        gc.collect()


def _child(argv: list[str]) -> int:
    """python -m delft.export.gguf_check GGUF INPUTS.json OUTPUTS.npz [LORA]"""
    import numpy as np

    path, request, result = Path(argv[0]), Path(argv[1]), Path(argv[2])
    spec = json.loads(request.read_text())
    inputs = CheckInputs(spec["texts"], spec["ids"], set(spec["stop"]))
    logits, greedy, same = _llama_outputs_here(path, inputs, Path(argv[3]) if len(argv) > 3 else None)
    np.savez(result, greedy=np.array(greedy, dtype=np.int64), same_tokens=np.array(same),
             **{f"logits{i}": x for i, x in enumerate(logits)})
    return 0


def _llama_tokens(llm, text: str, ids: list[int], chat: bool) -> bool:
    """llama.cpp's tokenisation of ``text`` equals the HF ids (a BOS the HF side added is llama.cpp's too)."""
    bos = llm.token_bos()
    add_bos = not chat and bool(ids) and ids[0] == bos
    return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True) == list(ids)


def logit_gap(logits: list, reference: list) -> tuple[float, float, int]:
    """(normalised squared error over all positions, share of positions whose argmax agrees, positions)."""
    import numpy as np

    n = min(a.shape[-1] for a in [*logits, *reference])  # llama.cpp may pad the vocabulary
    a = np.concatenate([x[:, :n] for x in logits]).astype(np.float64)
    b = np.concatenate([x[:, :n] for x in reference]).astype(np.float64)
    nse = float(((a - b) ** 2).sum() / max((b ** 2).sum(), 1e-30))
    return nse, float((a.argmax(-1) == b.argmax(-1)).mean()), int(a.shape[0])


def check_files(files: list[GgufFile], out: Path, run_dir: Path, base: str, console: Console) -> None:
    """Fill in each file's figures: merged GGUFs against the merged directory, the LoRA against base + adapter."""
    tokenizer = load_tokenizer(str(out))
    inputs = check_inputs(tokenizer)
    base_file = next((out / f.file for f in files if f.kind == "base"), None)
    for kind, name, adapter in (("merged", None, str(out)), ("lora", base, str(run_dir))):
        chosen = [f for f in files if f.kind == kind]
        if not chosen:
            continue
        with using_model(name, adapter=adapter, device="cpu", dtype="float32") as loaded:
            ref_logits, ref_greedy = reference_outputs(loaded.model, inputs)
        for f in chosen:
            path, lora = (base_file, out / f.file) if kind == "lora" else (out / f.file, None)
            logits, greedy, f.tokens_match = llama_outputs(path, inputs, lora)
            f.nse, f.argmax_agreement, f.positions = logit_gap(logits, ref_logits)
            f.tolerance = TOLERANCE[f.type]
            f.passed = f.nse <= f.tolerance and f.tokens_match
            f.greedy, f.greedy_reference = tokenizer.decode(greedy), tokenizer.decode(ref_greedy)
            console.print(f"  check {f.file}: normalised squared error {f.nse:.2g} (tolerance {f.tolerance:g}), "
                          f"argmax agrees at {f.argmax_agreement:.0%} of {f.positions} positions, llama.cpp's "
                          f"tokenizer {'agrees' if f.tokens_match else 'DIFFERS'}", highlight=False)



# Normalised squared error of llama.cpp's logits against transformers' fp32 merged model, per type.
#  f32/f16/bf16: the merged model's own weights, or within a 16-bit rounding of them; what is left is llama.cpp's
#    arithmetic (other kernels, another summation order) plus the rounding.
#  q8_0 and below: quantisation error, larger with fewer bits, largest on small models (whose widths are often
#    not multiples of the K-quants' 256-weight blocks, so llama.cpp keeps some tensors in other types).
#  Every bound sits far below what a wrong tensor layout or a broken vocabulary gives (of
#  order 1: unrelated logits of the same size give 2). docs/export.md#export-to-gguf-llamacpp-ollama-lm-studio
#  lists the values measured on SmolLM2-135M.
TOLERANCE = {"f32": 1e-4, "f16": 1e-4, "bf16": 1e-3, "q8_0": 5e-3, "q6_k": 0.02, "q5_k_m": 0.05, "q5_k_s": 0.05,
             "q5_1": 0.05, "q5_0": 0.05, "q4_k_m": 0.15, "q4_k_s": 0.15, "q4_1": 0.15, "q4_0": 0.15,
             "q3_k_l": 0.3, "q3_k_m": 0.3, "q3_k_s": 0.3, "q2_k": 0.5}


GREEDY_TOKENS = 24


@dataclass
class GgufFile:
    file: str
    type: str
    kind: str  # "merged" | "lora" | "base"
    size_bytes: int = 0
    made_by: str = ""  # "convert_hf_to_gguf.py", "llama.cpp quantiser", ...
    nse: Optional[float] = None  # normalised squared error of the logits (None: not checked)
    tolerance: Optional[float] = None
    argmax_agreement: Optional[float] = None
    positions: int = 0
    greedy: str = ""  # llama.cpp's greedy answer
    greedy_reference: str = ""  # transformers'
    tokens_match: Optional[bool] = None  # llama.cpp's tokenizer gives the HF token ids on the check texts
    passed: Optional[bool] = None
    probe: Optional[dict] = None  # answers on the numeric probe set (delft.export.gguf_probe.probe_figures)
    number_tokens: Optional[dict] = None  # llama.cpp's split of numbers against the training tokenizer's


if __name__ == "__main__":
    if len(sys.argv) in (4, 5):
        sys.exit(_child(sys.argv[1:]))
    sys.exit("usage: python -m delft.export.gguf_check GGUF INPUTS.json OUTPUTS.npz [LORA]")
