"""What one model's answers become: a ModelResult (prompts, texts, scored answers, samples), built from answer texts
the same way whichever backend wrote them (transformers in delft.evaluation.model_scores, llama.cpp in
delft.evaluation.gguf_backend), and the prompts both render.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from delft.data.batches import prompt_ids
from delft.data.prompts import read_completion, render_prompt, use_chat_template
from delft.evaluation.fewshot import fewshot_prompt, question_text
from delft.evaluation.generation import Sampling, stop_strings
from delft.evaluation.problems import Problem, task_scorer
from delft.evaluation.sampling import majority_index
from delft.models.context import check_context, context_limit
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
    contamination: Optional[dict] = None  # its training problems in the set (delft.evaluation.contamination)


def eval_prompts(tokenizer, problems: Sequence[Problem], data_cfg, eval_cfg) -> tuple[bool, list[str], list[str]]:
    """(chat template used, stop strings, prompt texts): the data's own rendering, or with ``eval.fewshot`` the
    harness's plain GSM8K prompt (delft.evaluation.fewshot)."""
    if eval_cfg.fewshot is not None:
        prompts = [fewshot_prompt(question_text(p.example), eval_cfg.fewshot, data_cfg) for p in problems]
        return False, stop_strings(tokenizer, False), prompts
    chat = use_chat_template(tokenizer, data_cfg)
    return chat, stop_strings(tokenizer, chat), [render_prompt(p.example, tokenizer, data_cfg) for p in problems]


def check_prompts_fit(model, tokenizer, prompts: Sequence[str], problems: Sequence[Problem], eval_cfg,
                      name: str) -> None:
    """Refuse, before any generation, when a prompt and eval.max_new_tokens pass the model's context
    (delft.models.context, the check inspect runs): the longest such prompt is named, with what fits instead."""
    limit = context_limit(model)
    if limit is None:
        return
    budget = eval_cfg.max_new_tokens
    lengths = [len(prompt_ids(tokenizer, p)) for p in prompts]
    over = [i for i, n in enumerate(lengths) if n + budget > limit]
    if not over:
        return
    i = max(over, key=lambda j: lengths[j])
    question = " ".join(question_text(problems[i].example).split())
    shown = question if len(question) <= 40 else question[:40] + "..."
    label = f"the prompt of eval problem {problems[i].index + 1} ({shown!r})"
    if len(over) > 1:
        label = f"{len(over)} of {len(prompts)} prompts do not fit; the longest, {label},"
    check_context(model, lengths[i], budget, name, "eval prompts", prompt=label, budget="eval.max_new_tokens",
                  lower="pass --set eval.max_new_tokens={n} or fewer",
                  shorten=_fewer_shots(tokenizer, problems[i], eval_cfg.fewshot, limit - budget))


def _fewer_shots(tokenizer, problem: Problem, shots, fits: int):
    """With few-shot prompts: the most exemplars whose prompt fits in ``fits`` tokens, as the fix (None without)."""
    if not shots:
        return None
    question = question_text(problem.example)
    for k in range(shots - 1, -1, -1):
        if len(prompt_ids(tokenizer, fewshot_prompt(question, k))) <= fits:
            return f"Use fewer exemplars (--fewshot {k} fits), or shorten the problem"
    return "Drop --fewshot (even zero exemplars do not fit) and shorten the problem"


def sampling_of(eval_cfg):
    """The eval section's decoding: None (greedy) for one sample, else delft.evaluation.generation.Sampling."""
    if eval_cfg.samples == 1:
        return None
    return Sampling(eval_cfg.samples, eval_cfg.temperature, eval_cfg.top_p, eval_cfg.seed)


def score_text(text: str, problem: Problem, stops: Sequence[str], task_scorer=None, data_cfg=None) -> Scored:
    """One answer scored: delft's extraction against the gold number, the harness's two scores beside it, and a
    generated task's own score (delft.evaluation.problems.task_scorer) when given. With ``data_cfg`` the answer,
    cut at the stop strings, is first read back from its data.numbers form (delft.data.prompts.read_completion)."""
    text = cut_at_stop(text, stops)
    if data_cfg is not None:
        text = read_completion(text, data_cfg)
    s = score(extract_answer(text, stops), problem.gold, harness_scores(text, problem.gold_text))
    if task_scorer is not None:
        s.task_score = task_scorer(s.extraction.canonical, problem)
    return s


def scored_result(name: str, adapter: Optional[str], chat: bool, stops: list[str], prompts: list[str],
                  texts: Sequence[Sequence[str]], problems: Sequence[Problem], data_cfg) -> ModelResult:
    """A ModelResult from each problem's answer texts: one (greedy) or several (sampled; ``scored`` then holds
    each problem's majority-vote answer, the samples are kept in ``samples``)."""
    scorer = task_scorer(data_cfg)
    groups = [[score_text(t, p, stops, scorer, data_cfg) for t in ts] for ts, p in zip(texts, problems)]
    sampled = any(len(ts) > 1 for ts in texts)
    chosen = [majority_index(g) if sampled else 0 for g in groups]
    scored = [g[i] for g, i in zip(groups, chosen)]
    generated = [ts[i] for ts, i in zip(texts, chosen)]
    return ModelResult(name, adapter, "chat" if chat else "plain", stops, prompts, generated, scored,
                       samples=groups if sampled else None, sample_texts=[list(t) for t in texts] if sampled else None)
