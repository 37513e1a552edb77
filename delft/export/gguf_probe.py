"""What quantisation did to the numbers: every checked GGUF file answers a small numeric probe set in llama.cpp
(delft eval's llama.cpp backend) beside the merged model in transformers, and llama.cpp's tokenizer is asked to
split a list of numbers as the training tokenizer does.

The logits check (delft.export.gguf_check) says whether a file is the model; this says what its quantisation
changed where delft's users look: exact match and digit accuracy on the probe set, against the gold and against
the merged model's own answers. Number tokenisation is checked because llama.cpp's pre-tokenizer can split digits
differently from the HF tokenizer (ggml-org/llama.cpp#6914: Llama-3 GGUFs converted before the fix tokenised
numbers differently), which no logits check on fixed token ids can see.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rich.console import Console

from delft.evaluation.gguf_backend import evaluate_gguf, run_llama
from delft.evaluation.metrics import DIGIT_ACCURACY, EXACT_MATCH, summarize
from delft.evaluation.model_scores import evaluate_model
from delft.evaluation.problems import load_problems
from delft.export.report import load_recipe_quietly
from delft.models.loading import load_tokenizer
from delft.recipe.schema import GENERATED, Recipe

PROBE_PROBLEMS = 40  # greedy answers per file: a few seconds for a small model in llama.cpp on a CPU
# Numbers in the forms that tokenizers split differently: lengths 1-7, decimals, signs, separators, in a sentence.
NUMBER_TEXTS = ["7", "42", "123", "1234", "12345", "1234567", "3.14", "-42", "0.001", "1,234,567", "2024",
                "The answer is 1234.", "x = 98765", " 56 + 78 = 134", "$19.99"]


def probe_recipe(run_dir: Path):
    """The run's recipe (defaults for adapters delft did not train) with its eval set cut to the probe, the
    synthetic held-out set when the eval set is not generated (a probe must not need a file or the hub), on the
    CPU in fp32 for the merged model."""
    cfg = load_recipe_quietly(run_dir) or Recipe()
    data = cfg.eval_data()
    if data.format not in GENERATED:
        held_out = Recipe().eval_data()  # the default synthetic held-out set, rendered as the run's data
        held_out.template, held_out.system_prompt = data.template, data.system_prompt
        held_out.separator = data.prompt_separator()
        data = held_out
    data.limit = PROBE_PROBLEMS
    cfg.model.device, cfg.model.dtype = "cpu", "float32"
    cfg.eval.samples, cfg.eval.fewshot = 1, None
    return cfg, data


def probe_files(files: list, out: Path, run_dir: Path, console: Console) -> None:
    """Fill in each merged or LoRA file's ``probe`` (answers on the probe set) and ``number_tokens`` figures."""
    chosen = [f for f in files if f.kind in ("merged", "lora")]
    if not chosen:
        return
    cfg, data = probe_recipe(run_dir)
    problems, _ = load_problems(data, Console(quiet=True))
    reference = evaluate_model("merged", str(out), None, problems, data, cfg)
    base_file = next((out / f.file for f in files if f.kind == "base"), None)
    tokenizer = load_tokenizer(str(out))
    for f in chosen:
        path, lora = (base_file, out / f.file) if f.kind == "lora" else (out / f.file, None)
        result = evaluate_gguf(f.file, path, problems, data, cfg, lora=lora)
        f.probe = probe_figures(result.scored, reference.scored)
        f.number_tokens = number_tokens(path, tokenizer, lora)
        console.print(f"  probe {f.file}: exact match {f.probe[EXACT_MATCH.key]:.0%} (merged model "
                      f"{f.probe['reference_exact_match']:.0%}), digit accuracy {f.probe[DIGIT_ACCURACY.key]:.0%} "
                      f"({f.probe['reference_digit_accuracy']:.0%}), same answer as the merged model on "
                      f"{f.probe['same_answers']:.0%} of {f.probe['n']}; numbers tokenised "
                      f"{'as in training' if f.number_tokens['match'] else 'DIFFERENTLY'}", highlight=False)


def probe_figures(scored: list, reference: list) -> dict:
    """Exact match and digit accuracy of a file's answers and of the merged model's, and how often they agree."""
    mine, theirs = summarize(scored, 0), summarize(reference, 0)
    same = sum(a.extraction.value == b.extraction.value for a, b in zip(scored, reference))
    exact, digits = EXACT_MATCH.key, DIGIT_ACCURACY.key
    return {"n": len(scored), exact: mine[exact], digits: mine[digits],
            "reference_exact_match": theirs[exact], "reference_digit_accuracy": theirs[digits],
            "same_answers": same / len(scored) if scored else None}


def number_tokens(path: Path, tokenizer, lora: Optional[Path]) -> dict:
    """llama.cpp's token ids for NUMBER_TEXTS against the training tokenizer's: which texts split differently."""
    theirs = run_llama(path, {"prompts": [], "tokenize": NUMBER_TEXTS, "n_ctx": 64}, lora)["tokens"]
    differ = [t for t, ids in zip(NUMBER_TEXTS, theirs) if tokenizer.encode(t, add_special_tokens=False) != ids]
    return {"match": not differ, "texts": len(NUMBER_TEXTS), "differ": differ}
