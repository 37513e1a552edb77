"""``delft inspect``: the model's distribution over the ten digits at every digit of one answer.

Rows are digit *characters*: on tokenizers with multi-digit number tokens (Llama-3's "123") each character
gets a row, scored as the losses score it (delft.numtokens.char_logits: the number tokens that agree with the
answer's token before that character), and the table names the token it belongs to.

Three separate pieces, so each can be tested on its own:

* :func:`compute_records` -- pure computation: (model, tokenizer, prompt text, answer token ids) -> one
  :class:`PositionRecord` per answer token, from ONE teacher-forced forward pass that keeps only the answer
  positions' logits (``logits_to_keep``; or the decoder's hidden rows times the output layer for models
  without it). Places come from :mod:`delft.digits` (the same rules as the losses).
* :func:`render_tables` -- rich Tables (one per number in the answer; with several models, one sub-row per model).
* :func:`write_plot` -- a heatmap PNG (digit positions x digits, one panel per model).

:func:`run_inspect` ties them together for the CLI: loads each model in turn (one in memory at a time), picks the
answer (``--target`` or the first model's greedy answer) and writes ``--json`` / ``--plot``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from rich import box
from rich.color import Color
from rich.console import Console
from rich.style import Style
from rich.table import Table
from rich.text import Text

from delft import __version__
from delft.data import prompt_ids
from delft.digits import DIGITS, DigitVocab, number_runs, place_name, run_places
from delft.errors import UserError
from delft.outputs import check_output_files, write_figure, write_result
from delft.numtokens import NumberVocab, number_vocab

PURPOSE = "per-digit inspection"
# "391", "-3.5", "1,234", "+0.25", ".5": an optional sign, digits (comma groups of 3 allowed), a decimal part.
TARGET_RE = re.compile(r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)", re.ASCII)  # 0-9 only, not "٤٢"
LEGEND = ("cells: P(digit | the next token is a digit) in %, [n] = the answer's digit, '·' < 0.5 %; "
          "entropy: over the ten digits, in bits; P(digits): full-vocabulary probability that the next token "
          "is a digit at all; p(token): full-vocabulary probability of the answer's token; argmax: where the "
          "model would have gone instead (its top digit, and its top token if that is not a digit). With number "
          "tokens of several digits a row is one character of the token shown (1[2]3: the 2), its cells are "
          "P(digit | the token's characters before it), P(digits) the probability of a number token that "
          "agrees with them.")


# ------------------------------------------------------------------------------------------- records


@dataclass
class PositionRecord:
    """What the model predicted at one answer position (every number here is also in the JSON)."""

    index: int  # position in the answer's tokens
    token_id: int
    token: str  # the vocabulary piece ("Ġ3", "▁", "3")
    text: str  # the token decoded
    char: Optional[str]  # '0'..'9' or '.' when the token is a digit or the dot, else None
    kind: Optional[str]  # "digit", "point" (a decimal point inside a number) or None (not shown)
    number: Optional[int]  # which number of the answer (0-based) for digit and point rows
    place: Optional[int]  # delft.digits place: 1 = units, 2 = tens, -1 = tenths, ...
    place_name: Optional[str]
    probs: list[float]  # over the ten digits '0'..'9', conditional on the next token being a digit (sum 1)
    digit_logprobs: list[float]  # full-vocabulary log-probabilities of the ten digit tokens
    entropy: float  # of ``probs``, bits
    digit_mass: float  # full-vocabulary probability of the ten digit tokens together
    token_prob: float  # full-vocabulary probability of this answer token
    digit: Optional[int]  # the answer's digit here (None for non-digits)
    argmax_digit: int
    top_token_id: int  # full-vocabulary argmax
    top_token: str  # ... decoded
    top_token_prob: float
    top_digit: Optional[int]  # the argmax's digit here when the argmax is a number token agreeing before it
    char_index: int = 0  # which character of the token this row is (number tokens of several digits)


@dataclass
class Number:
    """One number of the answer: its text and its shown rows (digits and decimal points, in order)."""

    index: int
    text: str
    rows: list[PositionRecord]


def check_target(target: str) -> str:
    """The target stripped of surrounding spaces; a UserError unless it is one plain number."""
    text = str(target).strip()
    if not TARGET_RE.fullmatch(text):
        other = any(c.isdigit() and c not in DIGITS for c in text)  # e.g. Arabic-Indic or full-width digits
        raise UserError(f"target is not a number{' written with the digits 0-9' if other else ''}: {target!r}",
                        "--target",
                        'Give the answer as a plain number, e.g. --target 391, --target -3.5 or --target 1,234.')
    return text


def _is_digit(char: Optional[str]) -> bool:
    return char is not None and char in DIGITS


def _thousands_separators(chars: Sequence[Optional[str]], texts: Sequence[str]) -> set[int]:
    """Positions of ',' between a digit and exactly three digits ("1,234"): skipped so places count by value."""
    out = set()
    n = len(chars)
    for i, t in enumerate(texts):
        if t == "," and 0 < i and _is_digit(chars[i - 1]) and i + 3 < n \
                and all(_is_digit(chars[i + k]) for k in (1, 2, 3)) and (i + 4 >= n or not _is_digit(chars[i + 4])):
            out.add(i)
    return out


def char_rows(token_ids: Sequence[int], texts: Sequence[str],
              vocab: DigitVocab | NumberVocab) -> tuple[list[Optional[str]], list[str], list[int]]:
    """(char, text, token index) per row: a number token gives one row per digit, any other token one row
    (its char '.' for the dot, else None); ``texts`` are the tokens decoded."""
    numbers = number_vocab(vocab)
    chars: list[Optional[str]] = []
    row_texts: list[str] = []
    owners: list[int] = []
    for i, t in enumerate(token_ids):
        digits = numbers.text_of(int(t))
        chars.extend(digits or [None])
        row_texts.extend(digits or [texts[i]])
        owners.extend([i] * len(digits or [None]))
    return chars, row_texts, owners


def label_positions(token_ids: Sequence[int], texts: Sequence[str], vocab: DigitVocab | NumberVocab):
    """(kind, number, place) per row (``char_rows``: per token, or per digit of a number token), places
    from delft.digits.run_places.

    Thousands separators are dropped before the run rules apply, so "1,234" is one number whose '1' is the
    thousands digit. A '.' is shown (kind "point") when it stands inside a number with a digit after it; a
    trailing sentence dot ("391.") or a run of dots is not.
    """
    chars, texts, _ = char_rows(token_ids, texts, vocab)
    keep = [i for i in range(len(chars)) if i not in _thousands_separators(chars, texts)]
    kept_chars = [chars[i] for i in keep]
    kept_places = run_places(kept_chars)
    n = len(chars)
    kind: list[Optional[str]] = [None] * n
    number: list[Optional[int]] = [None] * n
    place: list[Optional[int]] = [None] * n
    count = 0
    for j, end in number_runs(kept_chars):
        run = range(j, end)
        if any(kept_chars[k] in DIGITS for k in run):
            for k in run:
                i = keep[k]
                if kept_chars[k] in DIGITS:
                    kind[i], number[i], place[i] = "digit", count, kept_places[k]
                elif k > j and any(kept_chars[m] in DIGITS for m in range(k + 1, end)):
                    kind[i], number[i] = "point", count
            count += 1
    return kind, number, place


def _answer_logits(model, input_ids, n_keep: int):
    """Logits of the last ``n_keep`` positions only ([n_keep, vocab], float32)."""
    import inspect as pyinspect

    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = pyinspect.signature(base.forward).parameters
    with torch.inference_mode():
        for name in ("logits_to_keep", "num_logits_to_keep"):
            if name in params:
                out = model(input_ids=input_ids, use_cache=False, **{name: n_keep})
                return out.logits[0, -n_keep:].float()
        from delft.models import decoder_and_head

        decoder, head = decoder_and_head(model)
        hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state[0, -n_keep:]
        return head(hidden).float()


def _digit(char: Optional[str]) -> Optional[int]:
    return int(char) if char is not None and char in DIGITS else None


def compute_records(model, tokenizer, prompt_text: str, answer_ids: Sequence[int],
                    vocab: Optional[DigitVocab | NumberVocab] = None) -> list[PositionRecord]:
    """One record per answer token (per digit of a multi-digit number token), from one teacher-forced pass
    over prompt + answer.

    The input is the prompt and the answer without its last token; the logits of the last ``len(answer)``
    positions predict the answer's tokens, and only those rows are computed beyond the hidden states.
    """
    import torch

    numbers = number_vocab(vocab) or NumberVocab.from_tokenizer(tokenizer, PURPOSE)
    answer_ids = [int(t) for t in answer_ids]
    if not answer_ids:
        return []
    p_ids = prompt_ids(tokenizer, prompt_text)
    if not p_ids:
        raise UserError("the prompt is empty after tokenization", "prompt", "Give a non-empty prompt.")
    device = next(model.parameters()).device
    input_ids = torch.tensor([p_ids + answer_ids[:-1]], dtype=torch.long, device=device)
    logp = torch.log_softmax(_answer_logits(model, input_ids, len(answer_ids)), dim=-1)  # [A, V]
    stats = _char_stats(logp, answer_ids, numbers)
    ans = torch.tensor(answer_ids, device=logp.device)
    tok_l = logp.gather(1, ans[:, None])[:, 0].exp().cpu().tolist()
    top_p, top_id = logp.max(dim=-1)
    top_id_l, top_p_l = top_id.cpu().tolist(), top_p.exp().cpu().tolist()

    texts = [tokenizer.decode([t]) for t in answer_ids]
    pieces = tokenizer.convert_ids_to_tokens(answer_ids)
    chars, _, owners = char_rows(answer_ids, texts, numbers)
    kind, number, place = label_positions(answer_ids, texts, numbers)
    records = []
    for k, (i, char) in enumerate(zip(owners, chars)):
        j = k - owners.index(i)  # the character's index inside its token
        probs = stats["cond"][k]
        records.append(PositionRecord(
            index=i, token_id=answer_ids[i], token=str(pieces[i]), text=texts[i], char=char, kind=kind[k],
            number=number[k], place=place[k], place_name=place_name(place[k]) if place[k] is not None else None,
            probs=probs, digit_logprobs=stats["logp"][k], entropy=stats["entropy"][k], digit_mass=stats["mass"][k],
            token_prob=tok_l[i], digit=_digit(char),
            argmax_digit=max(range(10), key=lambda d: probs[d]),
            top_token_id=int(top_id_l[i]), top_token=tokenizer.decode([int(top_id_l[i])]),
            top_token_prob=top_p_l[i],
            top_digit=_top_digit(numbers, int(top_id_l[i]), numbers.text_of(answer_ids[i]), j),
            char_index=j))
    return records


def _char_stats(logp, answer_ids: Sequence[int], numbers: NumberVocab) -> dict[str, list]:
    """Per row (``char_rows``): full-vocabulary log-probabilities of the digits (the number tokens agreeing
    with the row's token before it, by digit: delft.numtokens.char_logits on log-probabilities), their
    conditional distribution, its entropy (bits) and their total probability. A non-number token's row is
    the first character's (for single-digit tokenizers: the ten digit tokens)."""
    import torch

    from delft.numtokens import char_logits

    cols = torch.tensor([numbers.column_of(t) or 0 for t in answer_ids], device=logp.device)
    ids = torch.tensor(numbers.ids, device=logp.device)
    d_logp = char_logits(logp[:, ids], cols, numbers.char_table(logp.device)).logits  # [rows, 10]
    cond = torch.softmax(d_logp, dim=-1)
    entropy = -(cond * torch.log2(cond.clamp_min(1e-30))).sum(-1)
    mass = torch.logsumexp(d_logp, dim=-1).exp()
    return {"logp": d_logp.cpu().tolist(), "cond": cond.cpu().tolist(), "entropy": entropy.cpu().tolist(),
            "mass": mass.cpu().tolist()}


def _top_digit(numbers: NumberVocab, top_id: int, answer_text: Optional[str], j: int) -> Optional[int]:
    """The argmax token's digit at character j, when it is a number token agreeing with the answer's before j."""
    top = numbers.text_of(top_id)
    if top is None or top == "." or len(top) <= j or (j and (answer_text or "")[:j] != top[:j]):
        return None
    return int(top[j])


def numbers_of(records: Sequence[PositionRecord]) -> list[Number]:
    """The answer's numbers: their text (sign and separators included) and their digit/point rows."""
    out: list[Number] = []
    by_number: dict[int, list[PositionRecord]] = {}
    token_text = {r.index: r.text for r in records}  # several rows share a multi-digit token
    for r in records:
        if r.number is not None:
            by_number.setdefault(r.number, []).append(r)
    for n in sorted(by_number):
        rows = by_number[n]
        first, last = rows[0].index, rows[-1].index
        text = "".join(token_text[i] for i in range(first, last + 1)).strip()
        if first > 0 and token_text[first - 1].endswith("-"):
            text = "-" + text
        out.append(Number(n, text, rows))
    return out


# ------------------------------------------------------------------------------------------ generation


def greedy_answer(model, tokenizer, prompt_text: str, max_new_tokens: int, chat: bool):
    """The greedy continuation (delft.generate, as delft eval answers); its ``answer_ids`` are teacher-forced."""
    from delft.generate import greedy

    return greedy(model, tokenizer, [prompt_text], max_new_tokens, chat, batch_size=1)[0]


# --------------------------------------------------------------------------------------------- result


@dataclass
class ModelView:
    name: str
    base: Optional[str]
    adapter: Optional[str]
    template: str  # "chat" or "plain"
    prompt_text: str
    answer_ids: list[int]
    records: list[PositionRecord]
    own_answer: Optional[str] = None  # this model's greedy answer (compare mode, no --target)

    @property
    def numbers(self) -> list[Number]:
        return numbers_of(self.records)


@dataclass
class InspectResult:
    prompt: str
    answer: str  # the teacher-forced answer text
    mode: str  # "target" or "greedy"
    source: str  # where the answer comes from, in words
    target: Optional[str] = None
    models: list[ModelView] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # warnings shown above the tables and kept in the JSON

    @property
    def has_digits(self) -> bool:
        return bool(self.models) and bool(self.models[0].numbers)


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


# ------------------------------------------------------------------------------------------- rendering

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
    return f"{100 * p:.1f}%"


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


# ----------------------------------------------------------------------------------------------- run


@dataclass
class _Spec:
    name: str
    base: Optional[str]
    adapter: Optional[str]


def _model_specs(base: Optional[str], adapters: Sequence[str]) -> list[_Spec]:
    from delft.rundir import base_model, check_model_files

    if not adapters:
        if base is None:
            raise UserError("no model given", "delft inspect",
                            "Pass --model NAME (e.g. --model smollm2-135m), a recipe, or --adapter RUN_DIR.")
        return [_Spec(Path(base).name if Path(base).expanduser().exists() else base, base, None)]
    recorded = [base_model(Path(a)) for a in adapters if Path(a).is_dir()]
    names = [Path(a).name or str(a) for a in adapters]
    specs = []
    for a, n in zip(adapters, names):
        if a == "base" and not Path(a).exists():
            b = base or next((r for r in recorded if r), None)
            if b is None:
                raise UserError("'base' needs a base model", "delft inspect", "Pass --model NAME or a recipe.")
            specs.append(_Spec("base", b, None))
            continue
        if Path(a).is_file():
            raise UserError(f"{a} is a file, not a run directory", "delft inspect",
                            "Give a directory written by `delft train` or `delft export`, or 'base'.")
        if not Path(a).is_dir():
            raise UserError(f"run directory {a} does not exist", "delft inspect",
                            "Give a directory written by `delft train` (an adapter) or by `delft export` "
                            "(a merged model), or 'base' for the base model.")
        check_model_files(Path(a), "delft inspect", "Restore the file, or train (or export) that run again.")
        specs.append(_Spec(str(a) if names.count(n) > 1 or n == "base" else n, base, str(a)))
    return specs


def _structure(records: Sequence[PositionRecord]) -> list[list[tuple]]:
    return [[(r.kind, r.place, r.char) for r in n.rows] for n in numbers_of(records)]


def _check_arguments(prompt: str, max_new_tokens: int, target: Optional[str]) -> Optional[str]:
    """The checked --target text (None without one); refuses an empty prompt or a non-positive budget."""
    if not prompt or not prompt.strip():
        raise UserError("the prompt is empty", "delft inspect",
                        'Give the prompt as the last argument, e.g. "What is 17 * 23?".')
    if max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be positive, not {max_new_tokens}", "--max-new-tokens", "e.g. 32.")
    return check_target(target) if target is not None else None


def _first_answer(lm, tok, vocab, spec: _Spec, prompt: str, prompt_text: str, target_text: Optional[str],
                  max_new_tokens: int, chat: bool, n_models: int) -> tuple[InspectResult, list[int]]:
    """The answer every model is teacher-forced on: --target, else the first model's greedy answer."""
    if target_text is not None:
        ids = tok.encode(target_text, add_special_tokens=False)
        return InspectResult(prompt, target_text, "target", f"teacher-forced on --target {target_text}",
                             target_text), ids
    generation = greedy_answer(lm, tok, prompt_text, max_new_tokens, chat)
    ids = generation.answer_ids
    source = f"greedy answer of {spec.name}" + (", teacher-forced for every model" if n_models > 1 else "")
    result = InspectResult(prompt, generation.answer, "greedy", source, None)
    if len(ids) >= max_new_tokens and vocab.text_of(ids[-1]) is not None:
        result.notes.append(f"the answer was cut by --max-new-tokens {max_new_tokens} inside a number, so the "
                            "places of its last number may be off; raise it")
    return result, ids


def _inspect_model(spec: _Spec, cfg, prompt: str, target_text: Optional[str], max_new_tokens: int, n_models: int,
                   result: Optional[InspectResult], first_vocab: Optional[dict]):
    """Load one model, teacher-force the answer, free the model: (result, the model's view, its vocabulary)."""
    from delft.data import Example, render_prompt, use_chat_template
    from delft.generate import free_memory
    from delft.models import load_for_inference

    lm, tok = load_for_inference(spec.base, spec.adapter, device=cfg.model.device, dtype=cfg.model.dtype)
    try:
        vocab = NumberVocab.from_tokenizer(tok, PURPOSE)
        chat = use_chat_template(tok, cfg.data)
        prompt_text = render_prompt(Example(prompt, ""), tok, cfg.data)
        own = None
        if result is None:
            result, ids = _first_answer(lm, tok, vocab, spec, prompt, prompt_text, target_text, max_new_tokens,
                                        chat, n_models)
        elif tok.get_vocab() == first_vocab:
            ids = list(result.models[0].answer_ids)
        else:
            ids = tok.encode(result.answer, add_special_tokens=False)
        if target_text is None and result.models:
            own = greedy_answer(lm, tok, prompt_text, max_new_tokens, chat).answer
        records = compute_records(lm, tok, prompt_text, ids, vocab)
        view = ModelView(spec.name, spec.base, spec.adapter, "chat" if chat else "plain", prompt_text, list(ids),
                         records, own)
        return result, view, tok.get_vocab()
    finally:
        del lm
        free_memory()


def _write_outputs(result: InspectResult, json_out: Optional[Path], plot: Optional[Path], console: Console) -> None:
    if json_out is not None:
        write_result(Path(json_out), json.dumps(to_json(result), indent=2), "--json")
        console.print(f"wrote {json_out}")
    if plot is not None:
        if result.has_digits:
            write_plot(result, Path(plot))
            console.print(f"wrote {plot}")
        else:
            console.print(f"[dim]no plot written to {plot}: the answer has no digits[/]")


def run_inspect(recipe_path: Optional[Path] = None, prompt: str = "", model: Optional[str] = None,
                adapters: Sequence[str] = (), target: Optional[str] = None, max_new_tokens: int = 32,
                json_out: Optional[Path] = None, plot: Optional[Path] = None, overrides: Sequence[str] = (),
                console: Optional[Console] = None) -> InspectResult:
    """The ``delft inspect`` command. Answers without digits print a note and return normally (exit 0)."""
    from delft.recipe import load_recipe

    console = console or Console()
    cfg = load_recipe(recipe_path, list(overrides))
    target_text = _check_arguments(prompt, max_new_tokens, target)
    specs = _model_specs(model or (cfg.model.name if recipe_path is not None else None), list(adapters))
    check_output_files({"--json": json_out, "--plot": plot})
    result: Optional[InspectResult] = None
    first_vocab = None
    for i, spec in enumerate(specs):
        result, view, vocab = _inspect_model(spec, cfg, prompt, target_text, max_new_tokens, len(specs),
                                            result, first_vocab)
        if i == 0:
            first_vocab = vocab
        elif _structure(view.records) != _structure(result.models[0].records):
            raise UserError(f"{spec.name}'s tokenizer splits the answer {result.answer!r} into digits differently "
                            f"from {specs[0].name}'s", "--compare", "Inspect these models one at a time.")
        result.models.append(view)
        if i == 0 and not result.has_digits:
            break  # nothing to teacher-force the others on
    assert result is not None
    render(result, console)
    _write_outputs(result, json_out, plot, console)
    return result
