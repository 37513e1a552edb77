"""data.synthetic.style: the compact form ('12+305=' and the answer right after it) beside the question form, with
the separator it implies, eval sets drawn without the training problems, and old recipes unchanged."""

from delft.data.generated import synthetic_examples
from delft.data.prompts import render_prompt
from delft.data.sources import normalised_prompt
from delft.evaluation.contamination import generated_exclusion, with_commuted
from delft.recipe.schema import Recipe

SETTINGS = {"n": 400, "ops": ["+", "*"], "max_digits": 2, "decimal_fraction": 0, "negative_fraction": 0.5}


def recipe(**data) -> Recipe:
    return Recipe.model_validate({"data": {"template": "plain", **data}})


def test_compact_problems_are_the_question_problems_written_short():
    question = recipe(synthetic=SETTINGS).data
    compact = recipe(synthetic={**SETTINGS, "style": "compact"}).data
    for q, c in zip(synthetic_examples(question.synthetic), synthetic_examples(compact.synthetic)):
        assert q.answer == c.answer  # the same draws, only written differently
        a, op, b = q.prompt.removeprefix("What is ").removesuffix("?").split(" ")
        assert c.prompt == f"{a}{op}{b}="
        assert eval(f"{a}{op}({b})") == int(c.answer)  # noqa: S307 (our own generated integers)


def test_the_answer_follows_the_equals_sign_and_a_question_keeps_its_newline():
    compact = recipe(synthetic={**SETTINGS, "style": "compact"}).data
    ex = synthetic_examples(compact.synthetic, count=1)[0]
    assert render_prompt(ex, None, compact) + ex.completion == f"{ex.prompt}{ex.answer}"
    assert recipe(synthetic={**SETTINGS, "style": "compact"}, separator=" ").data.prompt_separator() == " "
    question = recipe(synthetic=SETTINGS).data
    ex = synthetic_examples(question.synthetic, count=1)[0]
    assert render_prompt(ex, None, question) == ex.prompt + "\n"


def test_an_old_recipe_without_the_key_is_the_question_form():
    assert recipe(synthetic={"n": 5}).data.synthetic.style == "question"


def test_a_compact_eval_set_holds_no_training_problem():
    cfg = recipe(synthetic={"n": 2000, "ops": ["+"], "max_digits": 2, "decimal_fraction": 0,
                            "negative_fraction": 0, "style": "compact"})
    train = {normalised_prompt(e.prompt) for e in synthetic_examples(cfg.data.synthetic)}
    exclude = generated_exclusion(cfg.eval_data(), [cfg.data], [])
    assert exclude == with_commuted(train) and exclude > train  # its own training problems, and their b+a forms
    held_out = synthetic_examples(cfg.eval_data().synthetic, exclude=exclude, count=500)
    assert len(held_out) == 500 and not exclude & {normalised_prompt(e.prompt) for e in held_out}
    assert all(e.prompt.endswith("=") for e in held_out)
