"""delft eval's llama.cpp backend: a GGUF file answers the eval problems in llama.cpp (llama-cpp-python, the
``[gguf]`` extra) with the prompts, stop rules and scoring of the transformers path, so a run can be compared with
the files people actually run.

The prompt texts are rendered by a transformers tokenizer (the one delft export writes beside the GGUF, else the
one the GGUF carries, else the base model's), exactly as for the transformers columns; llama.cpp then tokenises
them itself, as it does for its users (a tokenizer that splits numbers differently is part of what is measured;
``delft export`` checks it separately). Greedy is the argmax of llama.cpp's logits; sampling draws from them with
numpy, seeded per problem and sample. llama.cpp runs in a child process (``python -m
delft.evaluation.gguf_backend``) under delft's guardian, so a llama.cpp that dies (SIGILL, SIGSEGV) ends only the
child and delft says so in one paragraph.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from delft import children
from delft.children import describe_exit
from delft.data.batches import prompt_ids
from delft.errors import UserError
from delft.evaluation.results import eval_prompts, scored_result
from delft.models.loading import load_tokenizer
from delft.models.sources import check_gguf_magic, resolve_model
from delft.numbers.answers import cut_at_stop

GGUF_INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install "delft-digits[gguf]"'
CHILD = [sys.executable, "-m", "delft.evaluation.gguf_backend"]  # tests put a stand-in that crashes
CONTEXT_MARGIN = 16  # tokens beyond the longest prompt and the answer budget (llama.cpp may count a few more)


def is_gguf(path: Optional[str]) -> bool:
    return path is not None and str(path).lower().endswith(".gguf")


def check_gguf(path: Path, where: str) -> None:
    """A GGUF column needs the file and llama-cpp-python: refuse before any model answers."""
    if not path.is_file():
        raise UserError(f"GGUF file {path} does not exist", where, "Check the path (delft export --gguf writes them).")
    check_gguf_magic(path, where)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise UserError(f"evaluating {path.name} needs llama-cpp-python, which is not installed", where,
                        f"Install it: {GGUF_INSTALL} (a portable build; pip compiles llama.cpp once).") from None


def gguf_tokenizer(path: Path, base: Optional[str]):
    """The transformers tokenizer that renders the prompts: delft export's beside the file, else the GGUF's own,
    else ``base``'s."""
    from transformers import AutoTokenizer

    if (path.parent / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(path.parent))
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception:  # transformers reads only some GGUF tokenizers
        if base is None or is_gguf(base):
            raise UserError(f"no tokenizer for {path.name}: none beside it and transformers cannot read its own",
                            "delft eval", "Put the model's tokenizer files beside the GGUF (delft export does), "
                            "or pass --model with the base model.") from None
        return load_tokenizer(resolve_model(base).path)


def evaluate_gguf(name: str, path: Path, problems, data_cfg, recipe_cfg, base: Optional[str] = None,
                  lora: Optional[Path] = None):
    """One GGUF column: prompts rendered as for transformers, answered in llama.cpp (a child process), scored."""
    tokenizer = gguf_tokenizer(path, base)
    chat, stops, prompts = eval_prompts(tokenizer, problems, data_cfg, recipe_cfg.eval)
    ev = recipe_cfg.eval
    longest = max(len(prompt_ids(tokenizer, p)) for p in prompts)
    request = {"prompts": prompts, "stops": stops, "max_new_tokens": ev.max_new_tokens, "samples": ev.samples,
               "temperature": ev.temperature, "top_p": ev.top_p, "seed": ev.seed,
               "n_ctx": longest + ev.max_new_tokens + CONTEXT_MARGIN}
    texts = run_llama(path, request, lora)["texts"]
    return scored_result(name, str(lora or path), chat, stops, prompts, texts, problems, data_cfg)


def run_llama(path: Path, request: dict, lora: Optional[Path] = None) -> dict:
    """The child's answers to ``request`` (see :func:`answer_all`); a child that dies is a UserError."""
    here = str(Path(__file__).resolve().parents[2])  # this delft, whatever else is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="delft-llama-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        cmd = [*CHILD, str(path), str(req), str(res)] + ([str(lora)] if lora else [])
        proc = children.run(cmd, (tmp,), capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not res.is_file():
            tail = " | ".join((proc.stderr or "").strip().splitlines()[-3:])
            raise UserError(f"llama.cpp died while answering with {(lora or path).name} "
                            f"({describe_exit(proc.returncode)}){': ' + tail if tail else ''}", "delft eval",
                            "A SIGILL means llama-cpp-python was built for another CPU: rebuild it portably "
                            f"(pip cache remove llama_cpp_python; {GGUF_INSTALL}).")
        return json.loads(res.read_text())


# ----------------------------------------------------------------------------- the child


def _pick(logits, rng, temperature: float, top_p: float) -> int:
    """One token from llama.cpp's logits: the argmax (rng None), or a draw at ``temperature`` within ``top_p``."""
    import numpy as np

    if rng is None:
        return int(np.argmax(logits))
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)  # the smallest set reaching top_p
    kept = order[:keep]
    return int(rng.choice(kept, p=p[kept] / p[kept].sum()))


def _answer(llm, prompt_tokens: list[int], spec: dict, rng) -> str:
    """One continuation: up to max_new_tokens, ending at an end-of-generation token or once a stop string shows."""
    import llama_cpp
    import numpy as np

    llm.reset()
    llm.eval(prompt_tokens)
    out: list[int] = []
    for _ in range(spec["max_new_tokens"]):
        # the last position's logits straight from llama.cpp (Llama.scores holds them only with logits_all)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        tok = _pick(logits, rng, spec["temperature"], spec["top_p"])
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):  # EOS, or an end-of-turn such as <|im_end|>
            break
        out.append(tok)
        shown = llm.detokenize(out, special=True).decode("utf-8", errors="ignore")
        if spec["stops"] and cut_at_stop(shown, spec["stops"]) != shown:
            break
        llm.eval([tok])
    return llm.detokenize(out).decode("utf-8", errors="replace")


def answer_all(path: Path, spec: dict, lora: Optional[Path] = None) -> dict:
    """The child's work: every prompt answered (``samples`` times), and ``tokenize`` texts tokenised."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), lora_path=str(lora) if lora else None, n_ctx=spec["n_ctx"],
                n_threads=os.cpu_count() or 1, verbose=False)
    try:
        texts = []
        for i, prompt in enumerate(spec["prompts"]):
            tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
            k = spec["samples"]
            rngs = [None] if k == 1 else [np.random.default_rng([spec["seed"], i, j]) for j in range(k)]
            texts.append([_answer(llm, tokens, spec, rng) for rng in rngs])
        tokenized = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in spec.get("tokenize", [])]
        return {"texts": texts, "tokens": tokenized}
    finally:
        llm.close()


def _child(argv: Sequence[str]) -> int:
    """python -m delft.evaluation.gguf_backend GGUF REQUEST.json RESULT.json [LORA]"""
    path, request, result = Path(argv[0]), Path(argv[1]), Path(argv[2])
    out = answer_all(path, json.loads(request.read_text()), Path(argv[3]) if len(argv) > 3 else None)
    result.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    if len(sys.argv) in (4, 5):
        sys.exit(_child(sys.argv[1:]))
    sys.exit("usage: python -m delft.evaluation.gguf_backend GGUF REQUEST.json RESULT.json [LORA]")
