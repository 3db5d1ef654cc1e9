"""The pairs of a :class:`~torchrl_oni.store.CaptionStore`: pairs of captions to rank, and their preferences.

One row per pair (added twice, a pair keeps its row and its answer), in a second
:class:`~torchrl_oni.store._table._Table` beside the captions:

==============  ==============  ==========================================================
field           dtype / shape   meaning
==============  ==============  ==========================================================
``slot_a``      int64           the first caption's row
``slot_b``      int64           the second caption's row
``preference``  float32         P(second is better): 0.0 first, 1.0 second, 0.5 tie; NaN
                                while unlabelled
``status``      int8            a :class:`~torchrl_oni.store.status.Status`, as for captions
``attempts``    int16           answers that could not be parsed so far
``provenance``  int16           id into :attr:`CaptionStore.provenances <torchrl_oni.store.CaptionStore.provenances>`, -1 none
==============  ==============  ==========================================================

The audience: the ranking trainers and annotation worker (:meth:`~_PairMethods.add_pairs`,
:meth:`~_PairMethods.claim_pairs`, :meth:`~_PairMethods.set_preferences`,
:meth:`~_PairMethods.sample_labelled_pairs`, ...).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from tensordict import TensorDict

from torchrl_oni.annotators.base import Provenance
from torchrl_oni.captions import CAPTION_HASH_KEY, MESSAGE_KEY, decode_messages
from torchrl_oni.store._table import ArrayLike, to_numpy
from torchrl_oni.store.status import LABELLED, UNSEEN

__all__ = ["PAIR_FIELDS"]

# name -> (dtype, per-row shape, fill value of a fresh row)
PAIR_FIELDS = {
    "slot_a": (torch.int64, (), 0),
    "slot_b": (torch.int64, (), 0),
    "preference": (torch.float32, (), float("nan")),
    "status": (torch.int8, (), UNSEEN),
    "attempts": (torch.int16, (), 0),
    "provenance": (torch.int16, (), -1),
}


class _PairMethods:
    """The pair methods of :class:`~torchrl_oni.store.CaptionStore` (which holds the state)."""

    def add_pairs(self, hash_a: ArrayLike, hash_b: ArrayLike) -> torch.Tensor:
        """Queues pairs of (already added) captions for ranking; returns their pair slots.

        A pair added twice (same order) keeps its slot and its label: it is not paid for twice.
        """
        fa = to_numpy(hash_a, np.int64).reshape(-1)
        fb = to_numpy(hash_b, np.int64).reshape(-1)
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
        with self._lock:
            cols = self._pairs.cols
            cand = self._pair_queue.claim(max_items)
            msgs = self._captions.cols[MESSAGE_KEY]
            texts_a = decode_messages(np.array(msgs[cols["slot_a"][cand]]))
            texts_b = decode_messages(np.array(msgs[cols["slot_b"][cand]]))
        return torch.from_numpy(cand.astype(np.int64)), list(zip(texts_a, texts_b))

    def _check_pair_slots(self, pair_slots: ArrayLike) -> np.ndarray:
        s = to_numpy(pair_slots, np.int64).reshape(-1)
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
        values = to_numpy(preferences, np.float32).reshape(-1)
        with self._lock:
            s = self._check_pair_slots(pair_slots)
            values = np.broadcast_to(values, s.shape)
            if not ((values >= 0) & (values <= 1)).all():
                raise ValueError("set_preferences: preferences must be in [0, 1]")
            pids = self._provenance_table.ids_for(provenance, len(s))
            cols = self._pairs.cols
            written = ~self._provenance_table.protected(cols["provenance"][s], pids)
            s, values, pids = s[written], values[written], pids[written]
            cols["preference"][s] = values
            cols["provenance"][s] = pids
            self._pair_queue.finish(s)
        return torch.from_numpy(written)

    def mark_pairs_failed(self, pair_slots: ArrayLike, error_kind: str = "error", *,
                          parse_failure: Optional[bool] = None, final: Optional[bool] = None) -> None:
        """Like :meth:`mark_failed`, for pairs."""
        with self._lock:
            s = self._check_pair_slots(pair_slots)
            failed, _ = self._pair_queue.fail(s, error_kind, parse_failure=parse_failure, final=final)
            self._count_errors(error_kind, len(failed))

    def pending_pairs(self) -> torch.Tensor:
        """Slots of the pairs claimed but not yet answered."""
        with self._lock:
            return torch.from_numpy(self._pair_queue.pending())

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

    def release_pairs(self, pair_slots: ArrayLike) -> int:
        """Sends the given pending pairs back to unseen."""
        with self._lock:
            return self._pair_queue.release(self._check_pair_slots(pair_slots))

