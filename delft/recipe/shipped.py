"""The recipes and docs that come with delft. A wheel carries them as package data (``delft/_shipped``, copied there
by the build, setup.py); a checkout reads its own ``recipes/`` and ``docs/``. A built-in recipe is named by its path
under recipes/ without the suffix (``quickstart``, ``compare/del``), so ``delft train quickstart`` runs from any
directory, and ``delft recipe new quickstart my.yaml`` writes a copy to edit."""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Optional

from delft.errors import UserError

PACKAGED = "_shipped"  # the folder inside the installed package (setup.py writes it into the wheel)
RECIPES, DOCS = "recipes", "docs"
SUFFIX = ".yaml"
STUDY_SUFFIX = ".study"
LIST_FIX = "delft recipe list names the recipes that come with delft"


def shipped_root() -> Path:
    """Where recipes/ and docs/ are: the installed package's data, else the checkout this module runs from."""
    packaged = resources.files("delft") / PACKAGED
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2]  # a checkout (or an editable install): beside the delft package


def recipes_dir() -> Path:
    return shipped_root() / RECIPES


def docs_dir() -> Path:
    return shipped_root() / DOCS


def builtin_names() -> list[str]:
    """Every built-in recipe's name (study files end in .study), sorted."""
    root = recipes_dir()
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*" + SUFFIX))


def builtin_recipe(name: str | Path) -> Optional[Path]:
    """The built-in recipe ``name`` names (``quickstart``, ``quickstart.yaml``, ``recipes/quickstart.yaml``), or
    None; never a path outside recipes/."""
    parts = PurePosixPath(str(name).replace(os.sep, "/")).parts
    if parts and parts[0] == RECIPES:
        parts = parts[1:]
    if not parts or any(p in ("", ".", "..") for p in parts) or PurePosixPath(str(name)).is_absolute():
        return None
    relative = PurePosixPath(*parts)
    if relative.suffix.lower() not in (SUFFIX, ".yml"):
        relative = relative.with_name(relative.name + SUFFIX)
    path = recipes_dir() / relative
    return path if path.is_file() else None


def resolve_recipe(path: str | Path) -> Path:
    """``path`` itself when something is there, else the built-in recipe it names, else ``path`` (whose absence the
    reader then reports)."""
    path = Path(path)
    if path.exists():
        return path
    return builtin_recipe(path) or path


def missing_recipe_fix() -> str:
    """What a user without the file can do, whether or not they have a checkout."""
    return ("Check the path, or name a recipe that comes with delft (delft recipe list names them): delft train "
            "quickstart runs the quickstart, and delft recipe new quickstart my.yaml writes a commented copy to edit.")


_CITED = re.compile(r"\bdocs/([A-Za-z0-9_]+)\.md\b")


def cite_shipped_docs(message: str, cwd: Optional[Path] = None) -> str:
    """``message`` with, for each docs page it cites that the current directory lacks (a wheel user's case), how
    to read the copy that comes with delft."""
    here = Path.cwd() if cwd is None else cwd
    names = [n for n in dict.fromkeys(_CITED.findall(message))
             if not (here / DOCS / f"{n}.md").is_file() and (docs_dir() / f"{n}.md").is_file()]
    if not names:
        return message
    shown = ", ".join(f"delft docs {n}" for n in names)
    return f"{message} (The docs come with delft: {shown} prints {'it' if len(names) == 1 else 'them'}.)"


def doc_page(name: str) -> Path:
    """The shipped docs page ``name`` (``gpu``, ``gpu.md``, ``docs/gpu.md``)."""
    stem = PurePosixPath(name.replace(os.sep, "/")).name.removesuffix(".md")
    path = docs_dir() / f"{stem}.md"
    if not re.fullmatch(r"[A-Za-z0-9_]+", stem) or not path.is_file():
        pages = ", ".join(p.stem for p in sorted(docs_dir().glob("*.md")))
        raise UserError(f"no docs page named {name!r}", "delft docs", f"The pages are: {pages}.")
    return path
