"""Every shell block of the docs runs as printed (docs/*.md and README.md; tests/doc_blocks.py finds the blocks).

A command is a line of a bash block (comments left out) or a "$ " line of a console block (the rest of a console
block is its output, shown, not run); a trailing backslash continues it, a heredoc belongs to it, and `a && b` is
two. The first RULES row whose pattern the printed command matches says what is done with it:
- RUN: a `delft` command runs through the real CLI (python -m delft) in a subprocess, offline (HF_HUB_OFFLINE=1), in
  a directory of the page's own, after the commands printed above it on the page, with SUBSTITUTIONS applied (the
  one table of what the test changes: the tiny model of tests/tiny.py for SmolLM2, a few steps, fewer problems, a
  path of its own for /tmp paths), and must exit 0; each file it is told to write (--json, --plot, --out) must
  then exist. A page's directory holds a copy of the checkout's recipes/ and the PAGE_INPUTS it names, made as
  INPUTS says; a YAML block whose first line names a file (`# llama3-8b-fsdp.yaml`) is that file, written where it
  stands; a Python block of a doc_blocks.PYTHON_AFTER_SHELL page runs where it stands.
- SHELL: a line that writes or reads a file for the page's delft commands runs in bash there (exit 0).
- PARSE: a line this machine cannot run (several machines, GPUs, llama.cpp on a tokenizer it does not implement,
  the test suite itself) says why, and is checked as far as it can be here (test_commands_not_run_here_parse): the
  launcher's own parser and delft's accept every option, and a recipe it names passes `delft recipe check`.
A command no rule matches fails test_every_command_has_a_rule: nothing is skipped silently. The `delft` lines of
indented (unfenced) code, the README's overview, are checked as PARSE lines are (test_indented_commands_parse).

The commands run as the slow test test_page_runs_as_printed, one page at a time. The studies page trains 8 compare
runs and a 10-run study of 2 steps each (SUBSTITUTIONS), and study_lora_powered.md an 8-run study: these two are
the heaviest pages.
"""

from __future__ import annotations

import glob
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path

import pytest
import typer.main
from accelerate.commands.launch import launch_command_parser
from doc_blocks import (BLOCKS, INDENTED, PYTHON, PYTHON_AFTER_SHELL, REPO, SHELL, YAML, Block, check_report,
                        failed, run_python_block, user_env)
from torch.distributed.run import get_args_parser

from delft.cli import app
from delft.export.gguf import parse_types

RUN, SHELL_LINE, PARSE = "run", "shell", "parse"


@dataclass(frozen=True)
class Rule:
    pattern: str  # searched in the command as printed
    how: str
    why: str
    refusal: str = ""  # a RUN command the page shows refused on purpose: exit 2, and this in what it says


RULES = (
    Rule(r"--nnodes [2-9]", PARSE, "several machines"),
    Rule(r"^(torchrun|accelerate launch) ", PARSE, "4 GPUs: the launcher's own parser reads its options, delft's the "
         "command after -m delft"),
    Rule(r"--nproc [2-9]", PARSE, "one GPU per process: without them --nproc N is refused (--oversubscribe aside)"),
    Rule(r"--gguf\b|\.gguf\b", PARSE, "llama.cpp converts only tokenizers it implements (SmolLM2's, not the tiny "
         "model's); tests/export/test_gguf.py exports SmolLM2 to GGUF and answers with it in delft eval"),
    Rule(r"worked\.study\.yaml", PARSE, "GSM8K's worked solutions (--data-dir DIR) and a GPU: 20 hours of training on "
         "2 CPU cores"),
    Rule(r"^bash bench/gpu_run\.sh ", PARSE, "a CUDA GPU: the GPU half of the benchmark"),
    Rule(r"python3? -m pytest\b", PARSE, "the test suite itself, which runs this test"),
    Rule(r"^delft recipe check llama3-8b-fsdp\.yaml --plan --world-size 8 --gpu-memory 24GiB$", RUN, "the page's "
         "table: 0.34 GiB over the card", refusal="the run does not fit: 24.34 GiB planned per GPU"),
    Rule(r"^delft recipe check llama3-8b\.yaml --plan --gpu-memory 8GiB$", RUN, "the page: it does not fit 8 GiB "
         "(8.75 GiB with liger-kernel, 9.62 without)", refusal="the run does not fit"),
    Rule(r"^delft ", RUN, "the real CLI, SUBSTITUTIONS applied"),
    Rule(r"^(mkdir|cat >|printf) ", SHELL_LINE, "writes a file the page's next command reads"),
    Rule(r"^grep ", SHELL_LINE, "finds a line in a file the command above it wrote"),
)


@dataclass(frozen=True)
class Sub:
    commands: str  # a pattern searched in the command as printed: the commands this row changes
    old: str  # the printed text replaced by ``new``; "" appends ``new`` (--set KEY=V) unless the command sets KEY
    new: str  # {tiny}: the tiny model's directory; {here}: the page's directory
    why: str


# A command reading a recipe that names smollm2-135m: every shipped recipe the docs run, and the reader's
# recipe.yaml (INPUTS); not the Llama-3-8B plans, which read only that model's config.json.
RECIPE_COMMAND = r"^delft (train|eval|inspect|compare|study|recipe check) (?!llama3-8b)\S+\.ya?ml\b"
SUBSTITUTIONS = (
    Sub(r"^delft ", "smollm2-135m", "{tiny}", "the docs' model: the tiny model trains and answers in seconds"),
    Sub(RECIPE_COMMAND, "", "--set model.name={tiny}", "the recipe's model: the same"),
    Sub(r"^delft (train|compare|study) ", "", "--set train.max_steps=2", "a few steps: the run, not its result"),
    Sub(r"^delft (train|compare|study) ", "", "--set data.max_length=256", "the tiny model spends a token per "
        "character: at the lengths the recipes set for SmolLM2's tokenizer, every completion is cut off"),
    Sub(r"^delft compare ", "", "--set eval.limit=16", "fewer problems for each of the 9 models to answer"),
    Sub(r"^delft study ", "", "--set seeds=[0,1]", "2 seeds of each arm: the tests over seeds still have a spread"),
    Sub(r"^delft study \S*(arithmetic|lora_powered)", "", "--set evals.held_out.limit=16", "fewer problems for "
        "each model to answer"),
    Sub(r"^delft study \S*arithmetic", "", "--set evals.long.limit=8", "the same"),
    Sub(r"^delft study \S*arithmetic", "", "--set evals.long_gold.limit=8", "the same"),
    Sub(r"/tmp/h16e/", "/tmp/h16e/", "{here}/h16e/", "a directory of the test's own, not a shared /tmp one"),
)


@dataclass(frozen=True)
class Command:
    page: str
    line: int  # the line of the page it starts on
    text: str  # as printed: continuation lines joined, a console prompt dropped

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def bare(self) -> str:
        """The command without its comment: what RULES and SUBSTITUTIONS match."""
        return self.text if "\n" in self.text else shlex.join(shlex.split(self.text, comments=True))

    @property
    def rule(self) -> Rule | None:
        return next((r for r in RULES if re.search(r.pattern, self.bare)), None)


HEREDOC = re.compile(r"<<-?\s*'?\"?(\w+)")


def commands(block: Block) -> list[Command]:
    """The commands of a shell block, in order (see the module's docstring)."""
    lines, out, n = block.code.split("\n"), [], 0
    while n < len(lines):
        start, text = n, lines[n]
        n += 1
        if block.lang == "console":
            if not text.startswith("$ "):
                continue
            text = text[2:]
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        while text.endswith("\\") and n < len(lines):
            text, n = text[:-1].rstrip() + " " + lines[n].strip(), n + 1
        heredoc = HEREDOC.search(text)
        if heredoc:
            end = lines.index(heredoc.group(1), n)
            text, n = "\n".join([text, *lines[n:end + 1]]), end + 1
        parts = [text] if heredoc else re.split(r"\s+&&\s+", text)
        out += [Command(block.page, block.line + 1 + start, part) for part in parts]
    return out


COMMANDS = [c for b in BLOCKS if b.lang in SHELL for c in commands(b)]


def delft_params(args: list[str]) -> tuple[str, dict]:
    """delft's own parser on the arguments (every option, its type and range; a missing one), nothing run: the
    command's name and its parameters."""
    command = typer.main.get_command(app)
    ctx = command.make_context("delft", list(args))
    rest = [*ctx._protected_args, *ctx.args]
    while hasattr(command, "resolve_command"):  # a group (delft, delft recipe): on to its subcommand
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)
        rest = [*ctx._protected_args, *ctx.args] if hasattr(command, "resolve_command") else []
    return command.name, ctx.params


def delft(args: list[str], here: Path, timeout: int = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "delft", *args], cwd=here, env=user_env(), capture_output=True,
                          text=True, check=False, timeout=timeout)


def said(proc: subprocess.CompletedProcess, what: str) -> str:
    return f"{what}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_every_command_has_a_rule():
    assert len(COMMANDS) >= 40, f"{len(COMMANDS)} commands found: is the extractor broken?"
    uncovered = [f"{c.id}: {c.text}" for c in COMMANDS if c.rule is None]
    assert not uncovered, "commands no RULES row covers (add one, saying why):\n" + "\n".join(uncovered)
    unused = [r.pattern for r in RULES if not any(c.rule == r for c in COMMANDS)]
    assert not unused, f"RULES rows no command uses (remove them): {unused}"
    idle = [s.new for s in SUBSTITUTIONS
            if not any(re.search(s.commands, c.bare) and s.old in c.text for c in COMMANDS)]
    assert not idle, f"SUBSTITUTIONS rows no command uses (remove them): {idle}"


def test_the_parse_check_can_fail():
    """delft_params refuses what delft itself refuses, so a PARSE line that passes is one delft accepts."""
    assert delft_params(["train", "recipe.yaml", "--nproc", "4"])[1]["nproc"] == 4
    for wrong in (["train", "r.yaml", "--nprocs", "4"], ["train", "r.yaml", "--nproc", "0"], ["export", "runs/x"],
                  ["trian", "r.yaml"]):
        with pytest.raises(typer.TyperException):
            delft_params(wrong)


# What a page's commands read that the page does not make itself, by name: how the test makes it, and what it is.
# "delft ..." runs as a RUN command (SUBSTITUTIONS applied), once a session; "copy P" copies P from the checkout; a
# page's name runs that page's own SHELL commands that name it.
INPUTS = {
    "recipe.yaml": ("delft recipe new quickstart recipe.yaml", "the reader's own recipe, as delft writes one"),
    "runs/quickstart": ("delft train recipes/quickstart.yaml", "the quickstart's finished run"),
    "runs/ce": ("delft train recipes/compare/ce.yaml --set output.dir=runs/ce", "a finished CE run"),
    "runs/del": ("delft train recipes/compare/del.yaml --set output.dir=runs/del", "a finished DEL run"),
    "gsm8k_test.jsonl": ("copy tests/data/gsm8k_test.jsonl", "GSM8K's test split (a slice: tests/data/README.md)"),
    "svamp.json": ("copy tests/data/svamp.json", "SVAMP (a slice: tests/data/README.md)"),
    "llama3-8b": ("docs/performance.md", "Llama-3-8B's config.json alone, as that page writes it"),
    "results/study/formats_lora": ("copy results/study/formats_lora", "the pilot lora_powered's plan reads"),
}
PAGE_INPUTS = {
    "docs/distributed.md": ["recipe.yaml"],
    "docs/evaluation.md": ["runs/quickstart", "runs/ce", "runs/del", "gsm8k_test.jsonl"],
    "docs/export.md": ["runs/del"],
    "docs/fsdp_memory_plan.md": ["llama3-8b"],
    "docs/inspect.md": ["recipe.yaml", "runs/ce", "runs/del"],
    "docs/studies.md": ["svamp.json"],
    "docs/study_lora_powered.md": ["results/study/formats_lora"],
}
FILE_HEADER = re.compile(r"#\s*([\w./-]+\.ya?ml)\s*$")  # a YAML block's first line naming the file it is
WRITES = ("--json", "--plot", "--out")  # options naming a file or folder the command must leave


def applied(command: Command, tiny: Path, here: Path) -> tuple[str, list[str]]:
    """The command's text with SUBSTITUTIONS' replacements, and the --set items they append."""
    text, appended = command.text, []
    for sub in (s for s in SUBSTITUTIONS if re.search(s.commands, command.bare)):
        new = sub.new.format(tiny=tiny, here=here)
        if sub.old:
            text = text.replace(sub.old, new)
        elif not re.search(rf"--set ['\"]?{re.escape(new.split(' ', 1)[1].split('=')[0])}=", command.text):
            appended += new.split(" ", 1)
    return text, appended


def words(command: Command, tiny: Path, here: Path) -> list[str]:
    """The command's words as the test runs them, globs expanded in ``here`` as a shell expands them."""
    text, appended = applied(command, tiny, here)
    out = []
    for word in shlex.split(text, comments=True):
        matches = sorted(glob.glob(word, root_dir=here)) if "*" in word else []
        out += matches or [word]
    return out + appended


def run_command(command: Command, tiny: Path, here: Path) -> None:
    """A RUN or SHELL command in ``here``: exit 0, and what it is told to write is there."""
    if command.rule.how == SHELL_LINE:
        proc = subprocess.run(["bash", "-c", applied(command, tiny, here)[0]], cwd=here, capture_output=True,
                              text=True, check=False, timeout=60)
        assert proc.returncode == 0, said(proc, f"{command.id}: {command.text}")
        return
    args = words(command, tiny, here)
    proc = delft(args[1:], here)
    assert proc.returncode == (2 if command.rule.refusal else 0), said(proc, f"{command.id}: {' '.join(args)}")
    assert command.rule.refusal in " ".join((proc.stdout + proc.stderr).split()), said(proc, command.rule.refusal)
    written = [args[i + 1] for i, w in enumerate(args[:-1]) if w in WRITES]
    missing = [w for w in written if not (here / w).exists()]
    assert not missing, f"{command.id}: exit 0, but it did not write {missing}"


@pytest.fixture(scope="session")
def make_input(tiny_model_dir, tmp_path_factory):
    """make_input(name, here): INPUTS[name] in ``here``; what delft makes is made once a session, then copied."""
    made = tmp_path_factory.mktemp("doc_inputs")
    shutil.copytree(REPO / "recipes", made / "recipes")

    def make(name: str, here: Path) -> None:
        how, _ = INPUTS[name]
        (here / name).parent.mkdir(parents=True, exist_ok=True)
        if how.startswith("delft "):
            if not (made / name).exists():
                run_command(Command("INPUTS", 0, how), tiny_model_dir, made)
            source = made / name
        elif how.startswith("copy "):
            source = REPO / how.removeprefix("copy ")
        else:  # the page's own commands that write it
            for c in (c for c in COMMANDS if c.page == how and c.rule.how == SHELL_LINE
                      and any(w == name or w.startswith(f"{name}/") for w in c.text.split())):
                run_command(c, tiny_model_dir, here)
            assert (here / name).exists(), f"{how}'s commands did not write {name}"
            return
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, here / name)

    return make


RUN_PAGES = sorted({c.page for c in COMMANDS if c.rule and c.rule.how != PARSE})


def test_page_inputs_are_declared_and_used():
    assert set(PAGE_INPUTS) <= set(RUN_PAGES), set(PAGE_INPUTS) - set(RUN_PAGES)
    named = {n for names in PAGE_INPUTS.values() for n in names}
    assert named == set(INPUTS), f"INPUTS no page names, or names no INPUTS row makes: {set(INPUTS) ^ named}"


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_runs_as_printed(page, tiny_model_dir, make_input, tmp_path):
    here = tmp_path
    shutil.copytree(REPO / "recipes", here / "recipes")
    for name in PAGE_INPUTS.get(page, []):
        make_input(name, here)
    for block in (b for b in BLOCKS if b.page == page):
        header = FILE_HEADER.match(block.code.split("\n", 1)[0])
        if block.lang in SHELL:
            for command in (c for c in commands(block) if c.rule.how != PARSE):
                run_command(command, tiny_model_dir, here)
        elif block.lang in YAML and header:
            (here / header.group(1)).write_text(block.code)
        elif block.lang in PYTHON and page in PYTHON_AFTER_SHELL:
            proc, report = run_python_block(block, tiny_model_dir, here)
            assert proc.returncode == 0, failed(block, proc)
            check_report(block, report)


def check_delft_line(args: list[str], here: Path) -> None:
    """delft's parser accepts the line; the recipe or study file it names passes delft recipe check with the line's
    own --set items; the GGUF types it asks for are ones delft writes."""
    _, params = delft_params(args)
    targets = [str(t) for t in params.get("targets") or params.get("recipes") or []]
    recipe = params.get("recipe") or params.get("study_file") or next(
        (t for t in targets if t.endswith((".yaml", ".yml"))), None)
    if recipe is not None:
        sets = [w for item in params.get("set_", []) for w in ("--set", item)]
        proc = delft(["recipe", "check", str(recipe), *sets], here, timeout=300)
        assert proc.returncode == 0, said(proc, f"delft recipe check {recipe}")
    if params.get("gguf"):
        assert parse_types(params["gguf"]) == [t.lower() for t in params["gguf"]]


@pytest.fixture(scope="module")
def parse_dir(make_input, tmp_path_factory):
    here = tmp_path_factory.mktemp("doc_parse")
    shutil.copytree(REPO / "recipes", here / "recipes")
    make_input("recipe.yaml", here)
    return here


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.rule and c.rule.how == PARSE], ids=lambda c: c.id)
def test_commands_not_run_here_parse(command, parse_dir, tiny_model_dir):
    args = words(command, tiny_model_dir, parse_dir)
    env = dict(w.split("=", 1) for w in takewhile(lambda w: re.fullmatch(r"[A-Z_]+=\S*", w), args))
    args = args[len(env):]
    if args[0] == "delft":
        check_delft_line(args[1:], parse_dir)
    elif args[0] in ("torchrun", "accelerate"):
        launcher = get_args_parser().parse_args(args[1:]) if args[0] == "torchrun" else \
            launch_command_parser().parse_args(args[2:])
        assert launcher.module and launcher.training_script == "delft", vars(launcher)
        check_delft_line(launcher.training_script_args, parse_dir)
    elif args[0] == "bash":  # the script is there and bash reads it
        proc = subprocess.run(["bash", "-n", args[1]], cwd=REPO, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr
    else:  # pytest takes the options, collecting one torch-free test file (without conftest.py, which loads torch)
        assert args[1:3] == ["-m", "pytest"], f"{command.id}: no check for {command.text}"
        proc = subprocess.run([sys.executable, *args[1:], "--collect-only", "-q", "--noconftest", "tests/test_docs.py"],
                              cwd=REPO, env={**user_env(), **env}, capture_output=True, text=True, check=False,
                              timeout=300)
        assert proc.returncode == 0, said(proc, command.text)


@pytest.mark.parametrize("command", [Command(*row) for row in INDENTED], ids=lambda c: c.id)
def test_indented_commands_parse(command, parse_dir, tiny_model_dir):
    check_delft_line(words(command, tiny_model_dir, parse_dir)[1:], parse_dir)


def test_indented_commands_are_found():
    """The README's overview is read (an extractor that found nothing would pass the test above vacuously)."""
    found = {text.split()[1] for page, _, text in INDENTED if page == "README.md"}
    assert {"train", "eval", "inspect", "export", "compare", "study"} <= found, found
