"""Generating and scoring: one model (base, or base + adapter) answers every problem (greedy or sampled), each
answer is scored (delft.evaluation.results); teacher-forced digit metrics on the gold completions when asked; GGUF
columns go to llama.cpp (delft.evaluation.gguf_backend).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console

from delft.evaluation.generation import generate
from delft.evaluation.gguf_backend import evaluate_gguf, is_gguf
from delft.evaluation.metrics import summarize
from delft.evaluation.problems import BOOTSTRAP_SEED, Problem
from delft.evaluation.results import ModelResult, check_prompts_fit, eval_prompts, sampling_of, scored_result
from delft.evaluation.sampling import summarize_samples
from delft.evaluation.teacher_forced import summarize_teacher, teacher_forced
from delft.models.loading import using_model
from delft.numbers.tokens import NumberVocab
from delft.recipe.files import as_trained


def evaluate_model(name: str, base: str, adapter: Optional[str], problems: Sequence[Problem], data_cfg,
                   recipe_cfg, progress=None, task=None, teacher_forced: bool = False) -> ModelResult:
    """Load one model, answer every problem, score the answers (and with ``teacher_forced`` score the gold
    completions, delft.evaluation.teacher_forced); the model is freed afterwards."""
    with using_model(base, adapter, device=recipe_cfg.model.device, dtype=recipe_cfg.model.dtype) as lm:
        chat, stops, prompts = eval_prompts(lm.tokenizer, problems, data_cfg, recipe_cfg.eval)
        check_prompts_fit(lm.model, lm.tokenizer, prompts, problems, recipe_cfg.eval, adapter or base)
        advance = (lambda n: progress.advance(task, n)) if progress is not None else None
        generations = generate(lm.model, lm.tokenizer, prompts, recipe_cfg.eval.max_new_tokens, chat,
                               recipe_cfg.eval.batch_size, stops, on_batch=advance,
                               sampling=sampling_of(recipe_cfg.eval))
        teacher = _teacher_forced(lm.model, lm.tokenizer, problems, data_cfg, recipe_cfg) if teacher_forced else None
    result = scored_result(name, adapter, chat, stops, prompts, [[g.text for g in gs] for gs in generations],
                           problems, data_cfg)
    result.teacher = teacher
    return result


def _teacher_forced(model, tokenizer, problems: Sequence[Problem], data_cfg, recipe_cfg):
    vocab = NumberVocab.from_tokenizer(tokenizer, purpose="--teacher-forced")
    return teacher_forced(model, tokenizer, [p.example for p in problems], data_cfg, vocab,
                          recipe_cfg.eval.batch_size)


def score_gold(base: str, adapter: Optional[str], problems: Sequence[Problem], data_cfg, recipe_cfg):
    """Load one model, score the gold completions of ``problems`` teacher-forced (no generation), free it: a run
    trained before data.separator reads them after its newline."""
    with using_model(base, adapter, device=recipe_cfg.model.device, dtype=recipe_cfg.model.dtype) as lm:
        return _teacher_forced(lm.model, lm.tokenizer, problems, as_trained(data_cfg, adapter), recipe_cfg)


def in_llama_cpp(adapter: Optional[str], base: str, recipe_cfg) -> bool:
    """Whether a column runs in llama.cpp: a GGUF run always, a GGUF base model with eval.backend llama.cpp."""
    return is_gguf(adapter) or (adapter is None and is_gguf(base) and recipe_cfg.eval.backend == "llama.cpp")


class LineProgress:
    """rich's live display draws nothing while stdout is not a terminal (a file, a pipe, CI), so a long eval would be
    silent for its whole length: instead one line as each model starts and one per tenth of its problems."""

    def __init__(self, console: Console):
        self.console, self.tasks = console, []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def add_task(self, name: str, total: int) -> int:
        self.tasks.append({"name": name, "total": total, "done": 0, "start": time.monotonic()})
        self.console.print(f"{name}: loading, then answering {total} problems", highlight=False)
        return len(self.tasks) - 1

    def advance(self, task: int, n: int) -> None:
        t = self.tasks[task]
        before, t["done"] = t["done"], min(t["total"], t["done"] + n)
        every = max(1, t["total"] // 10)
        if t["done"] == t["total"] or t["done"] // every > before // every:
            self.console.print(f"{t['name']}: {t['done']}/{t['total']} problems answered "
                               f"({time.monotonic() - t['start']:.0f} s)", highlight=False)


def progress_bar(console: Console):
    """rich's bars on a terminal; LineProgress's lines elsewhere."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not console.is_terminal:
        return LineProgress(console)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)


def evaluate_models(columns: Sequence[tuple[str, Optional[str]]], base: str, problems: Sequence[Problem], data_cfg,
                    recipe_cfg, console: Console, done: Optional[list] = None,
                    teacher_forced: bool = False) -> list[ModelResult]:
    """Every (name, adapter) column in turn (one model in memory at a time), answered, scored and summarised.

    Each finished result is appended to ``done`` (when given) at once, so a later failure cannot lose it.
    """
    results = [] if done is None else done
    with progress_bar(console) as progress:
        for name, adapter in columns:
            column_data = as_trained(data_cfg, adapter)  # a run trained before data.separator: its newline
            if column_data.separator != data_cfg.separator:
                console.print(f"[dim]{name} was trained before data.separator existed: a newline follows its plain "
                              "prompts (no chat template), as in its training[/]", highlight=False)
            if column_data.numbers.active():
                n = column_data.numbers
                console.print(f"[dim]{name} writes numbers in order {n.order}, count_prefix {n.count_prefix}, scope "
                              f"{n.scope} (data.numbers): its answers are read back before scoring[/]",
                              highlight=False)
            task = progress.add_task(name, total=len(problems))
            if in_llama_cpp(adapter, base, recipe_cfg):
                r = evaluate_gguf(name, Path(adapter or base), problems, column_data, recipe_cfg, base)
                progress.advance(task, len(problems))
            else:
                r = evaluate_model(name, base, adapter, problems, column_data, recipe_cfg, progress, task,
                                   teacher_forced)
            r.metrics = summarize(r.scored, recipe_cfg.eval.bootstrap, BOOTSTRAP_SEED)
            if r.samples is not None:
                r.metrics["sampling"] = summarize_samples(r.samples, recipe_cfg.eval.bootstrap, BOOTSTRAP_SEED)
            if r.teacher is not None:
                r.teacher_metrics = summarize_teacher(r.teacher)
            results.append(r)
    return results
