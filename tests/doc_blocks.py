"""The fenced code blocks of the docs (every docs/*.md page and README.md), and a Python block run as a user runs
it: tests/test_doc_examples.py (Python and YAML blocks) and tests/test_doc_commands.py (shell blocks) read them.

What a Python block gets changed, and nothing else: the docs' model, delft's built-in ``model_path("smollm2-135m")``
(DOC_ALIAS; ``HuggingFaceTB/SmolLM2-135M``, DOC_MODEL, in a YAML block), becomes the tiny saved model's path
(tests/tiny.py), and EPILOGUE is appended to report what the block made. It runs in a fresh process with
HF_HUB_OFFLINE=1, so a block that names another model or a hub dataset fails instead of downloading.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), REPO / "README.md"]
DOC_MODEL = "HuggingFaceTB/SmolLM2-135M"
DOC_ALIAS = 'model_path("smollm2-135m")'
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
# What each fence language is: run as a script, read by what reads that file, run as commands (test_doc_commands:
# bash lines are commands, console lines that start with "$ " are, the rest of a console block is their output), or
# an output listing that is shown, not run. Any other language, or none, fails test_every_block_is_covered.
PYTHON, YAML, SHELL, OUTPUT = {"python"}, {"yaml"}, {"bash", "console"}, {"text"}
# Pages whose Python blocks read what the page's shell commands wrote: test_doc_commands runs them after those
# commands, in the same directory, instead of test_doc_examples in an empty one.
PYTHON_AFTER_SHELL = {"docs/export.md": "loads merged/del, which the page's delft export commands write"}
# A Python block that trains nothing, by page: the name it must leave, which its report checks (check_report)
MAKES = {"docs/losses.md": "term", "docs/export.md": "model"}
REPORT_MARK = "DOC-EXAMPLE-REPORT "
EPILOGUE = f"""

import json as _doc_json
_doc_report = {{}}
if "trainer" in globals():
    _doc_report["log_history"] = trainer.state.log_history
if "term" in globals():
    _doc_report["term"] = float(term)
if "model" in globals() and "tok" in globals():
    _doc_report["model"] = [type(model).__name__, model.config.vocab_size, len(tok)]
print({REPORT_MARK!r} + _doc_json.dumps(_doc_report, default=str))
"""


@dataclass(frozen=True)
class Block:
    page: str  # relative to the checkout: docs/export.md, README.md
    line: int  # of the opening fence, 1-based
    lang: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}-{self.lang or 'none'}"


INDENTED_DELFT = re.compile(r"^ {4}(delft .*)$")


def read_page(path: Path) -> tuple[list[Block], list[tuple[int, str]]]:
    """A Markdown page's fenced code blocks, with the language each fence names ('' for none), and the `delft`
    lines of its indented (unfenced) code: the README's overview and install steps. Those are not run
    (placeholders such as recipe.yaml and runs/ce stand for the reader's own); test_doc_commands checks that delft's
    parser takes them and that a recipe they name passes recipe check."""
    blocks, indented, open_at, fence, lang, body = [], [], 0, None, "", []
    for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        m = FENCE.match(line.strip())
        if fence is None and m:
            open_at, fence, lang, body = n, m.group(1), m.group(2).lower(), []
        elif fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            blocks.append(Block(path.relative_to(REPO).as_posix(), open_at, lang, "\n".join(body) + "\n"))
            fence = None
        elif fence is not None:
            body.append(line)
        elif INDENTED_DELFT.match(line):
            indented.append((n, INDENTED_DELFT.match(line).group(1)))
    return blocks, indented


PAGE_CODE = {page.relative_to(REPO).as_posix(): read_page(page) for page in PAGES}
BLOCKS = [b for blocks, _ in PAGE_CODE.values() for b in blocks]
INDENTED = [(page, n, text) for page, (_, lines) in PAGE_CODE.items() for n, text in lines]


def for_the_tiny_model(code: str, model_dir: Path) -> str:
    return code.replace(DOC_MODEL, str(model_dir)).replace(DOC_ALIAS, f"model_path({str(model_dir)!r})")


def user_env() -> dict:
    """A user's environment: offline, this checkout first, and no TRITON_INTERPRET (conftest sets it for the
    tests' own process; a block that runs Liger on the CPU must set it itself, as the docs tell users to)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def run_python_block(block: Block, model_dir: Path | None, cwd: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """The block as a script in ``cwd`` (for the tiny model at ``model_dir``, or unchanged where that is None;
    EPILOGUE appended): the process and its report."""
    script = cwd / f"block_{block.line}.py"
    code = block.code if model_dir is None else for_the_tiny_model(block.code, model_dir)
    script.write_text(code + EPILOGUE)
    proc = subprocess.run([sys.executable, str(script)], cwd=cwd, env=user_env(), capture_output=True, text=True,
                          check=False, timeout=1200)
    reports = [json.loads(ln[len(REPORT_MARK):]) for ln in proc.stdout.splitlines() if ln.startswith(REPORT_MARK)]
    return proc, (reports[0] if reports else {})


def failed(block: Block, proc: subprocess.CompletedProcess) -> str:
    return f"{block.id} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def check_report(block: Block, report: dict) -> None:
    """What the block made: a digit term logged by a training, or the name MAKES says it leaves."""
    if "trainer.train()" in block.code:
        terms = [v for row in report.get("log_history", []) for k, v in row.items() if k.endswith("digit_term")]
        assert terms and all(math.isfinite(v) and v > 0 for v in terms), f"{block.id}: no digit term logged: {report}"
    elif MAKES[block.page] == "term":
        assert math.isfinite(report["term"]) and report["term"] > 0, f"{block.id}: {report}"
    else:  # a model loaded whole from files (not an adapter on a base): its class and its tokenizer's size
        kind, vocab, tokens = report["model"]
        assert kind.endswith("ForCausalLM") and 0 < tokens <= vocab, f"{block.id}: {report}"
