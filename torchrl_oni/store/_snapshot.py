"""Saving and loading a :class:`~torchrl_oni.store.CaptionStore`: one torch file, written atomically.

The file is a plain dict (read back with ``torch.load(weights_only=True)``):

=================  ==================================================================
key                value
=================  ==================================================================
``format``         ``"torchrl_oni.CaptionStore"``
``version``        1
``captions``       ``{field: tensor[size, ...]}``, the columns of :data:`~torchrl_oni.store.captions.CAPTION_FIELDS`
``pairs``          ``{field: tensor[n_pairs, ...]}``, the columns of :data:`~torchrl_oni.store.pairs.PAIR_FIELDS`
``provenances``    ``[[annotator, model, prompt_version], ...]`` (rows hold ids into it)
``error_counts``   ``{error kind: count}``
``config``         ``capacity``, ``pair_capacity``, ``max_attempts``, ``retry_backoff_s``, ``claim_order``
=================  ==================================================================

Statuses are saved as their :class:`~torchrl_oni.store.status.Status` numbers, pending rows as
unseen (pending work is not finished work). Retry backoffs are not saved: a loaded store hands
its failed rows out at once.

The same dict is the store's ``state_dict()`` (``load_state_dict`` restores it in place, so every
holder of the store sees the rows) and what a pickled store carries (a snapshot: see "Copies and
processes" in :class:`~torchrl_oni.store.CaptionStore`).
"""
from __future__ import annotations

import os
from dataclasses import astuple
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from torchrl_oni.annotators.base import Provenance
from torchrl_oni.atomic import UnreadableFileError, atomic_write, safe_torch_load
from torchrl_oni.captions import CAPTION_HASH_KEY
from torchrl_oni.store._provenance import ProvenanceTable
from torchrl_oni.store._table import _HashIndex
from torchrl_oni.store.status import PENDING, UNSEEN

__all__: list = []

_FORMAT = "torchrl_oni.CaptionStore"
_VERSION = 1


class _SnapshotMethods:
    """:meth:`save` and :meth:`load` of :class:`~torchrl_oni.store.CaptionStore`."""

    def _snapshot(self) -> dict:
        with self._lock:
            captions = {k: torch.from_numpy(np.array(v[: self._captions.size])) for k, v in self._captions.cols.items()}
            pairs = {k: torch.from_numpy(np.array(v[: self._pairs.size])) for k, v in self._pairs.cols.items()}
            provenances = [list(astuple(p)) for p in self._provenance_table.provenances]
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
        parsed = _parse_snapshot(data, str(path))
        config = parsed["config"]
        options = {k: config[k] for k in ("max_attempts", "retry_backoff_s", "claim_order")}
        options.update(kwargs)
        store = cls(
            capacity=max(capacity or config["capacity"], parsed["size"], 1),
            storage=storage,
            scratch_dir=scratch_dir,
            pair_capacity=max(config["pair_capacity"], parsed["n_pairs"], 1),
            **options,
        )
        store._fill(parsed)
        return store

    # ------------------------------------------------------------------ state_dict
    def state_dict(self) -> dict:
        """The store's rows, provenances and error counts, as :meth:`save` writes them.

        Plain tensors and Python data (``torch.load(weights_only=True)`` reads it back); captions
        pending at this moment are saved as unseen, so they are asked again after a restore.
        """
        return self._snapshot()

    def load_state_dict(self, state: dict) -> None:
        """Replaces the store's contents, in place, with a :meth:`state_dict` (or a saved file's data).

        Everything holding this store (a reward, an annotation transform) sees the restored rows.
        The store keeps its own settings (storage, ``max_attempts``, backoffs, claim order) and its
        capacity, grown to the rows when needed. Pending captions come back unseen. Meant for the
        start of a run: a caption labelled meanwhile by a worker that is running is written by
        hash into the restored rows, a pair answered meanwhile is dropped.

        Raises:
            UnreadableFileError: (a ``ValueError``) ``state`` is not a CaptionStore state.
        """
        parsed = _parse_snapshot(state, "the state")
        with self._lock:
            old = (self._captions, self._pairs)
            self._install_tables(
                old[0].replaced(max(old[0].capacity, parsed["size"], 1)),
                old[1].replaced(max(old[1].capacity, parsed["n_pairs"], 1)))
            self._fill(parsed)
        for table in old:
            table.discard()

    def _fill(self, parsed: dict) -> None:
        """Writes a parsed snapshot into the (empty) tables; pending rows come back unseen."""
        with self._lock:
            captions, pairs = parsed["captions"], parsed["pairs"]
            size, n_pairs = parsed["size"], parsed["n_pairs"]
            self._provenance_table = ProvenanceTable([Provenance(*p) for p in parsed["provenances"]])
            self.error_counts = dict(parsed["error_counts"])
            if size:
                slots = self._captions.append({k: v.numpy() for k, v in captions.items()}, size)
                self._index = _HashIndex.from_arrays(captions[CAPTION_HASH_KEY].numpy(), slots)
            if n_pairs:
                self._pairs.append({k: v.numpy() for k, v in pairs.items()}, n_pairs)
                self._pair_index = {
                    key: i for i, key in enumerate(zip(pairs["slot_a"].tolist(), pairs["slot_b"].tolist()))
                }
            self.release_pending()

    # ------------------------------------------------------------------ copies
    def __copy__(self):
        return self  # a shared resource: see "Copies and processes" in the class docstring

    def __deepcopy__(self, memo):
        return self

    def __getstate__(self) -> dict:
        # pickling (another process, torch.save) carries a snapshot; the lock is recreated
        return {
            "snapshot": self._snapshot(),
            "storage": self.storage_kind,
            "server_retry_s": self.server_retry_s,
            "origin_pid": self._origin_pid,
        }

    def __setstate__(self, state: dict) -> None:
        parsed = _parse_snapshot(state["snapshot"], "the pickled CaptionStore")
        config = parsed["config"]
        # a snapshot never writes into the live store's scratch folder: memmap goes to a temporary one
        self.__init__(
            capacity=max(config["capacity"], parsed["size"], 1),
            storage=state["storage"],
            pair_capacity=max(config["pair_capacity"], parsed["n_pairs"], 1),
            max_attempts=config["max_attempts"],
            retry_backoff_s=config["retry_backoff_s"],
            claim_order=config["claim_order"],
            server_retry_s=state["server_retry_s"],
        )
        self._fill(parsed)
        self._origin_pid = state["origin_pid"]
        self._unpickled = True


def _parse_snapshot(data, source: str) -> dict:
    """Checks a snapshot dict (:meth:`_SnapshotMethods._snapshot`'s layout) and unpacks it."""
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise UnreadableFileError(f"{source} is not a CaptionStore file")
    if data.get("version") != _VERSION:
        raise UnreadableFileError(f"{source}: unsupported CaptionStore version {data.get('version')}")
    try:
        config = dict(data["config"])
        captions, pairs = data["captions"], data["pairs"]
        size = len(captions[CAPTION_HASH_KEY])
        n_pairs = len(pairs["slot_a"])
        missing = [k for k in ("capacity", "pair_capacity", "max_attempts", "retry_backoff_s", "claim_order")
                   if k not in config]
        if missing:
            raise KeyError(missing[0])
        provenances, error_counts = data["provenances"], data["error_counts"]
    except (KeyError, TypeError) as err:
        raise UnreadableFileError(f"{source} is a damaged CaptionStore file (no {err})") from None
    return {"config": config, "captions": captions, "pairs": pairs, "size": size, "n_pairs": n_pairs,
            "provenances": provenances, "error_counts": error_counts}


def _write_snapshot(snapshot: dict, file) -> None:
    """Serialises a snapshot (a separate function so tests can simulate a crash mid-write)."""
    torch.save(snapshot, file)
