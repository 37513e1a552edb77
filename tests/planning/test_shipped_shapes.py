"""--shape NAME (issue 52 item 5): the memory plan of a usual family without its config.json, from the shapes
delft ships as data (delft/planning/shapes.json). Each shape is checked against the parameter count its hub page
states (the safetensors total), so a wrong width, depth or vocabulary fails here."""

from __future__ import annotations

import pytest
from helpers import recipe_file, run_cli
from rich.console import Console

from delft.planning.command import run_plan
from delft.planning.shapes import QWEN2, model_shape, parameter_counts, shipped_shapes
from delft.recipe.files import load_recipe

PUBLISHED = {  # parameters, as each model's hub page counts them
    "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512, "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248, "mistral-7b-v0.1": 7_241_732_096, "mistral-7b-v0.3": 7_248_023_552,
    "phi-3-mini": 3_821_079_552,
}


def test_every_shipped_shape_has_its_published_parameter_count():
    shapes = shipped_shapes()
    assert set(shapes) == set(PUBLISHED)
    for name, entry in shapes.items():
        assert sum(parameter_counts(model_shape(entry["config"]))) == PUBLISHED[name], name
        assert entry["number_tokens"] == (1110 if name.startswith("llama-3") else 10), name
    assert QWEN2["7b"] == shapes["qwen2.5-7b"]["config"]  # the measured rows plan the same shapes


def test_recipe_check_plans_a_shape_without_a_config(tmp_path, tiny_model_dir):
    rec = recipe_file(tmp_path, tiny_model_dir)
    r = run_cli("recipe", "check", rec, "--plan", "--shape", "llama-3.1-8b", "--gpu-memory", "80GiB")
    said = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert "meta-llama/Llama-3.1-8B (llama, 32 layers, hidden 4096, vocab 128,256)" in said, said
    assert "shipped shape llama-3.1-8b" in said and "number tokens: 1,110" in said and "fits in 80.00 GiB" in said
    recipe = load_recipe(rec)
    small, big = (run_plan(recipe, None, Console(record=True), shape=name) for name in ("qwen2.5-0.5b", "QWEN2.5-7B"))
    assert small["components"]["total"] < big["components"]["total"]
    assert small["config_source"] == "delft's shipped shape qwen2.5-0.5b (from Qwen/Qwen2.5-0.5B's config.json)"


@pytest.mark.parametrize("args, words", [
    (["--plan", "--shape", "qwen2.5-8b"], ["no shape 'qwen2.5-8b'", "did you mean", "llama-3.1-8b", "phi-3-mini"]),
    (["--shape", "qwen2.5-7b"], ["no --plan", "--plan --shape qwen2.5-7b"]),
])
def test_an_unknown_shape_or_one_without_plan_is_one_paragraph(tmp_path, tiny_model_dir, args, words):
    r = run_cli("recipe", "check", recipe_file(tmp_path, tiny_model_dir), *args)
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert all(w in said for w in words), said
