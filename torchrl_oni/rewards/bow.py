"""ELLM-BoW: reward messages whose bag-of-words embedding points the same way as a goal sentence.

``R(m) = cos(e(m), e(goal))`` when it exceeds ``threshold``, else 0, where ``e`` is the sum of
the word vectors of a text's words (oni_spec §2.5). No LLM is involved; results are memoised
per caption hash.

ONI used 300-d fastText vectors from a multi-GB file at a hard-coded path. Here the vectors
must ship inside a package (nothing is downloaded at run time); they come from
:mod:`~torchrl_oni.rewards.text` (:func:`~torchrl_oni.rewards.text.make_vectors`):
:class:`~torchrl_oni.rewards.text.MiniLMTokenVectors` (default, optional extra
``torchrl_oni[bow]``: all-MiniLM-L6-v2's static token table) or
:class:`~torchrl_oni.rewards.text.HashedWordVectors` (no dependency, purely lexical).

A third source, ``"sentence"`` (:func:`~torchrl_oni.rewards.text.make_vectors`), embeds the whole text with the full
all-MiniLM-L6-v2 transformer (:class:`~torchrl_oni.rewards.text.MiniLMEncoder`: mean pooling,
L2 norm; ELLM's kind of encoder) instead of summing static token vectors. It is **not** the
default, because it is not better here and costs far more. AUC of ``cos(message, goal sentence)``
on the 40 hand-labelled messages of ``benchmarks/annotation_throughput.py`` (labels for the
default goal as written there, for the other goals from
:class:`~torchrl_oni.annotators.scripted.ScriptedAnnotator`; positives 20 / 8 / 3 / 4):

============  ===========  ======  ======  ======  ======  =============================
vectors       default      combat  gold    stairs  mean    cost per new message (CPU)
============  ===========  ======  ======  ======  ======  =============================
minilm        0.873        0.988   0.982   1.000   0.961   ~0.2 ms (token table)
sentence      0.895        0.930   1.000   0.986   0.953   ~10–20 ms (6-layer BERT)
hashed        0.738        0.961   0.883   1.000   0.896   ~0.05 ms
============  ===========  ======  ======  ======  ======  =============================

(Both MiniLM variants reach AUC 1.0 on the small on/off-goal set of ``tests/test_rewards.py``.)

Example:
    >>> import torch
    >>> from torchrl_oni.captions import encode_messages, hash_messages
    >>> from torchrl_oni.rewards.bow import BoWReward
    >>> from torchrl_oni.rewards.text import HashedWordVectors
    >>> reward = BoWReward("kill monsters and collect gold", vectors=HashedWordVectors(), threshold=0.0)
    >>> msgs = encode_messages(["You kill the newt!", "It's a wall."])
    >>> r = reward(torch.as_tensor(msgs), torch.as_tensor(hash_messages(msgs)))
    >>> bool(r[0] > r[1])
    True
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch

from torchrl_oni.captions import MESSAGE_LEN, decode_message, hash_messages
from torchrl_oni.locks import OwnLockOnCopy

from torchrl_oni.rewards.text import MiniLMTokenVectors, WordVectors

__all__ = ["DEFAULT_GOAL", "GOAL_SENTENCES", "BoWReward"]

# Our own wording of the "score" goal: fight, collect gold, go deeper.
DEFAULT_GOAL = (
    "Make progress in NetHack: kill monsters, collect gold, find the staircase and descend "
    "to deeper dungeon levels."
)

# A goal sentence per annotation goal (--goal): content words only (a bag of words has no
# notion of "not").
GOAL_SENTENCES = {
    "default": DEFAULT_GOAL,
    "combat": "Kill monsters, fight and defeat enemies, gain experience levels.",
    "gold": "Find gold, pick up gold pieces, collect coins and treasure.",
    "stairs": "Find the staircase down, descend the stairs to deeper dungeon levels.",
}


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 0.0  # the empty message (or a goal of stopwords only) scores 0, as in ONI
    return float(a @ b) / (na * nb)


class BoWReward(OwnLockOnCopy):
    """ELLM-BoW reward: ``cos(e(m), e(goal)) · 1[cos > threshold]``, memoised per caption hash.

    Args:
        goal: the goal sentence (default: :data:`DEFAULT_GOAL`).
        vectors: a :class:`~torchrl_oni.rewards.text.WordVectors` (default:
            :class:`~torchrl_oni.rewards.text.MiniLMTokenVectors`, which needs
            the ``bow`` extra).
        threshold: cosines at or below it pay 0 (ONI's default -0.5 leaves it effectively off).
        cache_size: the most memoised captions; the oldest are forgotten first.

    The cache is guarded by a lock, so several threads may call the reward; it is not part of
    ``state_dict`` (it is a pure function of goal and vectors). A copy (``copy.deepcopy``,
    pickle: a ``ParallelEnv`` factory, a collector worker) has a lock of its own and starts with
    the cache as it was; it pays the same rewards.
    """

    def __init__(
        self,
        goal: str = DEFAULT_GOAL,
        vectors: Optional[WordVectors] = None,
        threshold: float = -0.5,
        cache_size: int = 200_000,
    ):
        self.vectors = vectors if vectors is not None else MiniLMTokenVectors()
        self.goal = str(goal)
        self.threshold = float(threshold)
        self.cache_size = int(cache_size)
        self._goal_vec = self.vectors.embed(self.goal)
        if not np.any(self._goal_vec):
            raise ValueError(f"the goal {goal!r} has no content word the vectors know")
        self._cache: "OrderedDict[int, float]" = OrderedDict()
        self._lock = threading.Lock()

    def _copy_state(self, state: dict) -> None:
        state["_cache"] = OrderedDict(self._cache)  # the copy's cache is its own

    def similarity(self, text: str) -> float:
        """Cosine between ``text`` and the goal (no threshold, no cache)."""
        return _cosine(self.vectors.embed(text), self._goal_vec)

    def __call__(self, messages, hashes=None) -> torch.Tensor:
        """``(uint8[N,256], int64[N]) -> float32[N]``, before count scaling."""
        if hasattr(messages, "detach"):
            messages = messages.detach().cpu().numpy()
        messages = np.asarray(messages, dtype=np.uint8).reshape(-1, MESSAGE_LEN)
        if hashes is None:
            hashes = hash_messages(messages)
        elif hasattr(hashes, "detach"):
            hashes = hashes.detach().cpu().numpy()
        hashes = np.asarray(hashes, dtype=np.int64).reshape(-1)
        out = np.empty(len(hashes), dtype=np.float32)
        with self._lock:
            for row, h in enumerate(hashes.tolist()):
                value = self._cache.get(h)
                if value is None:
                    cos = self.similarity(decode_message(messages[row]))
                    value = cos if cos > self.threshold else 0.0
                    self._cache[h] = value
                    if len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
                out[row] = value
        return torch.from_numpy(out)
