"""The captions of a :class:`~torchrl_oni.store.CaptionStore`: adding, looking up, labelling.

One row per UNIQUE caption, held as fixed-width tensors (:class:`~torchrl_oni.store._table._Table`):

========================  ==============  ==================================================
field                     dtype / shape   meaning
========================  ==============  ==================================================
``message``               uint8[256]      the NUL-padded caption bytes
``caption_hash``          int64           :func:`torchrl_oni.captions.caption_hash`
``label``                 float32         the annotator's label, NaN while unlabelled
``score``                 float32         the annotator's probability, NaN if it gave none
``status``                int8            a :class:`~torchrl_oni.store.status.Status`: 0 unseen,
                                          1 pending, 2 labelled, 3 failed (stores written
                                          before server faults were told apart: put back in
                                          the queue by :meth:`~torchrl_oni.store.CaptionStore.requeue_server_failures`),
                                          4 given up (its answers could not be parsed),
                                          5 skipped (the labeller declined it: never asked again)
``times_seen``            int64           how many steps showed this caption
``attempts``              int16           answers that could not be parsed so far
``provenance``            int16           id into :attr:`CaptionStore.provenances <torchrl_oni.store.CaptionStore.provenances>`, -1 none
========================  ==============  ==================================================

Two audiences use these methods: the trainer (:meth:`~_CaptionMethods.add`,
:meth:`~_CaptionMethods.lookup`, the samples for reward models) and the annotation worker
(:meth:`~_CaptionMethods.claim`, :meth:`~_CaptionMethods.set_labels`,
:meth:`~_CaptionMethods.mark_failed`, ...).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from tensordict import TensorDict

from torchrl_oni.annotators.base import Provenance
from torchrl_oni.captions import CAPTION_HASH_KEY, MESSAGE_KEY, MESSAGE_LEN, decode_messages, hash_messages
from torchrl_oni.store._table import ArrayLike, shape_of, to_numpy
from torchrl_oni.store.status import FAILED, GIVEN_UP, LABELLED, UNSEEN

__all__ = ["CAPTION_FIELDS", "CLAIM_ORDERS", "SEEN_RATE_PRIOR"]

# name -> (dtype, per-row shape, fill value of a fresh row)
CAPTION_FIELDS = {
    MESSAGE_KEY: (torch.uint8, (MESSAGE_LEN,), 0),
    CAPTION_HASH_KEY: (torch.int64, (), 0),
    "label": (torch.float32, (), float("nan")),
    "score": (torch.float32, (), float("nan")),
    "status": (torch.int8, (), UNSEEN),
    "times_seen": (torch.int64, (), 0),
    "attempts": (torch.int16, (), 0),
    "provenance": (torch.int16, (), -1),
}


# The orders in which claim hands out unseen captions (CaptionStore's claim_order)
CLAIM_ORDERS = ("most_seen", "oldest", "seen_rate")
# claim_order="seen_rate" ranks a caption by its sightings per caption first seen after it, as if
# SEEN_RATE_PRIOR more had come: one sighting of a brand-new caption is weak evidence of a high
# rate (500: ~24 s of new captions at the ~21/s of README's run; benchmarks/queue_order.py)
SEEN_RATE_PRIOR = 500


def _most_seen_first(cand: np.ndarray, seen: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` candidates seen most often (or of highest score ``seen``), in that order; ties
    oldest (lowest slot) first.

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


def _seen_rate_first(cand: np.ndarray, seen: np.ndarray, size: int, k: int,
                     prior: float = SEEN_RATE_PRIOR) -> np.ndarray:
    """``claim_order="seen_rate"``: the ``k`` candidates of most sightings per caption first seen
    since their own first sighting, ``seen / (size - 1 - slot + prior)`` (slots follow first
    sightings; ``size`` rows in all), in that order; ties oldest first.

    A rate rather than a count: a caption the agent has just started to see often outranks an
    old one seen as often over a longer time, and a new caption's first sighting outranks old
    captions seen less than once per ``prior`` new ones. Same cost as :func:`_most_seen_first`.

    Example (4 captions, the oldest first; with ``prior=2`` the newest one-off, slot 3, comes
    before the older one, slot 2):
        >>> _seen_rate_first(np.arange(4), np.array([6, 3, 1, 1]), 4, 4, prior=2).tolist()
        [0, 1, 3, 2]
    """
    return _most_seen_first(cand, seen / (size - 1 - cand + float(prior)), k)


class _CaptionMethods:
    """The caption methods of :class:`~torchrl_oni.store.CaptionStore` (which holds the state)."""

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
        msgs = to_numpy(messages, np.uint8)
        if msgs.ndim == 0 or msgs.shape[-1] != MESSAGE_LEN:
            raise ValueError(f"messages must be uint8[..., {MESSAGE_LEN}], got shape {tuple(msgs.shape)}")
        msgs = msgs.reshape(-1, MESSAGE_LEN)
        if hashes is None:
            hashes = hash_messages(msgs)
        out_shape = shape_of(hashes)
        flat = to_numpy(hashes, np.int64).reshape(-1)
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
        shape = shape_of(hashes)
        flat = to_numpy(hashes, np.int64).reshape(-1)
        with self._lock:
            return torch.from_numpy(self._index.find(flat)).reshape(shape)

    def lookup(self, hashes: ArrayLike, default: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
        """Labels of a batch of hashes (any shape).

        Returns:
            ``(labels float32, found bool)`` shaped like ``hashes``. ``found`` is True where the
            caption is labelled; ``labels`` holds ``default`` elsewhere (0.0, ONI-Retrieval's
            reward for a caption without a label).
        """
        shape = shape_of(hashes)
        flat = to_numpy(hashes, np.int64).reshape(-1)
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
        shape = shape_of(hashes)
        flat = to_numpy(hashes, np.int64).reshape(-1)
        out = np.full(len(flat), np.nan, dtype=np.float32)
        with self._lock:
            slots = self._index.find(flat)
            known = slots >= 0
            s = slots[known]
            ok = self._captions.cols["status"][s] == LABELLED
            out[np.flatnonzero(known)[ok]] = self._captions.cols["score"][s[ok]]
        return torch.from_numpy(out).reshape(shape)

    def claim(self, max_items: int) -> Tuple[torch.Tensor, List[str]]:
        """Hands out up to ``max_items`` captions to annotate and marks them pending.

        Candidates are unseen captions, including failed ones whose retry backoff has passed.
        With ``claim_order="most_seen"`` the most frequently seen come first (ties: oldest
        first); with ``"oldest"``, insertion order; with ``"seen_rate"``, most sightings per
        caption first seen since (:func:`_seen_rate_first`): of two captions seen as often, the
        newer first.

        Example:
            >>> from torchrl_oni.captions import encode_messages
            >>> from torchrl_oni.store import CaptionStore
            >>> messages = encode_messages(["a", "b", "b", "c"])   # b seen twice; a, then c, once
            >>> for order in ("most_seen", "oldest", "seen_rate"):
            ...     store = CaptionStore(capacity=8, claim_order=order)
            ...     _ = store.add(messages)
            ...     print(order, store.claim(3)[1])
            most_seen ['b', 'a', 'c']
            oldest ['a', 'b', 'c']
            seen_rate ['b', 'c', 'a']

        Returns:
            ``(hashes LongTensor[n], texts list[str])`` (texts decoded latin-1, NULs dropped).
        """
        with self._lock:
            cols = self._captions.cols
            cand = self._caption_queue.claim(max_items, self._claim_first)
            hashes = np.array(cols[CAPTION_HASH_KEY][cand])
            messages = np.array(cols[MESSAGE_KEY][cand])
        return torch.from_numpy(hashes), decode_messages(messages)

    def _claim_first(self, cand: np.ndarray, k: int) -> np.ndarray:
        """The ``k`` of the claimable slots ``cand`` (ascending) that :meth:`claim` hands out, in
        order, by ``claim_order`` (lock held)."""
        if self.claim_order == "oldest":
            return cand[:k]
        seen = self._captions.cols["times_seen"][cand]
        if self.claim_order == "seen_rate":
            return _seen_rate_first(cand, seen, self._captions.size, k, SEEN_RATE_PRIOR)
        return _most_seen_first(cand, seen, k)

    def pending(self) -> torch.Tensor:
        """Hashes of the captions claimed but not yet labelled or failed."""
        with self._lock:
            return torch.from_numpy(np.array(self._captions.cols[CAPTION_HASH_KEY][self._caption_queue.pending()]))

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
            >>> from torchrl_oni.store import CaptionStore, HUMAN
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
        shape = shape_of(hashes)
        flat = to_numpy(hashes, np.int64).reshape(-1)
        values = np.broadcast_to(to_numpy(labels, np.float32).reshape(-1), flat.shape)
        if not np.isfinite(values).all():
            raise ValueError("set_labels: labels must be finite (use mark_failed for failures)")
        if scores is None:
            score_values = np.full(len(flat), np.nan, dtype=np.float32)
        else:
            score_values = np.broadcast_to(to_numpy(scores, np.float32).reshape(-1), flat.shape)
        with self._lock:
            pids = self._provenance_table.ids_for(provenance, len(flat))
            slots = self._index.find(flat)
            cols = self._captions.cols
            written = slots >= 0
            idx = np.flatnonzero(written)
            protected = self._provenance_table.protected(cols["provenance"][slots[idx]], pids[idx])
            written[idx[protected]] = False
            s = slots[written]
            cols["label"][s] = values[written]
            cols["score"][s] = score_values[written]
            cols["provenance"][s] = pids[written]
            self._caption_queue.finish(s)
        return torch.from_numpy(written).reshape(shape)

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
            >>> from torchrl_oni.store import CaptionStore, SKIP_ERROR
            >>> store = CaptionStore(capacity=4)
            >>> _ = store.add(encode_messages(["It's a wall."]))
            >>> hashes, _ = store.claim(1)
            >>> store.mark_failed(hashes, SKIP_ERROR).tolist(), store.claim(1)[1], store.stats()["skipped"]
            ([True], [], 1)
        """
        shape = shape_of(hashes)
        flat = to_numpy(hashes, np.int64).reshape(-1)
        gave_up = np.zeros(len(flat), dtype=bool)
        with self._lock:
            slots = self._index.find(flat)
            idx = np.flatnonzero(slots >= 0)
            failed, give_up = self._caption_queue.fail(slots[idx], error_kind, parse_failure=parse_failure,
                                                       final=final)
            self._count_errors(error_kind, len(failed))
            gave_up[idx[np.isin(slots[idx], failed[give_up])]] = True
        return torch.from_numpy(gave_up).reshape(shape)

    def retry_failed(self) -> int:
        """Makes every given-up caption unseen again with a fresh attempt count; returns how many."""
        with self._lock:
            return len(self._caption_queue.reopen((FAILED, GIVEN_UP)))

    def given_up(self) -> List[str]:
        """The captions given up because their answers could not be parsed (oldest first)."""
        with self._lock:
            n = self._captions.size
            slots = np.flatnonzero(self._captions.cols["status"][:n] == GIVEN_UP)
            messages = np.array(self._captions.cols[MESSAGE_KEY][slots])
        return decode_messages(messages)

    def import_labels(self, source) -> Dict[str, int]:
        """Copies the labelled captions of another store ``source`` into this one: their labels,
        scores and provenance (an LLM's label stays that LLM's), as captions not seen in this run.

        A caption this store already labels keeps its own label, so importing is idempotent and,
        with several sources, the first to label a caption wins; any other caption (new, waiting,
        failed, given up or skipped) takes ``source``'s label. People's labels stay as they are.
        The captions are not counted as seen: ``times_seen`` and the steps' coverage say what
        this run saw.

        Returns:
            ``imported`` (captions labelled by the import), ``kept`` (already labelled here: left
            alone), ``disagreeing`` (of those, how many ``source`` labels otherwise),
            ``positive`` (imported labels ≥ 0.5).

        Example:
            >>> from torchrl_oni.annotators.base import Provenance
            >>> from torchrl_oni.captions import encode_messages, hash_messages
            >>> from torchrl_oni.store import CaptionStore
            >>> messages = encode_messages(["You kill the newt!", "It's a wall."])
            >>> hashes = hash_messages(messages)
            >>> old = CaptionStore()
            >>> _ = old.add(messages, hashes)
            >>> _ = old.set_labels(hashes, [1.0, 0.0], Provenance("openai", "qwen", "short-v1"))
            >>> new = CaptionStore()
            >>> new.import_labels(old)
            {'imported': 2, 'kept': 0, 'disagreeing': 0, 'positive': 1}
            >>> new.lookup(hashes)[0].tolist(), new.stats()["seen_coverage"], new.provenances[0].model
            ([1.0, 0.0], 0.0, 'qwen')
            >>> new.import_labels(old)["kept"]
            2
        """
        if source is self:
            raise ValueError("import_labels: a store cannot import its own labels")
        with source.lock:  # one consistent read of the other store
            rows = source.caption_rows(source.caption_slots(status=LABELLED))
            table = source.provenances
        hashes = rows.get(CAPTION_HASH_KEY).numpy()
        labels = rows.get("label").numpy()
        scores = rows.get("score").numpy()
        pids = rows.get("provenance").numpy()
        unknown = Provenance("unknown")  # a labelled row always has one; kept safe for old files
        provenance = [table[p] if 0 <= p < len(table) else unknown for p in pids.tolist()]
        with self._lock:
            slots_here = self._index.find(hashes)
            known = slots_here >= 0
            mine = np.zeros(len(hashes), dtype=bool)
            mine[known] = self._captions.cols["status"][slots_here[known]] == LABELLED
            disagreeing = int((self._captions.cols["label"][slots_here[mine]] != labels[mine]).sum())
            new = np.flatnonzero(~known)
            if len(new):
                new_slots = self._captions.append(
                    {MESSAGE_KEY: rows.get(MESSAGE_KEY).numpy()[new], CAPTION_HASH_KEY: hashes[new],
                     "times_seen": np.zeros(len(new), dtype=np.int64)}, len(new))
                self._index.insert(hashes[new], new_slots)
            take = np.flatnonzero(~mine)
            written = self.set_labels(hashes[take], labels[take], [provenance[i] for i in take], scores[take]).numpy()
        imported = take[written]
        return {"imported": int(len(imported)), "kept": int(mine.sum()), "disagreeing": disagreeing,
                "positive": int((labels[imported] >= 0.5).sum())}

    def release(self, hashes: ArrayLike) -> int:
        """Sends the given pending captions back to unseen (work that was claimed but dropped)."""
        flat = to_numpy(hashes, np.int64).reshape(-1)
        with self._lock:
            slots = self._index.find(flat)
            return self._caption_queue.release(slots[slots >= 0])

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
            >>> from torchrl_oni.store import CaptionStore
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

