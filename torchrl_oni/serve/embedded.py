"""The embedded OpenAI-compatible LLM server, run from a thread or a process of its own.

A small CPU model (or a rule-based stand-in) behind the OpenAI API, in three parts:

* :mod:`torchrl_oni.serve.engines` — the engines that load a model and generate
  (:class:`TransformersEngine`, :class:`ScriptedEngine`, :func:`make_engine`).
* :mod:`torchrl_oni.serve.http` — the HTTP protocol: routes, batching, client limits
  (:class:`~torchrl_oni.serve.http.OpenAIServer`).
* this module — running it: :class:`ServerHandle` (the app served from a background thread),
  :func:`start_embedded_server` (load, serve, return once it answers) and
  :func:`start_embedded_process` (the same server in a child process).

Example:
    >>> import json, urllib.request
    >>> from torchrl_oni.serve.embedded import start_embedded_server
    >>> with start_embedded_server(backend="scripted") as server:
    ...     body = json.dumps({"model": server.model, "prompt": ["You kill the newt!", "It's a wall."],
    ...                        "max_tokens": 1}).encode()
    ...     req = urllib.request.Request(server.url + "/completions", body,
    ...                                  {"Content-Type": "application/json"})
    ...     out = json.load(urllib.request.urlopen(req))
    >>> [(c["index"], c["text"]) for c in out["choices"]]
    [(0, 'yes'), (1, 'no')]
"""
from __future__ import annotations

from typing import Optional, Sequence

from torchrl_oni.net import AppThread, check_exposure
from torchrl_oni.serve._node_cache import DEFAULT_NODE_CACHE_MB
from torchrl_oni.serve.engines import TransformersEngine, make_engine
from torchrl_oni.serve.http import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, DEFAULT_READ_TIMEOUT, OpenAIServer

__all__ = ["ServerHandle", "start_embedded_server", "start_embedded_process"]


class ServerHandle:
    """A server running in a background thread: ``.url`` (``http://host:port/v1``), ``.stop()``.

    Use as a context manager to stop it on exit. It runs the application with handler
    cancellation (a request whose client disconnects stops waiting for the engine) and
    :meth:`~torchrl_oni.serve.http.OpenAIServer.watch_connections`, on a :class:`~torchrl_oni.net.AppThread`.

    Args:
        server: the application.
        host, port: where to listen; port 0 picks a free port.
        insecure_no_auth: allow a ``host`` other machines can reach without an API key
            (:func:`~torchrl_oni.net.check_exposure`).

    Raises:
        ValueError: a reachable ``host`` and no API key, without ``insecure_no_auth``.
    """

    def __init__(self, server: OpenAIServer, host: str = "127.0.0.1", port: int = 0, *,
                 insecure_no_auth: bool = False) -> None:
        check_exposure(host, server.api_key, insecure_no_auth)
        server.serve_on(host)  # the bound address is a Host the server answers to
        self.server = server
        self.model = server.model
        self.host = host
        self.port = port
        self._app = AppThread(
            server.app, host, port, name="oni-serve", handler_cancellation=True,
            # A body still arriving after an error answer is read for at most this long.
            lingering_time=min(10.0, server.read_timeout),
            background=[lambda runner: server.watch_connections(runner.server)])

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout: float = 30.0) -> "ServerHandle":
        try:
            self._app.start(timeout)
        except TimeoutError:
            raise TimeoutError(f"server did not start within {timeout} s") from None
        except BaseException as err:
            raise OSError(f"cannot serve on {self.host}:{self.port}: {err}") from err
        self.port = self._app.port
        return self

    def stop(self) -> None:
        """Stops the server and joins its thread. Safe to call twice."""
        self._app.stop(timeout=30)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()



def start_embedded_server(
    model: Optional[str] = None,
    *,
    backend: str = "embedded",
    host: str = "127.0.0.1",
    port: int = 0,
    threads: Optional[int] = None,
    dtype: str = "auto",
    layout: str = "tree",
    node_cache_mb: Optional[float] = None,
    served_name: Optional[str] = None,
    max_tokens_cap: int = 128,
    max_batch: int = 64,
    api_key: Optional[str] = None,
    insecure_no_auth: bool = False,
    max_queue: int = DEFAULT_MAX_QUEUE,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allowed_hosts: Sequence[str] = (),
) -> ServerHandle:
    """Loads the model and serves it in a background thread; returns once it accepts requests.

    Args:
        model: a packaged model name or alias (default :data:`~torchrl_oni.serve.models.DEFAULT_MODEL`),
            a transformers checkpoint directory, a GGUF file or a Hugging Face hub id
            (:func:`~torchrl_oni.serve.models.find_model`); ignored by the scripted backend.
        backend: ``"embedded"`` (a CPU model) or ``"scripted"`` (rules, no model).
        host, port: where to listen; port 0 picks a free port (read it from ``.url``).
        threads: torch threads for the model (``None``: torch's default).
        dtype: ``"auto"``, ``"bfloat16"``, ``"float32"`` or ``"int8"`` (CTranslate2,
            :mod:`torchrl_oni.serve._int8`; the float path with one warning where it cannot run).
        layout: how the float path runs a batch after its shared prefix, ``"tree"`` or
            ``"padded"`` (:class:`~torchrl_oni.serve.engines.TransformersEngine`).
        node_cache_mb: the float path's memory for tokens computed in earlier batches (0: off;
            ``None``: :data:`~torchrl_oni.serve._node_cache.DEFAULT_NODE_CACHE_MB`).
        served_name: the name clients use (default: the model's name).
        max_tokens_cap: the most tokens generated per prompt.
        max_batch: the most prompts per forward pass.
        api_key: the key clients must send as ``Authorization: Bearer <key>`` (``/health``
            excepted); None checks none.
        insecure_no_auth: allow a non-loopback ``host`` without ``api_key``.
        max_queue: the most requests waiting for the model; more are answered 503.
        read_timeout: seconds a client may take to send its request.
        max_body_bytes: the largest request body accepted (413 beyond).
        allowed_hosts: ``Host`` names accepted besides loopback names and ``host`` (``"*"``:
            any); without ``api_key`` other names are refused (DNS rebinding), with one any
            name is accepted unless these are given.

    Returns:
        A :class:`ServerHandle` (a context manager) with ``.url`` and ``.stop()``.

    Raises:
        ValueError: unknown backend, or a reachable ``host`` without ``api_key`` (checked
            before the model loads); a model path or id that cannot be loaded
            (:class:`~torchrl_oni.serve.models.ModelSourceError`).
    """
    check_exposure(host, api_key, insecure_no_auth)
    engine = make_engine(backend, model, dtype=dtype, threads=threads,
                         max_tokens_cap=max_tokens_cap, layout=layout,
                         node_cache_mb=DEFAULT_NODE_CACHE_MB if node_cache_mb is None else node_cache_mb)
    if isinstance(engine, TransformersEngine):
        engine.max_batch = min(engine.max_batch, max_batch)
    server = OpenAIServer(engine, served_name=served_name, max_batch=max_batch, api_key=api_key,
                          max_queue=max_queue, read_timeout=read_timeout,
                          max_body_bytes=max_body_bytes, host=host, allowed_hosts=allowed_hosts)
    return ServerHandle(server, host, port, insecure_no_auth=insecure_no_auth).start()


def start_embedded_process(model: Optional[str] = None, *, threads: Optional[int] = None,
                           dtype: str = "auto", node_cache_mb: Optional[float] = None,
                           startup_timeout: float = 900.0,
                           log_path: Optional[str] = None):
    """The embedded server in a child process of its own (``python -m torchrl_oni.serve``).

    Why a process: a model served from a thread of the training process shares that process's
    GIL and torch thread pool with the learner, so on a busy machine it answers a few prompts a
    minute; a process of its own gets its share of the cores from the OS. The child stops with
    its parent (process group, ``PR_SET_PDEATHSIG``), as vLLM does under :class:`VLLMServer`.

    ``model`` is what :func:`start_embedded_server` takes; a packaged name or a hub id is served
    under that name, a local directory or GGUF file under its own name (its absolute path goes to
    the child). ``threads``, ``dtype`` and ``node_cache_mb`` are :func:`start_embedded_server`'s.

    Returns:
        A started :class:`~torchrl_oni.serve.vllm.VLLMServer` with ``.url``, ``.model`` (the
        served name), ``.stop()``.

    Raises:
        ValueError: a model path that does not hold a model, or an impossible id (checked here,
            before the process starts; :class:`~torchrl_oni.serve.models.ModelSourceError`).
        VLLMLaunchError: the process exited or did not answer within ``startup_timeout``.
    """
    import sys

    from torchrl_oni.serve.models import DEFAULT_MODEL, find_model
    from torchrl_oni.serve.vllm import VLLMServer

    name = served = model or DEFAULT_MODEL
    spec = find_model(name, download=False)
    if spec.path is not None:  # a local model: the child may not share our working directory
        name, served = str(spec.path), spec.name
    server = VLLMServer(name, port=0, served_model_name=served,
                        launcher=[sys.executable, "-m", "torchrl_oni.serve", "--backend", "embedded"],
                        extra_args=(["--threads", str(threads)] if threads else [])
                        + ["--dtype", dtype]
                        + ([] if node_cache_mb is None else ["--node-cache-mb", f"{node_cache_mb:g}"]),
                        startup_timeout=startup_timeout, log_path=log_path)
    server.model = served  # what clients send, as ServerHandle.model (the path is in .command)
    return server.start()
