"""Small statistics written once for every reporter: intervals for evaluation tables, benchmark
summaries and plots, the rate ratio of the reward-hacking diagnostics, and the AUC that scores a
labeller or a reward model.

NumPy only, no SciPy at run time (tests check these against SciPy where it is installed).

Example:
    >>> from torchrl_oni.stats import auc, mean_ci, wilson_interval
    >>> auc([0.9, 0.4, 0.4, 0.1], [True, True, False, False])
    0.875
    >>> mean_ci([1.0, 3.0])["mean"], [round(x, 4) for x in wilson_interval(0, 10)]
    (2.0, [0.0, 0.2775])
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["auc", "fisher_greater", "mcnemar_exact", "mean_ci", "paired_difference", "rate_ratio_ci",
           "sign_flip_p", "t_quantile_975", "wilson_interval"]


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple:
    """Wilson score interval of a binomial proportion (95 % by default).

    Unlike the normal approximation it stays inside [0, 1] and is not empty at 0 or n successes.

    Example:
        >>> [round(x, 4) for x in wilson_interval(0, 10)]
        [0.0, 0.2775]
        >>> [round(x, 4) for x in wilson_interval(5, 10)]
        [0.2366, 0.7634]
    """
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


# two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom (standard tables)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t_quantile_975(df: int) -> float:
    """The 97.5 % quantile of Student's t: a table up to 30 degrees of freedom, then the
    Cornish-Fisher expansion around the normal quantile (error < 1e-4 there).

    Example:
        >>> round(t_quantile_975(9), 3), round(t_quantile_975(100), 3)
        (2.262, 1.984)
    """
    if df < 1:
        raise ValueError("df must be >= 1")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def mean_ci(values: Sequence[float]) -> dict:
    """``{mean, std, ci95, min, max, n}``: a Student-t 95 % interval of the mean (None below 2 values).

    Example:
        >>> r = mean_ci([1.0, 2.0, 3.0, 4.0])
        >>> r["mean"], [round(x, 3) for x in r["ci95"]]
        (2.5, [0.446, 4.554])
    """
    x = np.asarray(values, dtype=np.float64)
    n = int(x.size)
    if n == 0:
        return {"mean": None, "std": None, "ci95": None, "min": None, "max": None, "n": 0}
    mean = float(x.mean())
    std = float(x.std(ddof=1)) if n > 1 else 0.0
    ci = None
    if n > 1:
        half = t_quantile_975(n - 1) * std / math.sqrt(n)
        ci = [mean - half, mean + half]
    return {"mean": mean, "std": std, "ci95": ci, "min": float(x.min()), "max": float(x.max()), "n": n}


def sign_flip_p(differences: Sequence[float], exact_up_to: int = 16, draws: int = 200_000) -> float:
    """Two-sided p of a paired randomisation test: the share of the ``2^n`` sign patterns of the
    differences whose mean is at least as far from 0 as the observed one (each pair's two arms
    exchangeable under "no difference"). Exact up to ``exact_up_to`` pairs, else ``draws`` random
    patterns from a fixed seed. 1.0 for no pairs.

    Free of the normality a paired t-test needs, which 8 success rates near 0.1 do not have.

    Example:
        >>> sign_flip_p([0.1, 0.2, 0.3])  # all positive: 2 of the 8 patterns are as extreme
        0.25
        >>> sign_flip_p([0.1, -0.1])
        1.0
    """
    d = np.asarray(differences, dtype=np.float64)
    n = d.size
    if n == 0:
        return 1.0
    observed = abs(d.sum()) - 1e-12 * max(1.0, abs(d).sum())  # ties with the observed sum count as extreme
    if n <= exact_up_to:
        signs = ((np.arange(2**n)[:, None] >> np.arange(n)) & 1) * 2 - 1
    else:
        signs = np.random.default_rng(0).choice((-1, 1), size=(draws, n))
    return float((np.abs(signs @ d) >= observed).mean())


def paired_difference(a: Sequence[float], b: Sequence[float]) -> dict:
    """The paired comparison of ``a`` and ``b`` (one value each per pair, e.g. a seed's success
    rate under two methods): :func:`mean_ci` of ``a - b``, ``p`` of the sign-flip test
    (:func:`sign_flip_p`), ``excludes_zero`` (the Student-t 95 % interval lies on one side of 0),
    and how many pairs each side wins.

    Example:
        >>> r = paired_difference([0.2, 0.3, 0.25, 0.2, 0.3], [0.1, 0.1, 0.15, 0.2, 0.1])
        >>> round(r["mean"], 3), [round(x, 3) for x in r["ci95"]], r["excludes_zero"], r["wins"]
        (0.12, [0.016, 0.224], True, [4, 0])
        >>> r["p"]  # 4 of the 32 sign patterns are as extreme: the t interval is bolder than the data
        0.125
    """
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    out = mean_ci(d)
    out["p"] = sign_flip_p(d)
    out["excludes_zero"] = out["ci95"] is not None and (out["ci95"][0] > 0 or out["ci95"][1] < 0)
    out["wins"] = [int((d > 0).sum()), int((d < 0).sum())]
    return out


def mcnemar_exact(only_first: int, only_second: int) -> float:
    """Two-sided exact McNemar p for paired binary outcomes: of the pairs where exactly one side
    succeeded, ``only_first`` went to the first and ``only_second`` to the second; under "no
    difference" each such pair is a fair coin (as ``scipy.stats.binomtest(only_first,
    only_first + only_second).pvalue``). 1.0 without discordant pairs.

    Example:
        >>> round(mcnemar_exact(10, 2), 4), mcnemar_exact(3, 3)
        (0.0386, 1.0)
    """
    if only_first < 0 or only_second < 0:
        raise ValueError(f"counts must be non-negative, got {only_first} and {only_second}")
    n, k = only_first + only_second, min(only_first, only_second)
    if n == 0:
        return 1.0
    tail = sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2))
               for i in range(k + 1))
    return min(1.0, 2 * tail) if only_first != only_second else 1.0


def rate_ratio_ci(a: int, n1: int, c: int, n2: int, z: float = 1.959964) -> tuple:
    """``(ratio, lo, hi)``: the ratio of two proportions ``(a / n1) / (c / n2)`` with Katz's log
    interval (95 % by default), as ``scipy.stats.contingency.relative_risk`` computes it.

    A zero count has no log interval: for the interval only, a zero ``a`` (or ``c``) becomes 0.5
    of a group one larger (0.5 added to both of its cells, Haldane's correction in that group),
    and the bound on its side is 0 (or infinity). The ratio itself is never corrected: 0 when
    ``a`` is 0, infinity when only ``c`` is; ``(nan, nan, nan)`` when ``n1`` or ``n2`` is 0 or
    both counts are.

    Example:
        >>> [round(x, 3) for x in rate_ratio_ci(30, 100, 10, 100)]
        [3.0, 1.551, 5.803]
        >>> [round(x, 2) for x in rate_ratio_ci(0, 5, 20, 1000)]  # none of 5: 0, and a wide upper bound
        [0.0, 0.0, 61.32]
    """
    if n1 <= 0 or n2 <= 0 or (a == 0 and c == 0):
        return (math.nan, math.nan, math.nan)
    ratio = (a / n1) / (c / n2) if c > 0 else math.inf
    a_, n1_ = (a, n1) if a > 0 else (0.5, n1 + 1)
    c_, n2_ = (c, n2) if c > 0 else (0.5, n2 + 1)
    centre = (a_ / n1_) / (c_ / n2_)
    se = math.sqrt(max(0.0, 1 / a_ - 1 / n1_ + 1 / c_ - 1 / n2_))
    lo, hi = centre * math.exp(-z * se), centre * math.exp(z * se)
    return (ratio, 0.0 if a == 0 else lo, math.inf if c == 0 else hi)


def fisher_greater(a: int, n1: int, c: int, n2: int) -> float:
    """One-sided Fisher exact p of an excess in the first group: with ``a`` of ``n1`` and ``c`` of
    ``n2``, the chance of ``a`` or more in the first group when the ``a + c`` events fall at random
    among all ``n1 + n2`` (hypergeometric tail, as ``scipy.stats.fisher_exact(...,
    alternative="greater")``). A sum of ``min(n1, a + c) - a + 1`` terms: cheap for evaluation sizes.

    Example:
        >>> round(fisher_greater(8, 10, 2, 10), 4), round(fisher_greater(0, 10, 5, 10), 4)
        (0.0115, 1.0)
    """
    if n1 < 0 or n2 < 0 or not 0 <= a <= n1 or not 0 <= c <= n2:
        raise ValueError(f"counts out of range: {a} of {n1}, {c} of {n2}")
    total, events = n1 + n2, a + c
    if total == 0:
        return 1.0

    def log_comb(n: int, k: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)

    norm = log_comb(total, n1)
    p = sum(math.exp(log_comb(events, k) + log_comb(total - events, n1 - k) - norm)
            for k in range(a, min(n1, events) + 1))
    return min(1.0, p)


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve: P(a helpful caption scores above an unhelpful one), ties ½.

    ``nan`` when one of the two classes is empty.
    """
    scores, labels = np.asarray(scores, float), np.asarray(labels, bool)
    pos, neg = scores[labels], scores[~labels]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (len(pos) * len(neg)))
