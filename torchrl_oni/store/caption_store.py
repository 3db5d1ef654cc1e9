"""The :class:`CaptionStore` class: its state, and the work that spans captions and pairs.

What a store holds and how a caption moves through it is told in :mod:`torchrl_oni.store`; the
columns of its two tables in :mod:`torchrl_oni.store.captions` and :mod:`torchrl_oni.store.pairs`.
"""
from __future__ import annotations

import os
import threading
from typing import Dict, List, Optional, Tuple

import numpy as np

from torchrl_oni.annotators.base import Provenance
from torchrl_oni.store._provenance import ProvenanceTable
from torchrl_oni.store._queue import WorkQueue
from torchrl_oni.store._snapshot import _SnapshotMethods
from torchrl_oni.store._table import _HashIndex, _Table
from torchrl_oni.store.captions import CAPTION_FIELDS, CLAIM_ORDERS, _CaptionMethods
from torchrl_oni.store.pairs import PAIR_FIELDS, _PairMethods
from torchrl_oni.store.rows import _RowMethods
from torchrl_oni.store.status import FAILED, GIVEN_UP, LABELLED, PENDING, SKIPPED, UNSEEN, Status

__all__ = ["CaptionStore"]


class CaptionStore(_CaptionMethods, _PairMethods, _RowMethods, _SnapshotMethods):
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
        claim_order (str): which unseen captions :meth:`claim` hands out first, one of
            :data:`~torchrl_oni.store.CLAIM_ORDERS`: ``"most_seen"`` (default: the captions
            covering most steps are labelled first, ties oldest-first), ``"oldest"`` (insertion
            order) or ``"seen_rate"`` (most sightings per caption first seen since: what the
            agent has started to see often, and new captions, before old ones seen as often
            over a longer time). Saved with the store; ``oni-train --claim-order`` (whose
            default is ``seen_rate``).
        pair_capacity (int): initial number of pair rows (doubles when full).

    **Copies and processes.** A store is a shared, thread-safe resource (like a file): it is
    never duplicated by accident. ``copy.copy`` and ``copy.deepcopy`` return the store itself,
    so a deep copy of a transform or reward source made in this process (TorchRL makes them:
    ``MultiAsyncCollector`` deep-copies its ``postproc``) reads and fills the same live store.
    Pickling (another process: a ``ParallelEnv`` factory or a collector worker under spawn,
    ``torch.save``) carries a **snapshot**: the rows as :meth:`save` writes them (pending
    captions unseen), a lock of its own, a temporary folder for memmap storage;
    :attr:`is_snapshot` is then True, and labels written later to the live store are not seen.
    An independent copy on purpose: ``CaptionStore().load_state_dict(store.state_dict())``.

    Its methods, by audience: the trainer and the annotation worker
    (:class:`~torchrl_oni.store.captions._CaptionMethods`), the pair ranking
    (:class:`~torchrl_oni.store.pairs._PairMethods`), tools that show the store to people
    (:class:`~torchrl_oni.store.rows._RowMethods`), and save/load
    (:class:`~torchrl_oni.store._snapshot._SnapshotMethods`); the queue state they share lives
    here.

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
        if claim_order not in CLAIM_ORDERS:
            raise ValueError(f"claim_order must be one of {', '.join(map(repr, CLAIM_ORDERS))}, got {claim_order!r}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.storage_kind = storage
        self.scratch_dir = scratch_dir
        self.max_attempts = int(max_attempts)
        self.retry_backoff_s = float(retry_backoff_s)
        self.server_retry_s = float(server_retry_s)
        self.claim_order = claim_order
        self._lock = threading.RLock()
        # the live store's process; a store unpickled elsewhere (or forked) is a snapshot of it
        self._origin_pid = os.getpid()
        self._unpickled = False
        self._install_tables(_Table(CAPTION_FIELDS, capacity, storage, scratch_dir, "captions"),
                             _Table(PAIR_FIELDS, pair_capacity, storage, scratch_dir, "pairs"))

    def _install_tables(self, captions: _Table, pairs: _Table) -> None:
        """Starts over on two empty tables: no index, provenances, queues or error counts yet."""
        self._captions = captions
        self._pairs = pairs
        self._index = _HashIndex()
        self._pair_index: Dict[Tuple[int, int], int] = {}
        self._provenance_table = ProvenanceTable()
        # the store is its queues' rules: a change of max_attempts or a backoff counts from the
        # next failure
        self._caption_queue = WorkQueue(self._captions.queue_columns, self)
        self._pair_queue = WorkQueue(self._pairs.queue_columns, self)
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
        return list(self._provenance_table.provenances)

    @property
    def is_snapshot(self) -> bool:
        """True for a copy that no longer follows the live store: unpickled (another process,
        ``torch.load``) or inherited by a forked process. Readers (``RetrievalReward``) say so."""
        return self._unpickled or os.getpid() != self._origin_pid

    @property
    def lock(self) -> threading.RLock:
        """The store's lock, for callers that need several calls to be atomic."""
        return self._lock

    def nbytes(self) -> int:
        """Bytes held by the storage tensors (allocated capacity) and the hash index."""
        with self._lock:
            return self._captions.nbytes + self._pairs.nbytes + self._index.nbytes

    def provenance_ids(self, annotator: str) -> np.ndarray:
        """``int16`` ids (into :attr:`provenances`) of every provenance whose ``annotator`` is this."""
        with self._lock:
            return self._provenance_table.ids_of_annotator(annotator)

    def _count_errors(self, error_kind: str, n: int) -> None:
        """Counts ``n`` failures of captions or pairs (lock held; a kind is listed even at 0)."""
        self.error_counts[error_kind] = self.error_counts.get(error_kind, 0) + n

    def claimable(self, captions: bool = True, pairs: bool = True) -> int:
        """How many captions and/or pairs :meth:`claim` / :meth:`claim_pairs` would hand out now."""
        with self._lock:
            return ((len(self._caption_queue.claimable()) if captions else 0)
                    + (len(self._pair_queue.claimable()) if pairs else 0))

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
            count = 0
            for queue in (self._caption_queue, self._pair_queue):
                count += len(queue.reopen((FAILED,)))  # left by older versions: see status.py
                count += queue.requeue_server_failures()
            return count

    def release_pending(self) -> int:
        """Sends pending captions and pairs back to unseen (at load, on shutdown); returns how many."""
        with self._lock:
            return self._caption_queue.release() + self._pair_queue.release()

    # ------------------------------------------------------------------ stats
    def stats(self) -> Dict[str, float]:
        """Counts and coverage.

        Keys: ``size``, ``capacity``, ``unseen``, ``pending``, ``labelled``, ``given_up``
        (unparsable answers), ``skipped`` (declined by the labeller), ``failed`` (given up, plus
        any ``failed`` rows of an older store not yet requeued), ``retrying`` (unseen after a
        failure), ``positives`` (labelled with label >= 0.5),
        ``labelled_fraction`` (labelled / size), ``seen_coverage`` (fraction of all sightings
        whose caption is labelled), ``seen_captions`` and ``seen_labelled`` (captions seen at
        least once, and those of them labelled: labels imported from another store by
        :meth:`import_labels` count in ``size`` and ``labelled`` before the run sees them),
        ``pairs``, ``pairs_labelled``, ``pairs_pending``, ``pairs_given_up``, ``pairs_skipped``,
        ``nbytes``, and ``errors/<kind>`` counts.
        """
        with self._lock:
            n = self._captions.size
            cols = self._captions.cols
            status = cols["status"][:n]
            counts = np.bincount(status.astype(np.int64), minlength=len(Status)) if n else np.zeros(len(Status), np.int64)
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
                "retrying": self._caption_queue.retrying(),
                "positives": int((cols["label"][:n][labelled] >= 0.5).sum()),
                "labelled_fraction": float(counts[LABELLED] / n) if n else 0.0,
                "seen_coverage": float(seen[labelled].sum() / total_seen) if total_seen else 0.0,
                "seen_captions": int((seen > 0).sum()),
                "seen_labelled": int((labelled & (seen > 0)).sum()),
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

