"""The code's layout rules (docs/layout.md): imports run one way between floors, no import circle, no module uses
another's private name, the schema and the CLI load no torch, and modules and functions stay short."""

from __future__ import annotations

import ast
import subprocess
import sys

from helpers import REPO

PACKAGE = REPO / "delft"
# Floors, lowest first: a module may import from its own floor or below, never from above.
FLOORS = [
    ("delft", "delft.errors"),
    ("delft.rundir", "delft.outputs", "delft.children", "delft.signals"),
    ("delft.numbers",),
    ("delft.losses",),
    ("delft.recipe", "delft.data"),
    ("delft.models",),
    ("delft.planning",),
    ("delft.evaluation",),
    ("delft.integrations",),  # the trainers for library use; training's GRPO stage runs DigitGRPOTrainer
    ("delft.training",),
    ("delft.inspection", "delft.export"),
    ("delft.experiments",),
    ("delft.cli", "delft.__main__"),
]
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 700, 60
# Command modules (besides every module named `command`): what one `delft` command runs. Only delft/cli.py imports
# them; code that needs a command's pieces imports the module that holds them (evaluation.runs, experiments.arms,
# experiments.results), so no command depends on another. Named here whether or not the module exists yet.
COMMAND_MODULES = ("delft.experiments.compare", "delft.experiments.study", "delft.training.command")
# Known breaks of that rule, each to be removed with its cause (the test fails when one is no longer needed):

def modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def floor(module: str) -> int:
    best = None
    for i, prefixes in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{module} is on no floor: add it to FLOORS and docs/layout.md"
    return best[0]


def imports(tree: ast.Module, known: set[str]) -> list[tuple[str, list[str], int]]:
    """(imported delft module, names taken from it, line) for every import, function-level ones included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "delft":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in known:  # `from delft import rundir`: the module itself
                    out.append((sub, [], node.lineno))
                else:
                    out.append((node.module, [alias.name], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "delft"]
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: {target for target, _, _ in imports(t, set(mods)) if target != m} for m, t in mods.items()}


def test_every_import_runs_down_the_floors():
    mods = modules()
    upward = [f"{m}:{line} imports {target} (floor {floor(target)} > {floor(m)})"
              for m, tree in mods.items() for target, _, line in imports(tree, set(mods))
              if target in mods and floor(target) > floor(m)]
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_circle():
    g = graph()
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, path: list[str]) -> bool:
        state[m] = 1
        for n in sorted(g.get(m, ())):
            if n not in g or n == "delft":
                continue
            if state.get(n) == 1:
                cycle.extend(path[path.index(n):] + [n] if n in path else [m, n])
                return True
            if state.get(n) is None and visit(n, path + [n]):
                return True
        state[m] = 2
        return False

    for m in sorted(g):
        if state.get(m) is None and visit(m, [m]):
            break
    assert not cycle, " -> ".join(cycle)


def test_no_module_imports_another_modules_private_name():
    mods = modules()
    private = [f"{m}:{line} takes {', '.join(n for n in names if n.startswith('_'))} from {target}"
               for m, tree in mods.items() for target, names, line in imports(tree, set(mods))
               if target != m and any(n.startswith("_") and not n.startswith("__") for n in names)]
    assert not private, "\n".join(private)


def test_only_the_cli_imports_a_command_module():
    mods = modules()
    commands = {m for m in mods if m.rsplit(".", 1)[-1] == "command"} | set(COMMAND_MODULES)
    wrong = []
    for m, tree in mods.items():
        if m == "delft.cli":
            continue
        for target, names, line in imports(tree, set(mods)):
            # `from delft.training import command` names the module as a name when the index does not know it
            hit = sorted(({target} | {f"{target}.{n}" for n in names}) & commands - {m})
            wrong += [f"{m}:{line} imports the command module {c} (only delft/cli.py may)" for c in hit]
    assert not wrong, "\n".join(wrong)


def defined_names(tree: ast.Module) -> set[str]:
    """Names a module's top level defines itself (functions, classes, assignments), not the ones it imports."""
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def test_each_name_is_imported_from_the_module_that_defines_it():
    """A module that only passes a name on hides where it lives; package faces (``__init__``) are the exception."""
    mods = modules()
    faces = {m for m in mods if (PACKAGE / m.replace("delft.", "", 1).replace(".", "/") / "__init__.py").exists()}
    faces.add("delft")
    through = []
    for m, tree in mods.items():
        for target, names, line in imports(tree, set(mods)):
            if target in mods and target not in faces and target != m:
                passed = [n for n in names if n not in defined_names(mods[target])]
                if passed:
                    through.append(f"{m}:{line} takes {', '.join(passed)} from {target}, which does not define it")
    assert not through, "\n".join(through)


# The two lazy boundaries: the CLI imports each command's module when that command runs, and the recipe schema
# (which the CLI and `delft recipe check` load) reaches heavier modules only when a recipe is validated; both so
# that `delft --help` and a recipe check load no torch.
LAZY_BOUNDARIES = {"delft.cli", "delft.recipe.schema"}
# Optional libraries a delft module may bring with it: a module whose import loads one of these is imported where
# it is used, so nothing else pays for a library a run may not need.
OPTIONAL_LIBRARIES = ("trl", "llama_cpp", "reasoning_gym", "liger_kernel", "axolotl", "wandb", "mlflow", "vllm")


def imports_inside_functions() -> list[tuple[str, int, str]]:
    """(module, line, imported delft module) for every delft import below a module's top level."""
    out = []
    for m, tree in modules().items():
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if id(node) in top or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            out += [(m, node.lineno, n) for n in names if n.split(".")[0] == "delft"]
    return out


def loads_an_optional_library(module: str) -> bool:
    code = f"import sys, {module}; print(sorted(set(sys.modules) & set({OPTIONAL_LIBRARIES!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    return out.stdout.strip() != "[]"


def test_delfts_own_imports_sit_at_the_top_of_each_file():
    """A file's first lines say what it stands on: a delft import inside a function is allowed only across the lazy
    boundaries, or of a module that brings an optional library with it."""
    inside = [(m, line, target) for m, line, target in imports_inside_functions() if m not in LAZY_BOUNDARIES]
    heavy = {t: loads_an_optional_library(t) for t in {t for _, _, t in inside}}
    wrong = [f"{m}:{line} imports {target} inside a function" for m, line, target in inside if not heavy[target]]
    assert not wrong, "\n".join(wrong)


def test_the_schema_and_the_cli_load_no_torch():
    code = ("import sys, delft.cli, delft.recipe.schema, delft.recipe.files, delft.recipe.keys, delft.planning.command, delft.losses.registry, delft.numbers.digits; "
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_modules_and_functions_are_short():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        n = len(text.splitlines())
        if n > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(REPO)}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert not long, "\n".join(long)


def test_every_package_says_what_it_is():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 80, f"{init.relative_to(REPO)} needs a one-paragraph docstring"


def test_no_module_shadows_the_standard_library():
    stdlib = set(sys.stdlib_module_names)
    clash = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if p.stem in stdlib and p.stem != "__init__"]
    assert not clash, clash


# What only the run lifecycle (delft/training/run.py) calls: the run lock and the writers of delft_run.json (each
# allowed in the module that defines it).
LIFECYCLE_CALLS = {"run_lock": "delft.training.lock", "write_info": "delft.rundir", "update_info": "delft.rundir",
                   "start_info": "delft.rundir"}
FILE_WRITERS = {"write_atomic", "write_text", "write_bytes", "open", "write_result", "append_line", "dump"}


def called_name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def names_run_info(node: ast.AST) -> bool:
    """``node`` mentions delft_run.json: rundir.RUN_INFO or the file name itself."""
    return any((isinstance(n, ast.Name) and n.id == "RUN_INFO") or (isinstance(n, ast.Attribute) and n.attr == "RUN_INFO")
               or (isinstance(n, ast.Constant) and n.value == "delft_run.json") for n in ast.walk(node))


def written(call: ast.Call) -> list[ast.AST]:
    """What a write call names as its file: its arguments, and the path a method is called on (path.write_text)."""
    return [*call.args, *([call.func.value] if isinstance(call.func, ast.Attribute) else [])]


def test_every_stage_trains_through_the_run_lifecycle():
    """Every train.stage the schema accepts has a STAGES entry whose module builds on delft.training.run, and no
    module but run.py takes the run lock or writes delft_run.json (by rundir's writers or by a write of its own):
    a stage cannot skip the lock, the run info, the final save's checks or the stopped exit."""
    from typing import get_args

    from delft.recipe.schema import TrainConfig
    from delft.training.stages import STAGES

    mods = modules()
    assert set(STAGES) == set(get_args(TrainConfig.model_fields["stage"].annotation))
    for name, stage in STAGES.items():
        module = stage.load.__module__
        used = {target for target, _, _ in imports(mods[module], set(mods))}
        assert "delft.training.run" in used, f"train.stage {name}: {module} does not build on delft.training.run"
    outside = []
    for m, tree in mods.items():
        if m == "delft.training.run":
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = called_name(node)
            if LIFECYCLE_CALLS.get(name, m) != m:
                outside.append(f"{m}:{node.lineno} calls {name}")
            elif name in FILE_WRITERS and m != "delft.rundir" and any(map(names_run_info, written(node))):
                outside.append(f"{m}:{node.lineno} writes delft_run.json ({name})")
    assert not outside, "\n".join(outside)
