"""The eval set: problems (prompt, gold number) from a recipe's data section, and the settings block every
report records. A generated set is drawn without the training problems (``exclude``: their normalised prompts,
delft.evaluation.contamination); a file or hub set is read as given, and the commands count its training problems.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from rich.console import Console

from delft.data.pipeline import load_examples
from delft.errors import UserError
from delft.numbers.answers import parse_number
from delft.recipe.schema import EVAL_SEED_OFFSET

BOOTSTRAP_SEED = 0


@dataclass
class Problem:
    """One eval problem: the source example and its numeric gold answer."""

    example: Any  # delft.data.Example
    gold: Decimal
    index: int
    gold_text: str = ""  # the gold as written (a GSM8K answer whole): what lm-evaluation-harness compares against


def disjoint_from_training(data_cfg, train_data):
    """``data_cfg``, its generator's seed moved by EVAL_SEED_OFFSET where it equals the training seed, so the eval
    draw does not start with the training problems. A seed alone does not keep them out (two seeds' draws share
    every problem a small space repeats): the problems are excluded by content when the set is drawn."""
    if (data_cfg.source == "synthetic" and train_data.source == "synthetic"
            and data_cfg.synthetic.seed == train_data.synthetic.seed):
        data_cfg.synthetic = data_cfg.synthetic.model_copy(update={"seed": data_cfg.synthetic.seed + EVAL_SEED_OFFSET})
    if (data_cfg.source == "reasoning_gym" and train_data.source == "reasoning_gym"
            and data_cfg.reasoning_gym.seed == train_data.reasoning_gym.seed):
        data_cfg.reasoning_gym = data_cfg.reasoning_gym.model_copy(
            update={"seed": data_cfg.reasoning_gym.seed + EVAL_SEED_OFFSET})
    if data_cfg.source == "nupa" and train_data.source == "nupa" and data_cfg.nupa.seed == train_data.nupa.seed:
        data_cfg.nupa = data_cfg.nupa.model_copy(update={"seed": data_cfg.nupa.seed + EVAL_SEED_OFFSET})
    return data_cfg


def load_problems(data_cfg, console: Console, exclude: Collection[str] = frozenset()) -> tuple[list[Problem], int]:
    """The eval problems with numeric gold answers; (problems, number skipped for lack of an answer). A generated
    set skips the normalised prompts in ``exclude`` (the training problems) and draws others in their place."""
    examples = load_examples(data_cfg, "eval.data", exclude)
    problems, skipped = [], 0
    for i, ex in enumerate(examples):
        gold = parse_number(ex.answer) if ex.answer is not None else parse_number(ex.completion)
        if gold is None:
            skipped += 1
            continue
        problems.append(Problem(ex, gold, i, gold_text(ex)))
    if not problems:
        raise UserError(f"the eval set ({data_cfg.source}, format {data_cfg.format}) has no numeric answers: none "
                        f"of its {len(examples)} examples has an 'answer' field or a completion that is a number",
                        "eval.data", "Use a format with answers (gsm8k, svamp, synthetic), or add an 'answer' "
                        "column to a prompt_completion / chat file.")
    if skipped:
        console.print(f"[yellow]warning:[/] skipped {skipped} of {len(examples)} eval examples without a numeric "
                      "answer")
    return problems, skipped


def gold_text(example) -> str:
    """The reference lm-evaluation-harness's exact_match sees: a GSM8K answer whole (its normalisation keeps what
    follows ``#### ``), else the answer as written."""
    if "#### " in example.completion:
        return example.completion
    return str(example.answer if example.answer is not None else example.completion)


def task_scorer(data_cfg):
    """reasoning-gym's own scorer for its problems, as ``f(number text or None, problem) -> float``; None for
    other sources. It is given delft's reading of the answer (the extracted number, canonical), so the two scores
    differ only where the task's rule does (a tolerance, partial credit)."""
    if data_cfg.format != "reasoning_gym":
        return None
    import reasoning_gym

    score_answer = reasoning_gym.get_score_answer_fn(data_cfg.reasoning_gym.task)
    return lambda text, problem: float(score_answer(answer=text, entry=problem.example.item))


def describe_source(data_cfg) -> str:
    if data_cfg.source == "synthetic":
        return f"synthetic (seed {data_cfg.synthetic.seed})"
    if data_cfg.source == "reasoning_gym":
        return f"reasoning-gym {data_cfg.reasoning_gym.task} (seed {data_cfg.reasoning_gym.seed})"
    if data_cfg.source == "nupa":
        n = data_cfg.nupa
        return f"number tasks, {len(n.tasks)} tasks x lengths {n.min_length}-{n.max_length} (seed {n.seed})"
    return data_cfg.source


def decoding(eval_cfg) -> dict | str:
    """'greedy', or the sampling settings."""
    if eval_cfg.samples == 1:
        return "greedy"
    return {"samples": eval_cfg.samples, "temperature": eval_cfg.temperature, "top_p": eval_cfg.top_p,
            "seed": eval_cfg.seed}


def shows_harness_scores(data_cfg, eval_cfg) -> bool:
    """lm-evaluation-harness's GSM8K scores go in the table for GSM8K data or its prompt (always in the JSON)."""
    return data_cfg.format == "gsm8k" or eval_cfg.fewshot is not None


def settings_block(data_cfg, recipe_cfg, n: int, skipped: int) -> dict:
    """How an eval set was answered and scored (the JSON's settings; compare adds its own keys)."""
    return {
        "data": data_cfg.model_dump(mode="json"),
        "n": n,
        "skipped_without_answer": skipped,
        "decoding": decoding(recipe_cfg.eval),
        "fewshot": recipe_cfg.eval.fewshot,
        "max_new_tokens": recipe_cfg.eval.max_new_tokens,
        "batch_size": recipe_cfg.eval.batch_size,
        "bootstrap": {"resamples": recipe_cfg.eval.bootstrap, "seed": BOOTSTRAP_SEED, "level": 0.95},
        "device": recipe_cfg.model.device,
        "dtype": recipe_cfg.model.dtype,
    }
