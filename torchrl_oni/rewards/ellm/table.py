"""ELLM's goal table: state hash → suggested goals (ids into one goal vocabulary), with the request
queue the :class:`~torchrl_oni.rewards.ellm.worker.GoalWorker` drains.

The queue is the store's :class:`~torchrl_oni.store.WorkQueue` over the shared
:mod:`~torchrl_oni.store.status` numbering; the table is saved atomically to one torch file.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from torchrl_oni.annotators.base import Provenance
from torchrl_oni.atomic import atomic_write
from torchrl_oni.store import FAILED, LABELLED, PENDING, UNSEEN, WorkQueue

__all__ = ["DONE", "GoalTable"]


# The goal table's statuses are the shared ones (torchrl_oni.store.status), saved as numbers: a
# state with goals is LABELLED (2), which this module calls DONE; one given up after
# max_attempts unparsable answers is FAILED (3), as tables of versions 1 and 2 saved it.
DONE = LABELLED
_FORMAT = "torchrl_oni.GoalTable"
_VERSION = 2  # 2: only unparsable answers give a state up (1: any failure did)


class GoalTable:
    """State hash → suggested goals, with a request queue. Thread-safe.

    Goals are stored as ids into :attr:`goal_texts` (``int32[M]`` per state, ``-1`` padded), so a
    goal suggested for many states is embedded once. Life of a state: :meth:`add` → unseen →
    :meth:`claim` → pending → :meth:`set_goals` → done, or :meth:`mark_failed` → unseen again.
    The queue is :class:`~torchrl_oni.store.CaptionStore`'s (one
    :class:`~torchrl_oni.store.WorkQueue`, the same :func:`~torchrl_oni.store.is_parse_failure`
    and :func:`~torchrl_oni.store.retry_delay`), except that a given-up state is ``FAILED`` (3)
    and a ``"skip"`` is a server fault like any other error:

    * a **server fault** (timeout, HTTP 5xx, connection error, circuit breaker open, an
      exception: anything but an unparsable answer) says nothing about the state: it waits
      ``server_retry_s · 2^(k-1)`` (``k`` faults in a row, at most 5 minutes) and is **never
      given up**; :meth:`requeue_server_failures` ends those waits (the worker calls it when a
      server answers again);
    * an **unparsable answer** is an attempt: the state waits ``retry_backoff_s · 2^(attempts-1)``
      (at most an hour) and is *failed* (given up, ``stats()["failed"]``) after ``max_attempts``.

    :meth:`release` and :meth:`load` send pending states back to unseen.

    Args:
        max_goals: goals kept per state (M).
        capacity: most states; new states beyond it are not queued (counted in ``dropped``).
        max_attempts: unparsable answers before a state is given up.
        retry_backoff_s: first retry delay after an unparsable answer.
        server_retry_s: first retry delay after a server fault.

    Example:
        >>> from torchrl_oni.annotators.base import Provenance
        >>> table = GoalTable(max_goals=2)
        >>> table.add([11, 12], ["Nearby: a newt.", "Nearby: gold."]).tolist()
        [True, True]
        >>> hashes, captions = table.claim(10)
        >>> table.set_goals(hashes, [["kill the newt"], ["pick up the gold", "kill the newt"]],
        ...                 Provenance("doc"))  # returns the goal texts new to the vocabulary
        ['kill the newt', 'pick up the gold']
        >>> table.lookup([12, 11, 99]).tolist()
        [[1, 0], [0, -1], [-1, -1]]
    """

    def __init__(self, *, max_goals: int = 5, capacity: int = 500_000, max_attempts: int = 5,
                 retry_backoff_s: float = 5.0, server_retry_s: float = 5.0):
        if max_goals < 1 or capacity < 1 or max_attempts < 1:
            raise ValueError("max_goals, capacity and max_attempts must be >= 1")
        self.max_goals = int(max_goals)
        self.capacity = int(capacity)
        self.max_attempts = int(max_attempts)
        self.retry_backoff_s = float(retry_backoff_s)
        self.server_retry_s = float(server_retry_s)
        self._lock = threading.RLock()
        self._slot: Dict[int, int] = {}
        self._size = 0
        self._alloc(1024)
        self._captions: List[str] = []
        self.goal_texts: List[str] = []
        self._goal_id: Dict[str, int] = {}
        self.provenances: List[Provenance] = []
        self._provenance_id: Dict[Provenance, int] = {}
        self.dropped = 0
        self.error_counts: Dict[str, int] = {}
        # the table is the queue's rules (max_attempts, backoffs); FAILED is its saved given-up status
        self._queue = WorkQueue(self._queue_columns, self, given_up=FAILED)

    def _alloc(self, n: int) -> None:
        old = getattr(self, "_cols", None)
        cols = {
            "hash": np.zeros(n, np.int64),
            "status": np.zeros(n, np.int8),
            "attempts": np.zeros(n, np.int16),
            "times_seen": np.zeros(n, np.int64),
            "provenance": np.full(n, -1, np.int16),
            "goals": np.full((n, self.max_goals), -1, np.int32),
        }
        if old is not None:
            for k, v in old.items():
                cols[k][: self._size] = v[: self._size]
        self._cols = cols

    def _queue_columns(self) -> Tuple[np.ndarray, np.ndarray]:
        return self._cols["status"][: self._size], self._cols["attempts"][: self._size]

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        s = self.stats()
        return f"GoalTable(states={s['states']}, done={s['done']}, goals={s['goal_vocabulary']})"

    # ------------------------------------------------------------------ adding and looking up
    def add(self, hashes: Sequence[int], captions: Sequence[str],
            counts: Optional[Sequence[int]] = None) -> np.ndarray:
        """Records states (distinct hashes with their captions); returns which were new."""
        hashes = [int(h) for h in hashes]
        counts = [1] * len(hashes) if counts is None else [int(c) for c in counts]
        new = np.zeros(len(hashes), bool)
        with self._lock:
            cols = self._cols
            for i, (h, caption, c) in enumerate(zip(hashes, captions, counts)):
                slot = self._slot.get(h)
                if slot is not None:
                    cols["times_seen"][slot] += c
                    continue
                if self._size >= self.capacity:
                    self.dropped += 1
                    continue
                if self._size == len(cols["hash"]):
                    self._alloc(2 * self._size)
                    cols = self._cols
                slot = self._size
                self._size += 1
                self._slot[h] = slot
                self._captions.append(str(caption))
                cols["hash"][slot] = h
                cols["times_seen"][slot] = c
                new[i] = True
        return new

    def lookup(self, hashes) -> torch.Tensor:
        """Goal ids ``int64[*shape, M]`` of the states ``hashes`` (``-1`` where none yet)."""
        arr = hashes.detach().cpu().numpy() if isinstance(hashes, torch.Tensor) else np.asarray(hashes)
        shape = arr.shape
        flat = arr.reshape(-1).astype(np.int64, copy=False)
        unique, inverse = np.unique(flat, return_inverse=True)
        rows = np.full((len(unique), self.max_goals), -1, np.int64)
        with self._lock:
            cols = self._cols
            for k, h in enumerate(unique.tolist()):
                slot = self._slot.get(h)
                if slot is not None and cols["status"][slot] == DONE:
                    rows[k] = cols["goals"][slot]
        return torch.from_numpy(rows[inverse.reshape(-1)].reshape(*shape, self.max_goals))

    def goals_of(self, state_hash: int) -> Optional[Tuple[str, ...]]:
        """The goals of one state, or ``None`` when they have not arrived."""
        with self._lock:
            slot = self._slot.get(int(state_hash))
            if slot is None or self._cols["status"][slot] != DONE:
                return None
            return tuple(self.goal_texts[i] for i in self._cols["goals"][slot] if i >= 0)

    def caption_of(self, state_hash: int) -> Optional[str]:
        with self._lock:
            slot = self._slot.get(int(state_hash))
            return None if slot is None else self._captions[slot]

    # ------------------------------------------------------------------ the request queue
    def claimable(self) -> int:
        """How many states :meth:`claim` would hand out now."""
        with self._lock:
            return len(self._queue.claimable())

    def claim(self, max_items: int) -> Tuple[List[int], List[str]]:
        """Up to ``max_items`` unseen states (most seen first), marked pending: ``(hashes, captions)``."""
        with self._lock:
            cols = self._cols

            def most_seen(cand: np.ndarray, k: int) -> np.ndarray:
                # when all fit, they go out in slot order
                return cand if len(cand) <= k else cand[np.lexsort((cand, -cols["times_seen"][cand]))[:k]]

            cand = self._queue.claim(max_items, most_seen)
            return cols["hash"][cand].tolist(), [self._captions[s] for s in cand.tolist()]

    def _slots(self, hashes) -> List[int]:
        return [s for s in (self._slot.get(int(h)) for h in hashes) if s is not None]

    def set_goals(self, hashes: Sequence[int], goals: Sequence[Sequence[str]],
                  provenance: Union[Provenance, Sequence[Provenance]]) -> List[str]:
        """Stores goals (at most ``max_goals`` each); returns the goal texts new to the vocabulary."""
        provs = [provenance] * len(hashes) if isinstance(provenance, Provenance) else list(provenance)
        fresh: List[str] = []
        done: List[int] = []
        with self._lock:
            cols = self._cols
            for h, state_goals, prov in zip(hashes, goals, provs):
                slot = self._slot.get(int(h))
                if slot is None:
                    continue
                ids = []
                for text in list(state_goals)[: self.max_goals]:
                    gid = self._goal_id.get(text)
                    if gid is None:
                        gid = self._goal_id[text] = len(self.goal_texts)
                        self.goal_texts.append(text)
                        fresh.append(text)
                    ids.append(gid)
                cols["goals"][slot] = -1
                cols["goals"][slot, : len(ids)] = ids
                pid = self._provenance_id.get(prov)
                if pid is None:
                    pid = self._provenance_id[prov] = len(self.provenances)
                    self.provenances.append(prov)
                cols["provenance"][slot] = pid
                done.append(slot)
            self._queue.finish(np.array(done, dtype=np.int64))
        return fresh

    def mark_failed(self, hashes: Sequence[int], kind: str = "error") -> int:
        """Records failed requests of kind ``kind`` (see the class docstring): a server fault sends
        the states back to unseen after a short wait, an unparsable answer spends an attempt.
        States with goals or given up are left alone. Returns how many were given up."""
        with self._lock:
            slots = np.array(self._slots(hashes), dtype=np.int64)
            # no skips here: a goal suggester does not decline, and "skip" stays an error kind
            failed, gave_up = self._queue.fail(slots, kind, final=False)
            if len(failed):  # only kinds that happened are listed
                self.error_counts[kind] = self.error_counts.get(kind, 0) + len(failed)
            return int(gave_up.sum())

    def requeue_server_failures(self) -> int:
        """Ends the waits of every state that failed for a server reason; returns how many were
        waiting. The worker calls it when a server that was out answers again."""
        with self._lock:
            return self._queue.requeue_server_failures()

    def release(self, hashes: Optional[Sequence[int]] = None) -> int:
        """Pending states (the given ones, or all) back to unseen; returns how many."""
        with self._lock:
            return self._queue.release(None if hashes is None else np.array(self._slots(hashes), dtype=np.int64))

    def retry_failed(self) -> int:
        """Given-up states become unseen again with a fresh attempt count; returns how many."""
        with self._lock:
            failed = self._queue.reopen((FAILED,))
            self._queue.forget(failed)  # the server faults before they were given up count no more
            return len(failed)

    def stats(self) -> Dict[str, float]:
        """``states``, ``unseen``, ``pending``, ``done`` (with goals), ``failed`` (given up after
        ``max_attempts`` unparsable answers), ``retrying`` (unseen after a failure), ``dropped``
        (past ``capacity``), ``goal_vocabulary``, ``goals_per_state`` (mean over done states)."""
        with self._lock:
            status = self._cols["status"][: self._size]
            attempts = self._cols["attempts"][: self._size]
            counts = np.bincount(status, minlength=4) if self._size else np.zeros(4, np.int64)
            goals = self._cols["goals"][: self._size][status == DONE]
            retrying = self._queue.retrying()
            return {
                "states": self._size,
                "unseen": int(counts[UNSEEN]),
                "pending": int(counts[PENDING]),
                "done": int(counts[DONE]),
                "failed": int(counts[FAILED]),
                "retrying": retrying,
                "dropped": self.dropped,
                "goal_vocabulary": len(self.goal_texts),
                "goals_per_state": float((goals >= 0).sum(1).mean()) if len(goals) else 0.0,
            }

    # ------------------------------------------------------------------ persistence
    def save(self, path: Union[str, os.PathLike]) -> Path:
        """Writes the table to one torch file atomically (tensors and plain lists only)."""
        with self._lock:
            n = self._size
            snapshot = {
                "format": _FORMAT,
                "version": _VERSION,
                "columns": {k: torch.from_numpy(v[:n].copy()) for k, v in self._cols.items()},
                "captions": list(self._captions),
                "goal_texts": list(self.goal_texts),
                "provenances": [[p.annotator, p.model, p.prompt_version] for p in self.provenances],
                "error_counts": dict(self.error_counts),
                "config": {"max_goals": self.max_goals, "capacity": self.capacity,
                           "max_attempts": self.max_attempts, "retry_backoff_s": self.retry_backoff_s,
                           "server_retry_s": self.server_retry_s},
            }
        status = snapshot["columns"]["status"]
        status[status == PENDING] = UNSEEN  # pending work is not finished work
        return atomic_write(path, lambda f: torch.save(snapshot, f))

    @classmethod
    def load(cls, path: Union[str, os.PathLike], **overrides) -> "GoalTable":
        """Reads a table written by :meth:`save` (``weights_only``); pending states come back unseen.

        Tables of version 1 gave states up after repeated server faults too: their failed states
        come back unseen with a fresh attempt count.

        Raises:
            FileNotFoundError: no file; ``ValueError``: not a goal table (one line).
        """
        from torchrl_oni.atomic import safe_torch_load

        data = safe_torch_load(path, what="ELLM goal table")
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(f"{path} is not an ELLM goal table")
        version = data.get("version")
        if version not in (1, _VERSION):
            raise ValueError(f"{path}: unsupported goal table version {version}")
        config = dict(data["config"])
        config.update(overrides)
        cols = {k: v.numpy() for k, v in data["columns"].items()}
        n = len(cols["hash"])
        table = cls(**config)
        if cols["goals"].shape[1] != table.max_goals:
            raise ValueError(f"{path} keeps {cols['goals'].shape[1]} goals per state, not {table.max_goals}")
        table._alloc(max(n, 1024))
        for k, v in cols.items():
            table._cols[k][:n] = v
        table._size = n
        table._slot = {h: i for i, h in enumerate(cols["hash"].tolist())}
        table._captions = list(data["captions"])
        table.goal_texts = list(data["goal_texts"])
        table._goal_id = {t: i for i, t in enumerate(table.goal_texts)}
        table.provenances = [Provenance(*p) for p in data["provenances"]]
        table._provenance_id = {p: i for i, p in enumerate(table.provenances)}
        table.error_counts = dict(data["error_counts"])
        table.release()
        if version == 1:
            table.retry_failed()
        return table
