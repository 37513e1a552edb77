"""`delft inspect`'s output: rich tables of the per-digit probabilities (a compact form for narrow consoles),
the JSON record and the heatmap.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from rich import box
from rich.color import Color
from rich.console import Console
from rich.style import Style
from rich.table import Table
from rich.text import Text

from delft import __version__
from delft.inspection.records import InspectResult, PositionRecord
from delft.numbers.digits import DIGITS
from delft.outputs import pct, write_figure

LEGEND = ("cells: P(digit | the next token is a digit) in %, [n] = the answer's digit, '·' < 0.5 %; "
          "entropy: over the ten digits, in bits; P(digits): full-vocabulary probability that the next token "
          "is a digit at all; p(token): full-vocabulary probability of the answer's token; argmax: where the "
          "model would have gone instead (its top digit, and its top token if that is not a digit). With number "
          "tokens of several digits a row is one character of the token shown (1[2]3: the 2), its cells are "
          "P(digit | the token's characters before it), P(digits) the probability of a number token that "
          "agrees with them.")


def to_json(result: InspectResult) -> dict[str, Any]:
    """Every number shown: per model, per number, per row (digit or decimal point)."""
    return {
        "delft_version": __version__,
        "prompt": result.prompt,
        "answer": result.answer,
        "mode": result.mode,
        "answer_source": result.source,
        "target": result.target,
        "digits": DIGITS,
        "notes": result.notes + ([] if result.has_digits else ["the answer has no digits: nothing to show"]),
        "models": [{
            "name": m.name, "base": m.base, "adapter": m.adapter, "template": m.template,
            "prompt_text": m.prompt_text, "answer_token_ids": m.answer_ids, "own_greedy_answer": m.own_answer,
            "numbers": [{"index": n.index, "text": n.text, "positions": [asdict(r) for r in n.rows]}
                        for n in m.numbers],
        } for m in result.models],
    }


_STOPS = ((0.0, (40, 40, 70)), (0.5, (30, 120, 150)), (1.0, (250, 215, 60)))


def heat(p: float) -> tuple[int, int, int]:
    """Background colour for a probability: dark blue (low) -> teal -> yellow (high)."""
    p = min(max(p, 0.0), 1.0)
    for (p0, c0), (p1, c1) in zip(_STOPS, _STOPS[1:]):
        if p <= p1:
            f = (p - p0) / (p1 - p0)
            return tuple(round(a + f * (b - a)) for a, b in zip(c0, c1))
    return _STOPS[-1][1]


def fmt_prob(p: float, marked: bool = False) -> str:
    """A digit cell: the probability in whole percent; '·' below 0.5 %; '[n]' on the answer's digit."""
    pct = round(100 * p)
    if marked:
        return f"[{pct}]"
    return "·" if pct == 0 else str(pct)


def fmt_pct(p: float) -> str:
    return pct(p, unit="%")


def fmt_entropy(h: float) -> str:
    return f"{h:.2f}"


def fmt_argmax(r: PositionRecord) -> str:
    """Where the model would have gone instead: its top digit where that is not the answer's digit, and its
    full-vocabulary top token with probability where that is not a digit ('' where the answer is the argmax)."""
    if r.top_token_id == r.token_id:
        return ""
    parts = []
    if r.digit is not None and r.argmax_digit != r.digit:
        parts.append(str(r.argmax_digit))
    if r.top_digit is None:
        parts.append(f"{r.top_token!r} {fmt_pct(r.top_token_prob)}")
    elif r.digit is None:
        parts.append(str(r.top_digit))
    return ", ".join(parts)


def fmt_token(r: PositionRecord) -> str:
    """The token a row belongs to, its character bracketed where the token has several: '1[2]3'."""
    text = r.text.strip()
    if r.kind != "digit" or len(text) < 2:
        return text
    j = r.char_index
    return f"{text[:j]}[{text[j]}]{text[j + 1:]}"


def has_multi_digit_tokens(result: "InspectResult") -> bool:
    """Whether any shown row is one character of a token of several digits (the table gets a token column)."""
    return any(r.char_index or len(r.text.strip()) > 1 for m in result.models for n in m.numbers for r in n.rows
               if r.kind == "digit")


def _cell(p: float, marked: bool) -> Text:
    text = fmt_prob(p, marked)
    if round(100 * p) == 0 and not marked:
        return Text(text, style="dim")
    r, g, b = heat(p)
    fg = "black" if (0.299 * r + 0.587 * g + 0.114 * b) > 140 else "white"
    return Text(text, style=Style(color=fg, bgcolor=Color.from_rgb(r, g, b), bold=marked, underline=marked))


def _row(r: PositionRecord, label: str, model: Optional[str], token: bool = False) -> list:
    cells: list = [Text(label, style="italic dim" if r.kind == "point" else "")]
    if token:
        cells.append(fmt_token(r))
    if model is not None:
        cells.append(model)
    cells += [_cell(p, r.digit == d) for d, p in enumerate(r.probs)]
    mass_style = "" if r.digit_mass >= 0.9 or r.kind == "point" else "yellow"
    cells += [fmt_entropy(r.entropy), Text(fmt_pct(r.digit_mass), style=mass_style), fmt_pct(r.token_prob),
              fmt_argmax(r)]
    return cells


HEADERS = ("entropy", "P(digits)", "p(token)")


COMPACT_HEADERS = ("H", "P(d)", "p(t)")  # for consoles narrower than the full table


def render_tables(result: InspectResult, compact: bool = False) -> list[Table]:
    """One table per number; with several models, one sub-row per model under each position.

    ``compact`` shortens the headers of the three summary columns (see COMPACT_HEADERS) and lets the place,
    model and argmax columns wrap, for narrow consoles; the digit cells are never cut.
    """
    compare = len(result.models) > 1
    token = has_multi_digit_tokens(result)
    first = result.models[0].numbers if result.models else []
    tables = []
    for k, num in enumerate(first):
        title = f"number {k + 1} of {len(first)}: {num.text}"
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                      padding=(0, 0) if compact else (0, 1), collapse_padding=True)
        per_model = [m.numbers[k].rows for m in result.models]
        labels = ["point" if r.kind == "point" else (r.place_name or "") for r in num.rows]
        table.add_column("place", no_wrap=True, min_width=max(map(len, labels)))
        if token:
            table.add_column("token", no_wrap=True)
        if compare:
            table.add_column("model", no_wrap=True, overflow="ellipsis",
                             min_width=min(8, max(len(m.name) for m in result.models)))
        for d in range(10):
            width = max(len(fmt_prob(r.probs[d], r.digit == d)) for rows in per_model for r in rows)
            table.add_column(str(d), justify="right", no_wrap=True, min_width=width)
        for h in (COMPACT_HEADERS if compact else HEADERS):
            table.add_column(h, justify="right", no_wrap=True)
        table.add_column("argmax", no_wrap=not compact, overflow="fold")
        for j, label in enumerate(labels):
            for mi, m in enumerate(result.models):
                r = per_model[mi][j]
                last = mi == len(result.models) - 1
                table.add_row(*_row(r, label if mi == 0 else "", m.name if compare else None, token),
                              end_section=compare and last and j < len(num.rows) - 1)
        tables.append(table)
    return tables


def render(result: InspectResult, console: Console) -> None:
    m0 = result.models[0]
    console.print(f"[bold]prompt[/] ({m0.template} template): {result.prompt!r}", highlight=False)
    console.print(f"[bold]answer[/] ({result.source}): {result.answer!r}", highlight=False)
    for m in result.models[1:]:
        if m.own_answer is not None:
            console.print(f"[dim]{m.name}'s own greedy answer: {m.own_answer!r}[/]", highlight=False)
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    if not result.has_digits:
        console.print("[yellow]the answer has no digits: nothing to show.[/] Teacher-force a number with "
                      "--target N (e.g. --target 391), or raise --max-new-tokens if the answer was cut short.",
                      highlight=False)
        return
    tables = render_tables(result)
    wide = console.options.update_width(10_000)
    compact = any(console.measure(t, options=wide).maximum > console.width for t in tables)
    if compact:
        tables = render_tables(result, compact=True)
    for table in tables:
        console.print(table)
    legend = LEGEND
    if compact:
        legend += " H = entropy, P(d) = P(digits), p(t) = p(token)."
    console.print(Text(legend, style="dim"))


def write_plot(result: InspectResult, path: Path) -> None:
    """Heatmap PNG: rows = digit positions (all numbers), columns = digits 0-9, one panel per model."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    views = [(m.name, [r for n in m.numbers for r in n.rows if r.kind == "digit"]) for m in result.models]
    n_rows = max(1, len(views[0][1]))
    multi = len(result.models[0].numbers) > 1
    labels = [(f"#{r.number + 1} " if multi else "") + f"{r.place_name} ({fmt_token(r)})" for r in views[0][1]]
    fig = Figure(figsize=(1.2 + 4.2 * len(views), 1.4 + 0.38 * n_rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(views), squeeze=False)[0]
    image = None
    for ax, (name, rows) in zip(axes, views):
        matrix = [r.probs for r in rows] or [[0.0] * 10]
        image = ax.imshow(matrix, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        ax.set_xticks(range(10), list(DIGITS))
        ax.set_yticks(range(len(rows)), labels if ax is axes[0] else [""] * len(rows))
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("digit")
        for y, r in enumerate(rows):
            if r.digit is not None:
                ax.add_patch(Rectangle((r.digit - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
            if n_rows <= 40:
                for d, p in enumerate(r.probs):
                    if p >= 0.005:
                        ax.text(d, y, f"{p:.2f}", ha="center", va="center", fontsize=6,
                                color="black" if p > 0.6 else "white")
    fig.colorbar(image, ax=list(axes), label="P(digit | a digit comes next)", shrink=0.9)
    fig.suptitle(f"{result.prompt[:70]!r} -> {result.answer[:40]!r} (red: the answer's digit)", fontsize=9)
    write_figure(fig, path, "--plot", dpi=120)
