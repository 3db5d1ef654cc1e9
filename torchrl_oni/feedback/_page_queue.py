"""What the labelling page shows next (:class:`~torchrl_oni.feedback.server.FeedbackServer`'s
``GET /api/queue``): the captions and pairs that have no human answer yet, most useful first.

Captions: the ``first`` ones (the reward-hacking diagnostics' flagged captions, with why), then the
most seen (:func:`torchrl_oni.queries.select`, rule ``frequency``), or, with a reward-model
ensemble's ``scorer``, the ones its members disagree on most among the ``pool_size`` most seen
(``disagree``). Pairs: oldest first, or by the members' disagreement with a ``pair_scorer``. Each
item carries its text, how often it was seen, whether a game screen is kept, and the current LLM
answer (shown only when asked for). ``_StoreView`` is the reads the page makes, over the store's
public row API; ``_QueueMethods`` are the server's methods that use it (the server's base class:
its attributes ``view``, ``first``, ``scorer``, ``pair_scorer``, ``pool_size``, ``snapshots``,
``_lock``, ``_skipped``, ``_human_pid`` are set by ``FeedbackServer.__init__``).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np
import torch

from torchrl_oni.captions import decode_message
from torchrl_oni.queries import select
from torchrl_oni.store import HUMAN, LABELLED, CaptionStore

__all__: list = []


def _finite(x) -> Optional[float]:
    x = float(x)
    return x if np.isfinite(x) else None


# ---------------------------------------------------------------------------------------- store access
def _numpy(rows) -> Dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in rows.items()}


class _StoreView:
    """The reads the page makes, over :class:`~torchrl_oni.store.CaptionStore`'s public row API."""

    def __init__(self, store: CaptionStore):
        self.store = store

    def caption_candidates(self, exclude: set) -> Dict[str, np.ndarray]:
        """Non-empty captions without a human label (slots, hashes, times_seen), minus ``exclude``."""
        slots = self.store.caption_slots(exclude_annotator=HUMAN, nonempty=True)
        rows = _numpy(self.store.caption_rows(slots, ("caption_hash", "times_seen")))
        slots, hashes, seen = slots.numpy(), rows["caption_hash"], rows["times_seen"]
        if exclude and len(hashes):
            mask = ~np.isin(hashes, np.fromiter(exclude, np.int64, len(exclude)))
            slots, hashes, seen = slots[mask], hashes[mask], seen[mask]
        return {"slots": slots, "hashes": hashes, "times_seen": seen}

    def caption_rows(self, slots: np.ndarray) -> Dict[str, np.ndarray]:
        return _numpy(self.store.caption_rows(slots))

    def caption_row(self, caption_hash: int) -> Optional[Dict[str, Any]]:
        slot = int(self.store.slots([caption_hash])[0])
        if slot < 0:
            return None
        return {k: v[0] for k, v in self.caption_rows(np.array([slot])).items()}

    def pair_candidates(self, exclude: set) -> np.ndarray:
        """Slots of pairs without a human preference, minus ``exclude``."""
        slots = self.store.pair_slots(exclude_annotator=HUMAN).numpy()
        if exclude and len(slots):
            slots = slots[~np.isin(slots, np.fromiter(exclude, np.int64, len(exclude)))]
        return slots

    def pair_rows(self, slots: np.ndarray) -> Dict[str, np.ndarray]:
        return _numpy(self.store.pair_rows(slots))


# ---------------------------------------------------------------------------------------- the queue
class _QueueMethods:
    """:class:`~torchrl_oni.feedback.server.FeedbackServer`'s methods that choose and describe the
    items the page shows next (see the module docstring)."""

    def _provenance_name(self, pid: int) -> Optional[str]:
        if pid < 0:
            return None
        p = self.store.provenances[pid]
        return ":".join(x for x in (p.annotator, p.model) if x)

    def _caption_item(self, rows: Dict[str, np.ndarray], i: int, human_pid: Optional[int]) -> Dict[str, Any]:
        h = int(rows["caption_hash"][i])
        pid = int(rows["provenance"][i])
        llm = None
        if int(rows["status"][i]) == LABELLED and pid != human_pid:
            llm = {"label": _finite(rows["label"][i]), "by": self._provenance_name(pid)}
        item = {
            "id": str(h),
            "text": decode_message(rows["message"][i]),
            "times_seen": int(rows["times_seen"][i]),
            "llm": llm,
            "screen": self.snapshots is not None and h in self.snapshots,
        }
        if h in self.first:
            item["note"] = self.first[h]
        return item

    def _first_waiting(self, skipped: set) -> int:
        """How many of the ``first`` captions still wait for a person."""
        if not self.first:
            return 0
        return len(self._front(self.view.caption_candidates(skipped)))

    def _front(self, cands: Dict[str, np.ndarray]) -> np.ndarray:
        """Positions into ``cands`` of the ``first`` captions, in their order."""
        if not self.first or not len(cands["hashes"]):
            return np.zeros(0, np.int64)
        wanted = np.fromiter(self.first, np.int64, len(self.first))
        positions = np.flatnonzero(np.isin(cands["hashes"], wanted))
        by_hash = dict(zip(cands["hashes"][positions].tolist(), positions.tolist()))
        return np.array([by_hash[h] for h in self.first if h in by_hash], dtype=np.int64)

    def _order_captions(self, cands: Dict[str, np.ndarray], limit: int) -> np.ndarray:
        """Positions into ``cands``, most useful first."""
        n = len(cands["slots"])
        if n == 0:
            return np.zeros(0, np.int64)
        seen = torch.from_numpy(cands["times_seen"])
        order = torch.from_numpy(cands["slots"])
        k = limit if self.scorer is None else max(limit, self.pool_size)
        if n > 4 * k:  # cut the field before the full sort: the k most seen (ties broken later)
            top = np.argpartition(-cands["times_seen"], k)[:k]
            seen, order = seen[top], order[top]
        else:
            top = np.arange(n)
        ranked = select({"times_seen": seen, "order": order}, k, "frequency").numpy()
        if self.scorer is None:
            return top[ranked[:limit]]
        pool = top[ranked]
        rows = self.view.caption_rows(cands["slots"][pool])
        probs = torch.as_tensor(self.scorer(torch.from_numpy(rows["message"])))
        best = select({"member_probs": probs, "order": torch.arange(len(pool))}, limit, "disagree").numpy()
        return pool[best]

    def _queue_captions(self, limit: int) -> Dict[str, Any]:
        with self._lock:
            skipped = set(self._skipped["caption"])
        cands = self.view.caption_candidates(skipped)
        front = self._front(cands)[:limit]
        if len(front):  # the flagged captions first, then the usual order over the others
            rest = np.setdiff1d(np.arange(len(cands["slots"])), front)
            others = (self._order_captions({k: v[rest] for k, v in cands.items()}, limit - len(front))
                      if limit > len(front) else np.zeros(0, np.int64))
            picked = np.concatenate([front, rest[others]]).astype(np.int64)
        else:
            picked = self._order_captions(cands, limit)
        rows = self.view.caption_rows(cands["slots"][picked])
        human_pid = self._human_pid
        items = [self._caption_item(rows, i, human_pid) for i in range(len(picked))]
        if self.snapshots is not None:
            self.snapshots.pin(int(x["id"]) for x in items)
        return {"kind": "captions", "items": items, "waiting": len(cands["slots"])}

    def _queue_pairs(self, limit: int) -> Dict[str, Any]:
        with self._lock:
            skipped = set(self._skipped["pair"])
        slots = self.view.pair_candidates(skipped)
        if len(slots) and self.pair_scorer is not None:
            pool = slots[: max(limit, self.pool_size)]
            rows = self.view.pair_rows(pool)
            probs = torch.as_tensor(self.pair_scorer(torch.from_numpy(rows["message_a"]),
                                                     torch.from_numpy(rows["message_b"])))
            picked = pool[select({"member_probs": probs}, limit, "disagree").numpy()]
        else:
            picked = slots[:limit]  # oldest first
        rows = self.view.pair_rows(picked)
        human_pid = self._human_pid
        items = []
        for i, slot in enumerate(picked.tolist()):
            pid = int(rows["provenance"][i])
            llm = None
            if int(rows["status"][i]) == LABELLED and pid != human_pid:
                llm = {"preference": _finite(rows["preference"][i]), "by": self._provenance_name(pid)}
            sides = {}
            for side, name in (("a", "left"), ("b", "right")):
                h = int(rows[f"caption_hash_{side}"][i])
                sides[name] = {"id": str(h), "text": decode_message(rows[f"message_{side}"][i]),
                               "times_seen": int(rows[f"times_seen_{side}"][i]),
                               "screen": self.snapshots is not None and h in self.snapshots}
            items.append({"id": str(slot), **sides, "llm": llm})
        if self.snapshots is not None:
            self.snapshots.pin(int(x[s]["id"]) for x in items for s in ("left", "right"))
        return {"kind": "pairs", "items": items, "waiting": len(slots)}
