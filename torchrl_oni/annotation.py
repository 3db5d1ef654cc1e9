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
import logging
import time
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.data import Categorical, Composite
from torchrl.envs.transforms import Transform

from torchrl_oni.annotators.base import Annotator
from torchrl_oni.background import BackgroundLoop, NotCopyableError
from torchrl_oni.captions import CAPTION_HASH_KEY, MESSAGE_KEY, hash_messages
from torchrl_oni.store import CaptionStore, is_parse_failure, is_skip
from torchrl_oni.transform_keys import KeyedTransform, KeyRole, alias_property

__all__ = ["AnnotationWorker", "LLMAnnotationTransform", "Claim", "NotCopyableError"]

logger = logging.getLogger(__name__)

# What the worker calls for captions to label: ``claim(max_items) -> (hashes LongTensor[n], texts)``,
# marking them pending in the store (``CaptionStore.claim``, or a budgeted, selective
# :class:`~torchrl_oni.queries.SelectiveClaim`). Optional methods, called when present:
# ``refund(hashes)`` for claimed captions that cost nothing after all (a server fault, a call
# cancelled at shutdown) and ``settle(hashes)`` for those paid for (labelled, unparsable, skipped).
Claim = Callable[[int], Tuple[torch.Tensor, List[str]]]

_COPY_ERROR = (
    "{cls} cannot be copied or pickled: it owns a background thread and shares a CaptionStore. "
    "Apply it in the trainer to each collected batch (`batch = annotate(batch)`)."
)
# What each refusal adds: the user rarely copied this transform by name (TorchRL copies a transform
# together with the Compose and env holding it, and MultiAsyncCollector deep-copies its postproc
# where MultiSyncCollector does not), so the error says how the copy got here and what to do.
_DEEPCOPY_WHY = (
    " {reached}TorchRL deep-copies a transform together with the Compose and env that hold it. "
    "As a collector's postproc it works with MultiSyncCollector, which calls its postproc as given "
    "in this process, and not with MultiAsyncCollector, which deep-copies its postproc first (one "
    "copy per storing device). To deep-copy another transform of the same Compose (e.g. "
    "`stack.intrinsic` as a MultiAsyncCollector postproc), `.clone()` it first: a clone leaves its "
    "container behind."
)
_PICKLE_WHY = (
    " Pickling sends it to another process (a ParallelEnv worker, a collector's env factory, "
    "torch.save), where neither would work: put it on the outer TransformedEnv around a ParallelEnv, "
    "or call it on collected batches, and give the workers' envs only CopyAliasedObservations, "
    "CaptionHash and MessageCounter (`from torchrl_oni import CopyAliasedObservations, CaptionHash, "
    "MessageCounter`). Its labels travel in `state_dict()`. A transform pickles with the Compose and "
    "env that hold it: `.clone()` another transform of the same Compose to pickle it alone."
)


def _deepcopy_root(memo) -> Optional[str]:
    """The class name of what ``copy.deepcopy`` was called on, when the copy reached this object
    from a container (a Compose, an env): CPython's deepcopy enters each object's new copy in
    ``memo`` as it starts copying it, so the first entry (but the keep-alive list kept under
    ``id(memo)``) is the root's copy. Only modules (transforms, envs) are named: another root may
    copy itself by its own rules, and a wrong name would mislead."""
    for key, value in (memo or {}).items():
        if key == id(memo):
            continue
        return type(value).__name__ if isinstance(value, torch.nn.Module) else None
    return None


def _copy_refusal(obj, memo=None, *, pickling: bool = False) -> NotCopyableError:
    """The error ``obj``'s ``__deepcopy__`` (``pickling=False``) or ``__getstate__`` raises."""
    text = _COPY_ERROR.format(cls=type(obj).__name__)
    if pickling:
        return NotCopyableError(text + _PICKLE_WHY)
    root = _deepcopy_root(memo)
    reached = f"copy.deepcopy was called on {root}, not on it, and reached it. " if root else ""
    return NotCopyableError(text + _DEEPCOPY_WHY.format(reached=reached))


# Request-level counters of the annotator (OpenAIAnnotator.metrics); 0 for annotators that
# keep none, so the metric keys do not depend on the annotator.
_ANNOTATOR_COUNTERS = ("requests_sent", "requests_unsent", "server_errors", "timeouts",
                       "connection_errors", "bad_answers", "auth_errors", "rejected")


def _one_line(value, limit: int = 160) -> str:
    return " ".join(str(value).split())[:limit]


class AnnotationWorker(BackgroundLoop):
    """A thread with its own asyncio loop that labels the store's unseen captions.

    Each round it claims captions (most frequently seen first; and, when ``pairs`` is True,
    pairs), keeps ``annotate``/``compare`` calls in flight, and writes the results back:
    ``set_labels`` for good labels, ``mark_failed(kind)`` for failures. The store puts server
    faults back in the queue (never given up) and gives a caption up only after repeated
    unparsable answers. It sleeps until :meth:`wake` or ``poll_interval_s``. The thread, its
    loop and the start/stop/wake/idle machinery are :class:`~torchrl_oni.background.BackgroundLoop`'s.

    The annotator may steer the worker (``OpenAIAnnotator`` does; all optional):

    * ``available()``: False while no request could be sent (every server's circuit breaker
      open). The worker then claims nothing, so no caption is held or refused;
    * ``recoveries`` (an int attribute): bumped when a server that was out answers again. The
      worker then calls ``store.requeue_server_failures()``, so the captions that failed
      meanwhile go back in the queue at once; it does so too when ``available()`` turns True
      again (a health check lets a request through), and when it starts (a resumed or reused
      store);
    * ``batch_hint()``: captions per call (at most ``batch_size``): one request's worth, so a
      claim happens just before its request and the most frequent captions go first;
    * ``concurrency_hint()``: calls in flight (instead of ``max_concurrency``);
    * ``metrics()``, ``recent(window_s)``, ``describe()``: request-level counters merged into
      :meth:`metrics` and used by :meth:`health`.

    Args:
        store (CaptionStore): where captions come from and labels go.
        annotator (Annotator): see :mod:`torchrl_oni.annotators.base`.
        batch_size (int): most captions per ``annotate`` call. Default 100 (ONI's).
        max_concurrency (int): calls in flight at once when the annotator gives no
            ``concurrency_hint``. Default 4.
        poll_interval_s (float): longest sleep between rounds (retries become due, a server
            that was out is checked). Default 1.
        pairs (bool): also answer the store's ranking pairs with ``annotator.compare``.
        captions (bool): label the store's single captions (False: pairs only, ONI-Ranking,
            which would otherwise pay for a label of every caption first).
        close_annotator (bool): await ``annotator.aclose()`` when the worker stops.
        log_interval_s (float): failures are summarised in the log at most this often.
        claim (callable, optional): used instead of ``store.claim`` to pick the captions to
            label (see :data:`Claim`): e.g. :class:`~torchrl_oni.queries.SelectiveClaim`, which
            applies a label budget and a query-selection rule.

    A labeller that declines a caption (error kind ``"skip"``: a
    :class:`~torchrl_oni.annotators.teacher.SimulatedTeacher`, a person) has answered for good:
    the store marks it skipped, it is not asked (nor paid for) again, and ``metrics()["skipped"]``
    counts it.

    Example:
        >>> from torchrl_oni.annotators.base import Label, Provenance
        >>> from torchrl_oni.annotation import AnnotationWorker
        >>> from torchrl_oni.captions import encode_messages, hash_messages
        >>> from torchrl_oni.store import CaptionStore
        >>> class Constant:
        ...     provenance = Provenance("constant")
        ...     async def annotate(self, captions):
        ...         return [Label(0.0, self.provenance) for _ in captions]
        >>> store = CaptionStore(capacity=8)
        >>> msgs = encode_messages(["Hello, Agent."])
        >>> _ = store.add(msgs, hash_messages(msgs))
        >>> worker = AnnotationWorker(store, Constant(), pairs=False).start()
        >>> worker.wait_idle(timeout=10)
        True
        >>> worker.stop()
        >>> store.stats()["labelled"]
        1
    """

    what = "annotation"
    noun = "captions"
    failure_log = ("annotation failures since the last report (captions; server faults are "
                   "retried, unparsable answers given up after a few tries): %s")
    crash_log = "annotation worker crashed"

    def __init__(
        self,
        store: CaptionStore,
        annotator: Annotator,
        *,
        batch_size: int = 100,
        max_concurrency: int = 4,
        poll_interval_s: float = 1.0,
        pairs: bool = True,
        captions: bool = True,
        close_annotator: bool = False,
        log_interval_s: float = 60.0,
        claim: Optional[Claim] = None,
    ):
        if claim is not None and not callable(claim):
            raise TypeError(f"claim must be callable (max_items -> (hashes, texts)), got {type(claim).__name__}")
        super().__init__(annotator, batch_size=batch_size, max_concurrency=max_concurrency,
                         poll_interval_s=poll_interval_s, log_interval_s=log_interval_s,
                         close_client=close_annotator, name="oni-annotation", logger=logger)
        self.captions = bool(captions)
        self.store = store
        self.claim = claim if claim is not None else store.claim
        self.annotator = annotator
        self.pairs = pairs and hasattr(annotator, "compare")
        self._label_times: Deque[Tuple[float, int]] = collections.deque()
        self.labels_total = 0
        self.preferences_total = 0
        self.claim_errors = 0
        self._last_claim_error_log = float("-inf")

    @property
    def caption_server_failures(self) -> int:
        """Captions and pairs sent back to the queue for a server reason."""
        return self.server_failures

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> Dict[str, float]:
        """Counters (thread-safe).

        Worker: ``labels_per_s`` (labels and preferences, last minute), ``labels_total``,
        ``preferences_total``, ``requests_total`` (calls answered), ``in_flight``,
        ``parse_failures`` (captions and pairs answered unparsably), ``skipped`` (declined by the
        labeller: final), ``claim_errors`` (a ``claim`` callable that raised: nothing claimed that
        round), ``caption_server_failures``
        (captions and pairs sent back to the queue for a server reason), ``requeued_total``
        (put back in the queue when the server recovered or the worker started),
        ``latency_s`` (mean of the last 100 calls), ``latency_max_s``, ``worker_running``.

        Annotator (request level; 0 when the annotator keeps none): ``requests_sent``,
        ``requests_unsent`` (refused without sending: circuit breaker open), ``server_errors``
        (HTTP 5xx/429), ``timeouts``, ``connection_errors``, ``bad_answers``, ``auth_errors``,
        ``rejected``, and whatever else its ``metrics()`` gives (``timeout_s``,
        ``request_batch``, ``servers_up``, ``server/<i>/...``: see
        :class:`~torchrl_oni.annotators.openai.OpenAIAnnotator`).
        """
        now = time.monotonic()
        out: Dict[str, float] = {k: 0.0 for k in _ANNOTATOR_COUNTERS}
        out.update(self._client_call("metrics", {}))
        with self._metrics_lock:
            recent = sum(n for t, n in self._label_times if now - t <= 60.0)
            window = min(60.0, now - self._started_at) if self._started_at is not None else 0.0
            out.update(self._loop_metrics())
            out.update({
                "labels_per_s": recent / window if window > 0 else 0.0,
                "labels_total": self.labels_total,
                "preferences_total": self.preferences_total,
                "skipped": self.skipped,
                "claim_errors": self.claim_errors,
                "caption_server_failures": self.server_failures,
                "requeued_total": self.requeued_total,
                "latency_max_s": float(np.max(self._latencies)) if self._latencies else 0.0,
            })
        return out

    def health(self, window_s: float = 60.0) -> str:
        """One short line on how annotation goes: ``"ok: ..."`` while labels arrive, else the
        dominant reason why none did in the last ``window_s`` seconds (a dead or slow server,
        a refused API key, unparsable answers, ...), for a warning the trainer prints while
        coverage stays low. Thread-safe.

        Example:
            >>> from torchrl_oni.annotation import AnnotationWorker
            >>> from torchrl_oni.annotators.scripted import ScriptedAnnotator
            >>> from torchrl_oni.store import CaptionStore
            >>> AnnotationWorker(CaptionStore(capacity=4), ScriptedAnnotator()).health()
            'annotation worker not running'
        """
        if self.crashed is not None:
            return f"annotation worker crashed: {type(self.crashed).__name__}: {_one_line(self.crashed)}"
        if not self.running:
            return "annotation worker not running"
        now = time.monotonic()
        stats = self.store.stats()
        waiting = int(stats["unseen"] + stats["pending"])
        with self._metrics_lock:
            labels = sum(n for t, n in self._label_times if now - t <= window_s)
            failures: Dict[str, int] = {}
            for t, kind, n in self._failure_times:
                if now - t <= window_s:
                    failures[kind] = failures.get(kind, 0) + n
            oldest = min(self._call_started.values(), default=None)
            in_flight = self._in_flight
        span = min(window_s, max(now - (self._started_at or now), 1e-9))
        recent = self._client_call("recent", {}, window_s)
        state = self._client_call("describe", "")
        sizing = self._client_call("metrics", {})
        tail = f"; {state}" if state else ""
        if labels:
            rate = labels / span
            if waiting > rate * window_s:
                return f"labelling {rate:.2g} captions/s with {waiting:,} waiting{tail}"
            return f"ok: {rate:.2g} labels/s, {waiting:,} waiting{tail}"
        if not waiting and not in_flight:
            return "idle: no caption waiting for a label"
        head = f"no labels in the last {window_s:g} s ({waiting:,} captions waiting): "
        parse = sum(n for k, n in failures.items() if is_parse_failure(k))
        other = {k: n for k, n in failures.items() if not is_parse_failure(k)}
        limit = sizing.get("timeout_s", 0.0)
        batch = int(sizing.get("request_batch", 0))
        causes = [
            (recent.get("auth", 0), f"the LLM server refused the API key ({recent.get('auth', 0)} "
                                    "requests): set --llm-api-key or OPENAI_API_KEY"),
            (recent.get("connection", 0), f"cannot reach the LLM server ({recent.get('connection', 0)} "
                                          "connection errors)"),
            (recent.get("timeout", 0), f"the LLM server is too slow: {recent.get('timeout', 0)} "
                                       f"requests timed out (now {limit:.0f} s for {batch} prompts)"),
            (recent.get("server", 0), f"the LLM server fails: {recent.get('server', 0)} HTTP 5xx/429 "
                                      "answers"),
            (recent.get("bad_answer", 0), f"the LLM server sends malformed answers "
                                          f"({recent.get('bad_answer', 0)} requests)"),
            (recent.get("rejected", 0), f"the LLM server rejects the requests ({recent.get('rejected', 0)} "
                                        "HTTP 4xx): check --llm-model"),
            (parse, f"the model's answers cannot be parsed ({parse} captions): try --llm-prompt "
                    "short or a larger model"),
        ]
        if not recent and other:  # an annotator without request counters
            top = max(other, key=other.get)
            causes.append((sum(other.values()), f"annotation calls fail ({top}: {other[top]} captions)"))
        count, text = max(causes, key=lambda c: c[0])
        unsent = recent.get("unsent", 0)
        held = f"; {unsent} requests held back by the circuit breaker" if unsent else ""
        if count:
            return head + text + held + tail
        if state or unsent:
            return head + (state or "circuit breaker open") + held
        if in_flight and oldest is not None:
            return (head + f"waiting for the LLM server: {in_flight} calls in flight, the oldest "
                    f"for {now - oldest:.0f} s" + (f" (time limit {limit:.0f} s)" if limit else ""))
        return head + "nothing sent yet"

    def _record_success(self, n_labels: int, n_prefs: int, latency: float) -> None:
        now = time.monotonic()
        with self._metrics_lock:
            self._count_call(latency)
            self.labels_total += n_labels
            self.preferences_total += n_prefs
            if n_labels + n_prefs:
                self._label_times.append((now, n_labels + n_prefs))
            while self._label_times and now - self._label_times[0][0] > 600.0:
                self._label_times.popleft()

    # ------------------------------------------------------------------ the loop's work
    def _requeue_failed(self) -> int:
        requeue = getattr(self.store, "requeue_server_failures", None)
        return int(requeue()) if callable(requeue) else 0

    def _claimable(self) -> int:
        fn = getattr(self.store, "claimable", None)
        return fn(captions=self.captions, pairs=self.pairs) if callable(fn) else 0

    def _next_call(self, batch: int):
        if self.captions:
            try:
                hashes, texts = self.claim(batch)
            except Exception as err:  # noqa: BLE001 - a failing selection rule must not kill annotation
                with self._metrics_lock:
                    self.claim_errors += 1
                    due = time.monotonic() - self._last_claim_error_log >= self.log_interval_s
                    if due:
                        self._last_claim_error_log = time.monotonic()
                if due:
                    logger.warning("annotation: choosing captions failed (%d times so far; nothing is lost, "
                                   "retried next round): %s: %s", self.claim_errors, type(err).__name__,
                                   _one_line(err))
                hashes, texts = None, []
            if texts:
                return self._annotate(hashes, texts)
        if self.pairs:
            slots, pairs = self.store.claim_pairs(batch)
            if pairs:
                return self._compare(slots, pairs)
        return None

    def _claim_call(self, name: str, hashes: torch.Tensor) -> None:
        """``claim.refund`` / ``claim.settle`` when the claim callable keeps accounts."""
        fn = getattr(self.claim, name, None)
        if callable(fn) and len(hashes):
            try:
                fn(hashes)
            except Exception:  # noqa: BLE001 - accounting must never stop annotation
                logger.exception("claim.%s() failed", name)

    def _fail_captions(self, hashes: torch.Tensor, kind: str) -> None:
        self.store.mark_failed(hashes, kind)
        if is_parse_failure(kind) or is_skip(kind):
            self._claim_call("settle", hashes)  # the labeller did the work
        else:
            self._claim_call("refund", hashes)  # a server fault costs nothing; asked again later

    def _release_captions(self, hashes: torch.Tensor) -> None:
        self.store.release(hashes)
        self._claim_call("refund", hashes)

    async def _annotate(self, hashes: torch.Tensor, texts: List[str]) -> None:
        start = time.monotonic()
        labels = await self._results(self.annotator.annotate(texts), len(texts),
                                     release=lambda: self._release_captions(hashes),
                                     fail=lambda kind: self._fail_captions(hashes, kind))
        if labels is None:
            return
        ok = [i for i, label in enumerate(labels) if label.ok]
        written = 0
        if ok:
            # False where a person labelled the caption meanwhile: theirs stays
            written = int(self.store.set_labels(
                hashes[ok],
                [labels[i].value for i in ok],
                [labels[i].provenance for i in ok],
                scores=[np.nan if labels[i].score is None else labels[i].score for i in ok],
            ).sum())
            self._claim_call("settle", hashes[ok])
        failed = self._failures(labels)
        for kind, idx in failed.items():
            self._fail_captions(hashes[idx], kind)
        self._record_success(written, 0, time.monotonic() - start)
        self._record_failures({kind: len(idx) for kind, idx in failed.items()})

    async def _compare(self, slots: torch.Tensor, pairs: List[Tuple[str, str]]) -> None:
        start = time.monotonic()
        prefs = await self._results(self.annotator.compare(pairs), len(pairs),
                                    release=lambda: self.store.release_pairs(slots),
                                    fail=lambda kind: self.store.mark_pairs_failed(slots, kind))
        if prefs is None:
            return
        ok = [i for i, p in enumerate(prefs) if p.ok]
        written = 0
        if ok:
            written = int(self.store.set_preferences(slots[ok], [prefs[i].value for i in ok],
                                                     [prefs[i].provenance for i in ok]).sum())
        failed = self._failures(prefs)
        for kind, idx in failed.items():
            self.store.mark_pairs_failed(slots[idx], kind)
        self._record_success(0, written, time.monotonic() - start)
        self._record_failures({kind: len(idx) for kind, idx in failed.items()})

    def __deepcopy__(self, memo):
        raise _copy_refusal(self, memo)

    def __getstate__(self):
        raise _copy_refusal(self, pickling=True)


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
