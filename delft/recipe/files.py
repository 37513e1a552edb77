"""Recipe and study files on disk: read within bounds (size, no anchors or aliases, depth, each key once), a
``base:`` chain merged, ``--set`` overrides parsed, validated into a Recipe, and written back as YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml

from delft.errors import UserError
from delft.recipe.schema import DataConfig, NumbersConfig, Recipe, validate_recipe
from delft.recipe.shipped import missing_recipe_fix, resolve_recipe
from delft.rundir import CHECKPOINTS, RECIPE, SNAPSHOTS


def merge_keys(base: dict, over: dict) -> dict:
    """``over``'s keys over ``base``'s, section by section (a recipe's base: chain, --set, a study's --set)."""
    merged = dict(base)
    for k, v in over.items():
        merged[k] = merge_keys(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


BASE_KEY = "base"


def read_yaml(path: Path) -> dict:
    """A recipe or study file as plain values, within this module's bounds (size, no aliases, depth, keys once)."""
    text = read_text(path)
    try:
        data = load_bounded(text, str(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"is not valid YAML{at}: {getattr(e, 'problem', e)}", str(path),
                        "Fix the YAML syntax (indentation, colons, quotes).") from None
    if data is None:
        raise UserError("empty recipe (no sections at all)", str(path),
                        "Write at least the sections you mean to set; delft recipe new quickstart my.yaml writes a starter.")
    if not isinstance(data, dict):
        raise UserError("the recipe must be a mapping of sections (model, data, train, ...)", str(path),
                        "Start from a starter: delft recipe new quickstart my.yaml.")
    return data


def recipe_chain(path: str | Path) -> list[Path]:
    """The recipe file (or the built-in recipe it names where no such file exists: ``quickstart``) and the files it
    extends through ``base:``, nearest first (cycles are errors)."""
    chain: list[Path] = []
    current: Optional[Path] = resolve_recipe(path)
    while current is not None:
        if any(current.resolve() == p.resolve() for p in chain):
            loop = " -> ".join(str(p) for p in [*chain, current])
            raise UserError(f"recipe bases form a cycle: {loop}", str(chain[0]), "Remove one of the base: keys.")
        data = read_yaml(current)
        chain.append(current)
        base = data.get(BASE_KEY)
        if base is None:
            current = None
        elif isinstance(base, str) and base.strip():
            current = current.parent / base  # relative to the file that names it
            if not current.is_file():
                raise UserError(f"base recipe {base!r} does not exist (looked for {current})", str(chain[-1]),
                                "base: is a path relative to the recipe file that names it.")
        else:
            raise UserError(f"base: must be a path to another recipe, not {base!r}", str(chain[-1]),
                            "e.g. base: base.yaml (relative to this file).")
    return chain


def read_recipe_data(path: str | Path) -> dict:
    """A recipe file as a plain dict with its ``base:`` chain merged in (deep; the extending file wins)."""
    data: dict = {}
    for p in reversed(recipe_chain(path)):
        layer = dict(read_yaml(p))
        layer.pop(BASE_KEY, None)
        data = merge_keys(data, layer)
    return data


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Read (following ``base:``), merge ``--set`` overrides, validate. ``path=None`` starts from the defaults.

    A top-level ``base: other.yaml`` (relative to the file) makes the recipe extend another: sections merge
    key by key, the extending file wins, lists and scalars are replaced whole; bases may chain.
    """
    data: dict = {}
    where = "command line"
    if path is not None:
        path = Path(path)
        where = str(path)
        data = read_recipe_data(path)
    if overrides:
        data = merge_keys(data, parse_overrides(overrides))
        where += " (with --set overrides)"
    return validate_recipe(data, where)


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)


# Before data.separator existed, delft followed every plain prompt with a newline (none after a prompt that already
# ended in a space or newline, which render_prompt still does). A run's recipe.yaml holds every key (dump_recipe),
# so one whose data section lacks separator was trained that way, whatever its format: evaluating, inspecting,
# exporting or resuming it keeps the newline where the recipe at hand leaves data.separator unset.
LEGACY_SEPARATOR = "\n"


def trained_recipe(model_dir: str | Path) -> Optional[Path]:
    """The recipe.yaml that says how the model in ``model_dir`` was trained: a run's own, or for a snapshot or a
    checkpoint (RUN/snapshots/step-N, RUN/checkpoints/step-N: the model alone) its run's; None where there is none."""
    model = Path(model_dir)
    for run in (model, model.parent.parent if model.parent.name in (SNAPSHOTS, CHECKPOINTS) else None):
        if run is not None and (run / RECIPE).is_file():
            return run / RECIPE
    return None


def predates_separator(run_dir: str | Path) -> bool:
    """Whether the run directory's recipe.yaml was written before data.separator existed. False without a readable
    one (a merged model, a GGUF file, an adapter delft did not train): nothing says how those prompted."""
    path = trained_recipe(run_dir)
    if path is None:
        return False
    try:
        data = read_yaml(path).get("data")
    except UserError:
        return False
    return isinstance(data, dict) and "separator" not in data


def trained_numbers(run_dir: str | Path | None) -> Optional[NumbersConfig]:
    """How the model in ``run_dir`` writes numbers: its (a snapshot: its run's, ``trained_recipe``) recipe.yaml's
    data.numbers (natural in one written before the key existed), natural for the base model (None, which never
    saw another form); None where no readable recipe.yaml says (a merged model, a GGUF file, an adapter delft did
    not train)."""
    if run_dir is None:
        return NumbersConfig()
    path = trained_recipe(run_dir)
    if path is None:
        return None
    try:
        data = read_yaml(path).get("data")
        numbers = data.get("numbers") if isinstance(data, dict) else None
        return NumbersConfig.model_validate(numbers or {})
    except (UserError, ValueError, AttributeError):
        return None


def as_trained(data_cfg: DataConfig, run_dir: str | Path | None) -> DataConfig:
    """``data_cfg`` as the model in ``run_dir`` (None: the base model) saw its prompts and writes its answers: its
    own data.numbers (trained_numbers; ``data_cfg``'s where nothing says), and for a run trained before
    data.separator existed an unset separator as the legacy newline. ``data_cfg`` itself when nothing differs."""
    update: dict[str, Any] = {}
    numbers = trained_numbers(run_dir)
    if numbers is not None and numbers != data_cfg.numbers:
        update["numbers"] = numbers
    if data_cfg.separator is None and data_cfg.prompt_separator() != LEGACY_SEPARATOR and run_dir is not None \
            and predates_separator(run_dir):
        update["separator"] = LEGACY_SEPARATOR
    return data_cfg.model_copy(update=update) if update else data_cfg


def keep_legacy_separator(recipe: Recipe) -> Recipe:
    """``recipe``, changed in place: each unset data.separator (data, eval.data) whose format's default is not the
    legacy newline set to it."""
    for data in (recipe.data, recipe.eval.data):
        if data is not None and data.separator is None and data.prompt_separator() != LEGACY_SEPARATOR:
            data.separator = LEGACY_SEPARATOR
    return recipe


def load_run_recipe(run_dir: str | Path) -> Recipe:
    """A run directory's recipe.yaml as the run trained: written before data.separator existed, the legacy
    newline where it is unset."""
    recipe = load_recipe(Path(run_dir) / RECIPE)
    return keep_legacy_separator(recipe) if predates_separator(run_dir) else recipe


MAX_BYTES = 1_000_000  # a recipe is a few kilobytes; this leaves room for long prompts and lists


MAX_DEPTH = 32  # sections nest four or five deep; PyYAML's composer fails near a few hundred


class UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML would silently keep the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (lines {seen[key]} and {key_node.start_mark.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def bounds_problem(text: str) -> str | None:
    """What makes ``text`` too costly to load (an anchor, an alias, nesting past MAX_DEPTH), or None; read from the
    parser's events, so nothing is built. Syntax errors raise yaml.YAMLError as yaml.load would."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            return f"uses the YAML alias *{event.anchor} at line {line}; anchors and aliases are not accepted"
        if isinstance(event, yaml.NodeEvent) and event.anchor is not None:
            return f"defines the YAML anchor &{event.anchor} at line {line}; anchors and aliases are not accepted"
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                return f"nests lists or mappings more than {MAX_DEPTH} deep (line {line})"
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return None


BOUNDS_FIX = "Write each value out in full (a recipe needs no anchors, aliases or deep nesting)."


def load_bounded(text: str, where: str) -> Any:
    """``text`` as plain Python values (safe_load's types, duplicate keys refused) once ``bounds_problem`` finds
    nothing; a problem is a UserError at ``where``; syntax errors raise yaml.YAMLError for the caller to word."""
    problem = bounds_problem(text)
    if problem is not None:
        raise UserError(problem, where, BOUNDS_FIX)
    return yaml.load(text, Loader=UniqueKeyLoader)


def read_text(path: Path) -> str:
    """The file's text, at most MAX_BYTES; a directory, a missing, unreadable, binary or oversized file is a clear
    error."""
    if path.is_dir():
        raise UserError(f"recipe {path} is a directory", fix="Give the recipe's YAML file.")
    if not path.is_file():
        raise UserError(f"recipe file {path} does not exist", fix=missing_recipe_fix())
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)  # bounded even if the file grows after a size check
    except OSError as e:
        raise UserError(f"recipe file {path} cannot be read ({e.strerror})", fix="Check its permissions.") from None
    if len(raw) > MAX_BYTES:
        raise UserError(f"is larger than {MAX_BYTES:,} bytes, too large for a recipe", str(path),
                        "A recipe is a short YAML file; keep data in a data file (data.source).")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise UserError(f"is not a text (UTF-8) file: byte 0x{raw[e.start]:02x} at line {line}", str(path),
                        "A recipe is a YAML text file; delft recipe new quickstart my.yaml writes a starter.") from None
    if "\x00" in text:
        raise UserError("is a binary file, not YAML", str(path), "delft recipe new quickstart my.yaml writes a starter.")
    return text


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["train.max_steps=50", "loss.type=ce"]`` -> nested dict; values parsed as YAML (within this module's
    bounds). A later --set of the same key wins; one below a key that an earlier --set made a value is refused."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--set {item!r} is not KEY=VALUE", fix="Write it as --set train.max_steps=50.")
        key, _, raw = item.partition("=")
        value = _override_value(item, raw)
        node = out
        parts = key.strip().split(".")
        for i, p in enumerate(parts[:-1]):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                above = ".".join(parts[:i + 1])
                raise UserError(f"--set {_shown(item)} sets a key inside {above}, which an earlier --set made the "
                                f"value {node!r}", "command line",
                                f"Drop one of the two: {above} is either a value or a section of keys.")
        node[parts[-1]] = value
    return out


def _override_value(item: str, raw: str) -> Any:
    """A --set value as YAML (bounded like a recipe: no aliases, no deep nesting); text that is no YAML stays text."""
    if raw == "":
        return ""
    try:
        return load_bounded(raw, f"--set {_shown(item)}")
    except yaml.YAMLError:
        return raw


def _shown(item: str, most: int = 80) -> str:
    return item if len(item) <= most else item[:most - 3] + "..."
