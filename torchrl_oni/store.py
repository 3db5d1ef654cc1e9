"""CaptionStore: every unique caption seen, its LLM label, and the pairs sent for ranking.

One row per UNIQUE caption, held as fixed-width tensors in a TorchRL
:class:`~torchrl.data.TensorDictReplayBuffer` (over :class:`~torchrl.data.LazyTensorStorage`
by default, or :class:`~torchrl.data.LazyMemmapStorage` to keep it on disk):

========================  ==============  ==================================================
field                     dtype / shape   meaning
========================  ==============  ==================================================
``message``               uint8[256]      the NUL-padded caption bytes
``caption_hash``          int64           :func:`torchrl_oni.captions.caption_hash`
``label``                 float32         the annotator's label, NaN while unlabelled
``score``                 float32         the annotator's probability, NaN if it gave none
``status``                int8            0 unseen, 1 pending, 2 labelled, 3 failed (stores
                                          written before server faults were told apart: put
                                          back in the queue by :meth:`~CaptionStore.requeue_server_failures`),
                                          4 given up (its answers could not be parsed),
                                          5 skipped (the labeller declined it: never asked again)
``times_seen``            int64           how many steps showed this caption
``attempts``              int16           answers that could not be parsed so far
``provenance``            int16           id into :attr:`CaptionStore.provenances`, -1 none
========================  ==============  ==================================================

No Python strings live in the TorchRL storage: strings there cost O(capacity) per write and do
not survive a save/load. Provenances are a small table beside the storage.

A hash→slot index (two sorted int64 runs searched with :func:`numpy.searchsorted`) makes
``add`` and ``lookup`` vectorised over a whole collector batch. A single lock makes the store
safe to share between the trainer (``add``/``lookup``) and an annotation thread
(``claim``/``set_labels``/``mark_failed``).

Life of a caption: ``add`` → unseen → ``claim`` → pending → ``set_labels`` → labelled, or
``mark_failed`` → unseen again after a backoff. Failures are of two kinds:

* **server faults** (timeouts, HTTP 5xx, connection errors, a request held back by the circuit
  breaker, anything that is not an unparsable answer) say nothing about the caption: it goes
  back to the queue after a short backoff (``server_retry_s``, doubling, at most 5 minutes) and
  is **never given up**. :meth:`CaptionStore.requeue_server_failures` cancels those backoffs
  (the annotation worker calls it when the server is back, and when it starts on a reused or
  resumed store);
* **unparsable answers** count as attempts: after ``max_attempts`` of them the caption is
  *given up* (status 4), counted in ``stats()["given_up"]`` and listed by
  :meth:`CaptionStore.given_up`;
* **skips** (error kind :data:`SKIP_ERROR`, or ``final=True``): the labeller — a person, a
  :class:`~torchrl_oni.annotators.teacher.SimulatedTeacher` — declined the caption. That answer
  is final: the caption is *skipped* (status 5), counted in ``stats()["skipped"]``, and never
  handed out (or paid for) again.

**People first.** A label whose provenance says ``annotator="human"`` (:data:`HUMAN`: the
labelling page, ``oni-label``) is never overwritten by a later non-human label or preference:
:meth:`~CaptionStore.set_labels` and :meth:`~CaptionStore.set_preferences` leave such rows alone
and return False for them (a person may still correct a person).

Unseen captions are handed out most frequently seen first (``claim_order="most_seen"``), so
the steps' coverage (``stats()["seen_coverage"]``) rises as fast as the server allows.
``release_pending`` (and :meth:`CaptionStore.load`) send pending captions back to unseen so no
caption is lost when a run stops mid-annotation.

Row-level reads for tools that show the store to people (the labelling page of
:mod:`torchrl_oni.feedback`): :meth:`~CaptionStore.caption_slots` / :meth:`~CaptionStore.caption_rows`,
:meth:`~CaptionStore.pair_slots` / :meth:`~CaptionStore.pair_rows`, :meth:`~CaptionStore.count_by`,
and the compare-and-set undo :meth:`~CaptionStore.restore_label` /
:meth:`~CaptionStore.restore_preference`. :meth:`~CaptionStore.sample_unlabelled` feeds SURF's
pseudo-labels (:class:`~torchrl_oni.rewards.ensemble.EnsembleClassifierTrainer`).

Example:
    >>> import torch
    >>> from torchrl_oni.captions import encode_messages, hash_messages
    >>> from torchrl_oni.annotators.base import Provenance
    >>> from torchrl_oni.store import CaptionStore
    >>> store = CaptionStore(capacity=16)
    >>> msgs = encode_messages(["You kill the newt!", "It's a wall.", "You kill the newt!"])
    >>> store.add(msgs, hash_messages(msgs)).tolist()
    [True, True, False]
    >>> hashes, texts = store.claim(10)
    >>> texts
    ['You kill the newt!', "It's a wall."]
    >>> store.set_labels(hashes, [1.0, 0.0], Provenance("scripted")).tolist()
    [True, True]
    >>> labels, found = store.lookup(torch.as_tensor(hash_messages(msgs)))
    >>> labels.tolist(), found.tolist()
    ([1.0, 0.0, 1.0], [True, True, True])
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import astuple
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictReplayBuffer

from torchrl_oni.atomic import UnreadableFileError, atomic_write, safe_torch_load
from torchrl_oni.annotators.base import Provenance
from torchrl_oni.annotators.teacher import SKIP_ERROR
from torchrl_oni.captions import CAPTION_HASH_KEY, MESSAGE_KEY, MESSAGE_LEN, decode_messages, hash_messages

__all__ = ["CaptionStore", "UNSEEN", "PENDING", "LABELLED", "FAILED", "GIVEN_UP", "SKIPPED", "HUMAN",
           "SKIP_ERROR", "is_parse_failure", "is_skip", "retry_delay", "waiting_slots", "MAX_RETRY_S",
           "MAX_SERVER_RETRY_S"]

# FAILED is only found in stores written before server faults were told apart from unparsable
# answers (such captions were given up after 3 server errors); new code never writes it.
UNSEEN, PENDING, LABELLED, FAILED, GIVEN_UP, SKIPPED = 0, 1, 2, 3, 4, 5
STATUS_NAMES = {UNSEEN: "unseen", PENDING: "pending", LABELLED: "labelled", FAILED: "failed",
                GIVEN_UP: "given up", SKIPPED: "skipped"}
_N_STATUS = len(STATUS_NAMES)

# Provenance.annotator of people's answers: kept over any later non-human label.
HUMAN = "human"

# Longest wait before an item that failed for a server reason is handed out again, and before
# one whose answer could not be parsed is.
MAX_SERVER_RETRY_S = 300.0
MAX_RETRY_S = 3600.0


def is_parse_failure(error_kind: str) -> bool:
    """True for failures that are the model's fault (an answer that could not be parsed).

    Everything else (timeouts, HTTP errors, connection errors, ``"circuit open"``, exceptions)
    is a server fault: it says nothing about the caption.

    Example:
        >>> is_parse_failure("unparsable"), is_parse_failure("timeout")
        (True, False)
    """
    return "pars" in error_kind.lower()


def retry_delay(first_s: float, failures, cap_s: float):
    """Seconds before an item that failed ``failures`` times in a row is asked again:
    ``first_s · 2^(failures-1)``, at most ``cap_s``. Vectorised over a numpy array of counts.

    The rule of every request queue of the package (:class:`CaptionStore`'s captions and pairs,
    :class:`~torchrl_oni.rewards.ellm.GoalTable`'s states): server faults wait
    ``server_retry_s``-based delays capped at :data:`MAX_SERVER_RETRY_S` and are never given up;
    unparsable answers wait ``retry_backoff_s``-based delays capped at :data:`MAX_RETRY_S`.

    Example:
        >>> retry_delay(5.0, 1, 300.0), retry_delay(5.0, 4, 300.0), retry_delay(5.0, 99, 300.0)
        (5.0, 40.0, 300.0)
        >>> retry_delay(30.0, np.array([1, 2]), 3600.0).tolist()
        [30.0, 60.0]
    """
    # the exponent is capped so a long outage cannot overflow the float
    exponent = np.minimum(np.asarray(failures, dtype=np.float64), 30.0) - 1.0
    delay = np.minimum(float(first_s) * 2.0 ** exponent, float(cap_s))
    return float(delay) if delay.ndim == 0 else delay


def waiting_slots(*retry_ats: Dict[int, float]) -> np.ndarray:
    """Slots still waiting for a retry backoff in ``retry_ats`` (slot → monotonic time it may be
    asked again); entries whose time has come are dropped on the way.

    Example:
        >>> import time
        >>> retry_at = {3: time.monotonic() + 60.0, 7: time.monotonic() - 1.0}
        >>> waiting_slots(retry_at).tolist(), sorted(retry_at)
        ([3], [3])
    """
    if not any(retry_ats):
        return np.empty(0, dtype=np.int64)
    now = time.monotonic()
    for retry_at in retry_ats:
        for slot in [k for k, t in retry_at.items() if t <= now]:
            del retry_at[slot]
    keys = [k for retry_at in retry_ats for k in retry_at]
    return np.fromiter(keys, dtype=np.int64, count=len(keys))


def is_skip(error_kind: str) -> bool:
    """True for a labeller's refusal to answer (:data:`SKIP_ERROR`): final, never retried.

    Example:
        >>> is_skip("skip"), is_skip("timeout")
        (True, False)
    """
    return error_kind == SKIP_ERROR

_FORMAT = "torchrl_oni.CaptionStore"
_VERSION = 1

# name -> (dtype, per-row shape, fill value of a fresh row)
_CAPTION_FIELDS = {
    MESSAGE_KEY: (torch.uint8, (MESSAGE_LEN,), 0),
    CAPTION_HASH_KEY: (torch.int64, (), 0),
    "label": (torch.float32, (), float("nan")),
    "score": (torch.float32, (), float("nan")),
    "status": (torch.int8, (), UNSEEN),
    "times_seen": (torch.int64, (), 0),
    "attempts": (torch.int16, (), 0),
    "provenance": (torch.int16, (), -1),
}
# A pair refers to two caption slots; preference is P(second is better), NaN while unlabelled.
_PAIR_FIELDS = {
    "slot_a": (torch.int64, (), 0),
    "slot_b": (torch.int64, (), 0),
    "preference": (torch.float32, (), float("nan")),
    "status": (torch.int8, (), UNSEEN),
    "attempts": (torch.int16, (), 0),
    "provenance": (torch.int16, (), -1),
}

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence]


def _to_numpy(x: ArrayLike, dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def _shape_of(x: ArrayLike) -> Tuple[int, ...]:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return tuple(x.shape)
    return np.shape(x)


def _most_seen_first(cand: np.ndarray, seen: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` candidates seen most often, in that order; ties oldest (lowest slot) first.

    ``cand`` is sorted ascending. A partial sort keeps a claim cheap on a large backlog (the
    store's lock is held, and the trainer waits on it).
    """
    if k < len(cand):
        if k <= 0:
            return cand[:0]
        kth = np.partition(seen, len(seen) - k)[len(seen) - k]  # the k-th largest count
        above = np.flatnonzero(seen > kth)
        ties = np.flatnonzero(seen == kth)[: k - len(above)]  # oldest first: cand is sorted
        keep = np.concatenate([above, ties])
        cand, seen = cand[keep], seen[keep]
    # lexsort: last key is primary -> by -times_seen, then by slot (oldest).
    return cand[np.lexsort((cand, -seen))]


class _HashIndex:
    """hash → slot as two sorted runs: a big ``main`` and a small ``delta`` merged into it.

    Inserting into the small run keeps ``add`` cheap on a large store (no O(N) copy per
    batch); the runs are merged once the delta reaches ``merge_at`` entries.
    """

    def __init__(self, merge_at: int = 65536):
        self.merge_at = merge_at
        empty = np.empty(0, dtype=np.int64)
        self._main_h, self._main_s = empty, empty
        self._delta_h, self._delta_s = empty, empty

    def __len__(self) -> int:
        return len(self._main_h) + len(self._delta_h)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self._main_h, self._main_s, self._delta_h, self._delta_s))

    @classmethod
    def from_arrays(cls, hashes: np.ndarray, slots: np.ndarray, merge_at: int = 65536) -> "_HashIndex":
        index = cls(merge_at)
        order = np.argsort(hashes, kind="stable")
        index._main_h = np.ascontiguousarray(hashes[order], dtype=np.int64)
        index._main_s = np.ascontiguousarray(slots[order], dtype=np.int64)
        return index

    def find(self, queries: np.ndarray) -> np.ndarray:
        """Slots of ``queries`` (1-D int64), -1 where absent. Sorted queries search fastest."""
        out = np.full(len(queries), -1, dtype=np.int64)
        for run_h, run_s in ((self._main_h, self._main_s), (self._delta_h, self._delta_s)):
            if len(run_h) == 0 or len(queries) == 0:
                continue
            pos = np.searchsorted(run_h, queries)
            np.minimum(pos, len(run_h) - 1, out=pos)
            hit = run_h[pos] == queries
            out[hit] = run_s[pos[hit]]
        return out

    def insert(self, hashes: np.ndarray, slots: np.ndarray) -> None:
        """Adds hashes that are not in the index yet (unique)."""
        if len(hashes) == 0:
            return
        order = np.argsort(hashes, kind="stable")
        hashes, slots = hashes[order], slots[order]
        pos = np.searchsorted(self._delta_h, hashes)
        self._delta_h = np.insert(self._delta_h, pos, hashes)
        self._delta_s = np.insert(self._delta_s, pos, slots)
        if len(self._delta_h) >= self.merge_at:
            pos = np.searchsorted(self._main_h, self._delta_h)
            self._main_h = np.insert(self._main_h, pos, self._delta_h)
            self._main_s = np.insert(self._main_s, pos, self._delta_s)
            self._delta_h = self._delta_h[:0]
            self._delta_s = self._delta_s[:0]


class _Table:
    """Fixed-width rows in a TensorDictReplayBuffer, appended in order and updated in place.

    Rows are never evicted: when the buffer is full it is replaced by one twice as large (a
    copy; peak memory is briefly 3x the old table).
    """

    def __init__(self, fields: dict, capacity: int, storage: str, scratch_dir: Optional[str], name: str):
        if storage not in ("tensor", "memmap"):
            raise ValueError(f"storage must be 'tensor' or 'memmap', got {storage!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.fields = fields
        self.storage_kind = storage
        self.scratch_dir = scratch_dir
        self.name = name
        self.size = 0
        self._generation = 0
        self._build(int(capacity))

    def _row_template(self, n: int) -> TensorDict:
        data = {}
        for key, (dtype, shape, fill) in self.fields.items():
            data[key] = torch.full((n, *shape), fill, dtype=dtype)
        return TensorDict(data, batch_size=[n])

    def _build(self, capacity: int) -> None:
        if self.storage_kind == "memmap":
            scratch = None
            if self.scratch_dir is not None:
                scratch = os.path.join(self.scratch_dir, f"{self.name}-{self._generation}")
            storage = LazyMemmapStorage(capacity, scratch_dir=scratch)
        else:
            storage = LazyTensorStorage(capacity)
        rb = TensorDictReplayBuffer(storage=storage, batch_size=1)
        # One write allocates every column at full capacity; empty() keeps the allocation, so
        # the numpy views below stay valid for the life of this buffer.
        rb.extend(self._row_template(1))
        rb.empty()
        self.rb = rb
        self.capacity = capacity
        # The storage's TensorDict: TorchRL offers no public per-column view, and lookups must
        # read/write single fields at arbitrary slots without materialising whole rows.
        columns = rb.storage._storage
        self.cols: Dict[str, np.ndarray] = {k: columns.get(k).numpy() for k in self.fields}

    def ensure_room(self, n_new: int) -> None:
        if self.size + n_new <= self.capacity:
            return
        new_capacity = max(2 * self.capacity, self.size + n_new)
        old_rows = self.rows(np.arange(self.size))
        old_scratch = None
        if self.storage_kind == "memmap" and self.scratch_dir is not None:
            old_scratch = os.path.join(self.scratch_dir, f"{self.name}-{self._generation}")
        self._generation += 1
        self._build(new_capacity)
        if self.size:
            self.rb.extend(old_rows)
        if old_scratch is not None:
            shutil.rmtree(old_scratch, ignore_errors=True)

    def append(self, values: Dict[str, np.ndarray], n: int) -> np.ndarray:
        """Appends ``n`` rows (missing fields take their fill value); returns their slots."""
        self.ensure_room(n)
        rows = self._row_template(n)
        for key, value in values.items():
            dtype = self.fields[key][0]
            rows.set(key, torch.as_tensor(value, dtype=dtype).reshape(rows.get(key).shape))
        slots = self.rb.extend(rows)
        self.size += n
        return _to_numpy(slots, np.int64)

    def rows(self, slots: np.ndarray) -> TensorDict:
        """A copy of the given rows as a TensorDict (torch tensors, batch ``[len(slots)]``)."""
        data = {k: torch.from_numpy(np.array(self.cols[k][slots])) for k in self.fields}
        return TensorDict(data, batch_size=[len(slots)])

    @property
    def nbytes(self) -> int:
        return sum(col.nbytes for col in self.cols.values())


class CaptionStore:
    """The set of unique captions, their labels, and pairs of captions to rank.

    Args:
        capacity (int): initial number of caption rows. The store doubles when full, so this is
            a sizing hint (each row costs 285 bytes plus 16 bytes of index). Default 65536.
        storage (str): ``"tensor"`` (RAM, :class:`~torchrl.data.LazyTensorStorage`) or
            ``"memmap"`` (:class:`~torchrl.data.LazyMemmapStorage`). Default ``"tensor"``.
        scratch_dir (str, optional): folder for the memmap files (memmap only; a temporary
            folder cleaned at exit when omitted).
        max_attempts (int): unparsable answers after which a caption is given up. Server
            faults never count (see the module docstring).
        retry_backoff_s (float): a caption answered unparsably ``k`` times is retried after
            ``retry_backoff_s * 2 ** (k - 1)`` seconds (capped at 1 hour).
        server_retry_s (float): a caption whose request failed for a server reason ``k`` times
            in a row is handed out again after ``server_retry_s * 2 ** (k - 1)`` seconds (capped
            at 5 minutes), or as soon as :meth:`requeue_server_failures` is called.
        claim_order (str): which unseen captions :meth:`claim` hands out first:
            ``"most_seen"`` (default: the captions covering most steps are labelled first, ties
            oldest-first) or ``"oldest"`` (insertion order).
        pair_capacity (int): initial number of pair rows (doubles when full).

    Example:
        >>> from torchrl_oni.captions import encode_messages, hash_messages
        >>> from torchrl_oni.store import CaptionStore
        >>> store = CaptionStore(capacity=8)
        >>> msgs = encode_messages(["a", "b"])
        >>> store.add(msgs, hash_messages(msgs)).tolist()
        [True, True]
        >>> len(store), store.stats()["unseen"]
        (2, 2)
    """

    def __init__(
        self,
        capacity: int = 65536,
        *,
        storage: str = "tensor",
        scratch_dir: Optional[str] = None,
        max_attempts: int = 3,
        retry_backoff_s: float = 30.0,
        claim_order: str = "most_seen",
        pair_capacity: int = 4096,
        server_retry_s: float = 5.0,
    ):
        if claim_order not in ("most_seen", "oldest"):
            raise ValueError(f"claim_order must be 'most_seen' or 'oldest', got {claim_order!r}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.storage_kind = storage
        self.scratch_dir = scratch_dir
        self.max_attempts = int(max_attempts)
        self.retry_backoff_s = float(retry_backoff_s)
        self.server_retry_s = float(server_retry_s)
        self.claim_order = claim_order
        self._lock = threading.RLock()
        self._captions = _Table(_CAPTION_FIELDS, capacity, storage, scratch_dir, "captions")
        self._pairs = _Table(_PAIR_FIELDS, pair_capacity, storage, scratch_dir, "pairs")
        self._index = _HashIndex()
        self._pair_index: Dict[Tuple[int, int], int] = {}
        self._provenances: List[Provenance] = []
        self._provenance_ids: Dict[Provenance, int] = {}
        self._human_ids = np.empty(0, dtype=np.int16)  # provenance ids of people's answers
        # slot -> monotonic time before which a failed caption is not handed out again, for
        # unparsable answers (kept until the caption is labelled) and for server faults (dropped
        # by requeue_server_failures), with the count of server faults in a row per slot.
        self._retry_at: Dict[int, float] = {}
        self._pair_retry_at: Dict[int, float] = {}
        self._server_retry_at: Dict[int, float] = {}
        self._pair_server_retry_at: Dict[int, float] = {}
        self._server_faults: Dict[int, int] = {}
        self._pair_server_faults: Dict[int, int] = {}
        self.error_counts: Dict[str, int] = {}

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return self._captions.size

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={len(self)}, capacity={self._captions.capacity}, "
            f"storage={self.storage_kind!r}, pairs={self._pairs.size})"
        )

    @property
    def capacity(self) -> int:
        return self._captions.capacity

    @property
    def provenances(self) -> List[Provenance]:
        """The provenance table; a row's ``provenance`` field indexes it."""
        return list(self._provenances)

    @property
    def lock(self) -> threading.RLock:
        """The store's lock, for callers that need several calls to be atomic."""
        return self._lock

    def nbytes(self) -> int:
        """Bytes held by the storage tensors (allocated capacity) and the hash index."""
        with self._lock:
            return self._captions.nbytes + self._pairs.nbytes + self._index.nbytes

    def _provenance_id(self, provenance: Provenance) -> int:
        if not isinstance(provenance, Provenance):
            raise TypeError(f"provenance must be a Provenance, got {type(provenance).__name__}")
        pid = self._provenance_ids.get(provenance)
        if pid is None:
            pid = len(self._provenances)
            if pid > np.iinfo(np.int16).max:
                raise ValueError("too many distinct provenances (max 32767) in one CaptionStore")
            self._provenances.append(provenance)
            self._provenance_ids[provenance] = pid
            if provenance.annotator == HUMAN:
                self._human_ids = np.append(self._human_ids, np.int16(pid))
        return pid

    def provenance_ids(self, annotator: str) -> np.ndarray:
        """``int16`` ids (into :attr:`provenances`) of every provenance whose ``annotator`` is this."""
        with self._lock:
            if annotator == HUMAN:
                return self._human_ids.copy()
            return np.array([i for i, p in enumerate(self._provenances) if p.annotator == annotator], dtype=np.int16)

    def _protected(self, current_pids: np.ndarray, incoming_pids: np.ndarray) -> np.ndarray:
        """Rows holding a person's answer that a non-human answer would overwrite (lock held)."""
        if not len(self._human_ids):
            return np.zeros(len(current_pids), dtype=bool)
        return np.isin(current_pids, self._human_ids) & ~np.isin(incoming_pids, self._human_ids)

    def _provenance_ids_for(self, provenance, n: int) -> np.ndarray:
        if isinstance(provenance, Provenance):
            return np.full(n, self._provenance_id(provenance), dtype=np.int16)
        if isinstance(provenance, (str, bytes)) or not hasattr(provenance, "__iter__"):
            raise TypeError(f"provenance must be a Provenance or a sequence of them, got {type(provenance).__name__}")
        provenance = list(provenance)
        if len(provenance) != n:
            raise ValueError(f"got {len(provenance)} provenances for {n} items")
        return np.array([self._provenance_id(p) for p in provenance], dtype=np.int16)

    # ------------------------------------------------------------------ captions
    def add(self, messages: ArrayLike, hashes: Optional[ArrayLike] = None) -> torch.Tensor:
        """Records a batch of captions as seen.

        Args:
            messages: ``uint8[..., 256]`` caption bytes (torch or numpy).
            hashes: their ``int64[...]`` caption hashes (``[..., 1]`` also accepted); computed
                from the messages when omitted (slower).

        Returns:
            a BoolTensor shaped like ``hashes``: True at the first occurrence of each caption
            that was not in the store. Every occurrence increments ``times_seen``.
        """
        msgs = _to_numpy(messages, np.uint8)
        if msgs.ndim == 0 or msgs.shape[-1] != MESSAGE_LEN:
            raise ValueError(f"messages must be uint8[..., {MESSAGE_LEN}], got shape {tuple(msgs.shape)}")
        msgs = msgs.reshape(-1, MESSAGE_LEN)
        if hashes is None:
            hashes = hash_messages(msgs)
        out_shape = _shape_of(hashes)
        flat = _to_numpy(hashes, np.int64).reshape(-1)
        if len(flat) != len(msgs):
            raise ValueError(f"got {len(msgs)} messages but {len(flat)} hashes")
        new_mask = np.zeros(len(flat), dtype=bool)
        if len(flat) == 0:
            return torch.from_numpy(new_mask).reshape(out_shape)
        uniq, first, counts = np.unique(flat, return_index=True, return_counts=True)
        with self._lock:
            slots = self._index.find(uniq)
            known = slots >= 0
            if known.any():
                self._captions.cols["times_seen"][slots[known]] += counts[known]
            new = np.flatnonzero(~known)
            if len(new):
                # Slots follow first appearance in the batch, so slot order is "oldest first".
                new = new[np.argsort(first[new], kind="stable")]
                rows = first[new]
                new_slots = self._captions.append(
                    {MESSAGE_KEY: msgs[rows], CAPTION_HASH_KEY: uniq[new], "times_seen": counts[new]},
                    len(new),
                )
                self._index.insert(uniq[new], new_slots)
                new_mask[rows] = True
        return torch.from_numpy(new_mask).reshape(out_shape)

    def slots(self, hashes: ArrayLike) -> torch.Tensor:
        """Row slots of ``hashes`` (any shape), -1 where a caption is not in the store."""
        shape = _shape_of(hashes)
        flat = _to_numpy(hashes, np.int64).reshape(-1)
        with self._lock:
            return torch.from_numpy(self._index.find(flat)).reshape(shape)

    def lookup(self, hashes: ArrayLike, default: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
        """Labels of a batch of hashes (any shape).

        Returns:
            ``(labels float32, found bool)`` shaped like ``hashes``. ``found`` is True where the
            caption is labelled; ``labels`` holds ``default`` elsewhere (0.0, ONI-Retrieval's
            reward for a caption without a label).
        """
        shape = _shape_of(hashes)
        flat = _to_numpy(hashes, np.int64).reshape(-1)
        # Few distinct captions per batch: search each once, in sorted order (cache friendly).
        uniq, inverse = np.unique(flat, return_inverse=True)
        labels = np.full(len(uniq), default, dtype=np.float32)
        found = np.zeros(len(uniq), dtype=bool)
        with self._lock:
            slots = self._index.find(uniq)
            known = slots >= 0
            s = slots[known]
            is_labelled = self._captions.cols["status"][s] == LABELLED
            values = self._captions.cols["label"][s]
        found[known] = is_labelled
        labels[known] = np.where(is_labelled, values, np.float32(default))
        return (
            torch.from_numpy(labels[inverse]).reshape(shape),
            torch.from_numpy(found[inverse]).reshape(shape),
        )

    def scores(self, hashes: ArrayLike) -> torch.Tensor:
        """The annotator's probabilities for ``hashes`` (NaN where none), shaped like ``hashes``."""
        shape = _shape_of(hashes)
        flat = _to_numpy(hashes, np.int64).reshape(-1)
        out = np.full(len(flat), np.nan, dtype=np.float32)
        with self._lock:
            slots = self._index.find(flat)
            known = slots >= 0
            s = slots[known]
            ok = self._captions.cols["status"][s] == LABELLED
            out[np.flatnonzero(known)[ok]] = self._captions.cols["score"][s[ok]]
        return torch.from_numpy(out).reshape(shape)

    def _claimable(self) -> np.ndarray:
        """Unseen caption slots whose retry backoff (if any) has passed, oldest first."""
        cand = np.flatnonzero(self._captions.cols["status"][: self._captions.size] == UNSEEN)
        blocked = waiting_slots(self._retry_at, self._server_retry_at)
        if len(blocked) and len(cand):
            cand = cand[~np.isin(cand, blocked)]
        return cand

    def claim(self, max_items: int) -> Tuple[torch.Tensor, List[str]]:
        """Hands out up to ``max_items`` captions to annotate and marks them pending.

        Candidates are unseen captions, including failed ones whose retry backoff has passed.
        With ``claim_order="most_seen"`` the most frequently seen come first (ties: oldest
        first); with ``"oldest"``, insertion order.

        Returns:
            ``(hashes LongTensor[n], texts list[str])`` (texts decoded latin-1, NULs dropped).
        """
        max_items = max(int(max_items), 0)
        with self._lock:
            cols = self._captions.cols
            cand = self._claimable()
            if self.claim_order == "most_seen" and len(cand):
                cand = _most_seen_first(cand, cols["times_seen"][cand], max_items)
            else:
                cand = cand[:max_items]
            cols["status"][cand] = PENDING
            hashes = np.array(cols[CAPTION_HASH_KEY][cand])
            messages = np.array(cols[MESSAGE_KEY][cand])
        return torch.from_numpy(hashes), decode_messages(messages)

    def claimable(self, captions: bool = True, pairs: bool = True) -> int:
        """How many captions and/or pairs :meth:`claim` / :meth:`claim_pairs` would hand out now."""
        with self._lock:
            n_pairs = 0
            if pairs:
                open_pairs = np.flatnonzero(self._pairs.cols["status"][: self._pairs.size] == UNSEEN)
                blocked = waiting_slots(self._pair_retry_at, self._pair_server_retry_at)
                n_pairs = len(open_pairs) - int(np.isin(open_pairs, blocked).sum()) if len(blocked) else len(open_pairs)
            return (len(self._claimable()) if captions else 0) + n_pairs

    def pending(self) -> torch.Tensor:
        """Hashes of the captions claimed but not yet labelled or failed."""
        with self._lock:
            n = self._captions.size
            cols = self._captions.cols
            return torch.from_numpy(np.array(cols[CAPTION_HASH_KEY][:n][cols["status"][:n] == PENDING]))

    def set_labels(
        self,
        hashes: ArrayLike,
        labels: ArrayLike,
        provenance: Union[Provenance, Sequence[Provenance]],
        scores: Optional[ArrayLike] = None,
    ) -> torch.Tensor:
        """Stores labels. A later label overwrites an earlier one, except that a person's label
        (provenance ``annotator="human"``) is only ever replaced by another person's.

        Args:
            hashes: caption hashes (any shape).
            labels: one finite label per hash (1.0 progress, 0.0 not; soft labels allowed).
            provenance: one :class:`Provenance` for all, or one per hash.
            scores: optional annotator probabilities (NaN where none).

        Returns:
            a BoolTensor shaped like ``hashes``: True where the label was written; False for
            hashes not in the store and for captions a person labelled (both left alone).

        Example:
            >>> from torchrl_oni.captions import encode_messages, hash_messages
            >>> store = CaptionStore(capacity=4)
            >>> h = hash_messages(encode_messages(["It's a wall."]))
            >>> _ = store.add(encode_messages(["It's a wall."]), h)
            >>> store.set_labels(h, [1.0], Provenance(HUMAN, "ada")).tolist()
            [True]
            >>> store.set_labels(h, [0.0], Provenance("openai", "llama")).tolist()   # a late LLM answer
            [False]
            >>> store.lookup(h)[0].tolist()
            [1.0]
        """
        shape = _shape_of(hashes)
        flat = _to_numpy(hashes, np.int64).reshape(-1)
        values = np.broadcast_to(_to_numpy(labels, np.float32).reshape(-1), flat.shape)
        if not np.isfinite(values).all():
            raise ValueError("set_labels: labels must be finite (use mark_failed for failures)")
        if scores is None:
            score_values = np.full(len(flat), np.nan, dtype=np.float32)
        else:
            score_values = np.broadcast_to(_to_numpy(scores, np.float32).reshape(-1), flat.shape)
        with self._lock:
            pids = self._provenance_ids_for(provenance, len(flat))
            slots = self._index.find(flat)
            cols = self._captions.cols
            written = slots >= 0
            idx = np.flatnonzero(written)
            protected = self._protected(cols["provenance"][slots[idx]], pids[idx])
            written[idx[protected]] = False
            s = slots[written]
            cols["label"][s] = values[written]
            cols["score"][s] = score_values[written]
            cols["status"][s] = LABELLED
            cols["provenance"][s] = pids[written]
            if self._retry_at:
                for slot in s.tolist():
                    self._retry_at.pop(slot, None)
        return torch.from_numpy(written).reshape(shape)

    def _fail(self, table: "_Table", slots: np.ndarray, error_kind: str, parse_failure: Optional[bool],
              retry_at: Dict[int, float], server_retry_at: Dict[int, float],
              server_faults: Dict[int, int], final: Optional[bool] = None) -> Tuple[np.ndarray, np.ndarray]:
        """Records failed attempts on ``slots`` of ``table`` (lock held).

        Returns:
            ``(slots that took the failure, mask of those given up or skipped)``.
        """
        cols = table.cols
        status = cols["status"][slots]
        slots = slots[(status != LABELLED) & (status != GIVEN_UP) & (status != SKIPPED)]
        self.error_counts[error_kind] = self.error_counts.get(error_kind, 0) + len(slots)
        now = time.monotonic()
        if is_skip(error_kind) if final is None else final:
            # the labeller declined: a final answer, neither retried nor paid for again
            cols["status"][slots] = SKIPPED
            for slot in slots.tolist():
                retry_at.pop(slot, None)
                server_retry_at.pop(slot, None)
                server_faults.pop(slot, None)
            return slots, np.ones(len(slots), dtype=bool)
        if not (is_parse_failure(error_kind) if parse_failure is None else parse_failure):
            # A server fault says nothing about the caption: back to the queue, no attempt spent.
            cols["status"][slots] = UNSEEN
            for slot in slots.tolist():
                k = server_faults.get(slot, 0) + 1
                server_faults[slot] = k
                server_retry_at[slot] = now + retry_delay(self.server_retry_s, k, MAX_SERVER_RETRY_S)
            return slots, np.zeros(len(slots), dtype=bool)
        cols["attempts"][slots] += 1
        attempts = cols["attempts"][slots]
        give_up = attempts >= self.max_attempts
        cols["status"][slots[give_up]] = GIVEN_UP
        cols["status"][slots[~give_up]] = UNSEEN
        delays = retry_delay(self.retry_backoff_s, attempts[~give_up], MAX_RETRY_S)
        for slot, delay in zip(slots[~give_up].tolist(), delays.tolist()):
            retry_at[slot] = now + delay
        for slot in slots[give_up].tolist():
            retry_at.pop(slot, None)
        return slots, give_up

    def mark_failed(self, hashes: ArrayLike, error_kind: str = "error", *,
                    parse_failure: Optional[bool] = None, final: Optional[bool] = None) -> torch.Tensor:
        """Records a failed annotation attempt.

        A skip (``final=True``, or by default the error kind :data:`SKIP_ERROR`) is the
        labeller's final answer: the caption becomes *skipped* and is never handed out again.
        A server fault (any ``error_kind`` for which :func:`is_parse_failure` is False, unless
        ``parse_failure`` says otherwise) sends the caption back to unseen after a short backoff
        and spends no attempt. An unparsable answer spends one: the caption is retried after
        ``retry_backoff_s * 2 ** (k - 1)`` seconds, and given up after ``max_attempts``.
        Labelled, given-up and skipped captions are left alone (a late failure never erases a label).

        Returns:
            a BoolTensor shaped like ``hashes``: True where the caption was given up or skipped.

        Example:
            >>> from torchrl_oni.captions import encode_messages, hash_messages
            >>> store = CaptionStore(capacity=4)
            >>> _ = store.add(encode_messages(["It's a wall."]))
            >>> hashes, _ = store.claim(1)
            >>> store.mark_failed(hashes, SKIP_ERROR).tolist(), store.claim(1)[1], store.stats()["skipped"]
            ([True], [], 1)
        """
        shape = _shape_of(hashes)
        flat = _to_numpy(hashes, np.int64).reshape(-1)
        gave_up = np.zeros(len(flat), dtype=bool)
        with self._lock:
            slots = self._index.find(flat)
            idx = np.flatnonzero(slots >= 0)
            failed, give_up = self._fail(self._captions, slots[idx], error_kind, parse_failure,
                                         self._retry_at, self._server_retry_at, self._server_faults, final)
            gave_up[idx[np.isin(slots[idx], failed[give_up])]] = True
        return torch.from_numpy(gave_up).reshape(shape)

    def retry_failed(self) -> int:
        """Makes every given-up caption unseen again with a fresh attempt count; returns how many."""
        with self._lock:
            cols = self._captions.cols
            n = self._captions.size
            failed = np.flatnonzero(np.isin(cols["status"][:n], (FAILED, GIVEN_UP)))
            cols["status"][failed] = UNSEEN
            cols["attempts"][failed] = 0
            return len(failed)

    def requeue_server_failures(self) -> int:
        """Puts every caption and pair that failed for a server reason back in the queue now.

        Cancels the backoffs of server faults, and sends the ``failed`` rows of stores written
        by older versions (which gave captions up after 3 server errors) back to unseen with a
        fresh attempt count. Given-up captions (unparsable answers) stay given up. Call it when
        the server is healthy again and after loading a store; :class:`AnnotationWorker` does
        both.

        Returns:
            how many captions and pairs became claimable.

        Example:
            >>> from torchrl_oni.captions import encode_messages, hash_messages
            >>> store = CaptionStore(capacity=4, server_retry_s=60.0)
            >>> msgs = encode_messages(["a"])
            >>> _ = store.add(msgs, hash_messages(msgs))
            >>> _ = store.mark_failed(store.claim(1)[0], "timeout")
            >>> store.claim(1)[1], store.requeue_server_failures(), store.claim(1)[1]
            ([], 1, ['a'])
        """
        with self._lock:
            now = time.monotonic()
            count = 0
            for table, retry_at, faults in ((self._captions, self._server_retry_at, self._server_faults),
                                            (self._pairs, self._pair_server_retry_at, self._pair_server_faults)):
                status = table.cols["status"][: table.size]
                legacy = np.flatnonzero(status == FAILED)
                status[legacy] = UNSEEN
                table.cols["attempts"][legacy] = 0
                waiting = [slot for slot, t in retry_at.items() if t > now and status[slot] == UNSEEN]
                count += len(legacy) + len(waiting)
                retry_at.clear()
                faults.clear()
            return count

    def given_up(self) -> List[str]:
        """The captions given up because their answers could not be parsed (oldest first)."""
        with self._lock:
            n = self._captions.size
            slots = np.flatnonzero(self._captions.cols["status"][:n] == GIVEN_UP)
            messages = np.array(self._captions.cols[MESSAGE_KEY][slots])
        return decode_messages(messages)

    def release(self, hashes: ArrayLike) -> int:
        """Sends the given pending captions back to unseen (work that was claimed but dropped)."""
        flat = _to_numpy(hashes, np.int64).reshape(-1)
        with self._lock:
            slots = self._index.find(flat)
            s = slots[slots >= 0]
            status = self._captions.cols["status"]
            s = s[status[s] == PENDING]
            status[s] = UNSEEN
            return len(s)

    def release_pairs(self, pair_slots: ArrayLike) -> int:
        """Sends the given pending pairs back to unseen."""
        with self._lock:
            s = self._check_pair_slots(pair_slots)
            status = self._pairs.cols["status"]
            s = s[status[s] == PENDING]
            status[s] = UNSEEN
            return len(s)

    def release_pending(self) -> int:
        """Sends pending captions and pairs back to unseen (at load, on shutdown); returns how many."""
        with self._lock:
            released = 0
            for table in (self._captions, self._pairs):
                status = table.cols["status"][: table.size]
                pending = status == PENDING
                released += int(pending.sum())
                status[pending] = UNSEEN
            return released

    def labelled_data(self) -> TensorDict:
        """Every labelled caption: ``message``, ``caption_hash``, ``label``, ``score``, ``times_seen``."""
        with self._lock:
            n = self._captions.size
            slots = np.flatnonzero(self._captions.cols["status"][:n] == LABELLED)
            rows = self._captions.rows(slots)
        return rows.select(MESSAGE_KEY, CAPTION_HASH_KEY, "label", "score", "times_seen")

    def sample_labelled(self, batch_size: int, generator: Optional[np.random.Generator] = None) -> TensorDict:
        """A uniform sample (with replacement) of labelled captions; empty batch when none."""
        rng = generator if generator is not None else np.random.default_rng()
        with self._lock:
            n = self._captions.size
            slots = np.flatnonzero(self._captions.cols["status"][:n] == LABELLED)
            picked = slots[rng.integers(0, len(slots), batch_size)] if len(slots) else slots
            rows = self._captions.rows(picked)
        return rows.select(MESSAGE_KEY, CAPTION_HASH_KEY, "label", "score", "times_seen")

    def sample_unlabelled(self, n: int, generator: Optional[np.random.Generator] = None) -> torch.Tensor:
        """Up to ``n`` distinct captions without a label (unseen, pending, given up or skipped),
        drawn uniformly without replacement: ``uint8[k <= n, 256]``.

        What SURF pseudo-labels (:class:`~torchrl_oni.rewards.ensemble.EnsembleClassifierTrainer`
        calls it as ``unlabelled(n, generator)``).

        Example:
            >>> import numpy as np
            >>> from torchrl_oni.captions import decode_messages, encode_messages
            >>> store = CaptionStore(capacity=4)
            >>> _ = store.add(encode_messages(["a", "b", "c"]))
            >>> _ = store.set_labels(store.slots_to_hashes([0]), [1.0], Provenance("doc"))
            >>> sorted(decode_messages(store.sample_unlabelled(10, np.random.default_rng(0)).numpy()))
            ['b', 'c']
        """
        rng = generator if generator is not None else np.random.default_rng()
        with self._lock:
            size = self._captions.size
            slots = np.flatnonzero(self._captions.cols["status"][:size] != LABELLED)
            k = min(max(int(n), 0), len(slots))
            picked = np.sort(rng.choice(slots, size=k, replace=False)) if k else slots[:0]
            messages = np.array(self._captions.cols[MESSAGE_KEY][picked])
        return torch.from_numpy(messages)

    # ------------------------------------------------------------------ rows (tools that show the store to people)
    CAPTION_ROW_FIELDS = tuple(_CAPTION_FIELDS)
    PAIR_ROW_FIELDS = tuple(_PAIR_FIELDS) + ("message_a", "message_b", "caption_hash_a", "caption_hash_b",
                                             "times_seen_a", "times_seen_b")

    def slots_to_hashes(self, slots: ArrayLike) -> torch.Tensor:
        """Caption hashes of row ``slots`` (the inverse of :meth:`slots`)."""
        with self._lock:
            s = self._check_caption_slots(slots)
            return torch.from_numpy(np.array(self._captions.cols[CAPTION_HASH_KEY][s]))

    def _check_caption_slots(self, slots: ArrayLike) -> np.ndarray:
        s = _to_numpy(slots, np.int64).reshape(-1)
        if len(s) and (s.min() < 0 or s.max() >= self._captions.size):
            raise ValueError(f"caption slots must be in [0, {self._captions.size}), got {s.min()}..{s.max()}")
        return s

    def _annotated_by_mask(self, table: "_Table", annotator: str) -> np.ndarray:
        ids = self._human_ids if annotator == HUMAN else np.array(
            [i for i, p in enumerate(self._provenances) if p.annotator == annotator], dtype=np.int16)
        return np.isin(table.cols["provenance"][: table.size], ids)

    def caption_slots(self, *, exclude_annotator: Optional[str] = None, nonempty: bool = False,
                      status: Optional[int] = None) -> torch.Tensor:
        """Row slots of the captions that match, oldest first (``LongTensor``).

        Args:
            exclude_annotator: leave out captions whose label comes from this annotator (e.g.
                :data:`HUMAN`: what a person has not labelled yet).
            nonempty: leave out the empty caption.
            status: only captions with this status (:data:`UNSEEN`, :data:`LABELLED`, ...).

        Example:
            >>> from torchrl_oni.captions import encode_messages
            >>> store = CaptionStore(capacity=4)
            >>> _ = store.add(encode_messages(["", "a", "b"]))
            >>> _ = store.set_labels(store.slots_to_hashes([2]), [1.0], Provenance(HUMAN))
            >>> store.caption_slots(exclude_annotator=HUMAN, nonempty=True).tolist()
            [1]
        """
        with self._lock:
            n = self._captions.size
            cols = self._captions.cols
            keep = np.ones(n, dtype=bool)
            if nonempty:
                keep &= cols[MESSAGE_KEY][:n, 0] != 0
            if status is not None:
                keep &= cols["status"][:n] == status
            if exclude_annotator is not None:
                keep &= ~self._annotated_by_mask(self._captions, exclude_annotator)
        return torch.from_numpy(np.flatnonzero(keep))

    def caption_rows(self, slots: ArrayLike, fields: Optional[Sequence[str]] = None) -> TensorDict:
        """Copies of caption rows: a TensorDict ``[len(slots)]`` of ``fields`` (default: all of
        :attr:`CAPTION_ROW_FIELDS`: message, caption_hash, label, score, status, times_seen,
        attempts, provenance — an id into :attr:`provenances`)."""
        fields = self.CAPTION_ROW_FIELDS if fields is None else tuple(fields)
        unknown = set(fields) - set(self.CAPTION_ROW_FIELDS)
        if unknown:
            raise KeyError(f"unknown caption fields {sorted(unknown)}; known: {', '.join(self.CAPTION_ROW_FIELDS)}")
        with self._lock:
            s = self._check_caption_slots(slots)
            rows = self._captions.rows(s)
        return rows.select(*fields)

    def pair_slots(self, *, exclude_annotator: Optional[str] = None) -> torch.Tensor:
        """Slots of the pairs, oldest first, without those whose preference comes from
        ``exclude_annotator`` when given."""
        with self._lock:
            keep = np.ones(self._pairs.size, dtype=bool)
            if exclude_annotator is not None:
                keep &= ~self._annotated_by_mask(self._pairs, exclude_annotator)
        return torch.from_numpy(np.flatnonzero(keep))

    @property
    def num_pairs(self) -> int:
        """How many pairs the store holds (any status)."""
        return self._pairs.size

    def pair_rows(self, pair_slots: ArrayLike) -> TensorDict:
        """Copies of pair rows with both captions: a TensorDict ``[len(pair_slots)]`` of
        :attr:`PAIR_ROW_FIELDS` (``slot_a``, ``slot_b``, ``preference``, ``status``, ``attempts``,
        ``provenance``, ``message_a``/``_b``, ``caption_hash_a``/``_b``, ``times_seen_a``/``_b``)."""
        with self._lock:
            s = self._check_pair_slots(pair_slots)
            rows = self._pairs.rows(s)
            ccols = self._captions.cols
            for side in ("a", "b"):
                c = rows.get(f"slot_{side}").numpy()
                for key in (MESSAGE_KEY, CAPTION_HASH_KEY, "times_seen"):
                    rows.set(f"{key}_{side}", torch.from_numpy(np.array(ccols[key][c])))
        return rows

    def count_by(self, annotator: str) -> Dict[str, int]:
        """``{"captions": n, "pairs": m}`` currently labelled by ``annotator`` (e.g. :data:`HUMAN`)."""
        with self._lock:
            return {"captions": int(self._annotated_by_mask(self._captions, annotator).sum()),
                    "pairs": int(self._annotated_by_mask(self._pairs, annotator).sum())}

    def restore_label(self, caption_hash: int, row, *, expect_provenance: int, expect_label: float) -> bool:
        """Undo of a label: puts ``row``'s ``label``, ``score``, ``status`` and ``provenance`` back,
        only if the caption still holds ``(expect_provenance, expect_label)`` (what the undone
        answer wrote; a label written since wins). A row that was pending goes back to unseen.

        Args:
            caption_hash: the caption.
            row: a mapping with the earlier ``label``, ``score``, ``status``, ``provenance``
                (one row of :meth:`caption_rows`).
            expect_provenance, expect_label: what the store must still hold.

        Returns:
            True when restored.

        Example:
            >>> from torchrl_oni.captions import encode_messages
            >>> store = CaptionStore(capacity=4)
            >>> _ = store.add(encode_messages(["a"]))
            >>> h = store.slots_to_hashes([0])
            >>> before = store.caption_rows([0])[0]
            >>> _ = store.set_labels(h, [1.0], Provenance(HUMAN))
            >>> store.restore_label(int(h[0]), before, expect_provenance=0, expect_label=1.0)
            True
            >>> store.stats()["labelled"], store.stats()["unseen"]
            (0, 1)
        """
        with self._lock:
            slot = int(self._index.find(np.array([int(caption_hash)], dtype=np.int64))[0])
            if slot < 0:
                return False
            cols = self._captions.cols
            if cols["provenance"][slot] != expect_provenance or cols["label"][slot] != np.float32(expect_label):
                return False
            status = int(row["status"])
            cols["label"][slot] = float(row["label"])
            cols["score"][slot] = float(row["score"])
            cols["status"][slot] = UNSEEN if status == PENDING else status
            cols["provenance"][slot] = int(row["provenance"])
            return True

    def restore_preference(self, pair_slot: int, row, *, expect_provenance: int, expect_preference: float) -> bool:
        """:meth:`restore_label` for a pair: ``row`` holds the earlier ``preference``,
        ``status`` and ``provenance`` (one row of :meth:`pair_rows`)."""
        with self._lock:
            slot = int(self._check_pair_slots([pair_slot])[0])
            cols = self._pairs.cols
            held = (cols["provenance"][slot], cols["preference"][slot])
            if held != (expect_provenance, np.float32(expect_preference)):
                return False
            status = int(row["status"])
            cols["preference"][slot] = float(row["preference"])
            cols["status"][slot] = UNSEEN if status == PENDING else status
            cols["provenance"][slot] = int(row["provenance"])
            return True

    # ------------------------------------------------------------------ pairs
    def add_pairs(self, hash_a: ArrayLike, hash_b: ArrayLike) -> torch.Tensor:
        """Queues pairs of (already added) captions for ranking; returns their pair slots.

        A pair added twice (same order) keeps its slot and its label: it is not paid for twice.
        """
        fa = _to_numpy(hash_a, np.int64).reshape(-1)
        fb = _to_numpy(hash_b, np.int64).reshape(-1)
        if len(fa) != len(fb):
            raise ValueError(f"add_pairs: got {len(fa)} first and {len(fb)} second hashes")
        with self._lock:
            sa, sb = self._index.find(fa), self._index.find(fb)
            missing = int((sa < 0).sum() + (sb < 0).sum())
            if missing:
                raise ValueError(f"add_pairs: {missing} hashes are not in the store; add() the captions first")
            out = np.empty(len(fa), dtype=np.int64)
            new_pos, new_a, new_b, new_keys = [], [], [], {}
            for i, key in enumerate(zip(sa.tolist(), sb.tolist())):
                slot = self._pair_index.get(key)
                if slot is None:
                    slot = new_keys.get(key)
                    if slot is None:
                        slot = -1 - len(new_a)  # placeholder, resolved below
                        new_keys[key] = slot
                        new_a.append(key[0])
                        new_b.append(key[1])
                out[i] = slot
                if slot < 0:
                    new_pos.append(i)
            if new_a:
                slots = self._pairs.append(
                    {"slot_a": np.array(new_a, dtype=np.int64), "slot_b": np.array(new_b, dtype=np.int64)},
                    len(new_a),
                )
                for key, placeholder in new_keys.items():
                    self._pair_index[key] = int(slots[-1 - placeholder])
                new_pos = np.array(new_pos, dtype=np.int64)
                out[new_pos] = slots[-1 - out[new_pos]]
        return torch.from_numpy(out)

    def claim_pairs(self, max_items: int) -> Tuple[torch.Tensor, List[Tuple[str, str]]]:
        """Hands out up to ``max_items`` unseen pairs (oldest first) and marks them pending.

        Returns:
            ``(pair_slots LongTensor[n], [(text_a, text_b), ...])``.
        """
        max_items = max(int(max_items), 0)
        with self._lock:
            cols = self._pairs.cols
            n = self._pairs.size
            cand = np.flatnonzero(cols["status"][:n] == UNSEEN)
            blocked = waiting_slots(self._pair_retry_at, self._pair_server_retry_at)
            if len(blocked) and len(cand):
                cand = cand[~np.isin(cand, blocked)]
            cand = cand[:max_items]
            cols["status"][cand] = PENDING
            msgs = self._captions.cols[MESSAGE_KEY]
            texts_a = decode_messages(np.array(msgs[cols["slot_a"][cand]]))
            texts_b = decode_messages(np.array(msgs[cols["slot_b"][cand]]))
        return torch.from_numpy(cand.astype(np.int64)), list(zip(texts_a, texts_b))

    def _check_pair_slots(self, pair_slots: ArrayLike) -> np.ndarray:
        s = _to_numpy(pair_slots, np.int64).reshape(-1)
        if len(s) and (s.min() < 0 or s.max() >= self._pairs.size):
            raise ValueError(f"pair slots must be in [0, {self._pairs.size}), got {s.min()}..{s.max()}")
        return s

    def set_preferences(
        self,
        pair_slots: ArrayLike,
        preferences: ArrayLike,
        provenance: Union[Provenance, Sequence[Provenance]],
    ) -> torch.Tensor:
        """Stores preferences: P(second is better), 0.0 first better, 1.0 second, 0.5 tie.

        As for :meth:`set_labels`, a person's preference is only replaced by another person's.

        Returns:
            ``bool[n]``: True where the preference was written, False where a person's stays.
        """
        values = _to_numpy(preferences, np.float32).reshape(-1)
        with self._lock:
            s = self._check_pair_slots(pair_slots)
            values = np.broadcast_to(values, s.shape)
            if not ((values >= 0) & (values <= 1)).all():
                raise ValueError("set_preferences: preferences must be in [0, 1]")
            pids = self._provenance_ids_for(provenance, len(s))
            cols = self._pairs.cols
            written = ~self._protected(cols["provenance"][s], pids)
            s, values, pids = s[written], values[written], pids[written]
            cols["preference"][s] = values
            cols["status"][s] = LABELLED
            cols["provenance"][s] = pids
            for slot in s.tolist():
                self._pair_retry_at.pop(slot, None)
        return torch.from_numpy(written)

    def mark_pairs_failed(self, pair_slots: ArrayLike, error_kind: str = "error", *,
                          parse_failure: Optional[bool] = None, final: Optional[bool] = None) -> None:
        """Like :meth:`mark_failed`, for pairs."""
        with self._lock:
            s = self._check_pair_slots(pair_slots)
            self._fail(self._pairs, s, error_kind, parse_failure, self._pair_retry_at,
                       self._pair_server_retry_at, self._pair_server_faults, final)

    def pending_pairs(self) -> torch.Tensor:
        """Slots of the pairs claimed but not yet answered."""
        with self._lock:
            n = self._pairs.size
            return torch.from_numpy(np.flatnonzero(self._pairs.cols["status"][:n] == PENDING))

    def sample_labelled_pairs(self, batch_size: int, generator: Optional[np.random.Generator] = None) -> TensorDict:
        """A uniform sample (with replacement) of labelled pairs; an empty batch when none.

        Returns:
            a TensorDict ``[batch_size]`` with ``message_a``/``message_b`` (uint8[256]),
            ``caption_hash_a``/``caption_hash_b`` and ``preference`` (P(second is better)).
        """
        rng = generator if generator is not None else np.random.default_rng()
        with self._lock:
            pcols = self._pairs.cols
            labelled = np.flatnonzero(pcols["status"][: self._pairs.size] == LABELLED)
            picked = labelled[rng.integers(0, len(labelled), batch_size)] if len(labelled) else labelled
            sa, sb = pcols["slot_a"][picked], pcols["slot_b"][picked]
            ccols = self._captions.cols
            data = {
                "message_a": np.array(ccols[MESSAGE_KEY][sa]),
                "message_b": np.array(ccols[MESSAGE_KEY][sb]),
                "caption_hash_a": np.array(ccols[CAPTION_HASH_KEY][sa]),
                "caption_hash_b": np.array(ccols[CAPTION_HASH_KEY][sb]),
                "preference": np.array(pcols["preference"][picked]),
            }
        return TensorDict({k: torch.from_numpy(v) for k, v in data.items()}, batch_size=[len(picked)])

    # ------------------------------------------------------------------ stats
    def stats(self) -> Dict[str, float]:
        """Counts and coverage.

        Keys: ``size``, ``capacity``, ``unseen``, ``pending``, ``labelled``, ``given_up``
        (unparsable answers), ``skipped`` (declined by the labeller), ``failed`` (given up, plus
        any ``failed`` rows of an older store not yet requeued), ``retrying`` (unseen after a
        failure), ``positives`` (labelled with label >= 0.5),
        ``labelled_fraction`` (labelled / size), ``seen_coverage`` (fraction of all sightings
        whose caption is labelled), ``pairs``, ``pairs_labelled``, ``pairs_pending``,
        ``pairs_given_up``, ``pairs_skipped``, ``nbytes``, and ``errors/<kind>`` counts.
        """
        with self._lock:
            n = self._captions.size
            cols = self._captions.cols
            status = cols["status"][:n]
            counts = np.bincount(status.astype(np.int64), minlength=_N_STATUS) if n else np.zeros(_N_STATUS, np.int64)
            labelled = status == LABELLED
            seen = cols["times_seen"][:n]
            total_seen = int(seen.sum())
            pstatus = self._pairs.cols["status"][: self._pairs.size]
            out = {
                "size": n,
                "capacity": self._captions.capacity,
                "unseen": int(counts[UNSEEN]),
                "pending": int(counts[PENDING]),
                "labelled": int(counts[LABELLED]),
                "given_up": int(counts[GIVEN_UP]),
                "skipped": int(counts[SKIPPED]),
                "failed": int(counts[FAILED] + counts[GIVEN_UP]),
                "retrying": int(((status == UNSEEN) & (cols["attempts"][:n] > 0)).sum())
                + sum(1 for slot in self._server_faults
                      if status[slot] == UNSEEN and cols["attempts"][slot] == 0),
                "positives": int((cols["label"][:n][labelled] >= 0.5).sum()),
                "labelled_fraction": float(counts[LABELLED] / n) if n else 0.0,
                "seen_coverage": float(seen[labelled].sum() / total_seen) if total_seen else 0.0,
                "pairs": self._pairs.size,
                "pairs_labelled": int((pstatus == LABELLED).sum()),
                "pairs_pending": int((pstatus == PENDING).sum()),
                "pairs_given_up": int((pstatus == GIVEN_UP).sum()),
                "pairs_skipped": int((pstatus == SKIPPED).sum()),
                "nbytes": self._captions.nbytes + self._pairs.nbytes + self._index.nbytes,
            }
            for kind, count in self.error_counts.items():
                out[f"errors/{kind}"] = count
        return out

    # ------------------------------------------------------------------ persistence
    def _snapshot(self) -> dict:
        with self._lock:
            captions = {k: torch.from_numpy(np.array(v[: self._captions.size])) for k, v in self._captions.cols.items()}
            pairs = {k: torch.from_numpy(np.array(v[: self._pairs.size])) for k, v in self._pairs.cols.items()}
            provenances = [list(astuple(p)) for p in self._provenances]
            errors = dict(self.error_counts)
        # Pending work is not finished work: save it as unseen so a reload retries it.
        for table in (captions, pairs):
            status = table["status"]
            status[status == PENDING] = UNSEEN
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "captions": captions,
            "pairs": pairs,
            "provenances": provenances,
            "error_counts": errors,
            "config": {
                "capacity": self._captions.capacity,
                "pair_capacity": self._pairs.capacity,
                "max_attempts": self.max_attempts,
                "retry_backoff_s": self.retry_backoff_s,
                "claim_order": self.claim_order,
            },
        }

    def save(self, path: Union[str, os.PathLike]) -> Path:
        """Writes the store to one file, atomically.

        The data is written to a temporary file in the same folder, flushed to disk, then
        moved over ``path`` with :func:`os.replace`: a crash at any point leaves either the
        previous file or the new one, never a torn file. The lock is held only while copying
        the rows, not while writing, so the trainer keeps running.
        """
        snapshot = self._snapshot()
        path = atomic_write(path, lambda f: _write_snapshot(snapshot, f))
        return path

    @classmethod
    def load(
        cls,
        path: Union[str, os.PathLike],
        *,
        storage: str = "tensor",
        scratch_dir: Optional[str] = None,
        capacity: Optional[int] = None,
        **kwargs,
    ) -> "CaptionStore":
        """Reads a store written by :meth:`save`. Pending captions come back unseen.

        Args:
            path: the file.
            storage, scratch_dir: as in the constructor (the file does not fix them).
            capacity: initial capacity (default: the saved one, at least the saved size).
            **kwargs: overrides of ``max_attempts``, ``retry_backoff_s``, ``claim_order``.

        Raises:
            FileNotFoundError: no such file.
            UnreadableFileError: (a ``ValueError``) a truncated, foreign or damaged file, or one
                holding more than tensors and plain data: it is read with
                ``torch.load(weights_only=True)``, so a crafted file is refused before it runs.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no CaptionStore file at {path}")
        data = safe_torch_load(path, what="CaptionStore file")
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise UnreadableFileError(f"{path} is not a CaptionStore file")
        if data.get("version") != _VERSION:
            raise UnreadableFileError(f"{path}: unsupported CaptionStore version {data.get('version')}")
        try:
            config = dict(data["config"])
            captions, pairs = data["captions"], data["pairs"]
            size = len(captions[CAPTION_HASH_KEY])
            n_pairs = len(pairs["slot_a"])
            options = {k: config[k] for k in ("max_attempts", "retry_backoff_s", "claim_order")}
        except (KeyError, TypeError) as err:
            raise UnreadableFileError(f"{path} is a damaged CaptionStore file (no {err})") from None
        options.update(kwargs)
        store = cls(
            capacity=max(capacity or config["capacity"], size, 1),
            storage=storage,
            scratch_dir=scratch_dir,
            pair_capacity=max(config["pair_capacity"], n_pairs, 1),
            **options,
        )
        store._provenances = [Provenance(*p) for p in data["provenances"]]
        store._provenance_ids = {p: i for i, p in enumerate(store._provenances)}
        store._human_ids = np.array([i for i, p in enumerate(store._provenances) if p.annotator == HUMAN],
                                    dtype=np.int16)
        store.error_counts = dict(data["error_counts"])
        if size:
            slots = store._captions.append({k: v.numpy() for k, v in captions.items()}, size)
            store._index = _HashIndex.from_arrays(captions[CAPTION_HASH_KEY].numpy(), slots)
        if n_pairs:
            store._pairs.append({k: v.numpy() for k, v in pairs.items()}, n_pairs)
            store._pair_index = {
                key: i for i, key in enumerate(zip(pairs["slot_a"].tolist(), pairs["slot_b"].tolist()))
            }
        store.release_pending()
        return store


def _write_snapshot(snapshot: dict, file) -> None:
    """Serialises a snapshot (a separate function so tests can simulate a crash mid-write)."""
    torch.save(snapshot, file)
