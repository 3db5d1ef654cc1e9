"""Test doubles shipped with the package: a fault-injecting OpenAI-compatible server.

:class:`FakeLLMServer` (aiohttp, 127.0.0.1, a free port) stands in for an LLM server in the
tests and in ``benchmarks/annotation_faults.py``; it lives in the package so both import it
without putting ``tests/`` on ``sys.path``.

It serves ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``. In
``"ok"`` mode it reads the judged caption(s) out of our prompts and answers in the prompt's
format with :class:`~torchrl_oni.annotators.scripted.ScriptedAnnotator`'s verdict (with token
logprobs when asked), so a client's labels can be checked against known answers.

Modes (set ``server.mode``, or ``server.fail_next(n, mode)`` for the next ``n`` requests only):

=================  =============================================================
``ok``             well-formed answers from the scripted rules
``http500``        HTTP 500
``http429``        HTTP 429 (rate limited)
``hang``           sleeps ``hang_s``, then answers like ``ok`` (set ``hang_s`` past the
                   client's timeout; ``max_in_flight`` records the concurrency seen)
``malformed_json`` HTTP 200 with a body that is not JSON
``no_label``       well-formed JSON whose texts hold no label
``wrong_count``    one choice fewer than prompts
``bad_index``      the right number of choices, all with ``index`` 0
``yes``            well-formed answers calling every caption progress (a mis-prompted judge)
=================  =============================================================

``stop()`` then ``start()`` simulates a server that dies mid-run (connections are refused, and
requests in flight are cut) and comes back on the same port. The server runs in a background
thread with its own event loop (:class:`~torchrl_oni.net.AppThread`), so a client under test
can use ``asyncio.run`` in the main thread.

A slow server: ``latency_s`` (per request) + ``per_prompt_s`` (per prompt) of work before each
completion answer, one request at a time when ``serial`` (like a one-thread CPU server, where
requests queue). Like our embedded server, it stops working on a request whose client went
away (``disconnects`` counts them). ``api_key``: requests without ``Authorization: Bearer
<api_key>`` get HTTP 401.

``vllm_routes=True`` also serves what vLLM serves outside ``/v1``, where its ``--api-key`` does
not reach: ``GET /health``, ``POST /invocations`` (completions, as SageMaker calls them),
``POST /tokenize`` and ``POST /pooling``, all without a key (``open_route_calls`` counts the
calls): the stand-in for vLLM behind ``oni-serve``'s guard.

Example:
    >>> import json, urllib.request
    >>> with FakeLLMServer(models=("m",)) as server:
    ...     json.load(urllib.request.urlopen(server.url + "/models"))["data"][0]["id"]
    'm'
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import List, Optional, Sequence

from aiohttp import web

from torchrl_oni.annotators import prompts as P
from torchrl_oni.annotators.base import FIRST, SECOND
from torchrl_oni.annotators.scripted import ScriptedAnnotator
from torchrl_oni.net import AppThread

__all__ = ["FakeLLMServer", "MODES", "P_POSITIVE_IF_PROGRESS", "P_POSITIVE_IF_NOT"]

MODES = ("ok", "http500", "http429", "hang", "malformed_json", "no_label", "wrong_count",
         "bad_index", "yes")

# Probabilities the fake model gives to the positive label (graded so scores can be compared).
P_POSITIVE_IF_PROGRESS = 0.9
P_POSITIVE_IF_NOT = 0.15


class FakeLLMServer:
    """An OpenAI-compatible test server with switchable faults (see the module docstring).

    Args:
        mode: the initial mode.
        models: the model names listed at ``/v1/models`` and accepted in requests.
        hang_s: how long ``"hang"`` waits before answering.
        shuffle_choices: return completions choices in reverse order (indices stay right), to
            check that clients match choices by ``index``.
        ranking_bias: ``None`` or ``"1"``: always answer that position in ranking prompts (a
            position-biased model).
        goal: the goal of the scripted rules that decide the answers.
        latency_s: seconds of work per completion request (any mode).
        per_prompt_s: extra seconds of work per prompt of a request.
        serial: work on one request at a time (the others wait their turn).
        api_key: the bearer token requests must carry (``None``: no check).
        vllm_routes: also serve vLLM's routes that its key does not guard (see the module docstring).
    """

    def __init__(
        self,
        mode: str = "ok",
        models: Sequence[str] = ("fake-model",),
        *,
        hang_s: float = 3.0,
        shuffle_choices: bool = False,
        ranking_bias: Optional[str] = None,
        goal: str = "default",
        latency_s: float = 0.0,
        per_prompt_s: float = 0.0,
        serial: bool = False,
        api_key: Optional[str] = None,
        vllm_routes: bool = False,
    ) -> None:
        self.mode = mode
        self.models = tuple(models)
        self.hang_s = hang_s
        self.shuffle_choices = shuffle_choices
        self.ranking_bias = ranking_bias
        self.rules = ScriptedAnnotator(goal=goal)
        self.port = 0
        self.requests = 0  # completion requests received (any mode)
        self.received: List[str] = []  # captions read out of prompts answered in "ok" mode
        self.last_payload: Optional[dict] = None
        self.latency_s = latency_s
        self.per_prompt_s = per_prompt_s
        self.serial = serial
        self.api_key = api_key
        self.vllm_routes = vllm_routes
        self.open_route_calls = 0  # calls of the vllm_routes, which need no key
        self.completed = 0  # completion requests answered (the client may have gone meanwhile)
        self.prompts_answered = 0
        self.batch_sizes: List[int] = []  # prompts of each completion request answered
        self.disconnects = 0  # requests whose client went away before the answer
        self.unauthorized = 0
        self.authorization: List[Optional[str]] = []  # the Authorization header of every request
        self.in_flight = 0
        self.max_in_flight = 0  # most completion requests handled at once
        self._serial_lock: Optional[asyncio.Lock] = None
        self._fail_queue: List[str] = []
        self._lock = threading.Lock()
        self._app: Optional[AppThread] = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def running(self) -> bool:
        return self._app is not None and self._app.running

    def fail_next(self, n: int, mode: str) -> None:
        """The next ``n`` completion requests get ``mode``; later ones get ``self.mode``."""
        assert mode in MODES, mode
        with self._lock:
            self._fail_queue.extend([mode] * n)

    def start(self) -> "FakeLLMServer":
        """Starts serving (on the previous port after a ``stop()``)."""
        if self.running:
            return self
        # Requests in flight are cut after 0.2 s (a dying server), and the port is bound again
        # at once on a restart.
        self._app = AppThread(self._make_app, "127.0.0.1", self.port, name="fake-llm-server",
                              shutdown_timeout=0.2, reuse_address=True)
        self._app.start(timeout=10)
        self.port = self._app.port
        return self

    def stop(self) -> None:
        """Stops serving: connections are refused until ``start()``."""
        if not self.running:
            return
        self._app.stop(timeout=10)

    def __enter__(self) -> "FakeLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _make_app(self) -> web.Application:
        # Called on the server's loop at every start: the lock belongs to that loop.
        self._serial_lock = asyncio.Lock()
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        if self.vllm_routes:
            app.router.add_get("/health", self._open_route)
            for path in ("/invocations", "/tokenize", "/pooling"):
                app.router.add_post(path, self._open_route)
        return app

    async def _open_route(self, request: web.Request) -> web.Response:
        """vLLM's routes outside /v1: answered without a key (as vLLM does)."""
        with self._lock:
            self.open_route_calls += 1
        if request.path == "/invocations":
            return await self._completions(request, check_key=False)
        return web.json_response({"path": request.path, "open": True})

    # ------------------------------------------------------------------ handlers
    def _unauthorized(self, request: web.Request) -> Optional[web.Response]:
        with self._lock:
            self.authorization.append(request.headers.get("Authorization"))
        if self.api_key is None or request.headers.get("Authorization") == f"Bearer {self.api_key}":
            return None
        with self._lock:
            self.unauthorized += 1
        return web.json_response({"error": {"message": "invalid API key", "code": 401}}, status=401)

    async def _models(self, request: web.Request) -> web.Response:
        refused = self._unauthorized(request)
        if refused is not None:
            return refused
        data = [{"id": m, "object": "model", "owned_by": "fake"} for m in self.models]
        return web.json_response({"object": "list", "data": data})

    @staticmethod
    def _gone(request: web.Request) -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    async def _work(self, request: web.Request, seconds: float) -> bool:
        """Waits ``seconds`` unless the client goes away first; returns whether it stayed."""
        end = time.monotonic() + seconds
        while True:
            if self._gone(request):
                with self._lock:
                    self.disconnects += 1
                return False
            left = end - time.monotonic()
            if left <= 0:
                return True
            await asyncio.sleep(min(left, 0.005))

    async def _serve_time(self, request: web.Request, mode: str, n_prompts: int) -> bool:
        work = self.latency_s + self.per_prompt_s * n_prompts
        if mode == "hang":
            work += self.hang_s
        if work <= 0:
            return True
        if self.serial:
            async with self._serial_lock:
                return await self._work(request, work)
        return await self._work(request, work)

    def _next_mode(self) -> str:
        with self._lock:
            self.requests += 1
            return self._fail_queue.pop(0) if self._fail_queue else self.mode

    async def _read(self, request: web.Request, check_key: bool = True):
        mode = self._next_mode()
        refused = self._unauthorized(request) if check_key else None
        if refused is not None:
            return mode, None, refused
        payload = await request.json()
        prompts = payload.get("prompt", [None])
        n_prompts = 1 if isinstance(prompts, str) or "messages" in payload else len(prompts)
        self.in_flight += 1  # only touched on the server's loop: no lock needed
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            stayed = await self._serve_time(request, mode, n_prompts)
        finally:
            self.in_flight -= 1
        if not stayed:  # nobody will read the answer
            return mode, payload, web.Response(status=499, text="client closed the request")
        with self._lock:
            self.completed += 1
            self.prompts_answered += n_prompts
            self.batch_sizes.append(n_prompts)
        self.last_payload = payload
        if payload.get("model") not in self.models:
            return mode, payload, web.json_response(
                {"error": {"message": f"model {payload.get('model')!r} not found"}}, status=404
            )
        if mode == "http500":
            return mode, payload, web.Response(status=500, text="internal error")
        if mode == "http429":
            return mode, payload, web.Response(status=429, text="rate limited")
        if mode == "malformed_json":
            return mode, payload, web.Response(
                status=200, text='{"choices": [{"text": "<label>FOO',
                content_type="application/json",
            )
        return mode, payload, None

    async def _completions(self, request: web.Request, check_key: bool = True) -> web.Response:
        mode, payload, early = await self._read(request, check_key)
        if early is not None:
            return early
        prompts = payload.get("prompt")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        want = payload.get("logprobs")
        choices = []
        for i, prompt in enumerate(prompts):
            text, positions = self._answer(prompt, mode, payload.get("stop"))
            choices.append({
                "index": i,
                "text": text,
                "logprobs": self._completion_logprobs(positions, want) if want else None,
                "finish_reason": "stop",
            })
        choices = self._break_choices(choices, mode)
        if self.shuffle_choices:
            choices.reverse()
        return web.json_response(
            {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
             "model": payload["model"], "choices": choices}
        )

    async def _chat(self, request: web.Request) -> web.Response:
        mode, payload, early = await self._read(request)
        if early is not None:
            return early
        prompt = "\n\n".join(m.get("content", "") for m in payload.get("messages", []))
        text, positions = self._answer(prompt, mode, payload.get("stop"))
        logprobs = None
        if payload.get("logprobs"):
            logprobs = {"content": [
                {"token": tok, "logprob": top.get(tok, -0.01),
                 "top_logprobs": [{"token": t, "logprob": lp} for t, lp in top.items()]}
                for tok, top in positions
            ]}
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": logprobs, "finish_reason": "stop"}
        choices = self._break_choices([choice], mode)
        return web.json_response(
            {"id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
             "model": payload["model"], "choices": choices}
        )

    @staticmethod
    def _break_choices(choices: list, mode: str) -> list:
        if mode == "wrong_count":
            return choices[:-1]
        if mode == "bad_index":
            return [dict(c, index=0) for c in choices]
        return choices

    @staticmethod
    def _completion_logprobs(positions, k) -> dict:
        return {
            "tokens": [tok for tok, _ in positions],
            "token_logprobs": [top.get(tok, -0.01) for tok, top in positions],
            "top_logprobs": [dict(list(top.items())[: int(k)]) for _, top in positions],
            "text_offset": [0] * len(positions),
        }

    # ------------------------------------------------------------------ the fake model
    def _answer(self, prompt: str, mode: str, stop) -> tuple:
        """(text, [(token, {candidate: logprob})]) for one prompt."""
        if mode == "no_label":
            text = "This message is about the dungeon."
            return text, [(text, {text: -0.01})]
        family = P.prompt_family(prompt)
        captions = P.extract_captions(prompt)
        with self._lock:
            self.received.extend(captions)
        if family == "ranking" and len(captions) == 2:
            pref = self.rules.preference(*captions)
            best = self.ranking_bias or {FIRST: "1", SECOND: "2"}.get(pref, "tie")
            prefix = ("<knowledge>NetHack rewards depth.</knowledge>\n"
                      "<analysis>Compared.</analysis>\n<best>")
            positions = [(prefix, {prefix: -0.01}), (best, {best: -0.05})]
            return self._cut(prefix + best + "</best>", stop), positions
        if family in ("tagged", "short") and len(captions) == 1:
            progress = mode == "yes" or self.rules.label(captions[0]) == 1.0
            p = P_POSITIVE_IF_PROGRESS if progress else P_POSITIVE_IF_NOT
            if family == "short":
                pos, neg = " " + P.SHORT_POSITIVE, " " + P.SHORT_NEGATIVE
                tok = pos if progress else neg
                return tok, [(tok, {pos: math.log(p), neg: math.log(1 - p)})]
            pos, neg = P.POSITIVE_TOKEN, P.NEGATIVE_TOKEN
            tok = pos if progress else neg
            prefix = ("<knowledge>NetHack is won by descending and surviving.</knowledge>\n"
                      "<analysis>Judged by the rules.</analysis>\n<label>")
            text = self._cut(prefix + tok + "</label>", stop)
            top = {pos: math.log(p), neg: math.log(1 - p)}
            return text, [(prefix, {prefix: -0.01}), (tok, top)]
        text = "I cannot tell."
        return text, [(text, {text: -0.01})]

    @staticmethod
    def _cut(text: str, stop) -> str:
        # Like vLLM: generation ends at the first stop string, which is not returned.
        for s in [stop] if isinstance(stop, str) else (stop or []):
            at = text.find(s)
            if at >= 0:
                text = text[:at]
        return text
