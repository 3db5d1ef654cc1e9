"""The storage under :class:`~torchrl_oni.store.CaptionStore`: fixed-width rows and a hash index.

* :class:`_Table`: rows of fixed-width columns in a TorchRL
  :class:`~torchrl.data.TensorDictReplayBuffer` (over :class:`~torchrl.data.LazyTensorStorage`,
  or :class:`~torchrl.data.LazyMemmapStorage` to keep it on disk), appended in order, updated in
  place through numpy views of its columns, and never evicted;
* :class:`_HashIndex`: caption hash → row slot, two sorted int64 runs searched with
  :func:`numpy.searchsorted`, so a whole collector batch is looked up in one vectorised call.

The columns themselves (names, dtypes, shapes) are declared by their owners:
:mod:`torchrl_oni.store.captions` and :mod:`torchrl_oni.store.pairs`.
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictReplayBuffer

# what the store accepts for a batch of hashes, slots or values
ArrayLike = Union[torch.Tensor, np.ndarray, Sequence]


def to_numpy(x: ArrayLike, dtype) -> np.ndarray:
    """``x`` as a numpy array of ``dtype`` (a view where torch and numpy allow it)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def shape_of(x: ArrayLike) -> Tuple[int, ...]:
    """The shape of a batch given as a tensor, an array or nested sequences."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return tuple(x.shape)
    return np.shape(x)


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

    def __init__(self, fields: dict, capacity: int, storage: str, scratch_dir: Optional[str], name: str,
                 generation: int = 0):
        if storage not in ("tensor", "memmap"):
            raise ValueError(f"storage must be 'tensor' or 'memmap', got {storage!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.fields = fields
        self.storage_kind = storage
        self.scratch_dir = scratch_dir
        self.name = name
        self.size = 0
        self._generation = int(generation)
        self._build(int(capacity))

    def _scratch(self) -> Optional[str]:
        if self.storage_kind == "memmap" and self.scratch_dir is not None:
            return os.path.join(self.scratch_dir, f"{self.name}-{self._generation}")
        return None

    def replaced(self, capacity: int) -> "_Table":
        """An empty table of the same columns and storage, in files of its own (memmap)."""
        return _Table(self.fields, capacity, self.storage_kind, self.scratch_dir, self.name, self._generation + 1)

    def discard(self) -> None:
        """Removes this table's files from the scratch folder (memmap; the table is unusable after)."""
        scratch = self._scratch()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    def _row_template(self, n: int) -> TensorDict:
        data = {}
        for key, (dtype, shape, fill) in self.fields.items():
            data[key] = torch.full((n, *shape), fill, dtype=dtype)
        return TensorDict(data, batch_size=[n])

    def _build(self, capacity: int) -> None:
        if self.storage_kind == "memmap":
            storage = LazyMemmapStorage(capacity, scratch_dir=self._scratch())
        else:
            storage = LazyTensorStorage(capacity)
        rb = TensorDictReplayBuffer(storage=storage, batch_size=1)
        # One write allocates every column at full capacity; empty() keeps the allocation, so
        # the numpy views below stay valid for the life of this buffer. TorchRL says so at INFO
        # on every store (and every growth); that is our detail, not the user's news.
        torchrl_log = logging.getLogger("torchrl")
        level = torchrl_log.level
        torchrl_log.setLevel(max(level, logging.WARNING))
        try:
            rb.extend(self._row_template(1))
        finally:
            torchrl_log.setLevel(level)
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
        old_scratch = self._scratch()
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
        return to_numpy(slots, np.int64)

    def queue_columns(self) -> Tuple[np.ndarray, np.ndarray]:
        """Views of the live rows' ``status`` and ``attempts`` (what a labelling queue works on)."""
        return self.cols["status"][: self.size], self.cols["attempts"][: self.size]

    def rows(self, slots: np.ndarray) -> TensorDict:
        """A copy of the given rows as a TensorDict (torch tensors, batch ``[len(slots)]``)."""
        data = {k: torch.from_numpy(np.array(self.cols[k][slots])) for k in self.fields}
        return TensorDict(data, batch_size=[len(slots)])

    @property
    def nbytes(self) -> int:
        return sum(col.nbytes for col in self.cols.values())

