"""Row-level reads and undo of a :class:`~torchrl_oni.store.CaptionStore`, for tools that show it to people.

The labelling page of :mod:`torchrl_oni.feedback` lists rows
(:meth:`~_RowMethods.caption_slots` / :meth:`~_RowMethods.caption_rows`,
:meth:`~_RowMethods.pair_slots` / :meth:`~_RowMethods.pair_rows`), counts a person's answers
(:meth:`~_RowMethods.count_by`), and undoes one with a compare-and-set
(:meth:`~_RowMethods.restore_label` / :meth:`~_RowMethods.restore_preference`): an answer
written since wins over the undo.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
import torch
from tensordict import TensorDict

from torchrl_oni.captions import CAPTION_HASH_KEY, MESSAGE_KEY
from torchrl_oni.store._table import ArrayLike, _Table, to_numpy
from torchrl_oni.store.captions import CAPTION_FIELDS
from torchrl_oni.store.pairs import PAIR_FIELDS
from torchrl_oni.store.status import PENDING, UNSEEN

__all__: list = []


class _RowMethods:
    """The row methods of :class:`~torchrl_oni.store.CaptionStore` (which holds the state)."""

    CAPTION_ROW_FIELDS = tuple(CAPTION_FIELDS)
    PAIR_ROW_FIELDS = tuple(PAIR_FIELDS) + ("message_a", "message_b", "caption_hash_a", "caption_hash_b",
                                             "times_seen_a", "times_seen_b")

    def slots_to_hashes(self, slots: ArrayLike) -> torch.Tensor:
        """Caption hashes of row ``slots`` (the inverse of :meth:`slots`)."""
        with self._lock:
            s = self._check_caption_slots(slots)
            return torch.from_numpy(np.array(self._captions.cols[CAPTION_HASH_KEY][s]))

    def _check_caption_slots(self, slots: ArrayLike) -> np.ndarray:
        s = to_numpy(slots, np.int64).reshape(-1)
        if len(s) and (s.min() < 0 or s.max() >= self._captions.size):
            raise ValueError(f"caption slots must be in [0, {self._captions.size}), got {s.min()}..{s.max()}")
        return s

    def _annotated_by_mask(self, table: "_Table", annotator: str) -> np.ndarray:
        ids = self._provenance_table.ids_of_annotator(annotator)
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
            >>> from torchrl_oni.annotators.base import Provenance
            >>> from torchrl_oni.store import CaptionStore, HUMAN
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
            >>> from torchrl_oni.annotators.base import Provenance
            >>> from torchrl_oni.store import CaptionStore, HUMAN
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

