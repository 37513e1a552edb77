"""Generating and scoring: one model (base, or base + adapter) answers every problem greedily, each answer is
scored; teacher-forced digit metrics on the gold completions when asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.console import Console

from delft.evaluation.metrics import summarize
from delft.evaluation.problems import BOOTSTRAP_SEED, Problem
from delft.numbers.answers import Scored, cut_at_stop, extract_answer, score
from delft.numbers.harness import harness_scores


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
    samples: Optional[list[list[Scored]]] = None  # with eval.samples > 1: every sample scored, per problem
    sample_texts: Optional[list[list[str]]] = None  # ... and its text


def evaluate_model(name: str, base: str, adapter: Optional[str], problems: Sequence[Problem], data_cfg,
                   recipe_cfg, progress=None, task=None, teacher_forced: bool = False) -> ModelResult:
    """Load one model, answer every problem, score the answers (and with ``teacher_forced`` score the gold
    completions, delft.evaluation.teacher_forced); the model is freed afterwards."""
    from delft.evaluation.generation import generate
    from delft.models.loading import using_model

    with using_model(base, adapter, device=recipe_cfg.model.device, dtype=recipe_cfg.model.dtype) as lm:
        chat, stops, prompts = eval_prompts(lm.tokenizer, problems, data_cfg, recipe_cfg.eval)
        advance = (lambda n: progress.advance(task, n)) if progress is not None else None
        generations = generate(lm.model, lm.tokenizer, prompts, recipe_cfg.eval.max_new_tokens, chat,
                               recipe_cfg.eval.batch_size, stops, on_batch=advance,
                               sampling=sampling_of(recipe_cfg.eval))
        teacher = _teacher_forced(lm.model, lm.tokenizer, problems, data_cfg, recipe_cfg) if teacher_forced else None
    result = scored_result(name, adapter, chat, stops, prompts, [[g.text for g in gs] for gs in generations],
                           problems, data_cfg)
    result.teacher = teacher
    return result


def eval_prompts(tokenizer, problems: Sequence[Problem], data_cfg, eval_cfg) -> tuple[bool, list[str], list[str]]:
    """(chat template used, stop strings, prompt texts): the data's own rendering, or with ``eval.fewshot`` the
    harness's plain GSM8K prompt (delft.evaluation.fewshot)."""
    from delft.data import render_prompt, use_chat_template
    from delft.evaluation.fewshot import fewshot_prompt, question_text
    from delft.evaluation.generation import stop_strings

    if eval_cfg.fewshot is not None:
        prompts = [fewshot_prompt(question_text(p.example), eval_cfg.fewshot) for p in problems]
        return False, stop_strings(tokenizer, False), prompts
    chat = use_chat_template(tokenizer, data_cfg)
    return chat, stop_strings(tokenizer, chat), [render_prompt(p.example, tokenizer, data_cfg) for p in problems]


def sampling_of(eval_cfg):
    """The eval section's decoding: None (greedy) for one sample, else delft.evaluation.generation.Sampling."""
    from delft.evaluation.generation import Sampling

    if eval_cfg.samples == 1:
        return None
    return Sampling(eval_cfg.samples, eval_cfg.temperature, eval_cfg.top_p, eval_cfg.seed)


def score_text(text: str, problem: Problem, stops: Sequence[str], task_scorer=None) -> Scored:
    """One answer scored: delft's extraction against the gold number, the harness's two scores beside it, and a
    generated task's own score (delft.evaluation.problems.task_scorer) when given."""
    s = score(extract_answer(text, stops), problem.gold, harness_scores(cut_at_stop(text, stops), problem.gold_text))
    if task_scorer is not None:
        s.task_score = task_scorer(s.extraction.canonical, problem)
    return s


def scored_result(name: str, adapter: Optional[str], chat: bool, stops: list[str], prompts: list[str],
                  texts: Sequence[Sequence[str]], problems: Sequence[Problem], data_cfg) -> ModelResult:
    """A ModelResult from each problem's answer texts: one (greedy) or several (sampled; ``scored`` then holds
    each problem's majority-vote answer, the samples are kept in ``samples``)."""
    from delft.evaluation.problems import task_scorer
    from delft.evaluation.sampling import majority_index

    scorer = task_scorer(data_cfg)
    groups = [[score_text(t, p, stops, scorer) for t in ts] for ts, p in zip(texts, problems)]
    sampled = any(len(ts) > 1 for ts in texts)
    chosen = [majority_index(g) if sampled else 0 for g in groups]
    scored = [g[i] for g, i in zip(groups, chosen)]
    generated = [ts[i] for ts, i in zip(texts, chosen)]
    return ModelResult(name, adapter, "chat" if chat else "plain", stops, prompts, generated, scored,
                       samples=groups if sampled else None, sample_texts=[list(t) for t in texts] if sampled else None)


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


def in_llama_cpp(adapter: Optional[str], base: str, recipe_cfg) -> bool:
    """Whether a column runs in llama.cpp: a GGUF run always, a GGUF base model with eval.backend llama.cpp."""
    from delft.evaluation.gguf_backend import is_gguf

    return is_gguf(adapter) or (adapter is None and is_gguf(base) and recipe_cfg.eval.backend == "llama.cpp")


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
            if in_llama_cpp(adapter, base, recipe_cfg):
                from delft.evaluation.gguf_backend import evaluate_gguf

                r = evaluate_gguf(name, Path(adapter or base), problems, data_cfg, recipe_cfg, base)
                progress.advance(task, len(problems))
            else:
                r = evaluate_model(name, base, adapter, problems, data_cfg, recipe_cfg, progress, task,
                                   teacher_forced)
            r.metrics = summarize(r.scored, recipe_cfg.eval.bootstrap, BOOTSTRAP_SEED)
            if r.samples is not None:
                from delft.evaluation.sampling import summarize_samples

                r.metrics["sampling"] = summarize_samples(r.samples, recipe_cfg.eval.bootstrap, BOOTSTRAP_SEED)
            if r.teacher is not None:
                from delft.evaluation.teacher_forced import summarize_teacher

                r.teacher_metrics = summarize_teacher(r.teacher)
            results.append(r)
    return results
