"""Who answered: the provenance table beside the store's rows, and the "people first" rule.

Rows keep an ``int16`` id into this table (``-1``: none), because Python strings in the TorchRL
storage cost O(capacity) per write and do not survive a save/load.

**People first.** A label whose provenance says ``annotator="human"`` (:data:`HUMAN`: the
labelling page, ``oni-label``) is never overwritten by a later non-human label or preference
(:meth:`ProvenanceTable.protected`); a person may still correct a person.

Example:
    >>> from torchrl_oni.annotators.base import Provenance
    >>> table = ProvenanceTable()
    >>> table.id_of(Provenance("openai", "llama")), table.id_of(Provenance(HUMAN, "ada"))
    (0, 1)
    >>> import numpy as np
    >>> table.protected(np.array([1, 1, 0], np.int16), np.array([0, 1, 1], np.int16)).tolist()
    [True, False, False]
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Union

import numpy as np

from torchrl_oni.annotators.base import Provenance

__all__ = ["HUMAN", "ProvenanceTable"]

# Provenance.annotator of people's answers: kept over any later non-human label.
HUMAN = "human"


class ProvenanceTable:
    """The distinct provenances of a store, in the order they were first seen (ids ``0..32767``).

    Not thread-safe: the store's lock is held around every call.
    """

    def __init__(self, provenances: Sequence[Provenance] = ()):
        self.provenances: List[Provenance] = []
        self._ids: Dict[Provenance, int] = {}
        self._human_ids = np.empty(0, dtype=np.int16)  # ids of people's answers
        for provenance in provenances:
            self.id_of(provenance)

    def __len__(self) -> int:
        return len(self.provenances)

    def id_of(self, provenance: Provenance) -> int:
        """The id of ``provenance``, added to the table when new."""
        if not isinstance(provenance, Provenance):
            raise TypeError(f"provenance must be a Provenance, got {type(provenance).__name__}")
        pid = self._ids.get(provenance)
        if pid is None:
            pid = len(self.provenances)
            if pid > np.iinfo(np.int16).max:
                raise ValueError("too many distinct provenances (max 32767) in one CaptionStore")
            self.provenances.append(provenance)
            self._ids[provenance] = pid
            if provenance.annotator == HUMAN:
                self._human_ids = np.append(self._human_ids, np.int16(pid))
        return pid

    def ids_for(self, provenance: Union[Provenance, Sequence[Provenance]], n: int) -> np.ndarray:
        """``int16[n]`` ids of one provenance for all ``n`` items, or of one per item."""
        if isinstance(provenance, Provenance):
            return np.full(n, self.id_of(provenance), dtype=np.int16)
        if isinstance(provenance, (str, bytes)) or not hasattr(provenance, "__iter__"):
            raise TypeError(f"provenance must be a Provenance or a sequence of them, got {type(provenance).__name__}")
        provenance = list(provenance)
        if len(provenance) != n:
            raise ValueError(f"got {len(provenance)} provenances for {n} items")
        return np.array([self.id_of(p) for p in provenance], dtype=np.int16)

    def ids_of_annotator(self, annotator: str) -> np.ndarray:
        """``int16`` ids of every provenance whose ``annotator`` is this."""
        if annotator == HUMAN:
            return self._human_ids.copy()
        return np.array([i for i, p in enumerate(self.provenances) if p.annotator == annotator], dtype=np.int16)

    def protected(self, current_pids: np.ndarray, incoming_pids: np.ndarray) -> np.ndarray:
        """Rows holding a person's answer that a non-human answer would overwrite."""
        if not len(self._human_ids):
            return np.zeros(len(current_pids), dtype=bool)
        return np.isin(current_pids, self._human_ids) & ~np.isin(incoming_pids, self._human_ids)
