"""Examples made by a generator instead of read from a file: delft's synthetic arithmetic and reasoning-gym's
procedural tasks (an optional library, imported when a recipe asks for it)."""

from __future__ import annotations

import dataclasses
import difflib
import random
from collections.abc import Collection
from decimal import Decimal
from typing import Optional

from delft.data.number_tasks import draw
from delft.data.sources import Example, format_number, normalised_prompt
from delft.errors import UserError
from delft.numbers.digits import exact_context


def _operand(rng: random.Random, cfg, decimals: int, second: bool = False) -> Decimal:
    low_digits, high_digits = (cfg.min_digits, cfg.max_digits)
    if second and cfg.second_digits is not None:
        low_digits, high_digits = cfg.second_digits
    digits = rng.randint(low_digits, high_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    value = Decimal(rng.randint(low, 10**digits - 1))
    if decimals:
        value += Decimal(rng.randint(1, 10**decimals - 1)) / Decimal(10**decimals)
    if rng.random() < cfg.negative_fraction:
        value = -value
    return value


# How far a generator draws past the problems it skips: it gives up after this many draws per problem asked for
# (plus the spare), when the skipped prompts hold nearly every problem its settings can make.
DRAWS_PER_PROBLEM, SPARE_DRAWS = 20, 1000


def draws_allowed(wanted: int, exclude: Collection[str]) -> int:
    """Draws a generator may make for ``wanted`` problems: exactly that many when nothing is skipped (so a
    training set is what it always was), more when ``exclude`` may skip some."""
    return wanted * DRAWS_PER_PROBLEM + SPARE_DRAWS if exclude else wanted


def too_few(got: int, wanted: int, draws: int, where: str) -> UserError:
    return UserError(f"the generator gave only {got} of the {wanted} problems asked for in {draws} draws: the "
                     "training set holds nearly every other problem these settings can make", where,
                     "Ask for fewer eval problems (limit), or widen the generator (more digits, more operations) "
                     "so that problems the model has not trained on exist.")


def synthetic_examples(cfg, exclude: Collection[str] = frozenset(), count: Optional[int] = None,
                       where: str = "data") -> list[Example]:
    """Seeded arithmetic problems with exact answers (division is generated from its quotient; "copy" asks to
    repeat one operand). Arithmetic runs in an exact context: operands may have up to 30 digits.

    ``count`` (at most ``cfg.n``, default all) problems, none whose normalised prompt is in ``exclude``: the
    generator draws on past a skipped problem, so an eval set keeps its size and stays the same for the same
    arguments (its first N are the set of N). A draw with ``exclude`` (a held-out set) also skips a problem it
    already holds: a repeat would count one problem twice; a training draw is left as it always was."""
    rng = random.Random(cfg.seed)
    wanted = cfg.n if count is None else min(count, cfg.n)
    draws = draws_allowed(wanted, exclude)
    out: list[Example] = []
    taken: set[str] = set()
    with exact_context():
        for _ in range(draws):
            if len(out) == wanted:
                break
            question, answer = _synthetic_problem(rng, cfg)
            key = normalised_prompt(question) if exclude else ""
            if exclude and (key in exclude or key in taken):
                continue
            taken.add(key)
            out.append(Example(question, answer, answer, len(out)))
    if len(out) < wanted:
        raise too_few(len(out), wanted, draws, f"{where}.synthetic")
    return out


def _synthetic_problem(rng: random.Random, cfg) -> tuple[str, str]:
    """(question, answer) of one problem, drawn from ``rng``."""
    op = rng.choice(cfg.ops)
    decimals = rng.choice([1, 2]) if rng.random() < cfg.decimal_fraction else 0
    if op == "copy":
        a = _operand(rng, cfg, decimals)
        return f"Repeat {format_number(a)}", format_number(a)
    a, b = _operand(rng, cfg, decimals), _operand(rng, cfg, decimals if op in "+-" else 0, second=True)
    if op == "/":
        b = b if b != 0 else Decimal(rng.randint(1, 9))
        q = _operand(rng, cfg, decimals)
        a = b * q
    result = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if op == "/" else None}[op]
    if cfg.style == "compact":
        return f"{format_number(a)}{op}{format_number(b)}=", format_number(result)
    return f"What is {format_number(a)} {op} {format_number(b)}?", format_number(result)


def nupa_examples(cfg, exclude: Collection[str] = frozenset(), count: Optional[int] = None,
                  where: str = "data") -> list[Example]:
    """The digit-level benchmark's problems (delft.data.number_tasks) for a NupaConfig: ``per_bin`` per task and
    length bin, none whose normalised prompt is in ``exclude`` (its prompts are already normalised: single
    spaces, no ends), the first ``count``. Each example's ``item`` is its (task, length) bin."""
    try:
        problems = draw(cfg.per_bin, cfg.seed, cfg.tasks, range(cfg.min_length, cfg.max_length + 1), exclude)
    except UserError as e:
        raise UserError(e.what, f"{where}.nupa", e.fix) from None
    return [Example(p.prompt, p.answer, p.answer, i, {"task": p.task, "length": p.length})
            for i, p in enumerate(problems[:count])]


RG_INSTALL = 'pip install "delft-digits[reasoning]" (reasoning-gym, whose generators need no download)'


def reasoning_gym_dataset(cfg, where: str = "data", size: Optional[int] = None):
    """reasoning-gym's generated dataset for ``cfg`` (a ReasoningGymConfig), ``size`` items (default ``cfg.n``;
    its items are made one at a time as they are read); a missing package, an unknown task or option is a
    UserError naming it."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise UserError("data.source reasoning_gym needs the reasoning-gym package, which is not installed",
                        f"{where}.source", f"Install it: {RG_INSTALL}.") from None
    if cfg.task not in DATASETS:
        close = difflib.get_close_matches(cfg.task, list(DATASETS), n=3)
        hint = f"Did you mean {', '.join(close)}? " if close else ""
        raise UserError(f"reasoning-gym has no task {cfg.task!r}", f"{where}.reasoning_gym.task",
                        f"{hint}Its {len(DATASETS)} tasks: python -c 'import reasoning_gym.factory as f; "
                        "print(sorted(f.DATASETS))'.")
    fields = {f.name for f in dataclasses.fields(DATASETS[cfg.task][1])} - {"seed", "size"}
    unknown = sorted(set(cfg.options) - fields)
    if unknown:
        raise UserError(f"reasoning-gym task {cfg.task} has no option(s) {', '.join(unknown)}",
                        f"{where}.reasoning_gym.options", f"Its options: {', '.join(sorted(fields))}.")
    try:
        return reasoning_gym.create_dataset(cfg.task, size=size or cfg.n, seed=cfg.seed, **cfg.options)
    except (AssertionError, ValueError, TypeError) as e:  # its configs validate with assert
        raise UserError(f"reasoning-gym refused the options of {cfg.task}: {e or type(e).__name__}",
                        f"{where}.reasoning_gym.options", "Check the values against the task's config.") from None


def reasoning_gym_examples(cfg, where: str = "data", exclude: Collection[str] = frozenset(),
                           count: Optional[int] = None) -> list[Example]:
    """The generated problems as examples: the question as prompt, the answer (or the worked solution, with
    ``completion: cot`` where the task has one) as completion, the entry kept for the task's own scorer.
    ``count`` and ``exclude`` as in synthetic_examples: skipped questions are replaced by the items after them."""
    wanted = cfg.n if count is None else min(count, cfg.n)
    draws = draws_allowed(wanted, exclude)
    out: list[Example] = []
    for entry in reasoning_gym_dataset(cfg, where, draws if exclude else None):
        if len(out) == wanted:
            break
        if exclude and normalised_prompt(str(entry["question"])) in exclude:
            continue
        answer = str(entry["answer"])
        cot = (entry.get("metadata") or {}).get("answer_cot")
        if cfg.completion == "cot" and not cot:
            raise UserError(f"reasoning-gym task {cfg.task} has no worked solutions (metadata answer_cot)",
                            f"{where}.reasoning_gym.completion", "Use completion: answer (gsm_symbolic has them).")
        out.append(Example(str(entry["question"]), str(cot) if cfg.completion == "cot" else answer, answer,
                           len(out), entry))
    if len(out) < wanted:
        raise too_few(len(out), wanted, draws, f"{where}.reasoning_gym")
    return out
