"""The background worker of :mod:`torchrl_oni.annotation`: :class:`AnnotationWorker` claims captions
(and pairs) from a :class:`~torchrl_oni.store.CaptionStore`, keeps the annotator's calls in
flight and writes labels or failures back, on a thread with its own asyncio loop
(:class:`~torchrl_oni.background.BackgroundLoop`); ``health()`` says in one line why no labels
arrive. What it does with a slow or dead server: :mod:`torchrl_oni.annotation`.

Also here: what the worker calls for captions (:data:`Claim`) and the error that the worker and
:class:`~torchrl_oni.annotation.LLMAnnotationTransform` raise when something copies or pickles
them (``_copy_refusal``).
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Deque, Dict, List, Optional, Tuple

import numpy as np
import torch

from torchrl_oni.annotators.base import Annotator
from torchrl_oni.background import BackgroundLoop, NotCopyableError
from torchrl_oni.store import CaptionStore, is_parse_failure, is_skip

__all__ = ["AnnotationWorker", "Claim"]

logger = logging.getLogger("torchrl_oni.annotation")  # its public face's name, which log settings use

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
