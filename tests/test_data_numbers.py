"""data.numbers: numbers written reversed or with digit-count prefixes in training (the completion, with scope
everything the prompt too), and read back before scoring in eval and held-out accuracy. Real files, the tiny
character-level model, real run directories and the real scorer."""

import json
import shutil
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from helpers import recipe_file
from rich.console import Console

from delft.data.batches import tokenize_example
from delft.data.pipeline import load_examples
from delft.data.prompts import read_completion, render_pair, render_prompt, written_completion
from delft.data.sources import Example
from delft.errors import UserError
from delft.evaluation.command import run_eval
from delft.evaluation.generation import greedy
from delft.evaluation.metrics import METRICS, summarize
from delft.evaluation.problems import Problem
from delft.evaluation.results import scored_result
from delft.numbers.answers import cut_at_stop, extract_answer, score
from delft.numbers.formats import read_numbers
from delft.numbers.rewards import answer_column_of
from delft.numbers.tokens import IGNORE
from delft.recipe.files import as_trained, load_recipe, trained_numbers
from delft.recipe.schema import DataConfig, NumbersConfig
from delft.rundir import RECIPE
from delft.training.grpo import reward_setup
from delft.training.heldout import HeldOut, heldout_data
from delft.training.preview import preview_examples

ROWS = [("1234+5678=", "6912"), ("What is 12.5 + 1,000?", "The sum is 1,012.5\n#### 1,012.5")]


def rows_file(tmp_path: Path, rows=ROWS, name="sums.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in rows))
    return path


def plain(source, **numbers) -> DataConfig:
    return DataConfig(source=str(source), format="prompt_completion", template="plain", numbers=numbers)


def test_the_key_defaults_to_natural_and_refuses_unknown_forms(tmp_path, tiny_model_dir):
    assert NumbersConfig() == NumbersConfig(order="natural", count_prefix=False, scope="completion")
    assert not NumbersConfig().active() and NumbersConfig(count_prefix=True).active()
    path = recipe_file(tmp_path, tiny_model_dir, data={"numbers": {"order": "reversed", "scope": "everything"}})
    assert load_recipe(path).data.numbers == NumbersConfig(order="reversed", scope="everything")
    with pytest.raises(UserError) as bad:
        load_recipe(path, ["data.numbers.order=backwards"])
    assert "data.numbers.order" in str(bad.value)
    with pytest.raises(UserError) as typo:
        load_recipe(path, ["data.numbers.scop=answer"])
    assert "scope" in str(typo.value)
    assert load_recipe(path, ["train.stage=grpo"]).data.numbers.order == "reversed"  # GRPO reads answers back


def test_grpo_rewards_read_a_reversed_or_prefixed_answer_back(tmp_path, tiny_model_dir):
    """The rewards score the number the model means: '713' from a reversed run is 317; the gold stays natural."""
    path = recipe_file(tmp_path, tiny_model_dir, data={"numbers": {"order": "reversed", "scope": "answer"}},
                       train={"stage": "grpo"}, grpo={"reward": "partial"})
    funcs, _, _ = reward_setup(load_recipe(path))
    assert [f.__name__ for f in funcs] == ["exact", "digits"]  # the names TRL logs
    assert [answer_column_of(f) for f in funcs] == ["answer", "answer"]  # DigitGRPOTrainer still checks the column
    assert funcs[0](["713", "317", "the sum is 713\n\nQuestion: 5"], answer=["317"] * 3) == [1.0, 0.0, 1.0]
    assert funcs[1](["713"], answer=["317"]) == [1.0] and funcs[1](["703"], answer=["317"])[0] < 1.0
    natural, _, _ = reward_setup(load_recipe(path, ["data.numbers.order=natural"]))
    assert natural[0](["713", "317"], answer=["317"] * 2) == [0.0, 1.0]
    prefixed, _, _ = reward_setup(load_recipe(path, ["data.numbers.order=natural", "data.numbers.count_prefix=true"]))
    assert prefixed[0](["{3:317}", "317"], answer=["317"] * 2) == [1.0, 1.0]


def test_a_reversed_recipes_first_example_trains_on_the_reversed_text(tmp_path, tiny_model_dir, tiny_tokenizer):
    """The tokens equal the tokenisation of the hand-written reversed completion; the prompt is as written."""
    path = recipe_file(tmp_path, tiny_model_dir, data={"source": str(rows_file(tmp_path)),
                                                       "format": "prompt_completion", "template": "plain",
                                                       "numbers": {"order": "reversed"}})
    c = load_recipe(path).data
    tok = tokenize_example(load_examples(c)[0], tiny_tokenizer, c)
    prompt = tiny_tokenizer.encode("1234+5678=", add_special_tokens=False)
    assert tok.input_ids == tiny_tokenizer.encode("1234+5678=2196", add_special_tokens=False) + \
        [tiny_tokenizer.eos_token_id]
    assert tok.labels == [IGNORE] * len(prompt) + tok.input_ids[len(prompt):]
    shown = preview_examples(load_recipe(path, ["data.val_size=0"]), 2)  # what recipe check --show-examples prints
    texts = {"".join(v.text for v in tokens) for tokens in shown}
    assert "1234+5678=2196</s>" in texts
    assert any(t.startswith("What is 12.5 + 1,000?The sum is 5.210,1\n") for t in texts)


@pytest.mark.parametrize("numbers,prompt,completion", [
    ({"order": "reversed", "scope": "answer"}, "What is 12.5 + 1,000?", "The sum is 1,012.5\n#### 5.210,1"),
    ({"order": "reversed", "scope": "everything"}, "What is 5.21 + 000,1?", "The sum is 5.210,1\n#### 5.210,1"),
    ({"count_prefix": True}, "What is 12.5 + 1,000?", "The sum is {4.1:1,012.5}\n#### {4.1:1,012.5}"),
    ({"order": "reversed", "count_prefix": True, "scope": "answer"}, "What is 12.5 + 1,000?",
     "The sum is 1,012.5\n#### {4.1:5.210,1}"),
])
def test_each_scope_rewrites_its_numbers(tmp_path, tiny_tokenizer, numbers, prompt, completion):
    c = plain(rows_file(tmp_path), **numbers)
    example = load_examples(c)[1]
    assert render_pair(example, tiny_tokenizer, c) == (prompt, completion + tiny_tokenizer.eos_token)
    assert render_prompt(example, tiny_tokenizer, c) == prompt
    assert read_completion(written_completion(example.completion, c), c) == example.completion


def chat_example(tiny_tokenizer):
    """With a chat template the messages' numbers are written before the template renders them."""
    c = DataConfig(source="x.jsonl", format="prompt_completion", template="chat",
                   numbers={"order": "reversed", "scope": "everything"})
    prompt, completion = render_pair(Example([{"role": "user", "content": "12+30="}], "42"), tiny_tokenizer, c)
    return prompt, completion


def test_a_chat_templates_messages_are_written_too(tiny_tokenizer):
    prompt, completion = chat_example(tiny_tokenizer)
    assert "21+03=" in prompt and "12+30" not in prompt
    assert completion.startswith("24") and "42" not in completion


# ----------------------------------------------------------------------------- eval reads answers back


GENERATED = ["6912", "The sum is 1,012.5\n#### 1,012.5", "#### -3.25 and then 17", "no number", "7,1\n\nQuestion: 99",
             "answer: 1,000,000.5", "12.5%"]
GOLDS = ["6912", "1012.5", "-3.25", "4", "17", "1000000.5", "12.5"]


@pytest.mark.parametrize("numbers", [{"order": "reversed"}, {"order": "reversed", "scope": "answer"},
                                     {"count_prefix": True}, {"order": "reversed", "count_prefix": True},
                                     {"order": "reversed", "count_prefix": True, "scope": "everything"}])
def test_a_written_runs_eval_equals_the_natural_scoring_of_the_same_answers(numbers):
    """Texts written in a run's form and scored through its path score exactly as the natural texts do."""
    natural = DataConfig(source="x.jsonl", format="prompt_completion")
    written = DataConfig(source="x.jsonl", format="prompt_completion", numbers=numbers)
    problems = [Problem(Example(f"q{i}", g, g), Decimal(g), i, g) for i, g in enumerate(GOLDS)]
    stops = ["\n\n", "Question:"]
    # the model writes its completion in the run's form and may run on past a stop string, which is not read
    cuts = [cut_at_stop(t, stops) for t in GENERATED]
    texts = [[written_completion(c, written) + t[len(c):]] for c, t in zip(cuts, GENERATED)]
    assert [t[0] for t in texts] != GENERATED
    ours = scored_result("written", None, False, stops, [], texts, problems, written)
    theirs = scored_result("natural", None, False, stops, [], [[t] for t in GENERATED], problems, natural)
    assert [(s.extraction, s.exact, s.tolerance, s.places, s.strict, s.flexible) for s in ours.scored] == \
        [(s.extraction, s.exact, s.tolerance, s.places, s.strict, s.flexible) for s in theirs.scored]
    assert sum(s.exact for s in theirs.scored) >= 4  # the comparison covers right answers as well as wrong ones
    unread = scored_result("unread", None, False, stops, [], texts, problems, natural)
    assert [s.exact for s in unread.scored] != [s.exact for s in theirs.scored]  # reading back matters


def make_run(tiny_lora_run: Path, tmp_path: Path, name: str, numbers) -> Path:
    """A finished run directory (the tiny adapter) whose recipe.yaml trained with ``numbers`` (None: a recipe.yaml
    written before data.numbers existed)."""
    run = Path(shutil.copytree(tiny_lora_run, tmp_path / name))
    saved = yaml.safe_load((run / RECIPE).read_text())
    saved["data"].pop("numbers", None)
    if numbers is not None:
        saved["data"]["numbers"] = numbers
    saved["data"].update(source=str(rows_file(tmp_path, [("1+1=", "2")], name="train.jsonl")),
                         format="prompt_completion", template="plain")
    (run / RECIPE).write_text(yaml.safe_dump(saved, sort_keys=False))
    return run


def test_eval_prompts_and_reads_each_run_in_its_own_form(tiny_lora_run, tiny_model_dir, tmp_path):
    reversed_run = make_run(tiny_lora_run, tmp_path, "reversed", {"order": "reversed", "scope": "everything"})
    old_run = make_run(tiny_lora_run, tmp_path, "old", None)
    assert trained_numbers(reversed_run) == NumbersConfig(order="reversed", scope="everything")
    assert trained_numbers(old_run) == NumbersConfig() == trained_numbers(None)
    assert trained_numbers(tmp_path) is None  # no recipe.yaml: the eval data's own form
    prefixed = plain("x.jsonl", count_prefix=True)
    assert as_trained(prefixed, tmp_path) is prefixed and as_trained(prefixed, None).numbers == NumbersConfig()
    console = Console(record=True, width=200)
    settings = ["data.template=plain", "eval.max_new_tokens=3", "eval.bootstrap=10"]
    source = rows_file(tmp_path, [("6890+4=", "6894"), ("12+30=", "42")], name="eval.jsonl")
    base, rev, old = run_eval(None, [str(reversed_run), str(old_run)], str(tiny_model_dir), str(source),
                              "prompt_completion", None, True, None, None, settings, console)
    assert base.prompts == old.prompts == ["6890+4=", "12+30="]
    assert rev.prompts == ["0986+4=", "21+03="]
    assert "reversed writes numbers in order reversed" in console.export_text().replace("\n", " ")
    read = as_trained(plain(source), reversed_run)
    for text, scored in zip(rev.generated, rev.scored):  # whatever the tiny model wrote, it was read back
        assert scored.extraction.text is None or scored.extraction.text in read_completion(text, read)


def test_heldout_accuracy_prompts_and_reads_as_the_run_trains(tmp_path, tiny_model_dir, tiny_tokenizer):
    """The held-out slice is prompted in the recipe's form and its greedy answers are read back before scoring."""
    from transformers import AutoModelForCausalLM

    eval_rows = rows_file(tmp_path, [("6890+4=", "6894"), ("12+30=", "42")], name="eval.jsonl")
    path = recipe_file(tmp_path, tiny_model_dir, data={"numbers": {"order": "reversed", "scope": "everything"}},
                       eval={"data": {"source": str(eval_rows), "format": "prompt_completion", "template": "plain"},
                             "max_new_tokens": 4})
    recipe = load_recipe(path)
    assert heldout_data(recipe, 2).numbers == recipe.data.numbers != recipe.eval.data.numbers
    held = HeldOut.from_recipe(recipe, tiny_tokenizer, Console(record=True))
    assert held.prompts == ["0986+4=", "21+03="]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    row = held.measure(model)
    texts = [g.text for g in greedy(model, tiny_tokenizer, held.prompts, 4, False, 2)]
    natural = [score(extract_answer(read_numbers(cut_at_stop(t, held.stops), "reversed"), held.stops), p.gold)
               for t, p in zip(texts, held.problems)]
    m = summarize(natural, resamples=0)
    assert row == {**{x.heldout: m[x.key] for x in METRICS if x.heldout}, "accuracy_n": 2}


def test_fewshot_exemplars_are_written_in_the_runs_form():
    """An exemplar must not show a form the run was not taught: its answer (and with scope everything its
    question) written as the run trained; natural runs keep the harness's prompt exactly."""
    from delft.evaluation.fewshot import EXEMPLARS, fewshot_prompt

    natural = DataConfig(source="x.jsonl", format="prompt_completion")
    assert fewshot_prompt("What is 12 + 5?", 1, natural) == fewshot_prompt("What is 12 + 5?", 1)
    answer_only = natural.model_copy(update={"numbers": NumbersConfig(order="reversed", scope="answer")})
    prompt = fewshot_prompt("What is 12 + 5?", 1, answer_only)
    assert EXEMPLARS[0][1].endswith("#### 72") and prompt.split("\n\n")[0].endswith("#### 27")
    assert "48/2 = <<48/2=24>>24" in prompt and prompt.endswith("Question: What is 12 + 5?\nAnswer:")
    everything = natural.model_copy(update={"numbers": NumbersConfig(order="reversed", scope="everything")})
    prompt = fewshot_prompt("What is 12 + 5?", 1, everything)
    assert "sold clips to 84 of her friends" in prompt and "42 clips in May" in prompt
    assert prompt.endswith("Question: What is 21 + 5?\nAnswer:")


def test_the_ollama_modelfile_says_how_to_read_a_reversed_models_answers(tmp_path, tiny_model_dir, tiny_tokenizer):
    from delft.export.gguf import ollama_modelfile

    path = recipe_file(tmp_path, tiny_model_dir, data={"numbers": {"order": "reversed", "scope": "answer"}})
    text = ollama_modelfile(tiny_tokenizer, "m.gguf", recipe=load_recipe(path))[0]
    comment = [line for line in text.splitlines() if line.startswith("#")]
    assert comment[0].startswith("# This model writes numbers as reversed digits (data.numbers scope answer)")
    code = comment[1].removeprefix("# its answers back with: ")
    namespace = {"answer": "12 + 5 = 71"}
    imports, expression = code.split("; ")
    exec(imports, namespace)  # noqa: S102 (the Modelfile's own instruction, run as a user would)
    assert eval(expression, namespace) == "12 + 5 = 17"  # noqa: S307
    natural = recipe_file(tmp_path / "n", tiny_model_dir)
    assert "#" not in ollama_modelfile(tiny_tokenizer, "m.gguf", recipe=load_recipe(natural))[0]
