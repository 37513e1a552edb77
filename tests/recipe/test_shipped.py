"""The recipes and docs that come with delft (delft.recipe.shipped, delft.recipe.starter): named without a path,
copied to a file of the user's own, and cited in messages as what a wheel user has."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import REPO, run_cli

from delft.recipe.files import load_recipe
from delft.recipe.shipped import builtin_names, builtin_recipe, cite_shipped_docs, resolve_recipe


def test_a_built_in_recipe_is_found_by_name_and_nothing_outside_recipes_is():
    assert builtin_recipe("quickstart") == REPO / "recipes" / "quickstart.yaml"
    assert builtin_recipe("recipes/compare/del.yaml") == REPO / "recipes" / "compare" / "del.yaml"
    for outside in ("../pyproject", "/etc/passwd", "compare/../../README.md", "", "nothing"):
        assert builtin_recipe(outside) is None, outside
    assert "quickstart" in builtin_names() and "study/worked.study" in builtin_names()


def test_a_file_of_that_name_wins_over_the_built_in_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe("quickstart") == REPO / "recipes" / "quickstart.yaml"
    (tmp_path / "quickstart").write_text("model: {name: mine}\n")
    assert resolve_recipe("quickstart") == Path("quickstart")
    assert load_recipe("quickstart").model.name == "mine"


def test_recipe_new_writes_a_commented_copy_that_loads_as_the_built_in_one(tmp_path):
    out = tmp_path / "my.yaml"
    result = run_cli("recipe", "new", "quickstart", out)
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert f"# delft train {out}" in text and "# lambda: CE + 0.3" in text  # its comments kept
    assert load_recipe(out) == load_recipe(REPO / "recipes" / "quickstart.yaml")

    merged = tmp_path / "del.yaml"
    assert run_cli("recipe", "new", "compare/del", merged).exit_code == 0
    assert "extends base.yaml" in merged.read_text()
    assert load_recipe(merged) == load_recipe(REPO / "recipes" / "compare" / "del.yaml")


@pytest.mark.parametrize("name, words", [("quickstart", "already exists"), ("nothing", "no built-in recipe"),
                                         ("study/worked.study", "is a study file")])
def test_recipe_new_never_overwrites_and_names_what_it_cannot_write(tmp_path, name, words):
    out = tmp_path / "mine.yaml"
    if words == "already exists":
        out.write_text("# mine\n")
    result = run_cli("recipe", "new", name, out)
    assert result.exit_code == 2 and words in result.output, result.output
    assert (out.read_text() == "# mine\n") if words == "already exists" else not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == (["mine.yaml"] if words == "already exists" else [])


def test_a_message_citing_a_docs_page_says_how_a_wheel_user_reads_it(tmp_path):
    message = "see docs/gpu.md and docs/losses.md"
    cited = cite_shipped_docs(message, cwd=tmp_path)
    assert cited.startswith(message) and "delft docs gpu, delft docs losses" in cited
    assert cite_shipped_docs(message, cwd=REPO) == message  # a checkout has the pages
    unknown = "see docs/" + "nothing.md"  # split, so the docs test does not look for that page
    assert cite_shipped_docs(unknown, cwd=tmp_path) == unknown
    shown = run_cli("docs", "gpu")
    assert shown.exit_code == 0 and shown.output == (REPO / "docs" / "gpu.md").read_text()
