"""Asynchronous LLM annotation of captions: a TorchRL transform and its background worker.

:class:`LLMAnnotationTransform` watches the captions that flow through it (a collector batch,
a replay-buffer sample, or a :class:`~torchrl.envs.TransformedEnv` step), records new ones in a
:class:`~torchrl_oni.store.CaptionStore`, and wakes an :class:`AnnotationWorker`. The worker is
a thread running its own asyncio loop: it claims captions from the store in batches, awaits
``annotator.annotate(texts)`` with bounded concurrency, and writes labels or failures back.
The caller never waits for the LLM: a transform call costs one vectorised ``add`` and one
``lookup`` on the store.

A slow or dead server loses nothing: captions whose request failed for a server reason
(timeout, HTTP 5xx, connection error, circuit breaker open) go back in the queue and are never
given up; while no server can take a request the worker claims nothing, and when a server
answers again the captions that failed meanwhile are queued at once
(:meth:`~torchrl_oni.store.CaptionStore.requeue_server_failures`). Only captions whose answers
repeatedly cannot be parsed are given up (``CaptionStore.given_up()`` lists them).
:meth:`LLMAnnotationTransform.metrics` separates the causes (``requests_unsent``,
``server_errors``, ``timeouts``, ``connection_errors``, ``parse_failures``...) and
:meth:`LLMAnnotationTransform.health` sums up in one line why no labels arrive.

Where to put the transform: :class:`~torchrl.collectors.MultiAsyncCollector` deep-copies its
``postproc`` (``MultiSyncCollector`` calls it as given, so it takes this transform as its
postproc), and env worker processes get pickled copies, where a background thread and a
shared store make no sense. Apply the transform in the trainer to each collected batch
(``batch = annotate(batch)``), or inside a single-process ``TransformedEnv``. Copying or pickling
the transform raises :class:`~torchrl_oni.background.NotCopyableError` (a ``RuntimeError``) that
says so, also from inside a ``Compose`` or a collector's env factory.

Checkpoints: the transform's ``state_dict()`` holds its store's rows (captions, labels,
statuses, counts: :meth:`~torchrl_oni.store.CaptionStore.state_dict`), so ``env.state_dict()``
of a ``TransformedEnv`` keeps the labels; ``load_state_dict`` restores them into the transform's
store in place (captions pending at save time come back to be labelled).

Example:
    >>> import asyncio
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl_oni.annotators.base import Label, Provenance
    >>> from torchrl_oni.annotation import LLMAnnotationTransform
    >>> from torchrl_oni.captions import encode_messages, hash_messages
    >>> from torchrl_oni.store import CaptionStore
    >>> class KillIsProgress:
    ...     provenance = Provenance("doc", "rules")
    ...     async def annotate(self, captions):
    ...         return [Label(float("kill" in c), self.provenance) for c in captions]
    ...     async def compare(self, pairs):
    ...         return []
    ...     async def aclose(self):
    ...         pass
    >>> msgs = torch.from_numpy(encode_messages(["You kill the newt!", "It's a wall."]))
    >>> batch = TensorDict(message=msgs, caption_hash=torch.from_numpy(hash_messages(msgs)), batch_size=[2])
    >>> store = CaptionStore(capacity=16)
    >>> with LLMAnnotationTransform(store, KillIsProgress()) as annotate:
    ...     batch = annotate(batch)  # returns at once; labels arrive in the background
    ...     annotate.wait_idle(timeout=10)
    True
    >>> store.lookup(batch["caption_hash"])[0].tolist()
    [1.0, 0.0]
"""
from __future__ import annotations

import collections
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import torch
from tensordict import TensorDictBase
from torchrl.data import Categorical, Composite
from torchrl.envs.transforms import Transform

from torchrl_oni._annotation_worker import AnnotationWorker, Claim, _copy_refusal
from torchrl_oni.annotators.base import Annotator
from torchrl_oni.background import NotCopyableError
from torchrl_oni.captions import CAPTION_HASH_KEY, MESSAGE_KEY, hash_messages
from torchrl_oni.store import CaptionStore
from torchrl_oni.transform_keys import KeyedTransform, KeyRole, alias_property

__all__ = ["AnnotationWorker", "LLMAnnotationTransform", "Claim", "NotCopyableError"]


class LLMAnnotationTransform(KeyedTransform, Transform):
    """Sends the captions it sees to an LLM annotator in the background; data pass through.

    On every call it reads ``caption_hash`` and ``message`` (at the root and, when present,
    under ``"next"``), adds them to ``store``, and wakes its :class:`AnnotationWorker`, which
    labels new captions asynchronously. Nothing waits for the LLM. The data are not modified,
    except for an optional boolean ``labelled_key`` (declared in the observation spec) saying
    whether each step's caption already has a label.

    Works on a collector batch (``[T, K]`` or ``[K, T]``, any batch shape), a replay-buffer
    sample, or as a ``TransformedEnv`` transform in a single process. With a
    ``MultiAsyncCollector``, call it in the trainer on each batch: the collector deep-copies
    its ``postproc`` into worker processes.

    Args:
        store (CaptionStore): the caption store (shared with the reward transform).
        annotator (Annotator): the labeller (:mod:`torchrl_oni.annotators`).

    Keyword Args:
        in_keys (list of NestedKey): the caption hash and the message (2 keys; default
            ``["caption_hash", "message"]``; the hash is computed from the message when absent).
        out_keys (list of NestedKey): ``[]`` (default) or the one key of a bool "caption is
            labelled" entry.
        message_key, hash_key: aliases of ``in_keys[1]`` and ``in_keys[0]``.
        include_next (bool): also read ``("next", message_key)`` when present. Default True
            (terminal captions, e.g. death messages, only appear there).
        labelled_key (str, optional): alias of ``out_keys[0]``.
        batch_size, max_concurrency, poll_interval_s, pairs, close_annotator, log_interval_s, claim:
            passed to :class:`AnnotationWorker` (``claim``: e.g. a
            :class:`~torchrl_oni.queries.SelectiveClaim` for a label budget and query selection).
        coverage_window (int): number of recent calls over which ``coverage`` is measured.
        autostart (bool): start the worker on the first call (default). If False, call
            :meth:`start`.

    Keys can be changed later with :meth:`set_keys` (roles ``caption_hash``, ``message``,
    ``labelled``), as on TorchRL's losses.

    Copies: the transform refuses ``copy.deepcopy`` and pickling
    (:class:`~torchrl_oni.background.NotCopyableError`); ``clone()`` (TorchRL's shallow copy)
    shares its worker and store. Its ``state_dict()`` holds the store's rows (it owns them in a
    checkpoint; the reward transform reading the same store saves none of them).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_oni.annotators.base import Label, Provenance
        >>> from torchrl_oni.annotation import LLMAnnotationTransform
        >>> from torchrl_oni.captions import encode_messages, hash_messages
        >>> from torchrl_oni.store import CaptionStore
        >>> class Zero:
        ...     provenance = Provenance("zero")
        ...     async def annotate(self, captions):
        ...         return [Label(0.0, self.provenance) for _ in captions]
        >>> msgs = torch.from_numpy(encode_messages(["a", "b", "a", "c"])).reshape(2, 2, 256)
        >>> batch = TensorDict(message=msgs, caption_hash=torch.from_numpy(hash_messages(msgs)), batch_size=[2, 2])
        >>> annotate = LLMAnnotationTransform(CaptionStore(capacity=8), Zero(), labelled_key="caption_labelled")
        >>> out = annotate(batch)
        >>> out["caption_labelled"].shape
        torch.Size([2, 2])
        >>> annotate.wait_idle(timeout=10)
        True
        >>> annotate.metrics()["labelled"]
        3
        >>> annotate.close()
    """

    _IN_ROLES = (KeyRole("caption_hash", CAPTION_HASH_KEY, "hash_key"),
                 KeyRole("message", MESSAGE_KEY, "message_key"))
    _OUT_ROLES = (KeyRole("labelled", None, "labelled_key"),)

    hash_key = alias_property("caption_hash", "in_keys", 0, "``in_keys[0]``: the caption hash read.")
    message_key = alias_property("message", "in_keys", 1, "``in_keys[1]``: the message read.")
    labelled_key = alias_property("labelled", "out_keys", 0, "``out_keys[0]`` or None: the 'caption is labelled' flag written.")

    def __init__(
        self,
        store: CaptionStore,
        annotator: Annotator,
        *,
        in_keys: Optional[Sequence] = None,
        out_keys: Optional[Sequence] = None,
        message_key: Optional[str] = None,
        hash_key: Optional[str] = None,
        include_next: bool = True,
        labelled_key: Optional[str] = None,
        batch_size: int = 100,
        max_concurrency: int = 4,
        poll_interval_s: float = 1.0,
        pairs: bool = True,
        captions: bool = True,
        close_annotator: bool = False,
        log_interval_s: float = 60.0,
        coverage_window: int = 32,
        autostart: bool = True,
        claim: Optional[Claim] = None,
    ):
        in_keys, out_keys = self._resolve_keys(in_keys, out_keys, {
            "hash_key": hash_key, "message_key": message_key, "labelled_key": labelled_key})
        super().__init__(in_keys=in_keys, out_keys=out_keys)
        self.store = store
        self.include_next = include_next
        self.autostart = autostart
        self.worker = AnnotationWorker(
            store,
            annotator,
            batch_size=batch_size,
            max_concurrency=max_concurrency,
            poll_interval_s=poll_interval_s,
            pairs=pairs,
            captions=captions,
            close_annotator=close_annotator,
            log_interval_s=log_interval_s,
            claim=claim,
        )
        self._coverage: Deque[Tuple[int, int]] = collections.deque(maxlen=int(coverage_window))
        self._steps_seen = 0
        self._new_captions = 0
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "LLMAnnotationTransform":
        """Starts the background worker (done automatically on the first call by default)."""
        if self._closed:
            raise RuntimeError("this LLMAnnotationTransform is closed")
        self.worker.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stops the worker; captions still being annotated go back to unseen. Idempotent."""
        self._closed = True
        self.worker.stop(timeout)

    def __enter__(self) -> "LLMAnnotationTransform":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the worker has nothing left to do (tests, end of a run)."""
        return self.worker.wait_idle(timeout)

    def __copy__(self) -> "LLMAnnotationTransform":
        # Transform.clone() makes a shallow copy: the copy shares the worker and the store.
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo):
        raise _copy_refusal(self, memo)

    def __getstate__(self):
        raise _copy_refusal(self, pickling=True)

    # ------------------------------------------------------------------ checkpoints
    def get_extra_state(self) -> dict:
        """The store's rows (``CaptionStore.state_dict()``) and the transform's counters travel in
        ``state_dict()`` (nn.Module's extra-state hook); pending captions are saved as unseen."""
        return {"store": self.store.state_dict(), "steps_seen": self._steps_seen,
                "new_captions": self._new_captions}

    def set_extra_state(self, state: dict) -> None:
        """Restores the rows into the transform's store, in place (see ``CaptionStore.load_state_dict``)."""
        if not state:
            return
        if state.get("store") is not None:
            self.store.load_state_dict(state["store"])
        self._steps_seen = int(state.get("steps_seen", self._steps_seen))
        self._new_captions = int(state.get("new_captions", self._new_captions))

    # ------------------------------------------------------------------ data path
    def _groups(self, tensordict: TensorDictBase) -> List[TensorDictBase]:
        groups = [tensordict]
        if self.include_next:
            nxt = tensordict.get("next", None)
            if isinstance(nxt, TensorDictBase):
                groups.append(nxt)
        return groups

    def _observe(self, groups: List[TensorDictBase]) -> None:
        messages, hashes, shapes, holders = [], [], [], []
        for td in groups:
            msg = td.get(self.message_key, None)
            if msg is None:
                continue
            h = td.get(self.hash_key, None)
            if h is None:
                h = torch.from_numpy(hash_messages(msg))
            messages.append(msg.reshape(-1, msg.shape[-1]))
            hashes.append(h.reshape(-1))
            shapes.append(h.shape)
            holders.append(td)
        if not messages:
            if self.missing_tolerance:
                return
            raise KeyError(f"{type(self).__name__}: no '{self.message_key}' entry in the tensordict")
        all_msgs = messages[0] if len(messages) == 1 else torch.cat(messages)
        all_hashes = hashes[0] if len(hashes) == 1 else torch.cat(hashes)
        new = self.store.add(all_msgs, all_hashes)
        n_new = int(new.sum())
        # Coverage counts the steps of the first group (the root): each step once.
        _, found = self.store.lookup(hashes[0])
        self._coverage.append((int(found.sum()), found.numel()))
        self._steps_seen += found.numel()
        self._new_captions += n_new
        if self.labelled_key is not None:
            holders[0].set(self.labelled_key, found.reshape(shapes[0]))
            for td, h, shape in zip(holders[1:], hashes[1:], shapes[1:]):
                _, found_next = self.store.lookup(h)
                td.set(self.labelled_key, found_next.reshape(shape))
        if self._closed:
            return
        if not self.worker.running and self.autostart:
            self.worker.start()
        if n_new:
            self.worker.wake()

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        self._observe([next_tensordict])
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return self._call(tensordict_reset)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        self._observe(self._groups(tensordict))
        return tensordict

    # ------------------------------------------------------------------ specs
    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        if self.labelled_key is None:
            return observation_spec
        keys = observation_spec.keys(True, True)
        if self.hash_key in keys:
            shape = observation_spec[self.hash_key].shape
        else:
            shape = observation_spec[self.message_key].shape[:-1]
        observation_spec[self.labelled_key] = Categorical(
            2, shape=shape, dtype=torch.bool, device=observation_spec.device
        )
        return observation_spec

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> Dict[str, float]:
        """Annotation health, for logging.

        Keys: the worker's and the annotator's (:meth:`AnnotationWorker.metrics`:
        ``labels_per_s``, ``labels_total``, ``parse_failures``, ``caption_server_failures``,
        ``requests_unsent``, ``server_errors``, ``timeouts``, ``connection_errors``,
        ``latency_s``, ...), the store's queue (``pending`` = claimed and in the annotator,
        ``unseen`` = waiting, ``queue_depth`` = both, ``labelled``, ``given_up``, ``failed``,
        ``retrying``, ``size``), ``seen_coverage`` (fraction of every step seen so far whose
        caption is labelled now), ``coverage`` (fraction of steps in the last
        ``coverage_window`` calls whose caption was labelled at the time), ``steps_seen`` and
        ``new_captions``. For one line on what goes wrong, see :meth:`health`.
        """
        out = dict(self.worker.metrics())
        stats = self.store.stats()
        for key in ("size", "unseen", "pending", "labelled", "given_up", "failed", "retrying",
                    "positives", "seen_coverage"):
            out[key] = stats.get(key, 0)
        out["queue_depth"] = stats["unseen"] + stats["pending"]
        labelled = sum(n for n, _ in self._coverage)
        total = sum(n for _, n in self._coverage)
        out["coverage"] = labelled / total if total else 0.0
        out["steps_seen"] = self._steps_seen
        out["new_captions"] = self._new_captions
        return out

    def servers(self) -> list:
        """``(url, up, last_error)`` of each LLM server the annotator sends to (empty without one)."""
        return self.worker.servers()

    def health(self, window_s: float = 60.0) -> str:
        """One short line on annotation: ``"ok: ..."`` or why no label arrived in the last
        ``window_s`` seconds (see :meth:`AnnotationWorker.health`)."""
        if self._closed:
            return "annotation closed"
        return self.worker.health(window_s)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(keys=({self.hash_key!r}, {self.message_key!r}), "
            f"labelled_key={self.labelled_key!r}, store={self.store!r})"
        )
