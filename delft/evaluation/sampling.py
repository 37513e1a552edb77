"""Several sampled answers per problem (``delft eval --samples K``): the majority vote (self-consistency, Wang et
al. 2022, arXiv 2203.11171), pass@k by the unbiased estimator (Chen et al. 2021, arXiv 2107.03374) and the mean
accuracy over samples. No torch here.
"""

from __future__ import annotations

from collections import Counter
from math import comb
from typing import Optional, Sequence

from delft.evaluation.metrics import PASS_1, PASS_K, bootstrap_ci
from delft.numbers.answers import Scored


def majority_index(samples: Sequence[Scored]) -> int:
    """Which sample the majority vote picks: the first sample of the number most samples gave (numerically
    equal values are one vote: ``1.0`` = ``1``; a tie goes to the value given first). Answers without a number
    do not vote; when none has a number, the first sample (no number) is the outcome."""
    if not samples:
        raise ValueError("a majority vote needs at least one sample")
    votes = Counter(s.extraction.value.normalize() for s in samples if s.has_number)
    if not votes:
        return 0
    top = max(votes.values())
    return next(i for i, s in enumerate(samples) if s.has_number and votes[s.extraction.value.normalize()] == top)


def majority_vote(samples: Sequence[Scored]) -> Scored:
    """The majority vote's answer (:func:`majority_index`)."""
    return samples[majority_index(samples)]


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The probability that at least one of ``k`` answers drawn without replacement from ``n`` samples, of which
    ``correct`` are right, is right: 1 - C(n - c, k) / C(n, k) (unbiased for a model's pass@k)."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 1 <= k <= n (n={n}, correct={correct}, k={k})")
    if n - correct < k:
        return 1.0
    return 1.0 - comb(n - correct, k) / comb(n, k)


def per_problem(samples: Sequence[Sequence[Scored]]) -> dict[str, list[float]]:
    """Per problem: majority-vote exact (0/1), pass@1 and pass@K (K = the number of samples)."""
    out: dict[str, list[float]] = {"majority": [], PASS_1.key: [], PASS_K.key: []}
    for group in samples:
        n, c = len(group), sum(s.exact for s in group)
        out["majority"].append(float(majority_vote(group).exact))
        out[PASS_1.key].append(pass_at_k(n, c, 1))
        out[PASS_K.key].append(pass_at_k(n, c, n))
    return out


def summarize_samples(samples: Sequence[Sequence[Scored]], resamples: int, seed: int) -> dict:
    """Majority-vote exact match, pass@1 (the mean accuracy over samples) and pass@K, each with its percentile
    bootstrap interval over problems."""
    values = per_problem(samples)
    k = len(samples[0]) if samples else 0
    out: dict[str, Optional[float] | int | list] = {"k": k}
    for name, xs in values.items():
        ci = bootstrap_ci(xs, resamples, seed)
        out[name] = sum(xs) / len(xs) if xs else None
        out[f"{name}_ci"] = list(ci) if ci else None
    voted = [(g, majority_vote(g)) for g in samples]
    agree = [sum(s.extraction.value == v.extraction.value for s in g if s.has_number) / len(g)
             for g, v in voted if v.has_number]
    out["vote_share"] = sum(agree) / len(agree) if agree else None  # how often a sample gives the voted number
    return out
