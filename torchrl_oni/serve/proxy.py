"""oni-serve's front for vLLM: our guard on every route, and only the OpenAI routes ONI uses.

vLLM's ``--api-key`` (``VLLM_API_KEY``) guards the routes under ``/v1`` only: ``/invocations``
(SageMaker's entry point, which serves completions), ``/tokenize``, ``/detokenize``,
``/pooling``, ``/classify``, ``/score``, ``/metrics`` and others answer anyone who reaches the
port, and it checks neither the ``Host`` header nor where a POST comes from. So when
``oni-serve --backend vllm`` is asked to serve another machine (a non-loopback ``--host``), vLLM
listens on 127.0.0.1 at a free port, with a random key of its own, and :class:`GuardedProxy`
listens where ``--host`` says and forwards three routes to it:

=========================  =======================================================
``GET /v1/models``         forwarded
``POST /v1/completions``   forwarded (the body read within the limits, then sent)
``POST /v1/chat/completions``  forwarded; a streamed answer (``stream: true``) streams
``GET /health``            vLLM's ``/health`` (open, like the embedded server's)
anything else              401 without the key, 404 with it: never forwarded
=========================  =======================================================

Every request first passes :class:`~torchrl_oni.serve.http.ClientGuard`, the same checks as the
embedded server's: the API key on every route but ``/health``, the ``Host`` header without a
key (DNS rebinding), JSON POSTs from the same origin, the body size (413) and the read time of
request heads and bodies (408, slow connections closed). A client that disconnects closes its
upstream request, which vLLM aborts. What stays open: vLLM's own port on 127.0.0.1, to the
users of that machine (its ``/v1`` needs the random key; its other routes do not).

Example:
    >>> import json, urllib.request
    >>> from torchrl_oni.testing import FakeLLMServer
    >>> from torchrl_oni.serve.embedded import ServerHandle
    >>> with FakeLLMServer(models=("m",), api_key="inner") as vllm:
    ...     proxy = GuardedProxy(vllm.url, model="m", api_key="outer", upstream_key="inner")
    ...     with ServerHandle(proxy, port=0).start() as front:
    ...         ask = urllib.request.Request(front.url + "/models", headers={"Authorization": "Bearer outer"})
    ...         json.load(urllib.request.urlopen(ask))["data"][0]["id"]
    'm'
"""
from __future__ import annotations

import asyncio
import logging
from typing import Optional, Sequence

import aiohttp
from aiohttp import web

from torchrl_oni.serve.http import (DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT, ClientGuard,
                                    RequestError)

__all__ = ["GuardedProxy", "FORWARDED_ROUTES"]

log = logging.getLogger(__name__)

FORWARDED_ROUTES = (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"))
"""The only routes of the upstream server a client can reach through :class:`GuardedProxy`."""

_PASSED_BACK = ("Content-Type", "Cache-Control", "Retry-After", "WWW-Authenticate")
"""Answer headers passed back to the client (not Content-Length or encodings: the proxy streams)."""


class GuardedProxy:
    """Forwards :data:`FORWARDED_ROUTES` to an upstream OpenAI-compatible server (vLLM on a
    loopback port) behind :class:`~torchrl_oni.serve.http.ClientGuard`.

    Served like the embedded server's application, by
    :class:`~torchrl_oni.serve.embedded.ServerHandle` (which checks the exposure, sets the bound
    address and runs :meth:`watch_connections`).

    Args:
        upstream: the upstream's base URL, ``http://127.0.0.1:PORT/v1``.
        model: the served model name (what ``oni-serve`` prints).
        api_key: the key clients must send (None: none; then ``Host`` is checked).
        upstream_key: the key sent upstream (vLLM's ``VLLM_API_KEY``); the client's own
            ``Authorization`` header never goes upstream.
        host, allowed_hosts, max_body_bytes, read_timeout: as for
            :class:`~torchrl_oni.serve.http.ClientGuard`.
        connect_timeout: seconds to connect upstream (502 after).
    """

    def __init__(self, upstream: str, *, model: str, api_key: Optional[str] = None,
                 upstream_key: Optional[str] = None, host: str = "127.0.0.1",
                 allowed_hosts: Sequence[str] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 read_timeout: float = DEFAULT_READ_TIMEOUT, connect_timeout: float = 10.0) -> None:
        base = upstream.rstrip("/")
        self.origin = base[: -len("/v1")] if base.endswith("/v1") else base
        self.model = model
        self.api_key = api_key or None
        self.upstream_key = upstream_key or None
        self.read_timeout = float(read_timeout)
        self.max_body_bytes = int(max_body_bytes)
        self.connect_timeout = float(connect_timeout)
        self.guard = ClientGuard(api_key, host=host, allowed_hosts=allowed_hosts, max_body_bytes=max_body_bytes,
                                 read_timeout=read_timeout)
        self._session: Optional[aiohttp.ClientSession] = None
        self.stats = {"forwarded": 0, "upstream_errors": 0}

    def serve_on(self, host: str) -> None:
        self.guard.serve_on(host)

    async def watch_connections(self, server: web.Server) -> None:
        await self.guard.watch(server)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self.guard.middleware()])
        for method, path in FORWARDED_ROUTES:
            app.router.add_route(method, path, self.forward)
        app.router.add_get("/health", self.forward)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app) -> None:
        # no total timeout: a long generation is the client's to wait for (or to abandon, which
        # cancels this handler and closes the upstream request)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)

    async def _close(self, app) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await self.guard.read_body(request) if request.method == "POST" else None
        headers = {"Accept": request.headers.get("Accept", "*/*")}
        if body is not None:
            headers["Content-Type"] = request.headers.get("Content-Type", "application/json")
        if self.upstream_key and request.path != "/health":
            headers["Authorization"] = f"Bearer {self.upstream_key}"
        url = self.origin + request.rel_url.path_qs
        response: Optional[web.StreamResponse] = None
        try:
            async with self._session.request(request.method, url, data=body, headers=headers,
                                             allow_redirects=False) as upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for name in _PASSED_BACK + ("Content-Encoding",):
                    if name in upstream.headers:
                        response.headers[name] = upstream.headers[name]
                if upstream.status == 401:  # the upstream's key is ours, never the client's fault
                    log.warning("the upstream server refused oni-serve's key")
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                self.stats["forwarded"] += 1
                return response
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            self.stats["upstream_errors"] += 1
            if response is None or not response.prepared:
                raise RequestError(f"the model server behind oni-serve does not answer ({type(err).__name__}: "
                                   f"{err})", status=502, code="upstream_unavailable") from None
            request.protocol.force_close()  # an answer cut short: the client sees the connection end
            return response
