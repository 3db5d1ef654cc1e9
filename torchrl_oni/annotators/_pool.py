"""The server pool of :class:`~torchrl_oni.annotators.client.LLMClient` (its base class
``_PoolMethods``): which server takes the next request, which are taken out and health-checked
until they answer, and what the servers report.

* health checks: :meth:`check` (every server serves the model), the probes of a server that is
  out (``GET /v1/models`` every ``probe_interval_s``), :meth:`available` and the hints the
  background workers size their calls by (:meth:`batch_hint`, :meth:`concurrency_hint`);
* dispatch: a request slot on the usable server with the fewest requests in flight, waited for
  when every usable server is busy;
* reports: :meth:`metrics`, :meth:`recent`, :meth:`servers`, :meth:`describe` (the metrics are
  listed in :mod:`torchrl_oni.annotators.client`).

The per-server state (URL, circuit breaker, request sizer, counters) is
:mod:`torchrl_oni.annotators.endpoints`' ``_Endpoint``; the client's other attributes read here
(``_endpoints``, ``_lock``, ``_events``, ``_waiters``, ``_clock``, ``model``...) are set by
``LLMClient.__init__``.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import Dict, List, Optional, Tuple

from torchrl_oni.annotators.endpoints import AUTH_ERROR, AnnotatorUnavailable, _Endpoint, _fetch_models, _one_line

__all__: list = []

logger = logging.getLogger("torchrl_oni.annotators.client")  # the client's log, whose part this is

# Outcome categories of a request, and the metric that counts each.
_COUNTERS = {
    "sent": "requests_sent",
    "unsent": "requests_unsent",
    "server": "server_errors",
    "timeout": "timeouts",
    "connection": "connection_errors",
    "bad_answer": "bad_answers",
    "auth": "auth_errors",
    "rejected": "rejected",
    "unparsable": "unparsable",
}
# Failures that say the server is unwell: they count towards its circuit breaker.
_BREAKER_CATEGORIES = ("server", "timeout", "connection", "bad_answer", "auth")
# How long per-request outcomes are kept for recent() (the health summary looks back a minute).
_EVENTS_KEPT_S = 600.0


class _PoolMethods:
    """:class:`~torchrl_oni.annotators.client.LLMClient`'s methods over its pool of servers (see the
    module docstring)."""

    # ------------------------------------------------------------------ health check
    async def check(self) -> List[str]:
        """Lists the served models; fails clearly if no server can be used.

        Every server must serve ``model``; with ``model=None`` the first server that answers must
        serve exactly one model, which becomes ``model``. In a pool, servers that cannot be
        reached are taken out (and health-checked until they answer) as long as one can be used.

        Returns:
            the model names the first usable server lists at ``/v1/models``.

        Raises:
            AnnotatorUnavailable: one-line reason (unreachable, refused API key, not
                OpenAI-compatible, unknown model with the served names).
        """
        session = self._ensure_session()
        limit = min(self.timeout_s or 10.0, 10.0)
        found: Optional[List[str]] = None
        errors: List[Tuple[_Endpoint, AnnotatorUnavailable]] = []
        for ep in self._endpoints:
            try:
                names = await _fetch_models(session, ep.url, limit)
            except AnnotatorUnavailable as err:
                if AUTH_ERROR in str(err):
                    raise
                errors.append((ep, err))
                continue
            if self.model is None:
                if len(names) != 1:
                    raise AnnotatorUnavailable(
                        f"LLM server at {ep.url} serves {len(names)} models ({', '.join(names) or 'none'}): "
                        "name one with --llm-model")
                self._set_model(names[0])
            if self.model not in names:
                raise AnnotatorUnavailable(
                    f"model {self.model!r} is not served at {ep.url}; "
                    f"served: {', '.join(names) or 'none'}"
                )
            found = found if found is not None else names
        if found is None:
            raise errors[0][1]
        for ep, err in errors:
            ep.breaker.trip()
            ep.last_error = str(err).replace(f" at {ep.url}", "")
            ep.next_probe = self._clock() + self.probe_interval_s
            logger.warning("%s; using the other LLM servers and checking it every %g s", err,
                           self.probe_interval_s)
        return found

    def _start_due_probes(self) -> None:
        """Health-checks servers that are out, at most every ``probe_interval_s`` each."""
        now = self._clock()
        for ep in self._endpoints:
            if ep.breaker.allow() or now < ep.next_probe:
                continue
            if ep.probe_task is not None and not ep.probe_task.done():
                continue
            ep.next_probe = now + self.probe_interval_s
            ep.probe_task = asyncio.ensure_future(self._probe(ep))

    async def _probe(self, ep: _Endpoint) -> None:
        session = self._ensure_session()
        try:
            names = await _fetch_models(session, ep.url, min(5.0, max(self.probe_interval_s, 1.0)))
        except AnnotatorUnavailable as err:
            ep.last_error = str(err).replace(f" at {ep.url}", "")
            return
        if self.model not in names:
            ep.last_error = f"model {self.model!r} is not served at {ep.url}"
            return
        ep.breaker.half_open()
        self._wake_waiters()

    def available(self) -> bool:
        """True when a request could be sent now (some server's breaker is closed or
        half-open). From inside the client's event loop it also starts due health checks."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        # Probes run on the loop that owns the session; another thread's loop must not take it.
        if loop is not None and (self._loop is None or self._loop is loop or self._loop.is_closed()):
            self._ensure_session()
            self._start_due_probes()
        return any(ep.breaker.allow() for ep in self._endpoints)

    def batch_hint(self) -> int:
        """Captions per ``annotate`` call that make one request on the next server to use."""
        usable = [ep for ep in self._endpoints if ep.breaker.allow()] or self._endpoints
        return max(ep.sizer.batch for ep in usable)

    def concurrency_hint(self) -> int:
        """How many ``annotate`` calls in flight keep the usable servers busy."""
        return max(1, sum(ep.limit() for ep in self._endpoints if ep.breaker.allow()))

    # ------------------------------------------------------------------ dispatch
    def _wake_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _pick(self, avoid: Optional[_Endpoint]) -> Tuple[Optional[_Endpoint], bool]:
        """(the free usable server with the fewest requests in flight, whether any is usable)."""
        self._start_due_probes()
        usable = [ep for ep in self._endpoints if ep.breaker.allow()]
        free = [ep for ep in usable if ep.in_flight < ep.limit()]
        if avoid is not None and len(usable) > 1:
            # a retry goes to another server when there is one, and waits for it if it is busy
            # (going back to the one that just failed would spend the retry on it)
            free = [ep for ep in free if ep is not avoid]
        if not free:
            return None, bool(usable)
        return min(free, key=lambda ep: (ep.in_flight, ep.last_pick)), True

    async def _acquire(self, avoid: Optional[_Endpoint] = None) -> Optional[_Endpoint]:
        """Reserves a request slot on a server; None when no server is usable (breaker open)."""
        loop = asyncio.get_running_loop()
        while True:
            ep, any_usable = self._pick(avoid)
            if ep is not None:
                ep.in_flight += 1
                ep.last_pick = self._clock()
                return ep
            if not any_usable:
                return None
            fut = loop.create_future()
            self._waiters.append(fut)
            try:  # woken by a release or a recovery; the timeout re-checks breaker cool-downs
                await asyncio.wait_for(fut, timeout=max(self.probe_interval_s, 0.05))
            except asyncio.TimeoutError:
                pass

    def _release(self, ep: _Endpoint) -> None:
        ep.in_flight -= 1
        self._wake_waiters()

    def _event(self, category: str, n: int = 1, ep: Optional[_Endpoint] = None) -> None:
        with self._lock:
            if ep is not None:
                ep.counts[category] += n
            elif category == "unsent":
                self._unsent += n
            self._events.append((self._clock(), category, n))

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> Dict[str, float]:
        """Counters since the start, current request sizing, per-server entries (see the
        module docstring). Thread-safe."""
        with self._lock:
            totals = collections.Counter()
            for ep in self._endpoints:
                totals.update(ep.counts)
            out: Dict[str, float] = {name: float(totals.get(cat, 0)) for cat, name in _COUNTERS.items()}
            out["requests_unsent"] = float(self._unsent)
            out["unparsable"] = float(self.stats.unparsable)
            out["servers_total"] = float(len(self._endpoints))
            out["servers_up"] = float(sum(ep.breaker.allow() for ep in self._endpoints))
            out["timeout_s"] = max(ep.sizer.timeout(ep.sizer.batch) for ep in self._endpoints)
            out["request_batch"] = float(max(ep.sizer.batch for ep in self._endpoints))
            out["concurrency"] = float(sum(ep.sizer.concurrency for ep in self._endpoints))
            for ep in self._endpoints:
                key = f"server/{ep.index}/"
                errors = sum(ep.counts.get(c, 0) for c in _BREAKER_CATEGORIES + ("rejected",))
                out[key + "up"] = float(ep.breaker.allow())
                out[key + "requests"] = float(ep.counts.get("sent", 0))
                out[key + "errors"] = float(errors)
                out[key + "in_flight"] = float(ep.in_flight)
                out[key + "latency_s"] = ep.sizer.latency_s(0.5)
                out[key + "labels_per_s"] = ep.labels.rate(60.0, since=self._created)
                out[key + "batch"] = float(ep.sizer.batch)
                out[key + "concurrency"] = float(ep.sizer.concurrency)
                out[key + "timeout_s"] = ep.sizer.timeout(ep.sizer.batch)
        return out

    def recent(self, window_s: float = 60.0) -> Dict[str, int]:
        """Requests by outcome over the last ``window_s`` seconds: ``sent``, ``unsent``,
        ``server``, ``timeout``, ``connection``, ``bad_answer``, ``auth``, ``rejected``, ``ok``
        (answered), ``unparsable`` (captions). Thread-safe."""
        now = self._clock()
        out: Dict[str, int] = collections.Counter()
        with self._lock:
            events = list(self._events)
        for t, category, n in reversed(events):
            if now - t > window_s:
                break
            out[category] += n
        return dict(out)

    def servers(self) -> List[Tuple[str, bool, str]]:
        """``(url, up, last_error)`` of each server: up while its circuit breaker lets requests
        through. Thread-safe."""
        with self._lock:
            return [(ep.url, bool(ep.breaker.allow()), ep.last_error or "") for ep in self._endpoints]

    def describe(self) -> str:
        """One line on the servers' state, e.g. ``"1 of 2 LLM servers up (down: http://...:
        connection error ClientConnectorError)"``; empty when every server is up."""
        down = [ep for ep in self._endpoints if not ep.breaker.allow()]
        if not down:
            return ""
        what = "; ".join(f"{ep.url}: {_one_line(ep.last_error or 'failing', 100)}" for ep in down)
        if len(self._endpoints) == 1:
            return (f"LLM server taken out after {down[0].breaker.consecutive} failed requests "
                    f"in a row, checked every {self.probe_interval_s:g} s ({what})")
        up = len(self._endpoints) - len(down)
        return f"{up} of {len(self._endpoints)} LLM servers up (down: {what})"
