"""What ``delft recipe check`` needs to know of study files: whether a file is one, and which study files (beside a
recipe or above it) train a recipe, whose relative data paths are then looked up in ``delft study --data-dir``."""

from __future__ import annotations

from pathlib import Path

from delft.errors import UserError
from delft.recipe.files import read_yaml, recipe_chain

STUDY_SUFFIX = ".study.yaml"
STUDY_KEYS = ("recipes", "evals")  # a study file's own keys, which no recipe has
SEARCH_UP = 3  # a study file sits beside its recipes' folder (recipes/study/worked.study.yaml, worked/ce.yaml)


def is_study_file(path: Path) -> bool:
    """A ``*.study.yaml`` file, or one whose sections are a study's (recipes, evals) rather than a recipe's."""
    path = Path(path)
    if path.name.lower().endswith(STUDY_SUFFIX):
        return True
    try:
        data = read_yaml(path)
    except UserError:
        return False
    return all(k in data for k in STUDY_KEYS)


def study_recipes(study: Path) -> list[Path]:
    """The recipe files a study file names (relative to it); [] where it cannot be read."""
    try:
        listed = read_yaml(study).get("recipes")
    except UserError:
        return []
    if not isinstance(listed, list):
        return []
    names = [r.get("recipe") if isinstance(r, dict) else r for r in listed]
    return [study.parent / n for n in names if isinstance(n, str)]


def studies_training(recipe: Path) -> list[Path]:
    """The study files near ``recipe`` that train it, or a recipe extending it (its shared base)."""
    target = Path(recipe).resolve()
    found: list[Path] = []
    folder = Path(recipe).parent  # kept as given, so the study is named as the user would write it
    for _ in range(SEARCH_UP):
        for study in sorted(folder.glob("*" + STUDY_SUFFIX)):
            if any(study.resolve() == f.resolve() for f in found):
                continue
            for arm in study_recipes(study):
                try:
                    chain = [p.resolve() for p in recipe_chain(arm)] if arm.is_file() else []
                except UserError:
                    chain = []
                if target in chain:
                    found.append(study)
                    break
        folder = folder.parent
    return found
