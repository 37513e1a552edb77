"""Teacher-forced metrics (``delft eval --teacher-forced``): how a model scores the gold completion itself.

The model reads prompt + gold completion once; at every completion token it is asked for that token. At the
digit positions (places by delft.numbers.digits' run rules, as the losses find them) we report, per place, whether the
argmax among the ten digits is the gold digit, whether the full-vocabulary argmax is the gold token, and the
digit CE (cross-entropy over the ten digit logits, the distribution the digit losses shape). At every other
completion token (words, spaces, '.', the end-of-turn token) we report the full-vocabulary CE and its
perplexity: whether a digit loss costs the text. Digit rows come from the ten digit rows of the output layer
only; the full-vocabulary quantities from logits computed a chunk of positions at a time, never [B, T, V].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from delft.data.batches import collate, tokenize_example
from delft.evaluation.metrics import paired_difference
from delft.losses.heads import digit_logits
from delft.models.loading import decoder_and_head
from delft.numbers.digits import place_name
from delft.numbers.tokens import IGNORE, char_logits
from delft.outputs import num, pct, staged

CHUNK_POSITIONS = 256  # completion positions whose full-vocabulary logits exist at once


# Whether the argmax among the ten digits is the gold digit: teacher-forced, so a measure of its own, spelled as
# the answers' digit accuracy (delft.evaluation.metrics.DIGIT_ACCURACY) is in eval.json.
ARGMAX_ACCURACY = "digit_accuracy"


DIGIT_METRICS = (ARGMAX_ACCURACY, "full_accuracy", "digit_ce")  # per digit position, per place and overall


LABELS = {ARGMAX_ACCURACY: "digit argmax accuracy", "full_accuracy": "full-vocab argmax accuracy",
          "digit_ce": "digit CE", "text_ce": "non-digit CE", "text_perplexity": "non-digit perplexity"}


@dataclass
class Position:
    """One scored completion token."""

    example: int  # index into the examples scored
    place: Optional[int]  # its digit place, None for a non-digit token
    ce: float  # full-vocabulary CE of the gold token
    full_ok: bool  # full-vocabulary argmax == gold token
    digit_ok: Optional[bool] = None  # argmax among the ten digits == gold digit (digit positions only)
    digit_ce: Optional[float] = None  # CE over the ten digit logits (digit positions only)


@dataclass
class TeacherForced:
    """Every scored position of one model over the eval set, and how many completions were truncated."""

    positions: list[Position] = field(default_factory=list)
    n_examples: int = 0
    truncated: int = 0


def teacher_forced(model, tokenizer, examples: Sequence, data_cfg, vocab, batch_size: int) -> TeacherForced:
    """Score the gold completion of every example (prompt masked, as in training); ``vocab`` is the tokenizer's
    NumberVocab (digit metrics per digit character, so number tokens of 1-3 digits work as single digits do)."""
    cfg = data_cfg.model_copy(update={"train_on_prompt": False})
    vocab = vocab.written_as(cfg.numbers)  # the gold is written in the run's form: its digits at their true places
    items = [tokenize_example(ex, tokenizer, cfg) for ex in examples]
    out = TeacherForced(n_examples=len(items), truncated=sum(t.truncated for t in items))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    with torch.inference_mode():
        for start in range(0, len(items), batch_size):
            batch = {k: v.to(device) for k, v in collate(items[start:start + batch_size], pad_id).items()}
            out.positions.extend(_score_batch(model, batch, vocab, start))
    return out


def _score_batch(model, batch: dict, vocab, first: int) -> list[Position]:
    """Positions of one right-padded batch: hidden states once, then only the rows each metric needs."""
    decoder, head = decoder_and_head(model)
    hidden = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     use_cache=False).last_hidden_state[:, :-1]
    targets = batch["labels"][:, 1:]
    rows, cols = (targets != IGNORE).nonzero(as_tuple=True)
    places = [vocab.places(row) for row in targets.tolist()]
    h, gold = hidden[rows, cols], targets[rows, cols]
    ce, full_ok = _full_vocab(h, head, gold)
    out: list[Position] = []
    number_rows, number_cols, slots = [], [], []  # rows of h with a number-token label, its column, out's slots
    for k, (r, c) in enumerate(zip(rows.tolist(), cols.tolist())):
        column = vocab.column_of(int(gold[k]))
        if column is None:
            out.append(Position(first + r, None, ce[k], full_ok[k]))
            continue
        number_rows.append(k)
        number_cols.append(column)
        for place in places[r][c]:  # one position per digit character of the token
            slots.append(len(out))
            out.append(Position(first + r, place, ce[k], full_ok[k]))
    if number_rows:
        _digit_scores(out, slots, h[number_rows], head, torch.tensor(number_cols, device=h.device), vocab)
    return out


def _digit_scores(out: list, slots: list[int], h, head, gold_cols, vocab) -> None:
    """Digit CE and argmax hit of every digit character, from the number-token rows of the output layer only."""
    chars = char_logits(digit_logits(h, head, vocab.ids), gold_cols, vocab.char_table(h.device))
    z, gold_digit = chars.logits, chars.digit
    dce = (torch.logsumexp(z, -1) - z.gather(1, gold_digit[:, None])[:, 0]).tolist()
    dok = (z.argmax(-1) == gold_digit).tolist()
    for slot, c, ok in zip(slots, dce, dok):
        out[slot].digit_ce, out[slot].digit_ok = c, ok


def _full_vocab(h, head, gold) -> tuple[list[float], list[bool]]:
    """Full-vocabulary CE and argmax hit per row of ``h`` [N, H], CHUNK_POSITIONS rows of fp32 logits at a time."""
    ce: list[float] = []
    ok: list[bool] = []
    for s in range(0, h.shape[0], CHUNK_POSITIONS):
        logits = head(h[s:s + CHUNK_POSITIONS]).float()
        g = gold[s:s + CHUNK_POSITIONS]
        ce.extend((torch.logsumexp(logits, -1) - logits.gather(1, g[:, None])[:, 0]).tolist())
        ok.extend((logits.argmax(-1) == g).tolist())
        del logits
    return ce, ok


def _value(positions: Sequence[Position], metric: str) -> Optional[float]:
    if not positions:
        return None
    if metric == ARGMAX_ACCURACY:
        return sum(p.digit_ok for p in positions) / len(positions)
    if metric == "full_accuracy":
        return sum(p.full_ok for p in positions) / len(positions)
    if metric == "digit_ce":
        return sum(p.digit_ce for p in positions) / len(positions)
    ce = sum(p.ce for p in positions) / len(positions)  # text_ce, text_perplexity
    return ce if metric == "text_ce" else math.exp(ce)


def _groups(tf: TeacherForced) -> dict[str, list[Position]]:
    """'digits' (every digit position), each place's name, and 'text' (the non-digit tokens)."""
    groups: dict[str, list[Position]] = {"digits": [], "text": []}
    by_place: dict[int, list[Position]] = {}
    for p in tf.positions:
        if p.place is None:
            groups["text"].append(p)
        else:
            groups["digits"].append(p)
            by_place.setdefault(p.place, []).append(p)
    for place in sorted(by_place, key=lambda q: -q):
        groups[place_name(place)] = by_place[place]
    return groups


def summarize_teacher(tf: TeacherForced) -> dict:
    """The JSON block: overall digit metrics, per place, and the non-digit CE / perplexity."""
    groups = _groups(tf)
    digits = groups.pop("digits")
    text = groups.pop("text")
    return {
        "n_examples": tf.n_examples,
        "truncated": tf.truncated,
        "digits": {"n": len(digits), **{m: _value(digits, m) for m in DIGIT_METRICS}},
        "per_place": {name: {"place": ps[0].place, "n": len(ps), **{m: _value(ps, m) for m in DIGIT_METRICS}}
                      for name, ps in groups.items()},
        "text": {"n": len(text), "ce": _value(text, "text_ce"), "perplexity": _value(text, "text_perplexity")},
    }


def _per_example(positions: Sequence[Position], n_examples: int, metric: str, scale: float) -> list[float]:
    """Per-example sums of a metric divided by the mean count per example: their mean is the pooled mean, so
    paired_difference of two models' lists is the difference of pooled means, resampled by example."""
    sums = [0.0] * n_examples
    for p in positions:
        sums[p.example] += {ARGMAX_ACCURACY: float(bool(p.digit_ok)), "full_accuracy": float(p.full_ok),
                            "digit_ce": p.digit_ce or 0.0, "text_ce": p.ce}[metric]
    return [s / scale for s in sums]


def teacher_differences(base: TeacherForced | Sequence[TeacherForced], run: TeacherForced | Sequence[TeacherForced],
                        resamples: int, seed: int) -> dict:
    """run minus base for every digit metric (overall and per place) and the non-digit CE, with paired
    bootstrap intervals over the examples (both models scored the same gold tokens).

    Either side may be a list of one model's training seeds: each example's value is then averaged over them
    before the bootstrap, so an example is resampled once, not once per seed."""
    bases = [base] if isinstance(base, TeacherForced) else list(base)
    runs = [run] if isinstance(run, TeacherForced) else list(run)
    a, b = _groups(bases[0]), _groups(runs[0])
    n = runs[0].n_examples
    out: dict = {}
    for name, ps in b.items():
        if not ps or name not in a:
            continue
        metrics = ("text_ce",) if name == "text" else DIGIT_METRICS
        scale = len(ps) / max(1, n)
        out[name] = {m: paired_difference(_seed_mean(bases, name, m, scale), _seed_mean(runs, name, m, scale),
                                          resamples, seed)
                     for m in metrics}
    return out


def _seed_mean(models: Sequence[TeacherForced], group: str, metric: str, scale: float) -> list[float]:
    """Per example, ``_per_example`` of one group averaged over the models (one model's training seeds)."""
    lists = [_per_example(_groups(tf).get(group, []), tf.n_examples, metric, scale) for tf in models]
    return [sum(xs) / len(xs) for xs in zip(*lists)]


def mean_summaries(summaries: Sequence[dict]) -> dict:
    """The seed mean of ``summarize_teacher`` blocks of one recipe (same gold tokens: counts are kept)."""
    def avg(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    first = summaries[0]
    text_ce = avg(s["text"]["ce"] for s in summaries)
    return {
        "n_examples": first["n_examples"], "truncated": first["truncated"], "seeds": len(summaries),
        "digits": {"n": first["digits"]["n"], **{m: avg(s["digits"][m] for s in summaries) for m in DIGIT_METRICS}},
        "per_place": {name: {"place": p["place"], "n": p["n"],
                             **{m: avg(s["per_place"].get(name, {}).get(m) for s in summaries) for m in DIGIT_METRICS}}
                      for name, p in first["per_place"].items()},
        "text": {"n": first["text"]["n"], "ce": text_ce, "perplexity": None if text_ce is None else math.exp(text_ce)},
    }


def teacher_rows(summaries: Sequence[dict]) -> list[tuple[str, list[Optional[float]], list[str], bool]]:
    """(label, values, cells, higher_is_better) per row of the teacher-forced table."""
    def fixed(x):
        return num(x, ".4f")

    rows = []
    for m in DIGIT_METRICS:
        fmt, higher = (fixed, False) if m == "digit_ce" else (pct, True)
        vals = [s["digits"][m] for s in summaries]
        rows.append((f"{LABELS[m]} (n={summaries[0]['digits']['n']})", vals, [fmt(v) for v in vals], higher))
        for name, place in summaries[0]["per_place"].items():
            vals = [s["per_place"].get(name, {}).get(m) for s in summaries]
            rows.append((f"  {name} (n={place['n']})", vals, [fmt(v) for v in vals], higher))
    n_text = summaries[0]["text"]["n"]
    for key, m in (("ce", "text_ce"), ("perplexity", "text_perplexity")):
        vals = [s["text"][key] for s in summaries]
        rows.append((f"{LABELS[m]} (n={n_text})", vals, [fixed(v) for v in vals], False))
    return rows


def difference_line(name: str, diff: dict) -> str:
    """One line per run: its teacher-forced differences from the base, with 95 % intervals."""
    parts = []
    for group, metric, label, factor in (("digits", ARGMAX_ACCURACY, "digit accuracy", 100),
                                         ("digits", "digit_ce", "digit CE", 1), ("text", "text_ce", "non-digit CE", 1)):
        d = diff.get(group, {}).get(metric)
        if d is None or d["difference"] is None:
            continue
        ci = d["ci"]
        span = f" [{factor * ci[0]:+.3g}, {factor * ci[1]:+.3g}]" if ci else ""
        parts.append(f"{label} {factor * d['difference']:+.3g}{span}")
    return f"{name} vs base (teacher-forced, paired bootstrap): " + "; ".join(parts)


def teacher_plot_path(plot: Path) -> Path:
    """Where the teacher-forced figure goes beside eval's --plot: places.png -> places.teacher.png."""
    return plot.with_name(f"{plot.stem}.teacher{plot.suffix or '.png'}")


def write_teacher_plot(names: Sequence[str], summaries: Sequence[dict], path: Path, title: str) -> None:
    """Two panels per place, one bar per model: teacher-forced digit argmax accuracy and digit CE; the legend
    gives each model's non-digit CE."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    places = list(summaries[0]["per_place"])
    fig = Figure(figsize=(max(6.0, 0.9 * len(places) + 3), 6.0), dpi=120)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 1, sharex=True)
    width = 0.8 / max(1, len(summaries))
    for k, (name, s) in enumerate(zip(names, summaries)):
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(places))]
        ce = s["text"]["ce"]
        label = f"{name} (non-digit CE {ce:.3f})" if ce is not None else name
        acc = [100 * (s["per_place"].get(p, {}).get(ARGMAX_ACCURACY) or 0.0) for p in places]
        dce = [s["per_place"].get(p, {}).get("digit_ce") or 0.0 for p in places]
        axes[0].bar(xs, acc, width=width, label=label)
        axes[1].bar(xs, dce, width=width, label=label)
    axes[0].set_ylim(0, 100)
    axes[0].set_ylabel("digit argmax acc. (%)")
    axes[1].set_ylabel("digit CE (nats)")
    axes[1].set_xticks(range(len(places)))
    axes[1].set_xticklabels(places, fontsize=8, rotation=30)
    axes[0].set_title(title, fontsize=10)
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with staged(path, path.suffix) as tmp:  # whole or not at all; a full disk is one paragraph (the suffix: the format)
        fig.savefig(tmp)
