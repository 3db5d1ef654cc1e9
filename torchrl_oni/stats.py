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

__all__ = ["auc", "fisher_greater", "mean_ci", "rate_ratio_ci", "t_quantile_975", "wilson_interval"]


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
