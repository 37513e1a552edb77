"""The Markdown docs hold together: relative links and #anchors resolve, the README stays short, and every
docs/ page can be reached from the README. No torch, no delft import: plain file reading."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 260

# Pages another change is writing right now: a link to one of these may dangle only while the file is absent
# (once it exists, its links and anchors are checked like any other). Empty this set when they have landed.
PENDING: set[Path] = set()
# What code, recipes and CI cite: `docs/page.md#anchor`, `results/.../X.md#anchor`, `README.md#anchor`.
CITATION = re.compile(r"(?<![\w/.])((?:docs|results)/[\w./-]+\.md|README\.md(?=#))(?:#([\w-]+))?")
# The old way of citing, by README section title: it broke silently when a section moved.
OLD_CITATION = re.compile(r"README(?:\.md)?[,]? \(?[\"'][A-Z]")

LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def markdown_files() -> list[Path]:
    files = [README, *sorted(DOCS.glob("*.md")), *sorted((REPO / "results").rglob("*.md"))]
    return [f for f in files if f.is_file()]


def strip_code(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links and headings there are not Markdown)."""
    lines, fence = [], None
    for line in text.split("\n"):
        m = re.match(r"\s*(`{3,}|~{3,})", line)
        if m and (fence is None or m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)):
            fence = None if fence else m.group(1)
            lines.append("")
            continue
        lines.append("" if fence else line)
    return re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", "\n".join(lines))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (except - and _), spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "-_ ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's slug in a Markdown file; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    fence = None
    for line in path.read_text(encoding="utf-8").split("\n"):
        m = re.match(r"\s*(`{3,}|~{3,})", line)
        if m and (fence is None or m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)):
            fence = None if fence else m.group(1)
            continue
        h = None if fence else HEADING.match(line)
        if not h:
            continue
        s = slug(h.group(2))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[tuple[str, str]]:
    """(target path, anchor) of every relative link in a Markdown file; web and mail links left out."""
    out = []
    for target in LINK.findall(strip_code(path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        file, _, anchor = target.partition("#")
        out.append((unquote(file), unquote(anchor)))
    return out


def resolve(source: Path, file: str) -> Path:
    return (source.parent / file).resolve() if file else source


def test_slug_follows_github():
    assert slug("Export to GGUF (llama.cpp, Ollama, LM Studio)") == "export-to-gguf-llamacpp-ollama-lm-studio"
    assert slug("Evaluating: `delft eval`") == "evaluating-delft-eval"
    assert slug("Teacher-forced digit metrics: `--teacher-forced`") == "teacher-forced-digit-metrics---teacher-forced"
    assert slug("The default weight: `del` 0.03") == "the-default-weight-del-003"
    assert slug("Shift invariance: where DEL's gradient goes wrong") == "shift-invariance-where-dels-gradient-goes-wrong"


def test_links_skip_code_and_web(tmp_path):
    page = tmp_path / "probe.md"
    page.write_text("[a](x.md) `[b](y.md)` [c](https://e.org/z.md) [d](mailto:me@e.org)\n```\n[e](w.md)\n```\n"
                    "![f](p.png#top) [g](#here)\n")
    assert links(page) == [("x.md", ""), ("p.png", "top"), ("", "here")]


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_resolve(page: Path):
    broken = []
    for file, anchor in links(page):
        target = resolve(page, file)
        if not target.exists():
            if target not in PENDING:
                broken.append(f"{file}: no such file")
            continue
        if anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{file}#{anchor}: {target.relative_to(REPO)} has no such heading")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail into docs/"


def test_every_docs_page_is_reachable_from_the_readme():
    linked = {resolve(README, f) for f, _ in links(README)}
    index = DOCS / "README.md"
    assert index in linked, "README.md does not link docs/README.md"
    linked |= {resolve(index, f) for f, _ in links(index)}
    missing = [str(p.relative_to(REPO)) for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"not linked from README.md or docs/README.md: {missing}"


def cited_files() -> list[Path]:
    files = [*(REPO / "delft").rglob("*.py"), *(REPO / "recipes").rglob("*.yaml"), *(REPO / "bench").glob("*.py"),
             *(REPO / "tests").rglob("*.py"), REPO / ".ci" / "run", REPO / "pyproject.toml"]
    return sorted(f for f in files if f.is_file())


def test_every_page_and_section_the_code_cites_exists():
    broken, old = [], []
    for f in cited_files():
        if f.name == "test_docs.py":  # its own examples
            continue
        text = f.read_text(encoding="utf-8")
        for n, line in enumerate(text.splitlines(), 1):
            for file, anchor in CITATION.findall(line):
                target = REPO / file
                where = f"{f.relative_to(REPO)}:{n}"
                if not target.is_file():
                    broken.append(f"{where}: {file} does not exist")
                elif anchor and anchor not in anchors(target):
                    broken.append(f"{where}: {file} has no section #{anchor}")
            if OLD_CITATION.search(line):
                old.append(f"{f.relative_to(REPO)}:{n}: {line.strip()[:100]}")
    assert not broken, "\n".join(broken)
    assert not old, "cite a page and #anchor, not a README section title:\n" + "\n".join(old)


def test_the_citation_scan_finds_what_it_should(tmp_path):
    line = "see docs/losses.md#normalisation-and-lambda and results/study/arithmetic/REPORT.md; (README.md#install-and-run)"
    assert CITATION.findall(line) == [("docs/losses.md", "normalisation-and-lambda"),
                                      ("results/study/arithmetic/REPORT.md", ""), ("README.md", "install-and-run")]
    assert CITATION.findall('(tmp / "README.md").write_text(card)') == []  # an export's own model card
    assert OLD_CITATION.search('(README, "The losses")') and OLD_CITATION.search('README.md ("Evaluating")')


def test_the_recipe_keys_page_is_generated_from_the_schema():
    from delft.recipe.schema import Recipe
    from delft.recipe.keys import flat_keys
    from delft.recipe.keys import reference_markdown

    page = (REPO / "docs" / "recipe_keys.md").read_text()
    assert page == reference_markdown(), "docs/recipe_keys.md is stale: run `delft recipe keys > docs/recipe_keys.md`"
    for key in flat_keys(Recipe().to_dict()):
        if not key.startswith(("eval.data", "model.architecture", "train.early_stopping")):  # unset sections
            assert f"`{key}`" in page, key
    assert "`model.architecture.hidden_size`" in page and "### eval.data" in page
    assert "`train.early_stopping.patience`" in page
