"""The OpenAI-compatible HTTP protocol of the embedded server: the aiohttp app around an engine.

Routes: ``GET /v1/models``, ``POST /v1/completions`` (``prompt`` a string or a list: one choice
per prompt, ``index`` = its position), ``POST /v1/chat/completions`` (one conversation), and
``GET /health``. ``logprobs`` follows the OpenAI formats: for completions an integer ``k`` gives
``tokens`` / ``token_logprobs`` / ``top_logprobs`` (one ``{token: logprob}`` per generated token);
for chat ``logprobs: true`` + ``top_logprobs: k`` gives ``logprobs.content``. Errors are JSON
``{"error": {"message", "type", "code"}}`` with a 4xx status for bad requests.

Requests that arrive together with the same sampling settings are merged into one batch. One
worker thread runs the engine (:mod:`torchrl_oni.serve.engines`), so the event loop stays
responsive.

Facing clients (see :class:`OpenAIServer`; the checks made before any work are
:class:`ClientGuard`'s, shared with the front of vLLM in :mod:`torchrl_oni.serve.proxy`): an
optional API key (``Authorization: Bearer``, required by :func:`~torchrl_oni.net.check_exposure`
on any non-loopback address), without a key a ``Host`` header that names this server (DNS
rebinding), POSTs that are JSON (cross-site forms), a bounded queue
(503 + ``Retry-After``), the work of disconnected clients dropped, read timeouts for request
heads and bodies (408), a body-size limit (413), prompt-size limits checked before and after
tokenising, and every field validated (finite numbers in range): whatever a client sends, the
answer is a 4xx JSON error rather than a 500.

:class:`~torchrl_oni.serve.embedded.ServerHandle` serves the application from a thread.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hmac
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from aiohttp import web

from torchrl_oni.net import ConnectionWatch, HostCheck, post_refusal
from torchrl_oni.serve.engines import Completion

__all__ = [
    "OpenAIServer",
    "ClientGuard",
    "RequestError",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_READ_TIMEOUT",
    "DEFAULT_MAX_BODY_BYTES",
]


DEFAULT_MAX_QUEUE = 64
DEFAULT_READ_TIMEOUT = 30.0
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_TOKENS_LIMIT = 1 << 20  # any larger max_tokens is a client bug (the engine caps it anyway)
MAX_STOPS = 16


class RequestError(Exception):
    """A client error, answered with a 4xx JSON body."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers



def _error(status: int, message: str, param: Optional[str] = None,
           code: Optional[str] = None, headers: Optional[Dict[str, str]] = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status=status, headers=headers,
    )


class _NonFinite:
    """A JSON ``NaN``/``Infinity`` (or a number that overflows a float), kept as its text so that
    validation rejects it with the field's name instead of computing with it."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _parse_float(text: str):
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _loads(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError("request body is not UTF-8 text") from None
    try:
        return json.loads(text, parse_constant=_NonFinite, parse_float=_parse_float)
    except RecursionError:
        raise RequestError("request body is not valid JSON (nested too deeply)") from None
    except ValueError as err:  # JSONDecodeError, or an integer of more than 4300 digits
        raise RequestError(f"request body is not valid JSON ({err})") from None


def _number(body: dict, key: str, default, kind=float, lo=None, hi=None):
    """``body[key]`` as a finite ``kind`` in ``[lo, hi]`` (``default`` when absent or null)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, _NonFinite):
        raise RequestError(f"'{key}' must be a finite number, not {value!r}", param=key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{key}' must be a number", param=key)
    if kind is int and isinstance(value, float):
        if not value.is_integer():
            raise RequestError(f"'{key}' must be an integer", param=key)
        value = int(value)
    # Compared before converting: a huge integer would overflow float().
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = (f"between {lo} and {hi}" if lo is not None and hi is not None
                  else f"at least {lo}" if lo is not None else f"at most {hi}")
        raise RequestError(f"'{key}' must be {bounds}", param=key)
    return kind(value)


def _utf8_len(text: str, param: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise RequestError(f"'{param}' is not valid Unicode (it holds a lone surrogate)",
                           param=param) from None


def _stops(body: dict) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= MAX_STOPS
            and all(isinstance(s, str) for s in stops)):
        raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOPS} strings",
                           param="stop")
    for s in stops:
        _utf8_len(s, "stop")
    return stops


class ClientGuard:
    """What every route of an ``oni-serve`` server checks before any work, answered as OpenAI-style
    JSON errors; the embedded server (:class:`OpenAIServer`) and the front of vLLM
    (:class:`~torchrl_oni.serve.proxy.GuardedProxy`) share it.

    In order:

    * ``Host`` (403, ``host_not_allowed``): without an API key, or when ``allowed_hosts`` is given,
      the header must name a loopback host, the bound address or one of ``allowed_hosts``
      (:class:`~torchrl_oni.net.HostCheck`; ``"*"`` accepts any). With a key the key is the gate
      (a rebinding page cannot send it) and clients may use any name for the server.
    * API key (401, ``invalid_api_key``): ``Authorization: Bearer <key>`` on every route but
      ``open_paths``.
    * POST (415 / 403): ``Content-Type: application/json`` from the same origin, key or no key
      (:func:`~torchrl_oni.net.post_refusal`).
    * size (413): a ``Content-Length`` over ``max_body_bytes`` before reading;
      :meth:`read_body` reads within ``read_timeout`` (408) and ``max_body_bytes`` (chunked).
    * connections: :meth:`watch` closes those that hold a half-sent request head, or sit idle,
      for ``read_timeout`` seconds (:class:`~torchrl_oni.net.ConnectionWatch`).

    Example:
        >>> guard = ClientGuard(api_key=None, host="127.0.0.1")
        >>> guard.hosts("attacker.example:8000"), guard.hosts("localhost:8000")
        (False, True)
        >>> ClientGuard(api_key="k", host="0.0.0.0").hosts is None  # the key is the gate
        True
    """

    def __init__(self, api_key: Optional[str] = None, *, host: str = "127.0.0.1",
                 allowed_hosts: Sequence[str] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 read_timeout: float = DEFAULT_READ_TIMEOUT, open_paths: Sequence[str] = ("/health",)) -> None:
        if not read_timeout > 0 or max_body_bytes < 1:
            raise ValueError("read_timeout and max_body_bytes must be positive")
        self.api_key = api_key or None
        self._key = self.api_key.encode("utf-8") if self.api_key else None
        self.allowed_hosts = tuple(allowed_hosts)
        self.max_body_bytes = int(max_body_bytes)
        self.read_timeout = float(read_timeout)
        self.open_paths = tuple(open_paths)
        self.hosts: Optional[HostCheck] = None
        self.serve_on(host)
        self.connections = ConnectionWatch(self.read_timeout)

    def serve_on(self, host: str) -> None:
        """Sets the bound address (accepted as a ``Host``, with loopback names and ``allowed_hosts``)."""
        self.host = host
        self.hosts = HostCheck(host, self.allowed_hosts) if (self._key is None or self.allowed_hosts) else None

    def middleware(self):
        """An aiohttp middleware: the checks, then the handler; every failure a JSON error (a
        :class:`RequestError` its status, the router's 404/405 theirs, anything else 500)."""

        @web.middleware
        async def guard(request: web.Request, handler):
            conn = request.protocol
            self.connections.enter(conn)
            try:
                self.check(request)
                return await handler(request)
            except RequestError as err:
                return _error(err.status, str(err), err.param, err.code, err.headers)
            except web.HTTPException as err:  # the router's 404 / 405
                return _error(err.status, f"{err.reason}: {request.method} {request.path}")
            except Exception as err:  # an engine failure: a JSON 500, the server keeps running
                return _error(500, f"{type(err).__name__}: {err}")
            finally:
                self.connections.leave(conn)

        return guard

    def check(self, request: web.Request) -> None:
        """Raises :class:`RequestError` for a request refused before any work."""
        if self.hosts is not None and not self.hosts(request.host):
            shown = (request.headers.get("Host") or "")[:80]
            raise RequestError(f"unexpected Host header {shown!r}: this server answers to {self.hosts.describe()} "
                               f"(oni-serve --allowed-host NAME adds a name)", status=403, code="host_not_allowed")
        self.authorize(request)
        refused = post_refusal(request)
        if refused is not None:
            status, reason = refused
            raise RequestError(reason, status=status,
                               code="unsupported_media_type" if status == 415 else "cross_origin")
        size = request.content_length
        if size is not None and size > self.max_body_bytes:
            raise self.too_large(size)

    def authorize(self, request: web.Request) -> None:
        if self._key is None or request.path in self.open_paths:
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer" and hmac.compare_digest(
                token.encode("utf-8", "replace"), self._key):
            return
        problem = "incorrect API key" if token else "no API key"
        raise RequestError(
            f"{problem}: this server needs 'Authorization: Bearer <key>' with its key "
            "(OPENAI_API_KEY for OpenAI clients)", status=401, code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"})

    def too_large(self, size: Optional[int] = None) -> RequestError:
        what = f"request body of {size} bytes" if size is not None else "request body"
        return RequestError(f"{what} exceeds this server's limit of {self.max_body_bytes} bytes",
                            status=413, code="request_too_large")

    async def read_body(self, request: web.Request) -> bytes:
        """The request body, read within ``read_timeout`` (408) and ``max_body_bytes`` (413; the
        app must be made with ``client_max_size=max_body_bytes``)."""
        try:
            return await asyncio.wait_for(request.read(), self.read_timeout)
        except asyncio.TimeoutError:
            raise RequestError(f"request body not received within {self.read_timeout:g} s",
                               status=408, code="timeout") from None
        except web.HTTPRequestEntityTooLarge:  # no Content-Length (chunked): found while reading
            raise self.too_large() from None

    async def watch(self, server: web.Server) -> None:
        """Closes connections that hold no request in progress for ``read_timeout`` seconds (run
        on the server's loop with its runner's ``server``, until cancelled)."""
        await self.connections.watch(server)


@dataclass
class _Job:
    prompts: List[str]
    key: Tuple
    future: asyncio.Future


class OpenAIServer:
    """The aiohttp application around an engine (``complete`` + ``render_chat``).

    Concurrent requests with the same settings are merged into one engine call (up to
    ``max_batch`` prompts); the engine runs in one worker thread.

    Protection against clients (every refusal is an OpenAI-style JSON error, never a 500):

    * ``api_key``: every route but ``/health`` needs ``Authorization: Bearer <key>`` (401,
      ``code: "invalid_api_key"``, otherwise).
    * without a key, the ``Host`` header must name this server: a loopback name, the bound
      address (``host``, which :class:`~torchrl_oni.serve.embedded.ServerHandle` sets) or one of
      ``allowed_hosts`` (403); POSTs must be JSON from the same origin (415 / 403), key or no key
      (:class:`ClientGuard`).
    * at most ``max_queue`` requests wait for the engine; more get 503 with ``Retry-After``.
    * a request whose client disconnects leaves the queue at once; its prompts are skipped or
      dropped from the running batch at the engine's next step (the runner must be made with
      ``handler_cancellation=True``, as
      :class:`~torchrl_oni.serve.embedded.ServerHandle` does).
    * a body larger than ``max_body_bytes`` gets 413 (from ``Content-Length`` before reading);
      a body not received within ``read_timeout`` seconds gets 408; :meth:`watch_connections`
      closes connections that hold a half-sent request head (or sit idle) that long.
    * a prompt longer than ``max_prompt_bytes`` gets 400 before it is tokenised, one whose
      tokens do not fit the model's context gets 400 after; numbers must be finite and in
      range (JSON ``NaN``/``Infinity`` are refused naming the field).

    Args:
        engine: a :class:`~torchrl_oni.serve.engines.TransformersEngine` or
            :class:`~torchrl_oni.serve.engines.ScriptedEngine`.
        served_name: the model name to list and accept (default: the engine's).
        max_batch: the most prompts merged into one engine call.
        max_prompts: the most prompts one request may carry.
        api_key: the key clients must send; None or ``""`` checks none.
        max_queue: the most requests waiting for the engine (the running batch not counted).
        read_timeout: seconds a client may take to send a request (head, then body).
        max_body_bytes: the largest request body accepted.
        max_prompt_bytes: the longest prompt accepted, in UTF-8 bytes (default: the engine's
            ``max_prompt_bytes``; None: no limit but the body's).
        host: the address the server binds (accepted as a ``Host`` header).
        allowed_hosts: further ``Host`` names accepted (``"*"``: any); given, they are checked
            with a key too.
    """

    def __init__(self, engine, served_name: Optional[str] = None, max_batch: int = 64,
                 max_prompts: int = 1024, *, api_key: Optional[str] = None,
                 max_queue: int = DEFAULT_MAX_QUEUE, read_timeout: float = DEFAULT_READ_TIMEOUT,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 max_prompt_bytes: Optional[int] = None, host: str = "127.0.0.1",
                 allowed_hosts: Sequence[str] = ()) -> None:
        if max_queue < 1 or not read_timeout > 0 or max_body_bytes < 1:
            raise ValueError("max_queue, read_timeout and max_body_bytes must be positive")
        self.guard = ClientGuard(api_key, host=host, allowed_hosts=allowed_hosts,
                                 max_body_bytes=max_body_bytes, read_timeout=read_timeout)
        self.engine = engine
        self.model = served_name or engine.model_name
        self.accepted = {self.model, engine.model_name}
        self.max_batch = max_batch
        self.max_prompts = max_prompts
        self.api_key = api_key or None
        self.max_queue = int(max_queue)
        self.read_timeout = float(read_timeout)
        self.max_body_bytes = int(max_body_bytes)
        self.max_prompt_bytes = (max_prompt_bytes if max_prompt_bytes is not None
                                 else getattr(engine, "max_prompt_bytes", None))
        self.created = int(time.time())
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="oni-engine")
        self.pending: Deque[_Job] = collections.deque()
        self._in_engine: List[_Job] = []
        self._wakeup: Optional[asyncio.Event] = None
        self.worker: Optional[asyncio.Task] = None
        self._prompts_per_s: Optional[float] = None  # running estimate, for Retry-After
        self.stats = {"requests": 0, "prompts": 0, "engine_calls": 0, "cancelled": 0,
                      "aborted_prompts": 0, "busy": 0}

    def serve_on(self, host: str) -> None:
        """Sets the address the server binds (:class:`ClientGuard`'s ``Host`` check accepts it)."""
        self.guard.serve_on(host)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self.guard.middleware()])
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._drain)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app) -> None:
        self._wakeup = asyncio.Event()
        self.worker = asyncio.get_running_loop().create_task(self._work())

    async def _drain(self, app) -> None:
        # Shutting down: waiting requests get a 503 now instead of holding the shutdown, and
        # the running batch stops at its next step (its futures are done: ``alive`` is False).
        for job in list(self.pending) + self._in_engine:
            if not job.future.done():
                job.future.set_exception(RequestError("server is shutting down", status=503))
        self.pending.clear()

    async def _stop(self, app) -> None:
        if self.worker is not None:
            self.worker.cancel()
            try:
                await self.worker
            except asyncio.CancelledError:
                pass
        self.executor.shutdown(wait=False, cancel_futures=True)

    # -- the engine queue ----------------------------------------------------------------------
    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            job = self.pending.popleft()
            jobs, total = [job], len(job.prompts)
            for other in list(self.pending):  # merge same-settings jobs that wait, in arrival order
                if other.key == job.key and total + len(other.prompts) <= self.max_batch:
                    jobs.append(other)
                    self.pending.remove(other)
                    total += len(other.prompts)
            prompts = [p for j in jobs for p in j.prompts]
            owners = [j.future for j in jobs for _ in j.prompts]
            # Read from the engine thread between steps: a future is done there only when its
            # request was cancelled (client gone) or failed by a shutdown.
            alive = lambda: [not f.done() for f in owners]  # noqa: E731
            max_tokens, temperature, top, stop, chat = job.key
            if not any(alive()):  # every client left while they were being merged
                self.stats["aborted_prompts"] += len(prompts)
                continue
            self.stats["engine_calls"] += 1
            started = time.monotonic()
            self._in_engine = jobs
            try:
                results = await loop.run_in_executor(
                    self.executor,
                    lambda: self.engine.complete(prompts, max_tokens=max_tokens,
                                                 temperature=temperature, top_logprobs=top,
                                                 stop=list(stop), chat=chat, alive=alive),
                )
            except Exception as err:  # hand the failure to every waiting request
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(err)
                continue
            finally:
                self._in_engine = []
            rate = len(prompts) / max(time.monotonic() - started, 1e-3)
            self._prompts_per_s = rate if self._prompts_per_s is None else (
                0.8 * self._prompts_per_s + 0.2 * rate)
            offset = 0
            for j in jobs:
                part = results[offset:offset + len(j.prompts)]
                offset += len(j.prompts)
                self.stats["aborted_prompts"] += sum(r.finish_reason == "abort" for r in part)
                if j.future.done():
                    continue
                refused = next((r.error for r in part if r.error), None)
                if refused:
                    j.future.set_exception(RequestError(refused, param="prompt",
                                                        code="context_length_exceeded"))
                else:
                    j.future.set_result(part)

    def _retry_after(self) -> int:
        """Seconds until the queue has likely drained (1 to 60), for ``Retry-After``."""
        queued = sum(len(j.prompts) for j in self.pending)
        seconds = queued / self._prompts_per_s if self._prompts_per_s else 1.0
        return int(min(60, max(1, math.ceil(seconds))))

    async def _run(self, prompts: List[str], key: Tuple) -> List[Completion]:
        if len(self.pending) >= self.max_queue:
            self.stats["busy"] += 1
            wait = self._retry_after()
            raise RequestError(
                f"server busy: {len(self.pending)} requests are waiting for the model (the "
                f"most it queues); retry in {wait} s", status=503, code="server_busy",
                headers={"Retry-After": str(wait)})
        job = _Job(prompts, key, asyncio.get_running_loop().create_future())
        self.pending.append(job)
        self._wakeup.set()
        try:
            return await job.future
        except asyncio.CancelledError:  # the client went away (handler cancellation)
            job.future.cancel()
            try:
                self.pending.remove(job)
            except ValueError:  # already taken by the worker: it sees the future cancelled
                pass
            self.stats["cancelled"] += 1
            raise

    # -- connections ---------------------------------------------------------------------------
    async def watch_connections(self, server: web.Server) -> None:
        """Closes connections that hold no request in progress for ``read_timeout`` seconds.

        That covers a request head that never finishes arriving (slowloris), which no handler
        sees, and idle keep-alive connections (:class:`~torchrl_oni.net.ConnectionWatch`). Runs
        until cancelled; :class:`~torchrl_oni.serve.embedded.ServerHandle` starts it with its
        runner's ``server``.
        """
        await self.guard.watch(server)

    # -- handlers ----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model, "queued": len(self.pending),
                                  **self.stats})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": self.created, "owned_by": "torchrl_oni"}
        ]})

    async def _body(self, request: web.Request) -> dict:
        body = _loads(await self.guard.read_body(request))
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError("'model' must be a string", param="model")
        if model is not None and model not in self.accepted:
            raise RequestError(f"model {model!r} is not served here; this server serves "
                               f"{self.model!r}", status=404, param="model",
                               code="model_not_found")
        return body

    def _check_prompt_size(self, size: int, param: str, what: str) -> None:
        limit = self.max_prompt_bytes
        if limit is not None and size > limit:
            context = getattr(self.engine, "max_context", None)
            why = f" (the model's context is {context} tokens)" if context else ""
            raise RequestError(f"{what} is {size} bytes, more than the {limit} bytes this "
                               f"server accepts per prompt{why}", param=param,
                               code="context_length_exceeded")

    def _settings(self, body: dict, top: Optional[int], chat: bool) -> Tuple:
        length_key = ("max_completion_tokens"
                      if chat and body.get("max_completion_tokens") is not None else "max_tokens")
        max_tokens = _number(body, length_key, 16, int, 1, MAX_TOKENS_LIMIT)
        temperature = _number(body, "temperature", 0.0, float, 0.0, 2.0)
        # Accepted and ignored by the engines, but validated like the others.
        _number(body, "top_p", 1.0, float, 0.0, 1.0)
        _number(body, "presence_penalty", 0.0, float, -2.0, 2.0)
        _number(body, "frequency_penalty", 0.0, float, -2.0, 2.0)
        _number(body, "seed", None, int, -(2 ** 63), 2 ** 64 - 1)
        for key in ("n", "best_of"):
            if _number(body, key, 1, int, 1, 128) != 1:
                raise RequestError(f"only {key}=1 is supported", param=key)
        stream = body.get("stream")
        if stream not in (None, False):
            raise RequestError("streaming is not supported" if stream is True
                               else "'stream' must be true or false", param="stream")
        return (max_tokens, temperature, top, tuple(_stops(body)), chat)

    async def completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = prompt
        else:
            raise RequestError("'prompt' must be a string or a non-empty list of strings",
                               param="prompt")
        if len(prompts) > self.max_prompts:
            raise RequestError(f"at most {self.max_prompts} prompts per request", param="prompt")
        for index, text in enumerate(prompts):
            self._check_prompt_size(_utf8_len(text, "prompt"), "prompt", f"prompt {index}")
        top = body.get("logprobs")
        if top is not None:
            top = _number(body, "logprobs", 0, int, 0, 20)
        key = self._settings(body, top, chat=False)
        self.stats["requests"] += 1
        self.stats["prompts"] += len(prompts)
        results = await self._run(prompts, key)
        choices = []
        for index, res in enumerate(results):
            logprobs = None
            if top is not None:
                offsets, pos = [], 0
                for t in res.tokens:
                    offsets.append(pos)
                    pos += len(t)
                logprobs = {
                    "tokens": res.tokens,
                    "token_logprobs": res.token_logprobs,
                    "top_logprobs": [dict(cands) for cands in res.top_logprobs] if top else None,
                    "text_offset": offsets,
                }
            choices.append({"index": index, "text": res.text, "logprobs": logprobs,
                            "finish_reason": res.finish_reason})
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": self.model, "choices": choices,
            "usage": self._usage(results),
        })

    @staticmethod
    def _usage(results: Sequence[Completion]) -> dict:
        prompt = sum(r.prompt_tokens for r in results)
        completion = sum(len(r.tokens) for r in results)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    async def chat_completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages)):
            raise RequestError("'messages' must be a non-empty list of {role, content} objects "
                               "with string content", param="messages")
        size = sum(_utf8_len(m["role"], "messages") + _utf8_len(m["content"], "messages")
                   for m in messages)
        self._check_prompt_size(size, "messages", "the conversation")
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise RequestError("'logprobs' must be true or false", param="logprobs")
        top = None
        if want:
            top = _number(body, "top_logprobs", 0, int, 0, 20)
        key = self._settings(body, top, chat=True)
        try:
            prompt = self.engine.render_chat([{"role": m["role"], "content": m["content"]}
                                              for m in messages])
        except Exception as err:  # e.g. a template that only takes alternating user/assistant
            raise RequestError(f"'messages' do not fit the model's chat template: {err}",
                               param="messages") from None
        self._check_prompt_size(_utf8_len(prompt, "messages"), "messages", "the conversation")
        self.stats["requests"] += 1
        self.stats["prompts"] += 1
        (res,) = await self._run([prompt], key)
        logprobs = None
        if want:
            content = []
            for i, (tok, lp) in enumerate(zip(res.tokens, res.token_logprobs)):
                cands = res.top_logprobs[i] if i < len(res.top_logprobs) else []
                content.append({
                    "token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                    "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
                                     for t, v in cands],
                })
            logprobs = {"content": content}
        return web.json_response({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": res.text},
                         "logprobs": logprobs, "finish_reason": res.finish_reason}],
            "usage": self._usage([res]),
        })
