"""CaptionStore: every unique caption seen, its LLM label, and the pairs sent for ranking.

One row per UNIQUE caption (its columns: :mod:`torchrl_oni.store.captions`) and one per pair
of captions to rank (:mod:`torchrl_oni.store.pairs`), held as fixed-width tensors in TorchRL
:class:`~torchrl.data.TensorDictReplayBuffer` tables (over :class:`~torchrl.data.LazyTensorStorage`
by default, or :class:`~torchrl.data.LazyMemmapStorage` to keep it on disk). No Python strings
live in the TorchRL storage: strings there cost O(capacity) per write and do not survive a
save/load. Provenances are a small table beside the storage (:mod:`torchrl_oni.store._provenance`).

A hash→slot index (two sorted int64 runs searched with :func:`numpy.searchsorted`) makes
``add`` and ``lookup`` vectorised over a whole collector batch. A single lock makes the store
safe to share between the trainer (``add``/``lookup``) and an annotation thread
(``claim``/``set_labels``/``mark_failed``).

Life of a caption: ``add`` → unseen → ``claim`` → pending → ``set_labels`` → labelled, or
``mark_failed`` → unseen again after a backoff (statuses: :mod:`torchrl_oni.store.status`).
Failures are of three kinds (the rules: :mod:`torchrl_oni.store._queue`):

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
the steps' coverage (``stats()["seen_coverage"]``) rises as fast as the server allows; first seen
first (``"oldest"``); or most seen *per caption first seen since* (``"seen_rate"``, what
``oni-train`` uses), so that what the agent has just started to see, and a rare caption's first
sighting, need not wait behind thousands of older captions seen as often over a longer time
(:data:`CLAIM_ORDERS`; what each costs and buys: ``benchmarks/queue_order.py``).
``release_pending`` (and :meth:`CaptionStore.load`) send pending captions back to unseen so no
caption is lost when a run stops mid-annotation.

Row-level reads for tools that show the store to people (the labelling page of
:mod:`torchrl_oni.feedback`): :meth:`~CaptionStore.caption_slots` / :meth:`~CaptionStore.caption_rows`,
:meth:`~CaptionStore.pair_slots` / :meth:`~CaptionStore.pair_rows`, :meth:`~CaptionStore.count_by`,
and the compare-and-set undo :meth:`~CaptionStore.restore_label` /
:meth:`~CaptionStore.restore_preference`. :meth:`~CaptionStore.sample_unlabelled` feeds SURF's
pseudo-labels (:class:`~torchrl_oni.rewards.ensemble.EnsembleClassifierTrainer`).

Modules:

=============================  ==============================================================
:mod:`.status`                 :class:`Status`, the persisted numbers of every queue's statuses
:mod:`._queue`                 the fault-handling rules of every labelling queue
:mod:`.caption_store`          :class:`CaptionStore`: its state, stats, work across both tables
:mod:`.captions`               the caption table's columns and methods (trainer, annotator)
:mod:`.pairs`                  the pair table's columns and methods (ranking)
:mod:`.rows`                   row-level reads and undo (tools that show the store to people)
:mod:`._snapshot`              save / load, and the file's layout
:mod:`.labels_file`            the labels alone as gzip-compressed JSON lines, what ``--labels-from`` also reads
:mod:`._table`                 fixed-width rows in a replay buffer, and the hash index
:mod:`._provenance`            the provenance table and the "people first" rule
=============================  ==============================================================

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
from torchrl_oni.store._provenance import HUMAN
from torchrl_oni.store._queue import (
    MAX_RETRY_S,
    MAX_SERVER_RETRY_S,
    SKIP_ERROR,
    is_parse_failure,
    is_skip,
    retry_delay,
    waiting_slots,
    RetryRules,
    WorkQueue,
)
from torchrl_oni.store.caption_store import CaptionStore
from torchrl_oni.store.captions import CLAIM_ORDERS
from torchrl_oni.store.status import FAILED, GIVEN_UP, LABELLED, PENDING, SKIPPED, STATUS_NAMES, UNSEEN, Status

__all__ = ["CaptionStore", "CLAIM_ORDERS", "WorkQueue", "RetryRules", "Status", "UNSEEN", "PENDING", "LABELLED", "FAILED", "GIVEN_UP", "SKIPPED", "HUMAN",
           "SKIP_ERROR", "is_parse_failure", "is_skip", "retry_delay", "waiting_slots", "MAX_RETRY_S",
           "MAX_SERVER_RETRY_S"]
