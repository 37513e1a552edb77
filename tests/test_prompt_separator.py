"""data.separator: what joins a plain prompt and its completion. prompt_completion rows train as written (TRL's
join), the formats delft prompts keep their newline, a set separator is used as given, and a run trained before the
key existed (its recipe.yaml has no data.separator) is evaluated, inspected, exported and resumed with the newline
it trained on. Real files, the tiny character-level model and real run directories."""

import json
import shutil
from pathlib import Path
from typing import get_args

import pytest
import yaml
from helpers import recipe_file
from rich.console import Console

from delft.data.batches import tokenize_example
from delft.data.generated import synthetic_examples
from delft.data.pipeline import load_examples
from delft.data.prompts import render_pair, render_prompt
from delft.data.sources import Example
from delft.errors import UserError
from delft.evaluation.command import run_eval
from delft.export.gguf import ollama_modelfile
from delft.export.report import load_recipe_quietly
from delft.inspection.command import run_inspect
from delft.numbers.tokens import IGNORE
from delft.recipe.files import load_recipe, predates_separator
from delft.recipe.schema import FORMAT_SEPARATORS, DataConfig, SyntheticConfig
from delft.rundir import RECIPE, read_info
from delft.training import step as train_step
from delft.training.stages import run_training

PROMPT, COMPLETION = "6890+4=", "6894"


def rows_file(tmp_path: Path, rows=((PROMPT, COMPLETION), ("12+30=", "42")), name="sums.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in rows))
    return path


def plain(source, **kw) -> DataConfig:
    return DataConfig(source=str(source), format="prompt_completion", template="plain", **kw)


# ----------------------------------------------------------------------------- what joins prompt and completion


def test_a_prompt_completion_row_trains_as_written(tmp_path, tiny_tokenizer):
    """`6890+4=` + `6894` is the tokens of `6890+4=6894` and EOS, the loss from `6894` on: no newline between."""
    c = plain(rows_file(tmp_path))
    example = load_examples(c)[0]
    assert render_pair(example, tiny_tokenizer, c) == (PROMPT, COMPLETION + tiny_tokenizer.eos_token)
    tok = tokenize_example(example, tiny_tokenizer, c)
    whole = tiny_tokenizer.encode(PROMPT + COMPLETION, add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
    n_prompt = len(tiny_tokenizer.encode(PROMPT, add_special_tokens=False))
    assert tok.input_ids == whole
    assert tok.labels == [IGNORE] * n_prompt + whole[n_prompt:]
    assert tiny_tokenizer.decode(whole[n_prompt:]) == COMPLETION + tiny_tokenizer.eos_token


def test_the_formats_delft_prompts_keep_their_newline(tiny_tokenizer):
    """Every format has a default; the generated and question formats put the answer on a line of its own, and a
    prompt that already ends in a newline (alpaca's template) gets no second one."""
    assert set(FORMAT_SEPARATORS) == set(get_args(DataConfig.model_fields["format"].annotation))
    assert DataConfig().prompt_separator() == "\n" and plain("x.jsonl").prompt_separator() == ""
    c = DataConfig(template="plain")
    example = synthetic_examples(SyntheticConfig(n=1, seed=3))[0]
    prompt, completion = render_pair(example, tiny_tokenizer, c)
    assert prompt == example.prompt + "\n" and prompt.endswith("?\n")
    tok = tokenize_example(example, tiny_tokenizer, c)
    assert tok.input_ids == tiny_tokenizer.encode(example.prompt + "\n" + completion, add_special_tokens=False)
    alpaca = DataConfig(source="a.json", format="alpaca", template="plain")
    assert render_prompt(Example("### Response:\n", "5"), tiny_tokenizer, alpaca) == "### Response:\n"


def test_a_set_separator_is_used_as_given(tmp_path, tiny_tokenizer, tiny_model_dir):
    """data.separator from a recipe file and from --set: ' ' joins the row with a space, on every format."""
    source = rows_file(tmp_path)
    path = recipe_file(tmp_path, tiny_model_dir, data={"source": str(source), "format": "prompt_completion",
                                                       "template": "plain", "separator": " "})
    c = load_recipe(path).data
    assert c.separator == " "
    tok = tokenize_example(load_examples(c)[0], tiny_tokenizer, c)
    assert tiny_tokenizer.decode(tok.input_ids) == f"{PROMPT} {COMPLETION}</s>"
    newline = load_recipe(path, ['data.separator="\\n"']).data
    assert render_prompt(Example(PROMPT, ""), tiny_tokenizer, newline) == PROMPT + "\n"
    synthetic = load_recipe(None, ['data.separator=" => "', "data.template=plain"]).data
    assert render_prompt(Example("What is 1 + 2?", ""), tiny_tokenizer, synthetic) == "What is 1 + 2? => "


# ----------------------------------------------------------------------------- runs trained before the key


def make_run(tiny_lora_run: Path, tmp_path: Path, name: str, source: Path, old: bool) -> Path:
    """A finished run directory (the tiny adapter) whose recipe trained on ``source`` as prompt_completion; ``old``:
    its recipe.yaml as delft wrote it before data.separator existed (every other key, that one absent)."""
    run = Path(shutil.copytree(tiny_lora_run, tmp_path / name))
    saved = yaml.safe_load((run / RECIPE).read_text())
    saved["data"].update(source=str(source), format="prompt_completion", template="plain")
    assert "separator" in saved["data"]  # delft writes every key: its absence marks an old run
    if old:
        del saved["data"]["separator"]
    (run / RECIPE).write_text(yaml.safe_dump(saved, sort_keys=False))
    return run


@pytest.fixture
def runs(tiny_lora_run, tmp_path) -> tuple[Path, Path, Path]:
    trained = rows_file(tmp_path, [("1+1=", "2")], name="train.jsonl")  # not the eval set: nothing was seen
    return (make_run(tiny_lora_run, tmp_path, "old", trained, old=True),
            make_run(tiny_lora_run, tmp_path, "new", trained, old=False), rows_file(tmp_path))


def test_eval_and_inspect_prompt_an_old_run_as_it_trained(runs, tiny_model_dir, tmp_path):
    old, new, source = runs
    assert predates_separator(old) and not predates_separator(new) and not predates_separator(tmp_path)
    console = Console(record=True, width=200)
    settings = ["data.template=plain", "eval.max_new_tokens=3", "eval.bootstrap=10"]
    base, old_col, new_col = run_eval(None, [str(old), str(new)], str(tiny_model_dir), str(source),
                                      "prompt_completion", None, True, None, None, settings, console)
    assert base.prompts == new_col.prompts == [PROMPT, "12+30="]
    assert old_col.prompts == [PROMPT + "\n", "12+30=\n"]
    assert "old was trained before data.separator" in console.export_text().replace("\n", " ")
    # a separator the command line names is obeyed for every column, the old run's too
    _, old_col = run_eval(None, [str(old)], str(tiny_model_dir), str(source), "prompt_completion", None, True,
                          None, None, settings + ["data.separator=' '"], Console(record=True))
    assert old_col.prompts == [PROMPT + " ", "12+30= "]
    recipe = recipe_file(tmp_path, tiny_model_dir, name="inspect", data={"source": str(source),
                                                                       "format": "prompt_completion"})
    result = run_inspect(recipe, PROMPT, None, [str(old), str(new)], "7", 3, None, None,
                         ["data.template=plain"], Console(record=True, width=200))
    assert [v.prompt_text for v in result.models] == [PROMPT + "\n", PROMPT]


def test_export_prompts_an_old_run_as_it_trained(runs, tiny_tokenizer):
    """The Ollama Modelfile (and every export step reading the run's recipe) adds the newline the run learned."""
    old, new, _ = runs
    old_recipe, new_recipe = load_recipe_quietly(old), load_recipe_quietly(new)
    assert old_recipe.data.prompt_separator() == "\n" and new_recipe.data.prompt_separator() == ""
    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    assert 'TEMPLATE """{{ .Prompt }}\n"""' in ollama_modelfile(tok, "m.gguf", recipe=old_recipe)[0]
    assert 'TEMPLATE """{{ .Prompt }}"""' in ollama_modelfile(tok, "m.gguf", recipe=new_recipe)[0]


def interrupt_at_step(monkeypatch, at_call: int) -> None:
    """Ctrl-C inside the at_call-th training forward pass (the run saves a checkpoint and exits resumable)."""
    real, calls = train_step.forward_sums, {"n": 0}

    def forward(model, batch, loss):
        calls["n"] += model.training
        if calls["n"] == at_call:
            raise KeyboardInterrupt
        return real(model, batch, loss)

    monkeypatch.setattr(train_step, "forward_sums", forward)


def test_a_resumed_old_run_keeps_its_newline(tmp_path, tiny_model_dir, monkeypatch):
    """An interrupted run whose recipe.yaml predates data.separator resumes with the newline (and says so in its
    recipe.yaml from then on); a recipe that sets another separator is refused, naming the key."""
    source = rows_file(tmp_path, [(f"{a}+{a}=", str(2 * a)) for a in range(40)])
    data = {"source": str(source), "format": "prompt_completion", "template": "plain", "val_size": 4}
    path = recipe_file(tmp_path, tiny_model_dir, data=data, train={"save_steps": 2})
    interrupt_at_step(monkeypatch, at_call=5)
    with pytest.raises(SystemExit):
        run_training(load_recipe(path))
    monkeypatch.undo()
    run = tmp_path / "run"
    saved = yaml.safe_load((run / RECIPE).read_text())
    del saved["data"]["separator"]  # as the run's recipe.yaml was written before the key existed
    (run / RECIPE).write_text(yaml.safe_dump(saved, sort_keys=False))
    with pytest.raises(UserError) as refused:
        run_training(load_recipe(path, ["data.separator=''"]))
    assert "data.separator" in refused.value.what
    run_training(load_recipe(path))
    assert read_info(run)["status"] == "completed"
    assert yaml.safe_load((run / RECIPE).read_text())["data"]["separator"] == "\n"
