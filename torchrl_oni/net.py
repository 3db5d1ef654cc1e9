"""Network helpers shared by ONI's HTTP servers: who can reach an address, and serving an app.

* :func:`is_loopback` / :func:`check_exposure` — whether a bind address (or a URL's host) is
  reachable from this machine only, and the refusal to serve a reachable address without an
  API key (``oni-serve``, :class:`~torchrl_oni.serve.vllm.VLLMServer`).
* :class:`HostCheck` / :func:`post_refusal` — what a browser could be made to send: a ``Host``
  header naming another site (DNS rebinding turns a page on ``attacker.example`` into a client
  of a loopback port), and cross-site POSTs that are not JSON (an HTML form or a ``text/plain``
  ``fetch`` needs no CORS preflight). The labelling page and ``oni-serve`` (its embedded server
  and its front for vLLM) refuse both with these.
* :func:`free_port` — a TCP port to hand to a server that cannot pick its own.
* :class:`AppThread` — an aiohttp application served from a daemon thread with its own event
  loop, so that the caller's thread stays free (a trainer, or a test that uses ``asyncio.run``).
  The embedded LLM server, the labelling page and the fake LLM server of the tests run on it.
* :class:`ConnectionWatch` — closes connections that hold no request in progress for
  ``read_timeout`` seconds (a request head that never finishes: slowloris; idle keep-alives).

Example:
    >>> import urllib.request
    >>> from aiohttp import web
    >>> async def hello(request):
    ...     return web.Response(text="hello")
    >>> def make_app():
    ...     app = web.Application()
    ...     app.router.add_get("/", hello)
    ...     return app
    >>> with AppThread(make_app, port=0) as served:
    ...     urllib.request.urlopen(served.url + "/").read()
    b'hello'
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
import time
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple

from aiohttp import web

__all__ = ["is_loopback", "check_exposure", "host_name", "HostCheck", "post_refusal", "free_port", "AppThread",
           "ConnectionWatch"]

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether ``host`` accepts connections from this machine only (127.0.0.0/8, ::1, localhost).

    ``host`` is a bind address, a URL's host name or a Host header's name (IPv6 in brackets or
    not). ``localhost`` matches in any case: host names are case-insensitive and the resolver
    maps every spelling to the loopback. Anything else that is not a loopback IP literal counts
    as reachable: ``""`` and ``0.0.0.0`` (all interfaces), other names, ``localhost.`` (an
    absolute name may be looked up in DNS rather than in ``/etc/hosts``) and text with spaces
    around it (not an address at all).

    Example:
        >>> [is_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "LocalHost")]
        [True, True, True, True, True]
        >>> [is_loopback(h) for h in ("0.0.0.0", "", "gpu-node", "localhost.", " 127.0.0.1")]
        [False, False, False, False, False]
    """
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: Optional[str], insecure_no_auth: bool = False) -> None:
    """Refuses a server that other machines can reach but that checks no API key.

    Raises:
        ValueError: ``host`` is not loopback (:func:`is_loopback`), ``api_key`` is empty and
            ``insecure_no_auth`` is False.
    """
    if api_key or insecure_no_auth or is_loopback(host):
        return
    raise ValueError(
        f"refusing to serve on {host or 'all interfaces'!r}, which other machines can reach, "
        "without an API key: set one (--api-key KEY or $ONI_SERVE_API_KEY; api_key= in Python) "
        "or pass --insecure-no-auth (insecure_no_auth=True) on a trusted network")


WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
"""Bind addresses meaning every interface: no client names the server by them."""


def host_name(host_header: Optional[str]) -> str:
    """The host named by a ``Host`` header, lower case, without its port and brackets.

    Example:
        >>> [host_name(h) for h in ("127.0.0.1:8000", "[::1]:8000", "[::1]", "LocalHost", "gpu-node", None)]
        ['127.0.0.1', '::1', '::1', 'localhost', 'gpu-node', '']
    """
    text = (host_header or "").strip().lower()
    if text.startswith("["):
        end = text.find("]")
        return text[1:end] if end > 0 else ""
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class HostCheck:
    """The ``Host`` headers a server answers to: its defence against DNS rebinding.

    A page on ``attacker.example`` whose name the attacker re-points at 127.0.0.1 becomes, for
    the browser, a same-origin client of a loopback port; the one thing it cannot change is the
    ``Host`` header, which still names ``attacker.example``. Accepted: loopback names and
    addresses (:func:`is_loopback`), the address the server binds (unless it is a wildcard such
    as ``0.0.0.0``, which no client sends), and the names in ``allowed`` (``"*"``: any).

    Example:
        >>> check = HostCheck("127.0.0.1")
        >>> [check(h) for h in ("127.0.0.1:8000", "localhost:8000", "[::1]:80", "attacker.example:8000", "")]
        [True, True, True, False, False]
        >>> check = HostCheck("10.0.0.5", allowed=["gpu-node"])
        >>> [check(h) for h in ("10.0.0.5:8000", "GPU-node:8000", "other-node:8000")], check.describe()
        ([True, True, False], 'loopback names, 10.0.0.5, gpu-node')
        >>> HostCheck("0.0.0.0", allowed=["*"])("anything:1")
        True
    """

    def __init__(self, bound: str = "127.0.0.1", allowed: Sequence[str] = ()) -> None:
        self.any = "*" in allowed
        names = [host_name(f"[{bound}]" if ":" in bound.strip("[]") else bound)] \
            if bound.strip() not in WILDCARD_HOSTS else []
        names += [host_name(name) for name in allowed if name != "*"]
        self.names = tuple(dict.fromkeys(n for n in names if n and not is_loopback(n)))

    def __call__(self, host_header: Optional[str]) -> bool:
        if self.any:
            return True
        name = host_name(host_header)
        return bool(name) and (is_loopback(name) or name in self.names)

    def describe(self) -> str:
        """The accepted names, for an error message."""
        return "any" if self.any else ", ".join(("loopback names",) + self.names)


def post_refusal(request: web.Request) -> Optional[Tuple[int, str]]:
    """``(status, reason)`` for a POST a browser could send from another site, else None.

    A POST must say ``Content-Type: application/json`` (415 otherwise: HTML forms and
    ``text/plain`` ``fetch`` calls, which browsers send cross-site without a CORS preflight, cannot
    say it) and, when it has an ``Origin`` header, come from the server's own origin (403). Other
    methods pass. Command-line and library clients (OpenAI's, aiohttp's ``json=``) send JSON and
    no ``Origin``.
    """
    if request.method != "POST":
        return None
    if request.content_type != "application/json":
        return 415, "send JSON (Content-Type: application/json)"
    origin = request.headers.get("Origin")
    if origin is not None and origin != f"{request.scheme}://{request.host}":
        return 403, "cross-origin request refused"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Work run on the server's loop while it serves (given the runner, e.g. to watch its
# connections); cancelled when the server stops.
BackgroundJob = Callable[[web.AppRunner], Awaitable[Any]]


class AppThread:
    """An aiohttp application served from a daemon thread with its own event loop.

    :meth:`start` returns once the socket is bound (or raises why it could not be), :meth:`stop`
    closes it and joins the thread; :meth:`start` after :meth:`stop` serves again on the port
    bound before (a server that died and came back). Usable as a context manager.

    Args:
        make_app: builds the application; called on the server's loop at every start, so it may
            create asyncio objects that belong to that loop.
        host, port: where to listen; port 0 picks a free port (read :attr:`port` after start).
        name: the thread's name.
        handler_cancellation: cancel a handler whose client disconnects (aiohttp's option).
        shutdown_timeout: seconds requests in flight get to finish when stopping (None:
            aiohttp's default).
        lingering_time: seconds a request body still arriving after the answer is read for
            (None: aiohttp's default).
        reuse_address: set ``SO_REUSEADDR`` (None: the platform's default), to bind the same
            port again at once after a stop.
        background: coroutines to run on the loop while serving, each given the runner;
            cancelled, then awaited, when stopping.

    Attributes:
        port: the bound port once started (the requested one before).
    """

    def __init__(self, make_app: Callable[[], web.Application], host: str = "127.0.0.1",
                 port: int = 0, *, name: str = "aiohttp-app", handler_cancellation: bool = False,
                 shutdown_timeout: Optional[float] = None, lingering_time: Optional[float] = None,
                 reuse_address: Optional[bool] = None,
                 background: Sequence[BackgroundJob] = ()) -> None:
        self.make_app = make_app
        self.host = host
        self.port = int(port)
        self.name = name
        self._runner_options: Dict[str, Any] = {"access_log": None,
                                                "handler_cancellation": handler_cancellation}
        if shutdown_timeout is not None:
            self._runner_options["shutdown_timeout"] = shutdown_timeout
        if lingering_time is not None:
            self._runner_options["lingering_time"] = lingering_time
        self._site_options: Dict[str, Any] = {}
        if reuse_address is not None:
            self._site_options["reuse_address"] = reuse_address
        self.background: List[BackgroundJob] = list(background)
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stopping: Optional[asyncio.Event] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def url(self) -> str:
        """``http://host:port``, as a client on this machine reaches it (no trailing slash)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "AppThread":
        """Binds and serves; returns once requests are accepted. Does nothing when running.

        Raises:
            TimeoutError: not serving within ``timeout`` seconds.
            OSError: the address cannot be bound (or whatever else failed while starting).
        """
        if self.running:
            return self
        self._ready.clear()
        self._error = None
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.name} did not start serving within {timeout} s")
        if self._error is not None:
            self._thread.join(5)
            self._thread = None
            raise self._error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stops serving (requests in flight get ``shutdown_timeout``) and joins the thread.

        Safe to call twice, or before :meth:`start`.
        """
        if self._thread is None:
            return
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None:
            try:
                loop.call_soon_threadsafe(stopping.set)
            except RuntimeError:  # the loop closed meanwhile: the thread is ending anyway
                pass
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> "AppThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as err:  # noqa: BLE001 - reported to start(), or logged: never raised in a thread
            if not self._ready.is_set():
                self._error = err
            else:
                logger.exception("%s stopped serving", self.name)
        finally:
            self._ready.set()
            self._loop, self._stopping = None, None
            loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        runner = web.AppRunner(self.make_app(), **self._runner_options)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port, **self._site_options)
            await site.start()
            self.port = int(runner.addresses[0][1])
            jobs = [asyncio.ensure_future(job(runner)) for job in self.background]
            self._ready.set()
            await self._stopping.wait()
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
        finally:
            await runner.cleanup()


class ConnectionWatch:
    """Closes connections that hold no request in progress for ``read_timeout`` seconds.

    That covers a request head that never finishes arriving (slowloris), which no handler sees,
    and idle keep-alive connections. A server marks each request's connection busy from
    :meth:`enter` to :meth:`leave` (in a middleware) and runs :meth:`watch` on its loop with its
    runner's ``server`` (an :class:`AppThread` ``background`` job). Bodies are the handlers'
    business: read them with ``asyncio.wait_for(request.read(), read_timeout)``.
    """

    def __init__(self, read_timeout: float) -> None:
        if not read_timeout > 0:
            raise ValueError(f"read_timeout must be positive, got {read_timeout}")
        self.read_timeout = float(read_timeout)
        self._busy: Dict[Any, int] = {}
        self._idle_since: Dict[Any, float] = {}

    def enter(self, conn) -> None:
        self._busy[conn] = self._busy.get(conn, 0) + 1

    def leave(self, conn) -> None:
        left = self._busy.pop(conn, 1) - 1
        if left > 0:
            self._busy[conn] = left
        self._idle_since[conn] = time.monotonic()

    async def watch(self, server: web.Server) -> None:
        """Runs until cancelled, checking every ``min(1, read_timeout / 4)`` seconds."""
        period = min(1.0, self.read_timeout / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            connections = server.connections
            for conn in connections:
                if self._busy.get(conn):
                    continue  # a handler runs: its own timeouts govern it
                if now - self._idle_since.setdefault(conn, now) > self.read_timeout:
                    conn.force_close()
            for conn in set(self._idle_since).difference(connections):
                del self._idle_since[conn]
