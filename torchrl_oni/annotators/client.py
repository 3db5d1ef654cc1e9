"""LLMClient: a pooled, fault-tolerant aiohttp client for OpenAI-compatible servers (vLLM,
FastChat, llama.cpp, our embedded CPU server).

It knows nothing of labels: it sends chat prompts of any kind and returns each answer's text
or why there is none (:meth:`LLMClient.complete` → :class:`Completion`).
:class:`~torchrl_oni.annotators.openai.OpenAIAnnotator` turns captions into labels with it, and
ELLM's :class:`~torchrl_oni.annotators.goals.OpenAIGoalSuggester` turns states into goals.

Two endpoints:

* ``api="completions"`` (``/v1/completions``): several prompts per request, rendered to plain
  text (Llama-3 chat layout for Llama-3 models, as ONI did);
* ``api="chat"`` (``/v1/chat/completions``): one request per prompt.

**A slow answer is not a failure.** Each server gets a :class:`~torchrl_oni.annotators.pacing.RequestSizer`
(:mod:`torchrl_oni.annotators.pacing`, where the rules are) that adapts prompts per request
(from ``initial_batch_size`` up to ``batch_size``), requests in flight (up to
``max_concurrency``) and each request's time limit (between ``min_timeout_s`` and
``max_timeout_s``; ``first_timeout_s`` before any answer) to the latency the server actually
shows. ``timeout_s`` fixes the limit instead (``--llm-timeout``).

**Faults never escape** :meth:`LLMClient.complete`: they come back as a :class:`Completion`
with an ``error``. Within one call, HTTP 5xx/429, timeouts, connection errors and malformed
answers are retried with exponential backoff (``max_retries`` times, on another server when
there is one). HTTP 401/403 is not retried: the error reads ``"server refused the API key
(HTTP 401)"``. Other 4xx (unknown model, bad parameter) are not retried either.

**Circuit breaker and health checks.** A server whose ``circuit_failures`` requests in a row
failed is taken out: nothing is sent to it (requests that find no server are refused at once
with ``error="circuit open"``, counted as *unsent*: they cost the prompt nothing). While it is
out it is probed with ``GET /v1/models`` every ``probe_interval_s``; when it answers, one
request is let through, whose success brings it back (and so does a request let through after
``circuit_cooldown_s``).

**A pool of servers.** Give ``base_url`` a list: each request goes to the usable server with
the fewest requests in flight; a failed one is retried on another. Every server must serve
``model`` (:meth:`LLMClient.check`). :meth:`LLMClient.metrics` has per-server entries
``server/<i>/...``.

Choices are matched to prompts by their ``index`` field; a response whose indices do not cover
the batch exactly fails as a whole (``"wrong count"``) rather than risk giving a prompt someone
else's answer. What the caller made of each answer is reported back with
:meth:`LLMClient.record_parse` (the ``unparsable`` counters and each server's
``labels_per_s``).

Metrics (:meth:`LLMClient.metrics`, counts since the start):

=======================  ===============================================================
``requests_sent``        HTTP requests sent
``requests_unsent``      requests refused without sending: no server usable (breaker open)
``server_errors``        HTTP 5xx and 429 answers
``timeouts``             requests past their time limit
``connection_errors``    requests that could not connect or lost the connection
``bad_answers``          answers that were not JSON or had the wrong choices
``auth_errors``          HTTP 401/403 answers
``rejected``             other HTTP 4xx answers (the request itself is wrong)
``unparsable``           captions whose answer held no label
``timeout_s``            the current time limit of a full request (largest over servers)
``request_batch``        the current prompts per request (largest over servers)
``concurrency``          the current requests in flight allowed (sum over servers)
``servers_up``           servers taking requests (breaker closed or half-open)
``server/<i>/...``       per server ``i`` (order of ``base_url``): ``up``, ``requests``,
                         ``errors``, ``in_flight``, ``latency_s`` (median), ``labels_per_s``
                         (last minute), ``batch``, ``concurrency``, ``timeout_s``
=======================  ===============================================================

Example:
    >>> from torchrl_oni.annotators.client import LLMClient
    >>> client = LLMClient(["gpu-1:8000", "gpu-2:8000"], "m", api="chat")
    >>> client.base_urls, client.metrics()["servers_up"]
    (['http://gpu-1:8000/v1', 'http://gpu-2:8000/v1'], 2.0)
    >>> LLMClient("ftp://x", "m")
    Traceback (most recent call last):
    ...
    ValueError: invalid LLM server URL 'ftp://x': expected http(s)://host:port[/v1]
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import random
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

import aiohttp

from torchrl_oni.annotators import prompts as P
from torchrl_oni.annotators._pool import _BREAKER_CATEGORIES, _PoolMethods
from torchrl_oni.annotators.base import AnnotatorStats
from torchrl_oni.annotators.endpoints import (
    API_KEY_ENV,
    AUTH_ERROR,
    AnnotatorUnavailable,  # noqa: F401 - importable from here too (CHANGELOG), raised by check()
    _as_url_list,
    _auth_headers,
    _Endpoint,
    _one_line,
)
from torchrl_oni.annotators.pacing import CircuitBreaker, RequestSizer

__all__ = ["CIRCUIT_OPEN", "Completion", "LLMClient", "LLMClientFacade", "client_attribute"]

logger = logging.getLogger(__name__)

CIRCUIT_OPEN = "circuit open"


class _RequestFailed(Exception):
    def __init__(self, kind: str, detail: str = "", retryable: bool = True,
                 category: str = "server") -> None:
        super().__init__(kind)
        self.kind = kind
        self.detail = detail
        self.retryable = retryable
        self.category = category


class Completion:
    """One prompt's answer from :meth:`LLMClient.complete`: its text, or why there is none.

    Attributes:
        text: the model's answer (``""`` when the request failed).
        error: ``None``, or why no answer came after the retries: ``"timeout"``, ``"connection
            error"``, ``"http 500"``, ``"circuit open"`` (refused without sending: no server
            usable), ``"server refused the API key (HTTP 401)"``, ``"malformed json"``,
            ``"wrong count"``, ... (all server reasons: never the prompt's fault).
        positions: with ``logprobs=True``, the answer's tokens and their top alternatives,
            ``[(token, {token: logprob, ...}), ...]``; else ``None``.
        endpoint: the server that answered (for :meth:`LLMClient.record_parse`).

    Example:
        >>> Completion("- kill the newt").ok, Completion(error="timeout").ok
        (True, False)
    """

    __slots__ = ("text", "positions", "error", "endpoint")

    def __init__(self, text: str = "", positions=None, error: Optional[str] = None,
                 endpoint: Optional[_Endpoint] = None) -> None:
        self.text = text
        self.positions = positions
        self.error = error
        self.endpoint = endpoint

    @property
    def ok(self) -> bool:
        return self.error is None

    def __repr__(self) -> str:
        return f"Completion(text={self.text!r}, error={self.error!r})"


class LLMClient(_PoolMethods):
    """Sends chat prompts to one or several OpenAI-compatible HTTP servers (aiohttp, async,
    fault tolerant, adapting to each server's latency; see the module docstring).

    Args:
        base_url: the server, e.g. ``http://gpu-node:9001/v1`` (``host:port`` is accepted), or
            a list of servers that all serve ``model`` (a pool).
        model: the served model name (see :func:`~torchrl_oni.annotators.endpoints.resolve_model`);
            ``None``: the only model the servers serve, found by :meth:`check` (which must then be
            awaited first).
        api: ``"completions"`` (batched prompts) or ``"chat"`` (one request per prompt).
        batch_size: most prompts per ``/v1/completions`` request (ONI sent 100).
        max_concurrency: most requests in flight, per server.
        timeout_s: a fixed time limit per request; ``None`` (default) adapts it to the latency
            each server shows.
        adaptive: adapt prompts per request and requests in flight (default). If False, every
            request carries ``batch_size`` prompts and ``max_concurrency`` are in flight.
        initial_batch_size: prompts per request before a server has answered.
        target_latency_s: the request latency the adaptive batch aims at.
        min_timeout_s, max_timeout_s: bounds of the adaptive time limit.
        first_timeout_s: the adaptive time limit before a server has answered.
        max_retries: extra attempts for a failed request within one call.
        backoff_s: first retry delay; doubles per attempt (with jitter) up to ``max_backoff_s``.
        max_backoff_s: longest retry delay.
        top_logprobs: how many alternatives per token to ask for when logprobs are asked for.
        temperature: the sampling temperature of :meth:`complete` unless it is given one.
        max_tokens: the answer length limit of :meth:`complete` unless it is given one
            (``None``: 512).
        text_style: how ``/v1/completions`` prompts are laid out: ``"plain"`` or ``"llama-3"``;
            ``None`` picks ``"llama-3"`` when the model name says so.
        api_key: sent as ``Authorization: Bearer KEY``; ``None`` reads ``OPENAI_API_KEY`` (no
            header when unset or empty).
        circuit_failures: consecutive failed requests that take a server out.
        circuit_cooldown_s: how long before a server that is out gets a request again anyway.
        probe_interval_s: how often a server that is out is health-checked (``GET /v1/models``).
        clock: monotonic time source (tests).

    Attributes:
        stats: request counters (and, through :meth:`record_parse`, what callers made of the
            answers).
        recoveries: servers that were out and answered again; the workers then requeue the
            items that failed meanwhile.

    Raises:
        ValueError: for an invalid URL or option (one-line message).
    """

    def __init__(
        self,
        base_url: Union[str, Sequence[str]],
        model: Optional[str],
        *,
        api: str = "completions",
        batch_size: int = 100,
        max_concurrency: int = 4,
        timeout_s: Optional[float] = None,
        adaptive: bool = True,
        initial_batch_size: int = 4,
        target_latency_s: float = 10.0,
        min_timeout_s: float = 30.0,
        max_timeout_s: float = 600.0,
        first_timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        top_logprobs: int = 5,
        temperature: float = 0.1,
        max_tokens: Optional[int] = None,
        text_style: Optional[str] = None,
        api_key: Optional[str] = None,
        circuit_failures: int = 5,
        circuit_cooldown_s: float = 30.0,
        probe_interval_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base_urls = _as_url_list(base_url)
        self.base_url = self.base_urls[0]
        if model is not None and not model:
            raise ValueError("model name is empty: pass the name the server lists at /v1/models")
        if api not in ("completions", "chat"):
            raise ValueError(f"unknown api {api!r}; choose 'completions' or 'chat'")
        if batch_size < 1 or max_concurrency < 1 or max_retries < 0 or (
                timeout_s is not None and timeout_s <= 0):
            raise ValueError("batch_size and max_concurrency must be >= 1, max_retries >= 0, "
                             "timeout_s > 0")
        self.api = api
        self.batch_size = int(batch_size)
        self.max_concurrency = int(max_concurrency)
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.probe_interval_s = float(probe_interval_s)
        self.top_logprobs = int(top_logprobs)
        self.temperature = float(temperature)
        self.max_tokens = max_tokens
        self._auto_style = text_style is None
        self.text_style = text_style or P.default_text_style(model or "")
        P.render_text([], self.text_style)  # validates the style
        self.api_key = api_key
        self._headers = _auth_headers(api_key)
        self._clock = clock
        self._created = clock()
        per_request = self.batch_size if api == "completions" else 1
        self._endpoints = [
            _Endpoint(
                i, url,
                RequestSizer(per_request, self.max_concurrency, adaptive=adaptive,
                             initial_batch=initial_batch_size, target_latency_s=target_latency_s,
                             timeout_s=timeout_s, min_timeout_s=min_timeout_s,
                             max_timeout_s=max_timeout_s, first_timeout_s=first_timeout_s),
                CircuitBreaker(circuit_failures, circuit_cooldown_s, clock=clock),
                clock,
            )
            for i, url in enumerate(self.base_urls)
        ]
        self.stats = AnnotatorStats()
        self._set_model(model)
        # Counters are written on the event loop's thread and read by metrics() from another.
        self._lock = threading.Lock()
        self._unsent = 0
        self._events: Deque[Tuple[float, str, int]] = collections.deque(maxlen=8192)
        self._auth_logged = False
        # Servers that were out and answered again; the worker then requeues the captions that
        # failed meanwhile.
        self.recoveries = 0
        self._session: Optional[aiohttp.ClientSession] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._waiters: List[asyncio.Future] = []

    def _set_model(self, model: Optional[str]) -> None:
        self.model = model
        if self._auto_style:
            self.text_style = P.default_text_style(model or "")

    @property
    def breaker(self) -> CircuitBreaker:
        """The first server's circuit breaker (the only one without a pool)."""
        return self._endpoints[0].breaker

    # ------------------------------------------------------------------ session management
    def _ensure_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # A session belongs to one event loop; a new loop (e.g. another asyncio.run) gets
            # its own session, and the old one is dropped without awaiting.
            if self._session is not None and not self._session.closed:
                self._drop_session(self._session, self._loop)
            self._session = aiohttp.ClientSession(headers=self._headers,
                                                  timeout=aiohttp.ClientTimeout(total=None))
            self._loop = loop
            self._waiters = []
            for ep in self._endpoints:
                ep.probe_task = None  # tasks of an old loop are gone with it
        return self._session

    @staticmethod
    def _drop_session(session: aiohttp.ClientSession, loop) -> None:
        """Releases a session that belongs to another event loop (it cannot be awaited here)."""
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(session.close(), loop)
            return
        connector = session.connector
        session.detach()
        # The loop is closed: only aiohttp's synchronous bookkeeping is left to do.
        close_now = getattr(connector, "_close", None)
        if callable(close_now):
            try:
                close_now()
            except Exception:  # noqa: BLE001 - best effort on a dead loop
                pass

    async def aclose(self) -> None:
        """Closes the HTTP session and its connections: requests still in flight are abandoned
        and the servers see the client go (ours then stop working on them). Safe to call twice,
        and from another event loop."""
        running = asyncio.get_running_loop()
        for ep in self._endpoints:
            task, ep.probe_task = ep.probe_task, None
            if task is not None and not task.done() and self._loop is running:
                task.cancel()
        session, self._session = self._session, None
        if session is None or session.closed:
            return
        if self._loop is running:
            await session.close()
        else:
            self._drop_session(session, self._loop)

    async def __aenter__(self) -> "LLMClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ one HTTP request
    async def _post(self, ep: _Endpoint, path: str, payload: Dict[str, Any], n: int) -> Dict[str, Any]:
        session = self._ensure_session()
        limit = ep.sizer.timeout(n)
        self.stats.requests += 1
        self._event("sent", 1, ep)
        start = self._clock()
        try:
            async with session.post(
                f"{ep.url}{path}", json=payload,
                timeout=aiohttp.ClientTimeout(total=limit, sock_connect=min(limit, 10.0)),
            ) as resp:
                status = resp.status
                body = await resp.read()
        except aiohttp.ConnectionTimeoutError as err:
            raise _RequestFailed("connection error", type(err).__name__, category="connection") from None
        except asyncio.TimeoutError:
            ep.sizer.record_timeout(n, limit)
            raise _RequestFailed("timeout", f"no answer within {limit:.3g} s", category="timeout") from None
        except aiohttp.ClientError as err:
            raise _RequestFailed("connection error", type(err).__name__, category="connection") from None
        finally:
            self.stats.latency_s_total += self._clock() - start
        latency = self._clock() - start
        if status in (401, 403):
            raise _RequestFailed(f"{AUTH_ERROR} (HTTP {status})", retryable=False, category="auth")
        if status == 429 or status >= 500:
            raise _RequestFailed(f"http {status}", category="server")
        if status >= 400:
            # The request itself is wrong (unknown model, bad parameter): retrying cannot help.
            detail = _one_line(body[:200].decode("utf-8", "replace"))
            raise _RequestFailed(f"http {status}", detail, retryable=False, category="rejected")
        try:
            data = json.loads(body)
        except ValueError:
            raise _RequestFailed("malformed json", category="bad_answer") from None
        if not isinstance(data, dict):
            raise _RequestFailed("malformed json", category="bad_answer")
        ep.sizer.record_answer(n, latency)
        return data

    def _choices_by_index(self, data: Dict[str, Any], n: int) -> List[Dict[str, Any]]:
        choices = data.get("choices")
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise _RequestFailed("malformed json", category="bad_answer")
        if len(choices) != n:
            raise _RequestFailed("wrong count", f"{len(choices)} choices for {n} prompts",
                                 category="bad_answer")
        out: List[Optional[Dict[str, Any]]] = [None] * n
        for pos, choice in enumerate(choices):
            index = choice.get("index", pos if n == 1 else None)
            if not isinstance(index, int) or not 0 <= index < n or out[index] is not None:
                raise _RequestFailed("wrong count", f"bad choice index {index!r}", category="bad_answer")
            out[index] = choice
        return out  # type: ignore[return-value]

    def _count_failure(self, failure: _RequestFailed, ep: Optional[_Endpoint]) -> None:
        self.stats.count_error(failure.kind)
        if failure.category == "timeout":
            self.stats.timeouts += 1
        elif failure.category in ("server", "connection", "bad_answer"):
            self.stats.server_errors += 1
        self._event(failure.category, 1, ep)
        if ep is None:
            return
        ep.last_error = f"{failure.kind} {failure.detail}".strip()
        if failure.category == "auth" and not self._auth_logged:
            self._auth_logged = True
            logger.error("LLM server at %s %s (HTTP 401/403): set --llm-api-key or %s", ep.url,
                         AUTH_ERROR, API_KEY_ENV)
        if failure.category in _BREAKER_CATEGORIES:
            was_allowed = ep.breaker.allow()
            ep.breaker.record_failure()
            if was_allowed and not ep.breaker.allow():
                ep.next_probe = self._clock() + self.probe_interval_s
                logger.warning("LLM server at %s taken out after %d failed requests in a row "
                               "(last: %s); checking it every %g s", ep.url, ep.breaker.consecutive,
                               ep.last_error, self.probe_interval_s)

    def _count_success(self, ep: _Endpoint) -> None:
        self._event("ok", 1, ep)
        if ep.breaker.consecutive >= ep.breaker.failures:
            self.recoveries += 1
            logger.warning("LLM server at %s answers again", ep.url)
        ep.breaker.record_success()
        ep.last_error = ""

    async def _send(self, ep: _Endpoint, conversations, options: Dict[str, Any], answers,
                    chunk: List[int]) -> Optional[_RequestFailed]:
        """One request for ``chunk``; fills ``answers`` on success, returns the failure if any."""
        path = "/completions" if self.api == "completions" else "/chat/completions"
        try:
            data = await self._post(ep, path, self._payload([conversations[i] for i in chunk], **options),
                                    len(chunk))
            choices = self._choices_by_index(data, len(chunk))
        except _RequestFailed as failure:
            self._count_failure(failure, ep)
            return failure
        self._count_success(ep)
        for i, choice in zip(chunk, choices):
            try:
                text, positions = self._text_and_positions(choice)
                answers[i] = Completion(text, positions, endpoint=ep)
            except _RequestFailed as failure:
                self.stats.count_error(failure.kind)
                answers[i] = Completion(error=failure.kind)
        return None

    async def complete(
        self,
        conversations: Sequence[List[Dict[str, str]]],
        *,
        stop: Optional[List[str]] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        logprobs: bool = False,
    ) -> List[Completion]:
        """Sends chat prompts to the servers; one :class:`Completion` per prompt, in order.

        For prompts of any kind (the labels of
        :class:`~torchrl_oni.annotators.openai.OpenAIAnnotator`, ELLM's goals of
        :class:`~torchrl_oni.annotators.goals.OpenAIGoalSuggester`): requests go to the least
        loaded usable server of the pool, sized by its :class:`RequestSizer`
        (``api="completions"``: several prompts per request, rendered in ``text_style``;
        ``"chat"``: one each), with its adaptive time limit; server faults are retried with
        backoff on another server, then returned as ``error`` (never raised); a request that
        finds no usable server is refused at once (``"circuit open"``). Parse the
        texts yourself and report each outcome with :meth:`record_parse`.

        Args:
            conversations: the chat messages of each prompt (``[{"role": ..., "content": ...}]``).
            stop: stop strings (``None``: none).
            max_tokens: answer length limit (``None``: the client's ``max_tokens``, else 512).
            temperature: ``None``: the client's.
            logprobs: ask for the top ``top_logprobs`` token logprobs (``Completion.positions``).
        """
        n = len(conversations)
        if not n:
            return []
        if self.model is None:
            return [Completion(error="no model: await check() first") for _ in range(n)]
        options = {"stop": stop, "temperature": self.temperature if temperature is None else float(temperature),
                   "max_tokens": int(max_tokens if max_tokens is not None else self.max_tokens or 512),
                   "logprobs": bool(logprobs)}
        answers: List[Optional[Completion]] = [None] * n
        self._ensure_session()
        queue: Deque[int] = collections.deque(range(n))
        tries = [0] * n

        async def runner() -> None:
            avoid: Optional[_Endpoint] = None
            while queue:
                ep = await self._acquire(avoid)
                if ep is None:  # no server usable: refuse the rest at once, nothing is sent
                    refused = list(queue)
                    queue.clear()
                    per_request = max(1, self.batch_hint())
                    requests = -(-len(refused) // per_request)
                    self._event("unsent", requests)
                    for _ in range(requests):
                        self.stats.count_error(CIRCUIT_OPEN)
                    for i in refused:
                        answers[i] = Completion(error=CIRCUIT_OPEN)
                    return
                if not queue:
                    self._release(ep)
                    return
                chunk = [queue.popleft() for _ in range(min(ep.sizer.batch, len(queue)))]
                try:
                    failure = await self._send(ep, conversations, options, answers, chunk)
                except asyncio.CancelledError:
                    raise
                except Exception as err:  # noqa: BLE001 - a bug in one request must not kill the worker
                    kind = f"client error: {type(err).__name__}"
                    self.stats.count_error(kind)
                    failure = _RequestFailed(kind, retryable=False, category="client")
                finally:
                    self._release(ep)
                if failure is None:
                    avoid = None
                    continue
                retry = []
                for i in chunk:
                    tries[i] += 1
                    if failure.retryable and tries[i] <= self.max_retries:
                        retry.append(i)
                    else:
                        answers[i] = Completion(error=failure.kind)
                if retry:
                    queue.extendleft(reversed(retry))  # re-chunked with the server's new size
                    avoid = ep
                    delay = min(self.max_backoff_s, self.backoff_s * 2 ** (tries[retry[0]] - 1))
                    await asyncio.sleep(delay * (0.5 + 0.5 * random.random()))

        runners = min(n, sum(ep.sizer.max_concurrency for ep in self._endpoints))
        await asyncio.gather(*(runner() for _ in range(runners)))
        return answers  # type: ignore[return-value]

    # ------------------------------------------------------------------ prompts → payloads
    def _payload(self, conversations: Sequence[List[Dict[str, str]]], *, stop: Optional[List[str]],
                 temperature: float, max_tokens: int, logprobs: bool) -> Dict[str, Any]:
        payload: Dict[str, Any] = {"model": self.model, "temperature": temperature, "max_tokens": max_tokens}
        if stop:
            payload["stop"] = stop
        if self.api == "completions":
            payload["prompt"] = [P.render_text(c, self.text_style) for c in conversations]
            if logprobs:
                payload["logprobs"] = self.top_logprobs
        else:
            payload["messages"] = conversations[0]
            if logprobs:
                payload["logprobs"] = True
                payload["top_logprobs"] = self.top_logprobs
        return payload

    @staticmethod
    def _text_and_positions(choice: Dict[str, Any]) -> Tuple[str, Optional[list]]:
        if "message" in choice:
            message = choice.get("message") or {}
            text = message.get("content") if isinstance(message, dict) else None
        else:
            text = choice.get("text")
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise _RequestFailed("malformed json")
        positions = None
        logprobs = choice.get("logprobs")
        try:
            if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
                positions = []
                for entry in logprobs["content"]:
                    top = {t["token"]: float(t["logprob"]) for t in entry.get("top_logprobs") or []}
                    top.setdefault(entry["token"], float(entry["logprob"]))
                    positions.append((entry["token"], top))
            elif isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
                tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
                positions = [
                    (tok, {k: float(v) for k, v in (top or {}).items()})
                    for tok, top in zip(logprobs["tokens"], tops)
                ]
        except (KeyError, TypeError, ValueError):
            positions = None  # a server's odd logprob layout must not cost us the label
        return text, positions

    # ------------------------------------------------------------------ callers' verdicts
    def record_parse(self, parsed: bool, completion: Optional[Completion] = None) -> None:
        """Counts what the caller made of an answer of :meth:`complete`: a usable result
        (``stats.labelled``, and the answering server's ``labels_per_s``) or an unparsable one
        (``stats.unparsable``, ``metrics()["unparsable"]``, ``recent()["unparsable"]``: the
        health summary's "answers cannot be parsed"). Thread-safe for the metrics it feeds."""
        if not parsed:
            self.stats.unparsable += 1
            self.stats.count_error("unparsable")
            self._event("unparsable")
            return
        self.stats.labelled += 1
        if completion is not None and completion.endpoint is not None:
            with self._lock:
                completion.endpoint.labels.add(1)


def client_attribute(name: str, doc: str) -> property:
    """A read-only attribute that is ``self.client``'s: one place holds each setting."""
    return property(lambda self: getattr(self.client, name), doc=doc)


class LLMClientFacade:
    """The side of an :class:`LLMClient` (held in ``self.client``) that the background workers
    steer and report from, forwarded: for the classes that turn its answers into something
    (:class:`~torchrl_oni.annotators.openai.OpenAIAnnotator`,
    :class:`~torchrl_oni.annotators.goals.OpenAIGoalSuggester`).
    """

    client: LLMClient

    base_url = client_attribute("base_url", "The first server's URL.")
    base_urls = client_attribute("base_urls", "Every server's URL (a pool has several).")
    model = client_attribute("model", "The served model (``None`` until :meth:`check` finds it).")
    api = client_attribute("api", "``\"completions\"`` or ``\"chat\"``.")
    stats = client_attribute("stats", "Request and answer counters (``labelled``: usable answers).")
    recoveries = client_attribute(
        "recoveries", "Servers that were out and answered again (the workers then requeue).")

    async def check(self) -> List[str]:
        """Lists the served models; fails clearly if no server can be used
        (:meth:`LLMClient.check`; with ``model=None`` the only served model is chosen).

        Raises:
            AnnotatorUnavailable: one-line reason (unreachable, refused API key, not
                OpenAI-compatible, unknown model with the served names).
        """
        return await self.client.check()

    async def aclose(self) -> None:
        """Closes the client's HTTP session (requests in flight are abandoned); safe to call
        twice, and from another event loop."""
        await self.client.aclose()

    def available(self) -> bool:
        """True when a request could be sent now (:meth:`LLMClient.available`)."""
        return self.client.available()

    def batch_hint(self) -> int:
        """Items per call that make one request on the next server to use."""
        return self.client.batch_hint()

    def concurrency_hint(self) -> int:
        """How many calls in flight keep the usable servers busy."""
        return self.client.concurrency_hint()

    def metrics(self) -> Dict[str, float]:
        """The client's counters and request sizing (see the module docstring)."""
        return self.client.metrics()

    def recent(self, window_s: float = 60.0) -> Dict[str, int]:
        """Requests by outcome over the last ``window_s`` seconds (:meth:`LLMClient.recent`)."""
        return self.client.recent(window_s)

    def servers(self) -> List[Tuple[str, bool, str]]:
        """``(url, up, last_error)`` of each server (:meth:`LLMClient.servers`)."""
        return self.client.servers()

    def describe(self) -> str:
        """One line on the servers' state; empty when every server is up."""
        return self.client.describe()
