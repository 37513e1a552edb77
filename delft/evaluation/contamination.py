"""Contamination: the eval problems a model trained on, counted by normalised prompt
(delft.data.sources.normalised_prompt) for every model ``delft eval``, ``delft compare`` and ``delft study`` score.

A run's training problems are the data section of its ``recipe.yaml``, loaded as training loads it
(delft.data.pipeline.load_examples), validation split included (those problems shaped the run too); the base model
has none; a model without a recipe.yaml (a merged model, a GGUF file) is marked unknown, not clean. Each distinct
data section is read once per process and only its set of prompts is kept. A generated eval set is drawn without
the training problems and their commuted forms (``b + a`` and ``b * a`` of a training ``a + b``, ``a * b``: the same
problem to a model that has learned commutativity) (``generated_exclusion``); a file or hub set is scored whole and,
for a model that trained on some of it, on its unseen problems beside. Commuted duplicates are counted beside the
exact ones as near-duplicates. A set that is mostly (over half) one model's training data is refused unless the
command is given ``--allow-seen``. ``problem_mix`` counts a set's operations and digit counts, so a report can
state the eval set's mix against its generator's (leaving training problems out shifts it towards harder ones).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Optional

from delft.data.pipeline import load_examples
from delft.data.sources import normalised_prompt
from delft.errors import UserError
from delft.evaluation.metrics import EXACT_MATCH
from delft.outputs import pct
from delft.recipe.files import load_recipe, trained_recipe
from delft.recipe.schema import GENERATED
from delft.rundir import RECIPE

SEEN_LIMIT = 0.5  # a set with more than this share of one model's training problems is refused (--allow-seen)

ALLOW_SEEN = "--allow-seen"

_PROMPTS: dict[str, frozenset[str]] = {}  # a data section's identity -> its normalised prompts

# delft's synthetic prompts, natural ("What is -12 + 3.5?") and compact ("12+305="): the operands and the operator
_NUMBER = r"-?\d+(?:\.\d+)?"
_PROBLEM = (re.compile(rf"^(?P<pre>What is )(?P<a>{_NUMBER}) (?P<op>[-+*/]) (?P<b>{_NUMBER})(?P<post>\?)$"),
            re.compile(rf"^(?P<pre>)(?P<a>{_NUMBER})(?P<op>[-+*/])(?P<b>{_NUMBER})(?P<post>=)$"))
COMMUTATIVE = "+*"


def _parts(prompt: str) -> Optional[re.Match]:
    return next((m for m in (p.match(prompt) for p in _PROBLEM) if m), None)


def commuted(prompt: str) -> Optional[str]:
    """The normalised prompt of ``b + a`` (``b * a``) for a normalised ``a + b`` (``a * b``); None for any other
    prompt, or where the two operands are equal (the problem is its own commuted form)."""
    m = _parts(prompt)
    if m is None or m["op"] not in COMMUTATIVE or m["a"] == m["b"]:
        return None
    space = " " if m["pre"] else ""
    return f"{m['pre']}{m['b']}{space}{m['op']}{space}{m['a']}{m['post']}"


def with_commuted(prompts: Collection[str]) -> frozenset[str]:
    """``prompts`` and the commuted form of each that has one: what a held-out draw leaves out."""
    return frozenset(prompts) | frozenset(c for c in map(commuted, prompts) if c is not None)


def problem_mix(prompts: Sequence[str]) -> dict:
    """How many of ``prompts`` ask each operation and each digit count (the integer digits of the longer operand);
    prompts delft's generator does not write count as 'other'."""
    ops, digits = Counter(), Counter()
    for prompt in prompts:
        m = _parts(normalised_prompt(prompt))
        if m is None:
            ops["other"] += 1
            continue
        ops[m["op"]] += 1
        digits[str(max(len(x.lstrip("-").split(".")[0]) for x in (m["a"], m["b"])))] += 1
    return {"n": len(prompts), "ops": dict(sorted(ops.items())), "digits": dict(sorted(digits.items()))}


def mix_line(name: str, mix: dict) -> str:
    """One sentence: a set's mix of operations and digit counts against its generator's, in percent."""
    def shares(m: dict, key: str) -> str:
        return ", ".join(f"{k} {100 * v / max(1, m['n']):.0f} %" for k, v in m[key].items())

    eval_, gen = mix["eval"], mix["generator"]
    return (f"{name}: operations {shares(eval_, 'ops')} (the generator's: {shares(gen, 'ops')}); digits "
            f"{shares(eval_, 'digits')} (the generator's: {shares(gen, 'digits')})")


def training_prompts(data_cfg) -> frozenset[str]:
    """The normalised prompts of a training data section, read once per process."""
    key = _identity(data_cfg)
    if key not in _PROMPTS:
        _PROMPTS[key] = frozenset(normalised_prompt(e.prompt) for e in load_examples(data_cfg, "data"))
    return _PROMPTS[key]


def _identity(data_cfg) -> str:
    """What decides a data section's prompts (not its template, lengths or validation split), with a file's size
    and modification time, so a file rewritten in between is read again."""
    key = data_cfg.model_dump(mode="json", include={"source", "format", "split", "subset", "limit"})
    if data_cfg.format in GENERATED:
        key[data_cfg.format] = getattr(data_cfg, data_cfg.format).model_dump(mode="json")
    path = Path(data_cfg.source).expanduser()
    if path.is_file():
        stat = path.stat()
        key["file"] = [str(path.resolve()), stat.st_size, stat.st_mtime_ns]
    return json.dumps(key, sort_keys=True)


def model_training(model: Optional[str]) -> tuple[Optional[frozenset[str]], str]:
    """(the normalised prompts ``model`` trained on, why they are unknown when None): none for the base model
    (``model`` None), a run's from its recipe.yaml."""
    if model is None:
        return frozenset(), ""
    recipe = trained_recipe(Path(model))
    if recipe is None:
        return None, f"no {RECIPE} beside it says what it trained on"
    try:
        return training_prompts(load_recipe(recipe).data), ""
    except UserError as e:
        return None, f"the training data of its {recipe} cannot be read ({e.what})"


def generated_exclusion(data_cfg, train_data: Sequence, models: Sequence[str]) -> frozenset[str]:
    """What a generated eval set is drawn without: the prompts of every data section in ``train_data`` (the
    recipe's) and of every model's training; nothing for a file or hub set (its training problems are counted)."""
    if data_cfg.format not in GENERATED:
        return frozenset()
    prompts: set[str] = set()
    for data in train_data:
        prompts |= training_prompts(data)
    for model in models:
        prompts |= model_training(model)[0] or frozenset()
    return with_commuted(prompts)


def seen_record(problems: Sequence, prompts: Optional[frozenset[str]], why: str = "") -> dict:
    """How many of ``problems`` (and which, by index) are in ``prompts``, a model's training prompts (None:
    unknown, ``why``), and how many more are near-duplicates: the commuted form of a training problem."""
    if prompts is None:
        return {"seen_in_training": None, "n": len(problems), "unknown": why}
    keys = [(p.index, normalised_prompt(p.example.prompt)) for p in problems]
    seen = [i for i, key in keys if key in prompts]
    near = [i for i, key in keys if key not in prompts and commuted(key) in prompts]
    return {"seen_in_training": len(seen), "n": len(problems), "seen_problems": seen,
            "near_duplicates": len(near), "near_duplicate_problems": near}


def count_seen(problems: Sequence, model: Optional[str]) -> dict:
    """``seen_record`` of ``model`` (a run, snapshot, merged model or GGUF path; None for the base model)."""
    return seen_record(problems, *model_training(model))


def counted(problems: Sequence, models: dict[str, Optional[str]], what: str, where: str,
            allow_seen: bool) -> dict[str, dict]:
    """``count_seen`` of every model (name -> path; None: the base model), ``what`` refused when it is mostly one
    model's training data (``refuse_mostly_seen``)."""
    records = {name: count_seen(problems, model) for name, model in models.items()}
    refuse_mostly_seen(records, what, where, allow_seen)
    return records


def score_unseen(record: dict, problems: Sequence, scored: Sequence) -> dict:
    """``record`` with, when the model trained on some of ``problems``, exact match on the others and their n."""
    if not record["seen_in_training"]:
        return record
    seen = set(record["seen_problems"])
    unseen = [s.exact for p, s in zip(problems, scored) if p.index not in seen]
    return {**record, "unseen": {"n": len(unseen), EXACT_MATCH.key: sum(unseen) / len(unseen) if unseen else None}}


def refuse_mostly_seen(records: dict[str, dict], what: str, where: str, allow_seen: bool) -> None:
    """A UserError when ``what`` (an eval set) is more than SEEN_LIMIT one model's training problems, unless
    ``allow_seen``: its score would say how well the model remembers, not how well it solves."""
    counted = [(name, r) for name, r in records.items() if r["seen_in_training"]]
    if allow_seen or not counted:
        return
    name, worst = max(counted, key=lambda item: item[1]["seen_in_training"] / item[1]["n"])
    k, n = worst["seen_in_training"], worst["n"]
    if k <= SEEN_LIMIT * n:
        return
    raise UserError(f"{what} is mostly training data: {k} of its {n} problems ({pct(k / n)}) are in the training "
                    f"data of {name} (same prompt, whitespace aside), so its score would measure what the model "
                    "remembers", where, "Evaluate on problems the models did not train on (a held-out file or "
                    "split; a generated set leaves the training problems out itself), or pass "
                    f"{ALLOW_SEEN} to score it anyway: the unseen problems are then scored beside the whole set.")


def seen_lines(records: dict[str, dict]) -> list[str]:
    """What the terminal says about each model's training problems in one eval set."""
    if not records:
        return []
    n = next(iter(records.values()))["n"]
    clean = [name for name, r in records.items() if r["seen_in_training"] == 0]
    lines = []
    if len(clean) == len(records):
        lines.append(f"contamination: none of the {n} problems is in any model's training data (by normalised "
                     "prompt)")
    elif clean:
        lines.append(f"contamination: none of the {n} problems is in the training data of {', '.join(clean)}")
    for name, r in records.items():
        k, unseen = r["seen_in_training"], r.get("unseen")
        if k is None:
            lines.append(f"contamination: {name}: not counted, {r['unknown']}")
        elif k:
            tail = f"; {EXACT_MATCH.name} on the {unseen['n']} unseen: {pct(unseen[EXACT_MATCH.key])}" if unseen else ""
            lines.append(f"contamination: {k} of the {n} problems are in the training data of {name} (by "
                         f"normalised prompt){tail}")
        if r.get("near_duplicates"):
            lines.append(f"contamination: {r['near_duplicates']} of the {n} problems are near-duplicates of "
                         f"{name}'s training problems (b + a or b * a of a trained a + b, a * b)")
    return lines


def refuse_seen_before_training(data_cfg, train_data, what: str, where: str, allow_seen: bool) -> None:
    """``refuse_mostly_seen`` for a file or hub eval set against the data the runs are about to train on, before
    hours of training rather than after."""
    if data_cfg.format in GENERATED:
        return  # drawn without the training problems
    prompts = training_prompts(train_data)
    examples = load_examples(data_cfg, "eval.data")
    k = sum(normalised_prompt(e.prompt) in prompts for e in examples)
    refuse_mostly_seen({"the runs": {"seen_in_training": k, "n": len(examples)}}, what, where, allow_seen)
