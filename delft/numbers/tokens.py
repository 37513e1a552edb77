"""Number tokens: a tokenizer's digit-only tokens, and per-character digit logits computed from them.

Some tokenizers write numbers in chunks (Llama-3 splits "1234567.89" as 123 | 456 | 7 | . | 89). A number is
still a string of characters, so the digit losses work per digit *character*. The exact definition:

* A *number token* is a vocabulary entry whose text is one or more ASCII digits and that the tokenizer
  emits for that text (Llama-3.x: the 1,110 strings of one to three digits).
* At a position whose gold token is the number token s = s_1..s_L, the logit of digit d at character j is
  ``logsumexp`` of the logits of the number tokens u with len(u) >= j, u_1..u_{j-1} = s_1..s_{j-1} and
  u_j = d. Its softmax over d is the model's distribution of character j given the gold's first j-1
  characters, among the number tokens. A shorter token that is a prefix ("12" against gold "123") has no
  character 3, so it is excluded from character 3's distribution. A digit no such token has gets -inf.
* For a tokenizer whose number tokens are the ten digits this is exactly the ten digit logits.
* Places, place weights and runs come from the gold characters across tokens (``digits.token_places``).

Only the output-layer rows of the number tokens are needed ([P, T] logits, T = number of number tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence

from delft.errors import UserError
from delft.numbers.digits import DIGITS, place_weight, token_places
from delft.numbers.formats import token_written_places

if TYPE_CHECKING:
    from torch import Tensor


IGNORE = -100


_FIX = ("Use a model whose tokenizer writes numbers as digit-only tokens (Qwen2/2.5, SmolLM2, Llama-2, Mistral, "
        "Llama-3.x) or set loss.type: ce.")
FIT_MODELS = "Use a model whose tokenizer writes numbers as digit-only tokens (Qwen2/2.5, SmolLM2, Llama-2, Mistral, " \
             "Llama-3.x)"  # the first half of every caller's fix; the second half is CE alone in its own words


class UnfitTokenizer(UserError):
    """A tokenizer no digit loss is defined for. Its ``fix`` is in recipe words (``loss.type: ce``); a library
    caller re-raises it in its own (``reworded``)."""

    def reworded(self, ce_alone: str) -> "UnfitTokenizer":
        """The same refusal whose fix names CE alone as the caller spells it (``digit_loss={"type": "ce"}``)."""
        return UnfitTokenizer(self.what, self.where, f"{FIT_MODELS}, or {ce_alone}.")


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def _emitted(tokenizer, text: str) -> list[int]:
    """Ids the tokenizer emits for ``text``, without specials and whitespace-only pieces (a "▁" prefix)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [t for t in ids if tokenizer.decode([t], clean_up_tokenization_spaces=False).strip() != ""]


def _digit_bearing(tokenizer) -> dict[int, str]:
    """id -> decoded text of every ordinary (not added/special) token whose text holds an ASCII digit.

    Raw token strings keep ASCII digits as they are (byte-level BPE maps printable ASCII to itself;
    SentencePiece pieces and byte fallback "<0x31>" spell them), so only those are decoded.
    """
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    out = {}
    for raw, tid in tokenizer.get_vocab().items():
        if not any("0" <= c <= "9" for c in raw):
            continue
        # An added token that is one digit stays a number token (ntloss.NTLoss registers '0'..'9' as added tokens
        # on the caller's tokenizer, ids unchanged); from_tokenizer still keeps it only if encoding emits it.
        if tid in added and getattr(added[tid], "content", str(added[tid])) not in tuple(DIGITS):
            continue
        text = tokenizer.decode([tid], clean_up_tokenization_spaces=False)
        if any(c in DIGITS for c in text):
            out[tid] = text
    return out


def _is_number(text: str) -> bool:
    return text != "" and all(c in DIGITS for c in text)


def _refuse_glued(tokenizer, glued: dict[int, str], purpose: str) -> None:
    """Refuse when the tokenizer emits tokens gluing digits to other characters (GPT-2's " 2019", "x2").

    Such a token scores a digit and a non-digit at once, so no per-character digit distribution is exact.
    A glued vocabulary entry the tokenizer never emits (its pre-tokenizer isolates digits, as Qwen2's \\p{N}
    or Llama-3's \\p{N}{1,3}) cannot be a gold token and is harmless; each entry is probed on its own text.
    """
    reachable = []
    for text in sorted(set(glued.values()), key=lambda t: (len(t), t)):
        hits = [t for t in _emitted(tokenizer, text) if t in glued]
        reachable.extend(repr(glued[t]) for t in hits if repr(glued[t]) not in reachable)
        if len(reachable) >= 5:
            break
    if reachable:
        raise UnfitTokenizer(
            f"tokenizer {_name(tokenizer)!r} writes digits glued to other characters in one token (for example "
            f"{', '.join(reachable[:5])}), so {purpose} is undefined for it: a digit loss needs every digit in "
            "a token of digits only", fix=_FIX)


class _RawTokenizer:
    """The calls ``NumberVocab.from_tokenizer`` makes, answered by a tokenizers.Tokenizer (what a transformers
    fast tokenizer does underneath, without importing transformers)."""

    def __init__(self, core, name: str):
        self.core, self.name_or_path = core, name

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.core.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, clean_up_tokenization_spaces: bool = False) -> str:
        return self.core.decode(list(ids), skip_special_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.core.get_vocab()

    @property
    def added_tokens_decoder(self) -> dict:
        return self.core.get_added_tokens_decoder()


def _char_id(tokenizer, char: str) -> Optional[int]:
    """The id of the token that is exactly ``char`` ('.' or ','), when the tokenizer writes it alone."""
    ids = _emitted(tokenizer, char)
    return ids[0] if len(ids) == 1 and tokenizer.decode(ids, clean_up_tokenization_spaces=False) == char else None


@dataclass(frozen=True)
class NumberVocab:
    """A tokenizer's number tokens (ids and texts, ordered by length then text: '0'..'9' first), '.' and ','
    (the thousands separator, which joins a number: delft.numbers.digits)."""

    ids: tuple[int, ...]
    texts: tuple[str, ...]
    dot_id: Optional[int]
    comma_id: Optional[int] = None
    colon_id: Optional[int] = None  # ':' alone: it ends a count prefix's counts, {2:42} (delft.numbers.formats)
    order: str = "natural"  # how the trained text writes numbers (data.numbers): places are read through it
    count_prefix: bool = False

    @classmethod
    def from_tokenizer(cls, tokenizer, purpose: str = "a digit loss") -> "NumberVocab":
        """Probe the vocabulary: keep the digit-only tokens the tokenizer emits for their own text.

        Byte-fallback and other duplicates of a digit string that encoding never produces are dropped, so a
        single-digit tokenizer gets exactly today's ten ids. Refused: tokenizers that emit digits glued to
        other characters, or that do not write every digit and "1234567890" with number tokens alone.
        """
        bearing = _digit_bearing(tokenizer)
        _refuse_glued(tokenizer, {t: s for t, s in bearing.items() if not _is_number(s)}, purpose)
        numbers = {t: s for t, s in bearing.items() if _is_number(s) and _emitted(tokenizer, s) == [t]}
        texts = set(numbers.values())
        missing = [d for d in DIGITS if d not in texts]
        probe = "1234567890"
        pieces = [numbers.get(t) for t in _emitted(tokenizer, probe)]
        if missing or None in pieces or "".join(pieces) != probe:
            what = (f"has no single token for the digit(s) {', '.join(missing)}" if missing else
                    f"does not write {probe!r} with digit-only tokens (got {pieces})")
            raise UnfitTokenizer(f"tokenizer {_name(tokenizer)!r} {what}, so {purpose} is undefined for it", fix=_FIX)
        order = sorted(numbers.items(), key=lambda kv: (len(kv[1]), kv[1], kv[0]))
        return cls(tuple(t for t, _ in order), tuple(s for _, s in order), _char_id(tokenizer, "."),
                   _char_id(tokenizer, ","), _char_id(tokenizer, ":"))

    @classmethod
    def from_tokenizer_file(cls, path, purpose: str = "a digit loss") -> "NumberVocab":
        """``from_tokenizer`` on a tokenizer.json read with the tokenizers library alone (no torch: --plan)."""
        from tokenizers import Tokenizer

        return cls.from_tokenizer(_RawTokenizer(Tokenizer.from_file(str(path)), str(path)), purpose)

    @property
    def max_len(self) -> int:
        """The chunk length: the longest number token, in characters (1 for single-digit tokenizers)."""
        return max(len(s) for s in self.texts)

    @property
    def is_single_digit(self) -> bool:
        return self.texts == tuple(DIGITS)

    @classmethod
    def single_digits(cls, digit_ids: Sequence[int], dot_id: Optional[int] = None,
                      comma_id: Optional[int] = None, colon_id: Optional[int] = None) -> "NumberVocab":
        """The vocabulary of a single-digit tokenizer given its ten digit ids ('0'..'9', in order), '.', ',' and
        ':'."""
        if len(digit_ids) != 10:
            raise ValueError(f"give the ten ids of '0'..'9', not {len(digit_ids)}")
        return cls(tuple(int(t) for t in digit_ids), tuple(DIGITS), dot_id, comma_id, colon_id)

    @property
    def digit_ids(self) -> tuple[int, ...]:
        """The ids of the single-digit tokens '0'..'9' (every accepted tokenizer has all ten, first in ``ids``)."""
        return self.ids[:10]

    @property
    def _column(self) -> dict[int, int]:
        table = self.__dict__.get("_columns")
        if table is None:
            table = {t: i for i, t in enumerate(self.ids)}
            object.__setattr__(self, "_columns", table)
        return table

    def column_of(self, token_id: int) -> Optional[int]:
        """Index of a number token among ``ids`` (its column in number-token logits); None otherwise."""
        return self._column.get(int(token_id))

    def text_of(self, token_id: int) -> Optional[str]:
        """A number token's digits, '.' for the dot, ',' for the comma, None for anything else (ignored labels
        included)."""
        col = self.column_of(token_id)
        if col is not None:
            return self.texts[col]
        if self.dot_id is not None and int(token_id) == self.dot_id:
            return "."
        return "," if self.comma_id is not None and int(token_id) == self.comma_id else None

    def written_as(self, numbers) -> "NumberVocab":
        """This vocabulary reading places through a data.numbers form (order, count_prefix): the losses, the
        teacher-forced metrics and the preview of a run trained on reversed or prefixed numbers then give every
        digit its true place (delft.numbers.formats.token_written_places)."""
        return dataclasses.replace(self, order=numbers.order, count_prefix=numbers.count_prefix)

    def places(self, token_ids: Sequence[int]) -> list[tuple[Optional[int], ...]]:
        """Places of each position's characters, runs across tokens; () for positions outside numbers. Under a
        reversed form each digit's true place (the units digit of ``24``, 42 reversed, is its first); a count
        prefix's counts are their own small numbers."""
        texts = [self.text_of(t) for t in token_ids]
        if self.order == "natural":
            return token_places(texts)
        colons = [self.colon_id is not None and int(t) == self.colon_id for t in token_ids]
        return token_written_places(texts, colons, self.count_prefix)

    def char_table(self, device=None) -> "CharTable":
        return CharTable.build(self.texts, device)


class CharLogits(NamedTuple):
    logits: "Tensor"  # [C, 10] digit logits, one row per digit character of the gold tokens
    pos: "Tensor"     # [C] long: the position (row of the [P, T] input) the character belongs to
    char: "Tensor"    # [C] long: the character's index inside its gold token (0-based)
    digit: "Tensor"   # [C] long: the gold digit, 0..9


@dataclass(frozen=True)
class CharTable:
    """Index tensors for ``char_logits``, built once per tokenizer.

    For character j (0-based), number tokens longer than j are grouped by their first j characters
    (their *prefix group*). ``cells[j][g, d]`` lists the columns of the tokens in group g with digit d at
    character j, padded with column T (a -inf column) and, for an empty cell, filled with column T + 1 (a
    zero column, masked to -inf afterwards so no NaN reaches the gradient).
    """

    length: "Tensor"            # [T] characters per number token
    digit: "Tensor"             # [T, L] digit at each character (0 past the end)
    group: "Tensor"             # [T, L] prefix group of token t at character j (0 past the end)
    cells: tuple["Tensor", ...]  # per j: [G_j, 10, K_j] long
    filled: tuple["Tensor", ...]  # per j: [G_j, 10] bool, the cell holds a token

    @classmethod
    def build(cls, texts: Sequence[str], device=None) -> "CharTable":
        import torch

        n, width = len(texts), max(len(s) for s in texts)
        digit = [[int(s[j]) if j < len(s) else 0 for j in range(width)] for s in texts]
        group = [[0] * width for _ in texts]
        cells, filled = [], []
        for j in range(width):
            prefixes = sorted({s[:j] for s in texts if len(s) > j})
            index = {p: g for g, p in enumerate(prefixes)}
            members: list[list[list[int]]] = [[[] for _ in DIGITS] for _ in prefixes]
            for t, s in enumerate(texts):
                if len(s) > j:
                    group[t][j] = index[s[:j]]
                    members[index[s[:j]]][int(s[j])].append(t)
            k = max(len(c) for row in members for c in row)
            cells.append(torch.tensor([[c + [n] * (k - len(c)) if c else [n + 1] * k for c in row]
                                       for row in members], dtype=torch.long, device=device))
            filled.append(torch.tensor([[bool(c) for c in row] for row in members], device=device))
        return cls(torch.tensor([len(s) for s in texts], device=device), torch.tensor(digit, device=device),
                   torch.tensor(group, device=device), tuple(cells), tuple(filled))

    @property
    def max_len(self) -> int:
        return len(self.cells)

    @property
    def complete(self) -> bool:
        """Every prefix group offers all ten digits (Llama-3.x, single-digit tokenizers): no -inf digit logits."""
        return all(bool(f.all()) for f in self.filled)


def char_logits(z: "Tensor", gold: "Tensor", table: CharTable) -> CharLogits:
    """Per-character digit logits from number-token logits.

    ``z`` [P, T]: logits of the T number tokens (columns in NumberVocab order) at P positions;
    ``gold`` [P] long: the column of each position's gold number token. Characters come out in order
    (position, then character); half inputs are computed in fp32, fp64 stays fp64. No loop over positions:
    one gather + logsumexp per character index j < max_len.
    """
    import torch

    z = z.to(torch.promote_types(z.dtype, torch.float32))
    gold = gold.to(device=z.device, dtype=torch.long)
    lengths = table.length[gold]
    pos = torch.repeat_interleave(torch.arange(len(gold), device=z.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    char = torch.arange(len(pos), device=z.device) - starts[pos]
    tok = gold[pos]
    ext = torch.cat([z, z.new_full((z.shape[0], 1), float("-inf")), z.new_zeros((z.shape[0], 1))], dim=1)
    out = z.new_full((len(pos), 10), float("-inf"))
    if len(pos) == 0:  # no number tokens: an empty result that is still in the graph
        out = z[:, :0].sum(-1, keepdim=True).expand(0, 10)
    for j in range(table.max_len):
        sel = (char == j).nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        g = table.group[tok[sel], j]
        vals = ext[pos[sel][:, None, None], table.cells[j][g]]  # [n, 10, K]
        lse = torch.where(table.filled[j][g], torch.logsumexp(vals, dim=-1), float("-inf"))
        out = out.index_copy(0, sel, lse)
    return CharLogits(out, pos, char, table.digit[tok, char])


def offered(logits: "Tensor") -> "Tensor":
    """Digit logits with each -inf (a digit no token offers) replaced by a finite value far below the row.

    Its probability stays exactly 0, and DEL's p * BCE there is 0 * 0 instead of NaN (BCE of -inf against
    target 0 is -inf * 0); no gradient reaches the replaced entries.
    """
    import torch

    finite = torch.isfinite(logits)
    floor = logits.detach().masked_fill(~finite, float("inf")).amin(-1, keepdim=True) - 1e4
    return torch.where(finite, logits, floor)


class NumberTargets(NamedTuple):
    mask: "Tensor"     # [B, T] bool: the label is a number token; hidden[mask] gives the P rows, row-major
    gold: "Tensor"     # [P] long: the label's column among the number tokens
    weights: "Tensor"  # [C] float32: DEL place weight of every digit character (position, then character)


def number_targets(labels: "Tensor", vocab: NumberVocab, weigh=place_weight) -> NumberTargets:
    """Number-token positions, their columns and per-character place weights (``weigh(place)``, e.g. a
    ``loss.place_weights`` mode); runs per sequence, across tokens.

    On a single-digit tokenizer this equals the per-token oracle ``digit_targets`` in tests/helpers.py (mask,
    targets = gold, weights).
    """
    import torch

    rows = labels.tolist()
    mask = [[False] * labels.shape[-1] for _ in rows]
    gold: list[int] = []
    weights: list[float] = []
    for b, row in enumerate(rows):
        for t, places in enumerate(vocab.places(row)):
            col = vocab.column_of(row[t])
            if col is None:
                continue
            mask[b][t] = True
            gold.append(col)
            weights.extend(weigh(p) for p in places)
    dev = labels.device
    return NumberTargets(torch.tensor(mask, dtype=torch.bool, device=dev).reshape(labels.shape),
                         torch.tensor(gold, dtype=torch.long, device=dev),
                         torch.tensor(weights, dtype=torch.float32, device=dev))


def count_digit_chars(labels: "Tensor", vocab: NumberVocab) -> int:
    """N_digits for the batch-global normalisation: digit characters of the number-token labels."""
    import torch

    ids = torch.tensor(vocab.ids, device=labels.device)
    lengths = torch.tensor([len(s) for s in vocab.texts], device=labels.device)
    order = torch.argsort(ids)
    flat = labels.reshape(-1)
    at = torch.searchsorted(ids[order], flat).clamp(max=len(ids) - 1)
    hit = ids[order][at] == flat
    return int(lengths[order][at][hit].sum())
