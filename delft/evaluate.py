"""``delft eval``: greedy answers from the base model and adapters, scored side by side.

Generation is batched with the KV cache and left padding; only token ids are kept (no scores or logits),
so memory stays flat however large the eval set. Extraction, scoring and metrics live in delft.answers.
"""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.console import Console
from rich.table import Table

from delft import __version__
from delft.answers import (CHAT_STOP_STRINGS, PLAIN_STOP_STRINGS, Scored, canonical, cut_at_stop, extract_answer,
                           paired_difference, parse_number, place_order, score, summarize)
from delft.data import EVAL_SEED_OFFSET, prompt_ids
from delft.digits import place_name
from delft.errors import UserError

BOOTSTRAP_SEED = 0


@dataclass
class Problem:
    """One eval problem: the source example and its numeric gold answer."""

    example: Any  # delft.data.Example
    gold: Decimal
    index: int


@dataclass
class ModelResult:
    name: str
    adapter: Optional[str]
    template: str = "plain"
    stop_strings: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    generated: list[str] = field(default_factory=list)
    scored: list[Scored] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    vs_base: Optional[dict] = None


# ------------------------------------------------------------------------------------------ settings


def resolve_settings(recipe: Optional[Path], runs: Sequence[str], model: Optional[str], data: Optional[str],
                     data_format: Optional[str], limit: Optional[int], overrides: Sequence[str],
                     console: Console):
    """(recipe config, base model name, eval DataConfig, limit, runs) from the command line."""
    from pydantic import ValidationError

    from delft.recipe import DataConfig, load_recipe

    cfg = load_recipe(recipe, list(overrides))
    runs = list(runs)
    if recipe is None:
        if model is None:
            model = _base_from_runs(runs)
        if model is None or data is None:
            missing = " and ".join(x for x, v in (("--model", model), ("--data", data)) if v is None)
            raise UserError(f"without a recipe, {missing} {'is' if ' and ' not in missing else 'are'} required",
                            "delft eval", "Pass a recipe (delft eval RECIPE.yaml [RUNS...]) or e.g. "
                            "--model smollm2-135m --data synthetic (or --data FILE --format gsm8k).")
    model = model or cfg.model.name
    base_data = cfg.eval_data()
    fields = base_data.model_dump()
    if data is not None:
        fields["source"] = data
        if data == "synthetic":
            if data_format not in (None, "synthetic"):
                raise UserError(f"--data synthetic goes with --format synthetic, not {data_format!r}", "--format",
                                "Drop --format.")
            fields["format"] = "synthetic"
        elif data_format is not None:
            fields["format"] = data_format
        elif base_data.format == "synthetic" or recipe is None:
            raise UserError(f"--format is required with --data {data}", "--format",
                            "Say how rows map to question and answer: gsm8k, svamp, prompt_completion, chat, ...")
    elif data_format is not None:
        fields["format"] = data_format
    if limit is None:
        limit = cfg.eval.limit
    if limit is not None:
        if limit <= 0:
            raise UserError(f"--limit must be positive, not {limit}", "--limit", "e.g. --limit 100.")
        fields["limit"] = min(limit, fields["limit"]) if fields.get("limit") else limit
    fields["val_size"] = 0
    try:
        data_cfg = DataConfig.model_validate(fields)
    except ValidationError as e:
        problems = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
        raise UserError(f"invalid eval data: {problems}", "--data/--format", "Check --data and --format.") from None
    if (data_cfg.source == "synthetic" and cfg.data.source == "synthetic"
            and data_cfg.synthetic.seed == cfg.data.synthetic.seed):
        # An eval set equal to the training problems would measure memorisation.
        data_cfg.synthetic = data_cfg.synthetic.model_copy(update={"seed": data_cfg.synthetic.seed + EVAL_SEED_OFFSET})
    if not runs and recipe is not None:
        finished = _finished_run(Path(cfg.output.dir))
        if finished is not None:
            console.print(f"[dim]including the finished run in {finished} (output.dir of the recipe)[/]")
            runs = [str(finished)]
    return cfg, model, data_cfg, limit, runs


def _base_from_runs(runs: Sequence[str]) -> Optional[str]:
    from delft.rundir import read_info as read_run_info

    bases = {read_run_info(Path(r)).get("base_model") for r in runs if Path(r).is_dir()}
    bases.discard(None)
    return bases.pop() if len(bases) == 1 else None


def _finished_run(path: Path) -> Optional[Path]:
    from delft.rundir import read_info as read_run_info

    if path.is_dir() and (path / "adapter_config.json").is_file() and read_run_info(path).get("status") == "completed":
        return path
    return None


def check_runs(runs: Sequence[str], base: str) -> None:
    """Fail before any generation: every run must exist and be an adapter or a merged model for ``base``."""
    from delft.models import resolve_model
    from delft.rundir import check_adapter_matches, read_info as read_run_info

    base_config = None
    for run in runs:
        p = Path(run)
        if not p.exists():
            raise UserError(f"run directory {run} does not exist", "delft eval",
                            "Give a directory written by `delft train` (or by `delft export`).")
        if not p.is_dir() or not ((p / "adapter_config.json").is_file() or (p / "config.json").is_file()):
            raise UserError(f"{run} holds neither an adapter (adapter_config.json) nor a merged model (config.json)",
                            "delft eval", "Give a run directory written by `delft train` or a merged model.")
        if (p / "adapter_config.json").is_file() and read_run_info(p).get("architecture"):
            if base_config is None:
                from transformers import AutoConfig

                try:
                    base_config = AutoConfig.from_pretrained(resolve_model(base).path)
                except (OSError, ValueError):
                    return  # load_for_inference reports it
            check_adapter_matches(p, base, base_config, "delft eval")


def column_names(runs: Sequence[str], include_base: bool) -> list[str]:
    """'base', then each run's directory name (its path where names repeat)."""
    names = [Path(r).name or str(r) for r in runs]
    out = []
    for r, n in zip(runs, names):
        out.append(str(r) if names.count(n) > 1 or n == "base" else n)
    return (["base"] if include_base else []) + out


def load_problems(data_cfg, console: Console) -> tuple[list[Problem], int]:
    """The eval problems with numeric gold answers; (problems, number skipped for lack of an answer)."""
    from delft.data import load_examples

    examples = load_examples(data_cfg, "eval.data")
    problems, skipped = [], 0
    for i, ex in enumerate(examples):
        gold = parse_number(ex.answer) if ex.answer is not None else parse_number(ex.completion)
        if gold is None:
            skipped += 1
            continue
        problems.append(Problem(ex, gold, i))
    if not problems:
        raise UserError(f"the eval set ({data_cfg.source}, format {data_cfg.format}) has no numeric answers: none "
                        f"of its {len(examples)} examples has an 'answer' field or a completion that is a number",
                        "eval.data", "Use a format with answers (gsm8k, svamp, synthetic), or add an 'answer' "
                        "column to a prompt_completion / chat file.")
    if skipped:
        console.print(f"[yellow]warning:[/] skipped {skipped} of {len(examples)} eval examples without a numeric "
                      "answer")
    return problems, skipped


# ---------------------------------------------------------------------------------------- generation


def stop_strings(tokenizer, chat: bool) -> list[str]:
    """Where an answer ends: the end-of-turn markers for chat prompts, a blank line or a new problem otherwise."""
    stops = list(CHAT_STOP_STRINGS if chat else PLAIN_STOP_STRINGS)
    eos = getattr(tokenizer, "eos_token", None)
    if isinstance(eos, str) and eos and eos not in stops:
        stops.append(eos)
    return stops


def _eos_ids(model, tokenizer, chat: bool) -> list[int]:
    ids: list[int] = []
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        for i in (source if isinstance(source, (list, tuple)) else [source]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if chat:  # end-of-turn tokens that some chat templates use besides EOS
        vocab = tokenizer.get_vocab()
        for s in CHAT_STOP_STRINGS:
            if s in vocab and vocab[s] not in ids and s in getattr(tokenizer, "all_special_tokens", []):
                ids.append(vocab[s])
    return ids


class _StopOnStrings:
    """Per-sequence stopping once the generated text holds a stop string (after its leading whitespace)."""

    def __init__(self, tokenizer, prompt_len: int, stops: Sequence[str]):
        self.tokenizer, self.prompt_len, self.stops = tokenizer, prompt_len, list(stops)

    def __call__(self, input_ids, scores=None, **kwargs):
        import torch

        gen = input_ids[:, self.prompt_len:].tolist()
        done = []
        for row in gen:
            text = self.tokenizer.decode(row, skip_special_tokens=True)
            done.append(cut_at_stop(text, self.stops) != text)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def generate_answers(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int,
                     stops: Sequence[str], eos_ids: Sequence[int], progress=None, task=None) -> list[str]:
    """Greedy continuations of ``prompts`` (token ids only are kept), decoded, in the order given.

    Prompts are sorted by length so each batch pads little; padding is on the left so every prompt ends at
    the same position and the KV cache continues all of them together.
    """
    import torch
    from transformers import GenerationConfig, StoppingCriteriaList

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    encoded = [prompt_ids(tokenizer, p) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    out: list[str] = [""] * len(prompts)
    device = next(model.parameters()).device
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                               pad_token_id=pad_id, eos_token_id=list(eos_ids) or None, use_cache=True,
                               output_scores=False, output_logits=False, return_dict_in_generate=False)
    for start in range(0, len(order), batch_size):
        idx = order[start: start + batch_size]
        width = max(len(encoded[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):  # left padding
            seq = encoded[i]
            if seq:
                ids[row, width - len(seq):] = torch.tensor(seq)
                mask[row, width - len(seq):] = 1
        ids, mask = ids.to(device), mask.to(device)
        criteria = StoppingCriteriaList([_StopOnStrings(tokenizer, width, stops)]) if stops else None
        with torch.inference_mode():
            result = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                                    stopping_criteria=criteria)
        for row, i in enumerate(idx):
            new = result[row, width:].tolist()
            cut = next((k for k, t in enumerate(new) if t in eos_ids), len(new))
            out[i] = tokenizer.decode(new[:cut], skip_special_tokens=True)
        del result, ids, mask
        if progress is not None:
            progress.advance(task, len(idx))
    return out


def evaluate_model(name: str, base: str, adapter: Optional[str], problems: Sequence[Problem], data_cfg,
                   recipe_cfg, progress=None, task=None) -> ModelResult:
    """Load one model, answer every problem, score the answers; the model is freed afterwards."""
    import torch

    from delft.data import render_prompt, use_chat_template
    from delft.models import load_for_inference

    model, tokenizer = load_for_inference(base, adapter, device=recipe_cfg.model.device, dtype=recipe_cfg.model.dtype)
    try:
        chat = use_chat_template(tokenizer, data_cfg)
        stops = stop_strings(tokenizer, chat)
        prompts = [render_prompt(p.example, tokenizer, data_cfg) for p in problems]
        ev = recipe_cfg.eval
        generated = generate_answers(model, tokenizer, prompts, ev.max_new_tokens, ev.batch_size, stops,
                                     _eos_ids(model, tokenizer, chat), progress, task)
    finally:
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    scored = [score(extract_answer(text, stops), p.gold) for text, p in zip(generated, problems)]
    return ModelResult(name, adapter, "chat" if chat else "plain", stops, prompts, generated, scored)


# ------------------------------------------------------------------------------------------ rendering


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _num(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if abs(x) < 1e6 else f"{x:.3e}"


def metric_rows(results: Sequence[ModelResult]) -> list[tuple[str, list[Optional[float]], list[str], bool]]:
    """(label, values, cells, higher_is_better) per table row."""
    rows = []
    m = [r.metrics for r in results]

    def ci_cell(x, key):
        ci = x.get(key)
        return _pct(x[key.removesuffix("_ci")]) + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")

    rows.append(("exact match (95 % CI)", [x["exact_match"] for x in m], [ci_cell(x, "exact_match_ci") for x in m],
                 True))
    rows.append(("tolerance match (95 % CI)", [x["tolerance_match"] for x in m],
                 [ci_cell(x, "tolerance_match_ci") for x in m], True))
    rows.append(("no number", [x["no_number_rate"] for x in m], [_pct(x["no_number_rate"]) for x in m], False))
    rows.append(("MAE", [x["mae"] for x in m], [_num(x["mae"]) for x in m], False))
    rows.append(("log-MAE", [x["log_mae"] for x in m], [_num(x["log_mae"]) for x in m], False))
    rows.append(("digit accuracy (all places)", [x["digit_accuracy"] for x in m], [_pct(x["digit_accuracy"]) for x in m],
                 True))
    places = place_order(p["place"] for x in m for p in x["per_place"].values())
    for place in places:
        name = place_name(place)
        vals = [x["per_place"].get(name, {}).get("accuracy") for x in m]
        n = max(x["per_place"].get(name, {}).get("n", 0) for x in m)
        rows.append((f"  {name} (n={n})", vals, [_pct(v) for v in vals], True))
    return rows


def render_table(results: Sequence[ModelResult], title: str) -> Table:
    """Models as columns, metrics as rows, the best value of each row in bold green."""
    table = Table(title=title, title_justify="left", header_style="bold")
    table.add_column("metric", style="cyan", no_wrap=True)
    for r in results:
        table.add_column(r.name, justify="right")
    for label, values, cells, higher in metric_rows(results):
        present = [v for v in values if v is not None]
        best = None
        if len(present) > 1 and max(present) - min(present) > 1e-12:  # nothing to highlight when all tie
            best = max(present) if higher else min(present)
        styled = [f"[bold green]{c}[/]" if best is not None and v is not None and abs(v - best) < 1e-12 else c
                  for v, c in zip(values, cells)]
        table.add_row(label, *styled)
    table.caption = ("exact: numeric equality; tolerance: integer gold needs round(pred) == gold, other gold 4 % "
                     "relative error (DEL paper); digit places of the gold number, a missing place or no number "
                     "counts wrong; MAE and log-MAE over answers with a number")
    table.caption_justify = "left"
    return table


def prediction_record(p: Problem, prompt: str, generated: str, s: Scored) -> dict:
    e = s.extraction
    return {
        "index": p.index,
        "prompt": prompt,
        "gold": canonical(p.gold),
        "generated": generated,
        "extracted": e.canonical,
        "matched_text": e.text,
        "rule": e.rule,
        "exact": s.exact,
        "tolerance": s.tolerance,
        "places": {place_name(k): v for k, v in sorted(s.places.items(), key=lambda kv: -kv[0])},
    }


def to_json(results: Sequence[ModelResult], problems: Sequence[Problem], settings: dict) -> dict:
    return {
        "delft_version": __version__,
        "settings": settings,
        "models": [
            {
                "name": r.name,
                "adapter": r.adapter,
                "template": r.template,
                "stop_strings": r.stop_strings,
                "metrics": r.metrics,
                "vs_base": r.vs_base,
                "predictions": [prediction_record(p, pr, g, s)
                                for p, pr, g, s in zip(problems, r.prompts, r.generated, r.scored)],
            }
            for r in results
        ],
    }


def write_plot(results: Sequence[ModelResult], path: Path, title: str) -> None:
    """Grouped bars: per-place digit accuracy, one colour per model (matplotlib's Agg canvas, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    places = place_order(p["place"] for r in results for p in r.metrics["per_place"].values())
    names = [place_name(p) for p in places]
    counts = [max(r.metrics["per_place"].get(n, {}).get("n", 0) for r in results) for n in names]
    fig = Figure(figsize=(max(5.0, 1.1 * len(places) + 2), 3.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / max(1, len(results))
    for k, r in enumerate(results):
        vals = [100 * (r.metrics["per_place"].get(n, {}).get("accuracy") or 0.0) for n in names]
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(places))]
        ax.bar(xs, vals, width=width, label=r.name)
    ax.set_xticks(range(len(places)))
    ax.set_xticklabels([f"{n}\n(n={c})" for n, c in zip(names, counts)], fontsize=8)
    ax.set_ylim(0, 100)
    ax.set_ylabel("digit accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


# ---------------------------------------------------------------------------------------------- entry


def run_eval(recipe: Optional[Path] = None, runs: Sequence[str] = (), model: Optional[str] = None,
             data: Optional[str] = None, data_format: Optional[str] = None, limit: Optional[int] = None,
             include_base: bool = True, json_out: Optional[Path] = None, plot: Optional[Path] = None,
             overrides: Sequence[str] = (), console: Optional[Console] = None) -> list[ModelResult]:
    """Evaluate the base model (unless ``include_base`` is False) and every run; print, and write JSON / PNG."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    cfg, base, data_cfg, limit, runs = resolve_settings(recipe, runs, model, data, data_format, limit, overrides,
                                                        console)
    if not include_base and not runs:
        raise UserError("nothing to evaluate: --no-base and no run directories", "delft eval",
                        "Give run directories, or drop --no-base.")
    check_runs(runs, base)
    problems, skipped = load_problems(data_cfg, console)
    names = column_names(runs, include_base)
    adapters: list[Optional[str]] = ([None] if include_base else []) + [str(r) for r in runs]
    source = data_cfg.source if data_cfg.source != "synthetic" else f"synthetic (seed {data_cfg.synthetic.seed})"
    title = f"delft eval: {len(problems)} problems from {source}, base model {base}"

    results: list[ModelResult] = []
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        for name, adapter in zip(names, adapters):
            task = progress.add_task(name, total=len(problems))
            results.append(evaluate_model(name, base, adapter, problems, data_cfg, cfg, progress, task))

    for r in results:
        r.metrics = summarize(r.scored, cfg.eval.bootstrap, BOOTSTRAP_SEED)
    if include_base:
        base_exact = [s.exact for s in results[0].scored]
        for r in results[1:]:
            r.vs_base = {"exact_match": paired_difference(base_exact, [s.exact for s in r.scored],
                                                          cfg.eval.bootstrap, BOOTSTRAP_SEED),
                         "tolerance_match": paired_difference([s.tolerance for s in results[0].scored],
                                                              [s.tolerance for s in r.scored],
                                                              cfg.eval.bootstrap, BOOTSTRAP_SEED)}

    console.print(render_table(results, title))
    for r in results[1:] if include_base else []:
        d = r.vs_base["exact_match"]
        ci = d["ci"]
        span = f" [95 % CI {100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" if ci else ""
        console.print(f"{r.name} vs base: exact match {100 * d['difference']:+.1f} points{span} (paired bootstrap)")

    settings = {
        "base_model": base,
        "runs": [str(r) for r in runs],
        "data": data_cfg.model_dump(mode="json"),
        "limit": limit,
        "n": len(problems),
        "skipped_without_answer": skipped,
        "decoding": "greedy",
        "max_new_tokens": cfg.eval.max_new_tokens,
        "batch_size": cfg.eval.batch_size,
        "bootstrap": {"resamples": cfg.eval.bootstrap, "seed": BOOTSTRAP_SEED, "level": 0.95},
        "device": cfg.model.device,
        "dtype": cfg.model.dtype,
    }
    if json_out is not None:
        json_out = Path(json_out)
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(to_json(results, problems, settings), indent=2))
        console.print(f"[green]wrote[/] {json_out}")
    if plot is not None:
        write_plot(results, Path(plot), title)
        console.print(f"[green]wrote[/] {plot}")
    return results
