"""``delft recipe new NAME FILE``: a built-in recipe (delft.recipe.shipped) written out as the user's own file to
edit, never over a file that is there."""

from __future__ import annotations

import errno
import os
from pathlib import Path, PurePosixPath

import yaml

from delft import __version__
from delft.errors import UserError
from delft.outputs import temporary_sibling
from delft.recipe.files import read_recipe_data, recipe_chain
from delft.recipe.shipped import LIST_FIX, RECIPES, STUDY_SUFFIX, builtin_names, builtin_recipe, recipes_dir


def starter_text(name: str, out: str) -> str:
    """The built-in recipe ``name`` as the file ``out``: its text with its comments (its own path in them made
    ``out``) where it is one file; its ``base:`` chain merged (every key, the comments lost) where it extends
    another."""
    path = builtin_recipe(name)
    if path is None:
        raise UserError(f"no built-in recipe named {name!r}", "delft recipe new", f"{LIST_FIX}.")
    if path.stem.endswith(STUDY_SUFFIX):
        raise UserError(f"{name} is a study file, which names recipes beside it rather than being one",
                        "delft recipe new", f"Start from a recipe ({LIST_FIX}); a study's files are in {path.parent}.")
    chain = recipe_chain(path)
    shown = PurePosixPath(RECIPES, path.relative_to(recipes_dir()).as_posix())
    head = (f"# Written by `delft recipe new {name}` (delft {__version__}) from the built-in recipe {shown}.\n"
            "# Check it with `delft recipe check FILE`; every key, its default and meaning: `delft recipe keys`.\n")
    if len(chain) == 1:
        return head + "#\n" + path.read_text(encoding="utf-8").replace(str(shown), out)
    bases = ", ".join(p.name for p in chain[1:])
    return (head + f"# {shown} extends {bases}: merged here into one file.\n\n"
            + yaml.safe_dump(read_recipe_data(path), sort_keys=False))


def write_new_recipe(name: str, out: Path) -> Path:
    """Write the starter recipe ``name`` to ``out``, which must not exist (never overwritten): written beside it
    under a temporary name, then linked into place, which fails if ``out`` appeared meanwhile."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise UserError(f"{out} already exists; delft recipe new does not overwrite a file", "delft recipe new",
                        "Name a new file, or remove that one first.")
    if not out.parent.is_dir():
        raise UserError(f"folder {out.parent} does not exist", "delft recipe new", "Create it, or name a file in an "
                        "existing folder.")
    text = starter_text(name, str(out))
    tmp = temporary_sibling(out)
    try:
        tmp.write_text(text, encoding="utf-8")
        _link(tmp, out)
    except FileExistsError:
        raise UserError(f"{out} appeared while it was being written; it was left as it is", "delft recipe new",
                        "Name a new file.") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _link(tmp: Path, out: Path) -> None:
    """``tmp`` made ``out`` whole, failing if ``out`` exists; where the filesystem has no hard links, renamed after a
    last look (a file that appears in between is the one case left to chance)."""
    try:
        os.link(tmp, out)
    except OSError as e:
        if isinstance(e, FileExistsError) or e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise
        if out.exists():
            raise FileExistsError(str(out)) from None
        os.replace(tmp, out)


def builtin_recipes() -> list[tuple[str, str]]:
    """(name, what it is) for every built-in recipe: its first comment line that is not the command running it."""
    out = []
    for name in builtin_names():
        path = builtin_recipe(name)
        lines = path.read_text(encoding="utf-8").splitlines() if path is not None else []
        said = next((ln.lstrip("# ").strip() for ln in lines
                     if ln.startswith("#") and ln.lstrip("# ").strip() and not ln.lstrip("# ").startswith("delft ")), "")
        out.append((name, said))
    return out
