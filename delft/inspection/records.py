"""`delft inspect`'s data: for each digit character of an answer, the probabilities of the ten digits given
that the next token is a digit, the entropy, the argmax, and the answer's numbers with their places.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

from delft.data.batches import prompt_ids
from delft.errors import UserError
from delft.evaluation.generation import greedy
from delft.models.loading import decoder_and_head, plain_model
from delft.numbers.digits import DIGITS, number_runs, place_name, run_places, thousands_separators
from delft.numbers.tokens import NumberVocab, char_logits

PURPOSE = "per-digit inspection"


# "391", "-3.5", "1,234", "+0.25", ".5": an optional sign, digits (comma groups of 3 allowed), a decimal part.
TARGET_RE = re.compile(r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)", re.ASCII)  # 0-9 only, not "٤٢"


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
    place: Optional[int]  # delft.numbers.digits place: 1 = units, 2 = tens, -1 = tenths, ...
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


def char_rows(token_ids: Sequence[int], texts: Sequence[str],
              vocab: NumberVocab) -> tuple[list[Optional[str]], list[str], list[int]]:
    """(char, text, token index) per row: a number token gives one row per digit, any other token one row
    (its char '.' for the dot, else None); ``texts`` are the tokens decoded."""
    numbers = vocab
    chars: list[Optional[str]] = []
    row_texts: list[str] = []
    owners: list[int] = []
    for i, t in enumerate(token_ids):
        digits = numbers.text_of(int(t))
        chars.extend(digits or [None])
        row_texts.extend(digits or [texts[i]])
        owners.extend([i] * len(digits or [None]))
    return chars, row_texts, owners


def label_positions(token_ids: Sequence[int], texts: Sequence[str], vocab: NumberVocab):
    """(kind, number, place) per row (``char_rows``: per token, or per digit of a number token), places
    from delft.numbers.digits.run_places (or, for a vocabulary written_as a reversed form, its true places).

    Thousands separators are dropped before the run rules apply, so "1,234" is one number whose '1' is the
    thousands digit. A '.' is shown (kind "point") when it stands inside a number with a digit after it; a
    trailing sentence dot ("391.") or a run of dots is not.
    """
    chars, texts, _ = char_rows(token_ids, texts, vocab)
    keep = [i for i in range(len(chars)) if i not in thousands_separators(chars)]
    kept_chars = [chars[i] for i in keep]
    kept_places = run_places(kept_chars)
    if vocab.order != "natural":  # a reversed form: each digit's true place, as the losses read it (vocab.places)
        written = [p for t, places in zip(token_ids, vocab.places(token_ids)) for p in (places or (None,))]
        kept_places = [written[i] for i in keep]
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

    base = plain_model(model)
    params = pyinspect.signature(base.forward).parameters
    with torch.inference_mode():
        for name in ("logits_to_keep", "num_logits_to_keep"):
            if name in params:
                out = model(input_ids=input_ids, use_cache=False, **{name: n_keep})
                return out.logits[0, -n_keep:].float()
        decoder, head = decoder_and_head(model)
        hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state[0, -n_keep:]
        return head(hidden).float()


def _digit(char: Optional[str]) -> Optional[int]:
    return int(char) if char is not None and char in DIGITS else None


def compute_records(model, tokenizer, prompt_text: str, answer_ids: Sequence[int],
                    vocab: Optional[NumberVocab] = None) -> list[PositionRecord]:
    """One record per answer token (per digit of a multi-digit number token), from one teacher-forced pass
    over prompt + answer.

    The input is the prompt and the answer without its last token; the logits of the last ``len(answer)``
    positions predict the answer's tokens, and only those rows are computed beyond the hidden states.
    """
    import torch

    numbers = vocab or NumberVocab.from_tokenizer(tokenizer, PURPOSE)
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
    with the row's token before it, by digit: delft.numbers.tokens.char_logits on log-probabilities), their
    conditional distribution, its entropy (bits) and their total probability. A non-number token's row is
    the first character's (for single-digit tokenizers: the ten digit tokens)."""
    import torch

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
    if top is None or not top.isdigit() or len(top) <= j or (j and (answer_text or "")[:j] != top[:j]):
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


def greedy_answer(model, tokenizer, prompt_text: str, max_new_tokens: int, chat: bool):
    """The greedy continuation (delft.evaluation.generation, as delft eval answers); its ``answer_ids`` are teacher-forced."""
    return greedy(model, tokenizer, [prompt_text], max_new_tokens, chat, batch_size=1)[0]


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
