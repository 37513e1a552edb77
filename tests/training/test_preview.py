"""delft recipe check --show-examples: the preview's trained spans and scored digits are the trainer's labels."""

from helpers import recipe_file, run_cli

from delft.recipe.files import load_recipe
from delft.training.preview import preview_examples


def test_the_preview_marks_what_the_trainer_trains_and_scores(tmp_path, tiny_model_dir):
    from delft.data.batches import collate
    from delft.training.schedule import make_schedule, micro_batch_items
    from delft.training.setup import setup

    recipe = load_recipe(recipe_file(tmp_path, tiny_model_dir, data={"template": "plain"}))
    s = setup(recipe)
    previews = preview_examples(recipe, len(s.train))
    batch = collate(micro_batch_items(s.train, recipe, make_schedule(recipe, len(s.train), 1), 0),
                    s.tokenizer.pad_token_id)
    for row, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        index = next(i for i, item in enumerate(s.train) if item.input_ids == row[:len(item.input_ids)])
        view = previews[index]
        assert [v.trained for v in view] == [y != -100 for y in labels[:len(view)]]
    for item, view in zip(s.train, previews):
        trained = "".join(v.text for v in view if v.trained)
        item_text = s.tokenizer.decode([t for t, y in zip(item.input_ids, item.labels) if y != -100])
        assert trained == item_text and item_text.endswith(s.tokenizer.eos_token)
        digits = [(v.text, v.places) for v in view if v.places]
        number = trained.removesuffix(s.tokenizer.eos_token).lstrip("-")
        whole = number.split(".")[0]
        assert [t for t, _ in digits] == [c for c in number if c.isdigit()]
        assert [p[0] for _, p in digits][:len(whole)] == list(range(len(whole), 0, -1))  # tens, units, ...


def test_cli_show_examples(tmp_path, tiny_model_dir):
    res = run_cli("recipe", "check", recipe_file(tmp_path, tiny_model_dir), "--show-examples", "2")
    assert res.exit_code == 0, res.output
    assert "example 0" in res.output and "example 1" in res.output and "digit places scored" in res.output


SYSTEM_DEFAULT = ("{% if messages[0]['role'] != 'system' %}<|system|>Be brief.</s>\n{% endif %}"
                  "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_the_preview_says_the_chat_template_wraps_prompt_completion_rows(tmp_path, tiny_model_dir):
    """issue 52 item 5: prompt_completion rows go through the chat template (and its default system prompt); the
    preview says so, names that default, and says nothing of it under template plain."""
    from tiny import build_tokenizer

    from delft.training.preview import default_system_prompt, template_note

    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"prompt": "{i} + 1 =", "completion": "{i + 1}"}}\n' for i in range(8)))
    section = {"source": str(data), "format": "prompt_completion", "val_size": 0}
    res = run_cli("recipe", "check", recipe_file(tmp_path, tiny_model_dir, data=section), "--show-examples", "1")
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "chat template" in said and "no system message" in said and "data.template: plain" in said, res.output
    plain = recipe_file(tmp_path, tiny_model_dir, name="plain", data={**section, "template": "plain"})
    res = run_cli("recipe", "check", plain, "--show-examples", "1")
    assert res.exit_code == 0 and "note:" not in res.output, res.output

    tok = build_tokenizer()
    tok.chat_template = SYSTEM_DEFAULT
    assert default_system_prompt(tok) == "Be brief."
    recipe = load_recipe(recipe_file(tmp_path, tiny_model_dir, name="sys", data=section))
    assert "default system prompt 'Be brief.'" in template_note(recipe, tok)
    own = load_recipe(recipe_file(tmp_path, tiny_model_dir, name="own", data={**section, "system_prompt": "Add."}))
    assert "data.system_prompt 'Add.'" in template_note(own, tok)
