"""How well a score orders helpful captions above the others.

Example:
    >>> from torchrl_oni.rewards.metrics import auc
    >>> auc([0.9, 0.4, 0.4, 0.1], [True, True, False, False])
    0.875
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["auc"]


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
