"""Generating and scoring: one model (base, or base + adapter) answers every problem greedily, each answer is
scored; teacher-forced digit metrics on the gold completions when asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from rich.console import Console

from delft.evaluation.metrics import summarize
from delft.evaluation.problems import BOOTSTRAP_SEED, Problem
from delft.numbers.answers import Scored, extract_answer, score


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
    teacher: Any = None  # delft.evaluation.teacher_forced.TeacherForced with --teacher-forced
    teacher_metrics: Optional[dict] = None
    teacher_vs_base: Optional[dict] = None


def evaluate_model(name: str, base: str, adapter: Optional[str], problems: Sequence[Problem], data_cfg,
                   recipe_cfg, progress=None, task=None, teacher_forced: bool = False) -> ModelResult:
    """Load one model, answer every problem, score the answers (and with ``teacher_forced`` score the gold
    completions, delft.evaluation.teacher_forced); the model is freed afterwards."""
    from delft.data import render_prompt, use_chat_template
    from delft.evaluation.generation import greedy, stop_strings
    from delft.models.loading import using_model

    with using_model(base, adapter, device=recipe_cfg.model.device, dtype=recipe_cfg.model.dtype) as lm:
        tokenizer = lm.tokenizer
        chat = use_chat_template(tokenizer, data_cfg)
        stops = stop_strings(tokenizer, chat)
        prompts = [render_prompt(p.example, tokenizer, data_cfg) for p in problems]
        advance = (lambda n: progress.advance(task, n)) if progress is not None else None
        generations = greedy(lm.model, tokenizer, prompts, recipe_cfg.eval.max_new_tokens, chat,
                             recipe_cfg.eval.batch_size, on_batch=advance)
        teacher = _teacher_forced(lm.model, tokenizer, problems, data_cfg, recipe_cfg) if teacher_forced else None
    generated = [g.text for g in generations]
    scored = [score(extract_answer(text, stops), p.gold) for text, p in zip(generated, problems)]
    return ModelResult(name, adapter, "chat" if chat else "plain", stops, prompts, generated, scored,
                       teacher=teacher)


def _teacher_forced(model, tokenizer, problems: Sequence[Problem], data_cfg, recipe_cfg):
    from delft.evaluation.teacher_forced import teacher_forced
    from delft.numbers.tokens import NumberVocab

    vocab = NumberVocab.from_tokenizer(tokenizer, purpose="--teacher-forced")
    return teacher_forced(model, tokenizer, [p.example for p in problems], data_cfg, vocab,
                          recipe_cfg.eval.batch_size)


def score_gold(base: str, adapter: Optional[str], problems: Sequence[Problem], data_cfg, recipe_cfg):
    """Load one model, score the gold completions of ``problems`` teacher-forced (no generation), free it."""
    from delft.models.loading import using_model

    with using_model(base, adapter, device=recipe_cfg.model.device, dtype=recipe_cfg.model.dtype) as lm:
        return _teacher_forced(lm.model, lm.tokenizer, problems, data_cfg, recipe_cfg)


def progress_bar(console: Console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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
            task = progress.add_task(name, total=len(problems))
            r = evaluate_model(name, base, adapter, problems, data_cfg, recipe_cfg, progress, task, teacher_forced)
            r.metrics = summarize(r.scored, recipe_cfg.eval.bootstrap, BOOTSTRAP_SEED)
            if r.teacher is not None:
                from delft.evaluation.teacher_forced import summarize_teacher

                r.teacher_metrics = summarize_teacher(r.teacher)
            results.append(r)
    return results
