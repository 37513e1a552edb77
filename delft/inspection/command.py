"""``delft inspect``: the model's distribution over the ten digits at every digit of one answer.

Rows are digit *characters*: on tokenizers with multi-digit number tokens (Llama-3's "123") each character
gets a row, scored as the losses score it (delft.numbers.tokens.char_logits: the number tokens that agree with the
answer's token before that character), and the table names the token it belongs to.

Three separate pieces, so each can be tested on its own:

* :func:`compute_records` -- pure computation: (model, tokenizer, prompt text, answer token ids) -> one
  :class:`PositionRecord` per answer token, from ONE teacher-forced forward pass that keeps only the answer
  positions' logits (``logits_to_keep``; or the decoder's hidden rows times the output layer for models
  without it). Places come from :mod:`delft.numbers.digits` (the same rules as the losses).
* :func:`render_tables` -- rich Tables (one per number in the answer; with several models, one sub-row per model).
* :func:`write_plot` -- a heatmap PNG (digit positions x digits, one panel per model).

:func:`run_inspect` ties them together for the CLI: loads each model in turn (one in memory at a time), picks the
answer (``--target`` or the first model's greedy answer) and writes ``--json`` / ``--plot``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console

from delft.data.batches import prompt_ids
from delft.data.prompts import render_prompt, use_chat_template, written_completion
from delft.data.sources import Example
from delft.errors import UserError
from delft.inspection.records import (
    PURPOSE,
    InspectResult,
    ModelView,
    PositionRecord,
    check_target,
    compute_records,
    greedy_answer,
    numbers_of,
)
from delft.inspection.render import render, to_json, write_plot
from delft.models.context import check_context
from delft.models.loading import using_model
from delft.models.scratch import base_name
from delft.numbers.formats import NumberForm
from delft.numbers.tokens import NumberVocab
from delft.outputs import check_output_files, write_result
from delft.recipe.files import as_trained, load_recipe
from delft.rundir import base_model, check_trained_dir


@dataclass
class _Spec:
    name: str
    base: Optional[str]
    adapter: Optional[str]


def _model_specs(base: Optional[str], adapters: Sequence[str]) -> list[_Spec]:
    if not adapters:
        if base is None:
            raise UserError("no model given", "delft inspect",
                            "Pass --model NAME (e.g. --model smollm2-135m), a recipe, or --adapter RUN_DIR.")
        return [_Spec(Path(base).name if Path(base).expanduser().exists() else base, base, None)]
    recorded = [base_model(Path(a)) for a in adapters if Path(a).is_dir()]
    names = [Path(a).name or str(a) for a in adapters]
    specs = []
    for a, n in zip(adapters, names):
        if a == "base" and not Path(a).exists():
            b = base or next((r for r in recorded if r), None)
            if b is None:
                raise UserError("'base' needs a base model", "delft inspect", "Pass --model NAME or a recipe.")
            specs.append(_Spec("base", b, None))
            continue
        check_trained_dir(Path(a), "delft inspect")  # 'base' (above) names the base model itself
        specs.append(_Spec(str(a) if names.count(n) > 1 or n == "base" else n, base, str(a)))
    return specs


def _structure(records: Sequence[PositionRecord]) -> list[list[tuple]]:
    return [[(r.kind, r.place, r.char) for r in n.rows] for n in numbers_of(records)]


def _check_arguments(prompt: str, max_new_tokens: int, target: Optional[str]) -> Optional[str]:
    """The checked --target text (None without one); refuses an empty prompt or a non-positive budget."""
    if not prompt or not prompt.strip():
        raise UserError("the prompt is empty", "delft inspect",
                        'Give the prompt as the last argument, e.g. "What is 17 * 23?".')
    if max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be positive, not {max_new_tokens}", "--max-new-tokens", "e.g. 32.")
    return check_target(target) if target is not None else None


def _first_answer(lm, tok, vocab, spec: _Spec, prompt: str, prompt_text: str, target_text: Optional[str],
                  max_new_tokens: int, chat: bool, n_models: int) -> tuple[InspectResult, list[int]]:
    """The answer every model is teacher-forced on: --target, else the first model's greedy answer."""
    if target_text is not None:
        ids = tok.encode(target_text, add_special_tokens=False)
        return InspectResult(prompt, target_text, "target", f"teacher-forced on --target {target_text}",
                             target_text), ids
    generation = greedy_answer(lm, tok, prompt_text, max_new_tokens, chat)
    ids = generation.answer_ids
    source = f"greedy answer of {spec.name}" + (", teacher-forced for every model" if n_models > 1 else "")
    result = InspectResult(prompt, generation.answer, "greedy", source, None)
    if len(ids) >= max_new_tokens and vocab.text_of(ids[-1]) is not None:
        result.notes.append(f"the answer was cut by --max-new-tokens {max_new_tokens} inside a number, so the "
                            "places of its last number may be off; raise it")
    return result, ids


def _inspect_model(spec: _Spec, cfg, prompt: str, target_text: Optional[str], max_new_tokens: int, n_models: int,
                   result: Optional[InspectResult], first_vocab: Optional[dict]):
    """Load one model, teacher-force the answer, free the model: (result, the model's view, its vocabulary)."""
    with using_model(spec.base, spec.adapter, device=cfg.model.device, dtype=cfg.model.dtype) as loaded:
        tok = loaded.tokenizer
        data = as_trained(cfg.data, spec.adapter)  # a run trained before data.separator: its newline
        vocab = NumberVocab.from_tokenizer(tok, PURPOSE).written_as(data.numbers)  # true places, reversed or not
        if target_text is not None:  # the model writes its numbers in its trained form: force the target in it
            target_text = written_completion(target_text, data)
        chat = use_chat_template(tok, data)
        prompt_text = render_prompt(Example(prompt, ""), tok, data)
        n_answer = max_new_tokens if target_text is None else len(tok.encode(target_text, add_special_tokens=False))
        check_context(loaded.model, len(prompt_ids(tok, prompt_text)), n_answer, spec.name, "delft inspect",
                      budget=None if target_text is not None else "--max-new-tokens")
        own = None
        if result is None:
            result, ids = _first_answer(loaded.model, tok, vocab, spec, prompt, prompt_text, target_text,
                                        max_new_tokens, chat, n_models)
        elif tok.get_vocab() == first_vocab:
            ids = list(result.models[0].answer_ids)
        else:
            ids = tok.encode(result.answer, add_special_tokens=False)
        if target_text is None and result.models:
            own = greedy_answer(loaded.model, tok, prompt_text, max_new_tokens, chat).answer
        records = compute_records(loaded.model, tok, prompt_text, ids, vocab)
        view = ModelView(spec.name, spec.base, spec.adapter, "chat" if chat else "plain", prompt_text, list(ids),
                         records, own)
        return result, view, tok.get_vocab()


def _write_outputs(result: InspectResult, json_out: Optional[Path], plot: Optional[Path], console: Console) -> None:
    if json_out is not None:
        write_result(Path(json_out), json.dumps(to_json(result), indent=2), "--json")
        console.print(f"wrote {json_out}")
    if plot is not None:
        if result.has_digits:
            write_plot(result, Path(plot))
            console.print(f"wrote {plot}")
        else:
            console.print(f"[dim]no plot written to {plot}: the answer has no digits[/]")


def trained_form(adapter: Optional[str], cfg) -> str:
    """How a model writes its numbers (data.numbers order and count prefix; the base model: the recipe's)."""
    return NumberForm.of(as_trained(cfg.data, adapter).numbers).describe()


def check_one_form(specs: Sequence[_Spec], cfg) -> None:
    """Compared models must write numbers alike: one answer's tokens cannot be read by both forms. Each run's
    recipe.yaml is read once, before any model loads."""
    forms = [trained_form(spec.adapter, cfg) for spec in specs]
    other = next((i for i, form in enumerate(forms) if form != forms[0]), None)
    if other is not None:
        raise UserError(f"{specs[other].name} writes numbers as {forms[other]} and {specs[0].name} as {forms[0]} "
                        "(data.numbers): one answer's tokens cannot be read by both", "--compare",
                        "Inspect these models one at a time.")


def run_inspect(recipe_path: Optional[Path] = None, prompt: str = "", model: Optional[str] = None,
                adapters: Sequence[str] = (), target: Optional[str] = None, max_new_tokens: int = 32,
                json_out: Optional[Path] = None, plot: Optional[Path] = None, overrides: Sequence[str] = (),
                console: Optional[Console] = None) -> InspectResult:
    """The ``delft inspect`` command. Answers without digits print a note and return normally (exit 0)."""
    console = console or Console()
    cfg = load_recipe(recipe_path, list(overrides))
    target_text = _check_arguments(prompt, max_new_tokens, target)
    if model is None and recipe_path is not None:
        model = base_name(cfg)
    specs = _model_specs(model, list(adapters))
    check_output_files({"--json": json_out, "--plot": plot})
    check_one_form(specs, cfg)
    result: Optional[InspectResult] = None
    first_vocab = None
    for i, spec in enumerate(specs):
        result, view, vocab = _inspect_model(spec, cfg, prompt, target_text, max_new_tokens, len(specs),
                                            result, first_vocab)
        if i == 0:
            first_vocab = vocab
        elif _structure(view.records) != _structure(result.models[0].records):
            raise UserError(f"{spec.name}'s tokenizer splits the answer {result.answer!r} into digits differently "
                            f"from {specs[0].name}'s", "--compare", "Inspect these models one at a time.")
        result.models.append(view)
        if i == 0 and not result.has_digits:
            break  # nothing to teacher-force the others on
    assert result is not None
    render(result, console)
    _write_outputs(result, json_out, plot, console)
    return result
