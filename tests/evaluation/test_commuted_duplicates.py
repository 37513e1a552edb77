"""Held-out sets without commuted duplicates (issue 54 item 4): ``b + a`` of a trained ``a + b`` counted as a
near-duplicate, left out of a generated draw with the training problems, the draw free of repeats, and the set's
mix of operations and digit counts stated against its generator's."""

from __future__ import annotations

from types import SimpleNamespace

from delft.data.generated import synthetic_examples
from delft.data.sources import normalised_prompt
from delft.evaluation.contamination import commuted, mix_line, problem_mix, seen_record, with_commuted
from delft.recipe.schema import SyntheticConfig

SMALL = {"min_digits": 1, "max_digits": 1, "ops": ["+", "*"], "decimal_fraction": 0.0, "negative_fraction": 0.0}


def _problems(prompts: list[str]) -> list:
    return [SimpleNamespace(index=i, example=SimpleNamespace(prompt=p)) for i, p in enumerate(prompts)]


def test_commuted_forms_of_sums_and_products_only():
    assert commuted("What is 12 + 305?") == "What is 305 + 12?"
    assert commuted("What is -1.5 * 7?") == "What is 7 * -1.5?"
    assert commuted("12+305=") == "305+12="  # the compact style too
    assert commuted("What is 12 - 305?") is None and commuted("What is 8 / 2?") is None  # order matters there
    assert commuted("What is 4 + 4?") is None and commuted("Repeat 12") is None


def test_a_commuted_duplicate_is_counted_as_a_near_duplicate():
    train = frozenset(normalised_prompt(e.prompt) for e in synthetic_examples(SyntheticConfig(n=40, seed=0, **SMALL)))
    a_plus_b = next(p for p in sorted(train) if commuted(p) and commuted(p) not in train)
    record = seen_record(_problems([a_plus_b, commuted(a_plus_b), "What is 123 + 456?"]), train)
    assert record["seen_in_training"] == 1 and record["seen_problems"] == [0]
    assert record["near_duplicates"] == 1 and record["near_duplicate_problems"] == [1]


def test_a_held_out_draw_leaves_out_training_problems_their_commuted_forms_and_its_own_repeats():
    train = frozenset(normalised_prompt(e.prompt) for e in synthetic_examples(SyntheticConfig(n=40, seed=0, **SMALL)))
    # 1-digit sums and products: 200 prompts, so an undeduplicated draw of 60 repeats some and meets the training set
    plain = [normalised_prompt(e.prompt) for e in synthetic_examples(SyntheticConfig(n=60, seed=7, **SMALL))]
    assert len(set(plain)) < len(plain) and any(commuted(p) in train for p in plain)
    held = [normalised_prompt(e.prompt) for e in
            synthetic_examples(SyntheticConfig(n=60, seed=7, **SMALL), with_commuted(train))]
    assert len(held) == 60 and len(set(held)) == 60
    assert not any(p in train or commuted(p) in train for p in held)
    record = seen_record(_problems(held), train)
    assert record["seen_in_training"] == 0 and record["near_duplicates"] == 0


def test_the_mix_is_stated_against_the_generators():
    mix = problem_mix(["What is 1 + 2?", "What is 10 * 3?", "What is -120 + 4.5?", "Repeat 3"])
    assert mix == {"n": 4, "ops": {"*": 1, "+": 2, "other": 1}, "digits": {"1": 1, "2": 1, "3": 1}}
    line = mix_line("held_out", {"eval": mix, "generator": problem_mix(["What is 1 + 2?"] * 4)})
    assert line.startswith("held_out: operations * 25 %, + 50 %, other 25 % (the generator's: + 100 %)")
