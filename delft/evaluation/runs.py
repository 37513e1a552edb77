"""What ``delft eval`` evaluates, and the checks it passes before any model answers: the recipe, base model and
eval set a command line resolves to, the runs (the recipe's own run when it is finished), every run an adapter for
that base, a merged model or a GGUF file, and a base the chosen backend can run.

``delft compare`` and ``delft study`` evaluate their runs the way eval does, so they take these from here rather
than from the eval command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from pydantic import ValidationError
from rich.console import Console

from delft.errors import UserError
from delft.evaluation.gguf_backend import check_gguf, is_gguf
from delft.evaluation.problems import disjoint_from_training
from delft.models.scratch import base_name
from delft.models.sources import resolve_model
from delft.recipe.files import load_recipe
from delft.recipe.schema import GENERATED, DataConfig
from delft.rundir import base_model, check_adapter_matches, check_trained_dir, is_finished_run, read_info, status


def resolve_settings(recipe_path: Optional[Path], runs: Sequence[str], model: Optional[str], data: Optional[str],
                     data_format: Optional[str], limit: Optional[int], overrides: Sequence[str],
                     console: Console):
    """(recipe config, base model name, eval DataConfig, limit, runs) from the command line."""
    cfg = load_recipe(recipe_path, list(overrides))
    runs = list(runs)
    for run in runs:  # named before anything else: a mistyped path is the likeliest mistake, whatever else is missing
        if not Path(run).exists():
            raise UserError(f"{run} does not exist", "delft eval", "Give run directories written by `delft train`, "
                            "merged models from `delft export` or .gguf files (after the recipe, if any).")
    if recipe_path is None:
        if model is None:
            model = _base_from_runs(runs)
        if model is None or data is None:
            missing = " and ".join(x for x, v in (("--model", model), ("--data", data)) if v is None)
            raise UserError(f"without a recipe, {missing} {'is' if ' and ' not in missing else 'are'} required",
                            "delft eval", "Pass a recipe (delft eval RECIPE.yaml [RUNS...]) or e.g. "
                            "--model smollm2-135m --data synthetic (or --data FILE --format gsm8k).")
    if model is None:
        model = base_name(cfg)
    base_data = cfg.eval_data()
    fields = base_data.model_dump()
    if data is not None:
        fields["source"] = data
        if data in GENERATED:
            if data_format not in (None, data):
                raise UserError(f"--data {data} goes with --format {data}, not {data_format!r}", "--format",
                                "Drop --format.")
            fields["format"] = data
        elif data_format is not None:
            fields["format"] = data_format
        elif base_data.format in GENERATED or recipe_path is None:
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
    data_cfg = disjoint_from_training(data_cfg, cfg.data)
    if not runs and recipe_path is not None:
        runs = _recipe_run(Path(cfg.output.dir), console)
    return cfg, model, data_cfg, limit, runs


def _base_from_runs(runs: Sequence[str]) -> Optional[str]:
    bases = {base_model(Path(r)) for r in runs if Path(r).is_dir()}
    bases.discard(None)
    return bases.pop() if len(bases) == 1 else None


def _recipe_run(path: Path, console: Console) -> list[str]:
    """The recipe's own run (output.dir) as the one run to evaluate when it is finished; when it is not, one line
    says why it is left out, so a table without it is never a surprise."""
    if is_finished_run(path):
        console.print(f"[dim]including the finished run in {path} (output.dir of the recipe)[/]")
        return [str(path)]
    if not path.exists():
        why = "does not exist (not trained yet?)"
    elif status(path) not in (None, "completed"):
        why = f"is not finished (its status is {status(path)!r}: resume the training to finish it)"
    else:
        why = "holds no trained adapter or model"
    console.print(f"[dim]not including the recipe's run: {path} (output.dir) {why}; give run directories after the "
                  "recipe to evaluate them[/]", highlight=False)
    return []


def check_runs(runs: Sequence[str], base: str) -> None:
    """Fail before any generation: every run must exist and be an adapter or a merged model for ``base``."""
    base_config = None
    for run in runs:
        p = Path(run)
        if is_gguf(run):
            check_gguf(p, "delft eval")
            continue
        adapter = check_trained_dir(p, "delft eval") == "adapter"
        if adapter and read_info(p).get("architecture"):
            if base_config is None:
                from transformers import AutoConfig

                try:
                    base_config = AutoConfig.from_pretrained(resolve_model(base).path)
                except (OSError, ValueError):
                    return  # load_for_inference reports it
            check_adapter_matches(p, base, base_config, "delft eval")


def check_backend(cfg, base: str, runs: Sequence[str], include_base: bool, teacher_forced: bool) -> None:
    """eval.backend llama.cpp needs a .gguf base; --teacher-forced needs transformers' logits for every column."""
    llama_base = cfg.eval.backend == "llama.cpp"
    if llama_base and not is_gguf(base):
        raise UserError(f"--backend llama.cpp runs a .gguf model, and the base model is {base}", "--backend",
                        "Pass --model FILE.gguf, or give GGUF files as runs (they always run in llama.cpp).")
    if llama_base and include_base:
        check_gguf(Path(base), "--model")
    gguf = [r for r in runs if is_gguf(r)] + ([base] if llama_base and include_base else [])
    if teacher_forced and gguf:
        raise UserError(f"--teacher-forced reads transformers' logits, and {', '.join(map(str, gguf))} would run in "
                        "llama.cpp", "--teacher-forced", "Drop --teacher-forced, or evaluate the merged model "
                        "directory (delft export) instead of its GGUF.")
