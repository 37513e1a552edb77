"""NumberForm (delft.numbers.formats): the one owner of data.numbers' scope rule, which the training data, eval,
held-out accuracy, GRPO's rewards, inspect and export all read through."""

import pytest

from delft.numbers.formats import NumberForm, read_numbers, write_last_number, write_numbers
from delft.recipe.schema import NumbersConfig

COMPLETION = "12 + 345 = 357"
QUESTION = "What is 12 + 345?"


def test_natural_changes_nothing_whatever_the_scope():
    for scope in ("answer", "completion", "everything"):
        form = NumberForm(scope=scope)
        assert not form.active and not form.writes_prompts
        assert form.write_completion(COMPLETION) == COMPLETION == form.read_completion(COMPLETION)
        assert form.write_question(QUESTION) == QUESTION


@pytest.mark.parametrize("order,prefix", [("reversed", False), ("natural", True), ("reversed", True)])
def test_the_scope_decides_which_numbers_are_written(order, prefix):
    answer, completion, everything = (NumberForm(order, prefix, s) for s in ("answer", "completion", "everything"))
    assert answer.write_completion(COMPLETION) == write_last_number(COMPLETION, order, prefix)
    assert answer.write_completion(COMPLETION).startswith("12 + 345 = ")  # only the final answer changed
    assert completion.write_completion(COMPLETION) == write_numbers(COMPLETION, order, prefix)
    assert everything.write_completion(COMPLETION) == completion.write_completion(COMPLETION)
    assert answer.write_question(QUESTION) == QUESTION == completion.write_question(QUESTION)
    assert everything.write_question(QUESTION) == write_numbers(QUESTION, order, prefix) != QUESTION
    assert everything.writes_prompts and not completion.writes_prompts and not answer.writes_prompts
    for form in (answer, completion, everything):  # what is written reads back exactly
        assert form.read_completion(form.write_completion(COMPLETION)) == COMPLETION


def test_other_scripts_digits_are_read_as_ascii_first():
    form = NumberForm("reversed", False, "completion")
    assert form.read_completion("= ٧٥٣") == read_numbers("= 753", "reversed") == "= 357"


def test_the_recipe_section_and_the_form_agree():
    for values in ({}, {"order": "reversed"}, {"count_prefix": True, "scope": "answer"}):
        section = NumbersConfig(**values)
        form = NumberForm.of(section)
        assert (form.order, form.count_prefix, form.scope) == (section.order, section.count_prefix, section.scope)
        assert section.active() == form.active
    assert NumberForm("reversed", True).describe() == "reversed digits with count prefixes"
    assert NumberForm().describe() == "natural digits"
