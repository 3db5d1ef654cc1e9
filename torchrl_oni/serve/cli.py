"""``oni-serve``: serve an LLM behind the OpenAI API for ONI's annotator.

Usage::

    oni-serve                                   # embedded CPU model (qwen2.5-coder-0.5b-instruct)
    oni-serve --model smollm2 --port 0          # small model, any free port
    oni-serve --model ~/models/my-judge         # your judge: a transformers checkpoint folder,
    oni-serve --model ./judge.Q4_K_M.gguf       #   a GGUF file (converted once, then cached)
    oni-serve --model Qwen/Qwen2.5-1.5B-Instruct  # or a Hugging Face hub id (fetched once)
    oni-serve --backend scripted                # rules, no model (tests, overhead benchmarks)
    ONI_SERVE_API_KEY=... oni-serve --backend vllm --model /models/Llama-3.1-8B-Instruct \\
        --host 0.0.0.0 --served-model-name Meta-Llama-3.1-8B-Instruct -- --dtype float16

Your own judge (embedded backend): ``--model`` takes a transformers checkpoint directory, loaded
as it is (served as the directory's name), a GGUF file (served as its name without ``.gguf``),
converted once into a dense copy under the cache (``$TORCHRL_ONI_CACHE``, else
``~/.cache/torchrl_oni``) and loaded from there after, or a Hugging Face hub id, fetched into the
cache's ``hub/`` folder when the hub can be reached (a fetched one also offline). Their sha256 is
printed (a directory's is computed once and remembered by path, size and mtime); details in
:mod:`torchrl_oni.serve.models`. ``--served-model-name`` changes the name clients send.

Once the server answers ``/v1/models``, the base URL (``http://HOST:PORT/v1``) is printed alone on
stdout (pass it to ``oni-train --llm-url``); messages go to stderr. The default port is 8000, the
usual one for OpenAI-compatible servers, so the URL is predictable; ``--port 0`` picks a free one.

Access: on any address but loopback (127.0.0.1, ::1, localhost) an API key is required —
``--api-key KEY`` or, kept out of ``ps``, the environment variable ``ONI_SERVE_API_KEY`` — unless
``--insecure-no-auth`` declares the network trusted. Clients send ``Authorization: Bearer KEY``
(the OpenAI client's ``api_key``, ``OPENAI_API_KEY``); ``/health`` stays open. vLLM gets the key
as ``VLLM_API_KEY``.

Browsers: without an API key the server answers only requests whose ``Host`` header names a
loopback host, ``--host`` or an ``--allowed-host`` (a page that re-points its own name at
127.0.0.1, DNS rebinding, is refused), and every POST must be ``Content-Type: application/json``
from the same origin (cross-site forms are refused), key or no key.

vLLM off loopback: vLLM's own key guards only ``/v1`` (``/invocations``, ``/tokenize``,
``/pooling`` and more answer anyone), so with a non-loopback ``--host`` vLLM listens on 127.0.0.1
at a free port with a random key of its own, and oni-serve listens on ``--host`` in front of it
(:mod:`torchrl_oni.serve.proxy`): the key on every route but ``/health``, the checks above,
``--read-timeout`` and ``--max-body-mb``, and only ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions`` forwarded.

Limits (embedded and scripted backends): at most ``--max-queue`` requests wait for the model
(more get 503 with ``Retry-After``), the work of a client that disconnects is dropped, a client
has ``--read-timeout`` seconds to send its request, and bodies over ``--max-body-mb`` get 413.

Ctrl-C, SIGTERM or SIGHUP stop it at any time, also while a model loads or vLLM starts; vLLM's
whole process group is stopped with it (and on Linux vLLM gets SIGTERM if oni-serve is killed).
A requested stop exits with status 0. Every error — a bad flag, an unknown model, a model path
that does not hold a model, an unreachable hub, a missing package, vLLM failing to start — is one
line ``oni-serve: error: ...`` and exit status 2.

Example:
    >>> from torchrl_oni.serve.cli import build_parser
    >>> args = build_parser().parse_args(["--backend", "scripted", "--port", "0"])
    >>> args.backend, args.port, args.host
    ('scripted', 0, '127.0.0.1')
    >>> args = build_parser().parse_args(["--model", "/models/my-judge", "--served-model-name", "judge"])
    >>> args.backend, args.model, args.served_model_name
    ('embedded', '/models/my-judge', 'judge')
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import signal
import sys
import threading
import time
from typing import Iterator, List, Optional, Sequence

from torchrl_oni.cli_errors import OneLineArgumentParser, fail
from torchrl_oni.serve._node_cache import DEFAULT_NODE_CACHE_MB
from torchrl_oni.serve.models import DEFAULT_MODEL, MODELS

__all__ = ["main", "build_parser", "API_KEY_ENV"]

PROG = "oni-serve"
API_KEY_ENV = "ONI_SERVE_API_KEY"
_EMBEDDED_ONLY = ("max_queue",)
_SERVED_BY_US = ("read_timeout", "max_body_mb")  # vLLM: only where oni-serve fronts it (off loopback)
_OURS_NOT_VLLMS = ("--host", "--port", "--api-key", "--uds", "--root-path")  # never after '--'



def build_parser() -> argparse.ArgumentParser:
    """The ``oni-serve`` argument parser."""
    from torchrl_oni.serve.http import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE,
                                        DEFAULT_READ_TIMEOUT)

    models = ", ".join(f"{name} ({spec.pip_install})" for name, spec in MODELS.items())
    parser = OneLineArgumentParser(
        prog=PROG,
        description="Serve an LLM behind an OpenAI-compatible API for ONI annotation. "
                    "Arguments after '--' are passed to vLLM unchanged.",
        epilog=f"Packaged models: {models}.",
    )
    parser.add_argument("--backend", choices=("embedded", "vllm", "scripted"), default="embedded",
                        help="embedded: a CPU model (packaged, or yours: --model); vllm: launch a vLLM server; "
                             "scripted: keyword rules, no model (default: embedded)")
    parser.add_argument("--model", default=None,
                        help=f"embedded: a packaged model name (default {DEFAULT_MODEL}), a "
                             "transformers checkpoint directory, a .gguf file or a Hugging Face hub "
                             "id; vllm: a model path or id (required)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as 'model' (default: the model's name)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="listen address; 0.0.0.0 to serve other machines, which needs an "
                             "API key (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000,
                        help="listen port; 0 picks a free one (default 8000)")
    parser.add_argument("--api-key", type=_api_key, default=None, metavar="KEY",
                        help=f"the key clients must send as 'Authorization: Bearer KEY' "
                             f"(default: ${API_KEY_ENV}, which keeps it out of 'ps'); required "
                             "on a non-loopback --host")
    parser.add_argument("--allowed-host", type=_host_arg, nargs="+", default=[], metavar="NAME",
                        help="Host header names accepted besides loopback names and --host (default: "
                             "none; '*': any). Without an API key other names are refused (DNS "
                             "rebinding); with one any name is, unless this is given")
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="serve a non-loopback --host without an API key (trusted networks "
                             "only: anyone who reaches the port can use the model)")
    parser.add_argument("--threads", type=_thread_count, default=None,
                        help="torch threads for the embedded model (default: torch's choice)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32", "int8"), default="auto",
                        help="embedded model dtype; auto = bfloat16 where the CPU has native "
                             "bf16 (AMX/AVX512-BF16), else float32; int8 = CTranslate2's int8 "
                             "kernels (converted once; the float path with a warning where it "
                             "cannot run)")
    parser.add_argument("--node-cache-mb", type=_non_negative_float, default=DEFAULT_NODE_CACHE_MB, metavar="MB",
                        help=f"memory for the keys and values of prompt tokens computed before, so a "
                             f"caption whose beginning the embedded model has seen computes only the "
                             f"rest (default {DEFAULT_NODE_CACHE_MB}; 0: off)")
    parser.add_argument("--max-tokens-cap", type=_positive_int, default=128,
                        help="most tokens generated per prompt by the embedded model (default 128)")
    parser.add_argument("--max-queue", type=_positive_int, default=None, metavar="N",
                        help=f"most requests waiting for the model; more are answered 503 with "
                             f"Retry-After (default {DEFAULT_MAX_QUEUE})")
    parser.add_argument("--read-timeout", type=_positive_float, default=None, metavar="SECONDS",
                        help=f"seconds a client may take to send its request, head and body; "
                             f"idle keep-alive connections are closed after as long "
                             f"(default {DEFAULT_READ_TIMEOUT:g})")
    parser.add_argument("--max-body-mb", type=_positive_float, default=None, metavar="MB",
                        help=f"largest request body in MiB; larger ones get 413 "
                             f"(default {DEFAULT_MAX_BODY_BYTES / 2 ** 20:g})")
    parser.add_argument("--startup-timeout", type=_positive_float, default=900.0,
                        help="seconds to wait for a vLLM server to list its model (default 900)")
    parser.add_argument("--vllm-command", default=None, metavar="CMD",
                        help="the command that runs vLLM's OpenAI server, before --model ... "
                             "(default: this Python's -m vllm.entrypoints.openai.api_server)")
    parser.add_argument("--list-models", action="store_true",
                        help="list the packaged models and how to install them, then exit")
    return parser


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is out of range 0-65535")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _thread_count(text: str) -> int:
    value = _positive_int(text)
    if value > 1024:
        raise argparse.ArgumentTypeError(f"{value} threads: at most 1024")
    return value


def _finite_float(text: str, zero_allowed: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not (math.isfinite(value) and (value >= 0 if zero_allowed else value > 0)):
        raise argparse.ArgumentTypeError(f"{text} must be " + ("a number >= 0" if zero_allowed else "a positive number"))
    return value


def _positive_float(text: str) -> float:
    return _finite_float(text, zero_allowed=False)


def _non_negative_float(text: str) -> float:
    return _finite_float(text, zero_allowed=True)


def _host_arg(text: str) -> str:
    # a host name or address as a Host header names it (no port, scheme or path)
    if text != "*" and (not text or "/" in text or not all("!" <= ch <= "~" for ch in text)):
        raise argparse.ArgumentTypeError(f"not a host name: {text!r}")
    return text


def _api_key(text: str) -> str:
    # It travels in an HTTP header: printable ASCII, no spaces.
    if not text or not all("!" <= ch <= "~" for ch in text):
        raise argparse.ArgumentTypeError("an API key must be non-empty printable ASCII without "
                                         "spaces")
    return text


def _resolve_api_key(args) -> Optional[str]:
    if args.api_key is not None:
        return args.api_key
    env = os.environ.get(API_KEY_ENV, "")
    if not env:
        return None
    try:
        return _api_key(env)
    except argparse.ArgumentTypeError as err:
        fail(PROG, f"${API_KEY_ENV}: {err}")


class _Stopped(BaseException):
    """A stop signal, raised in the main thread (not an Exception, so that no ``except
    Exception`` on the way swallows it)."""


class _StopSignals:
    """Ctrl-C, SIGTERM and SIGHUP as a stop request, raised as :class:`_Stopped` only where
    that is safe.

    Inside :meth:`interruptible` (waits: for vLLM, for the model loader, for the end) the first
    signal raises at once. Elsewhere it is only noted and raised on entering the next
    interruptible block: an exception thrown into arbitrary code, an ``import`` say, can leave
    modules half-initialised and turn the stop into a traceback. After :meth:`hold` (cleanup
    under way) signals are ignored.
    """

    def __init__(self) -> None:
        self.requested: Optional[str] = None
        self._armed = False
        self._held = False

    def _handler(self, signum, frame) -> None:
        if self._held or self.requested is not None:
            return
        self.requested = signal.Signals(signum).name
        if self._armed:
            self._armed = False
            raise _Stopped(self.requested)

    @contextlib.contextmanager
    def installed(self) -> Iterator["_StopSignals"]:
        wanted = [signal.SIGINT, signal.SIGTERM]
        if hasattr(signal, "SIGHUP"):  # a closed terminal or ssh session
            wanted.append(signal.SIGHUP)
        previous = {sig: signal.signal(sig, self._handler) for sig in wanted}
        try:
            yield self
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        if self.requested is not None:
            raise _Stopped(self.requested)
        self._armed = not self._held
        try:
            yield
        finally:
            self._armed = False

    def hold(self) -> None:
        self._held, self._armed = True, False


def _wait_forever() -> None:
    while True:
        time.sleep(3600)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs ``oni-serve``; returns 0 on a clean stop (errors exit with status 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    if args.list_models:
        from torchrl_oni.serve.models import is_installed

        for name, spec in MODELS.items():
            state = "installed" if is_installed(name) else "not installed"
            print(f"{name}\t{state}\t{spec.description}\t{spec.pip_install}")
        return 0
    if extra and args.backend != "vllm":
        fail(PROG, "arguments after '--' are only for --backend vllm")
    if args.backend == "vllm":
        given = [name for name in _EMBEDDED_ONLY if getattr(args, name) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            fail(PROG, f"{flag} is for the embedded and scripted backends (vLLM has its own "
                       "limits: pass its flags after '--')")
        if any(a == "--api-key" or a.startswith("--api-key=") for a in extra):
            fail(PROG, "give the API key to oni-serve (--api-key or $ONI_SERVE_API_KEY), not "
                       "after '--': oni-serve passes it to vLLM and needs it to probe readiness")
        taken = next((a.split("=", 1)[0] for a in extra if a.split("=", 1)[0] in _OURS_NOT_VLLMS), None)
        if taken:
            fail(PROG, f"give {taken} to oni-serve, not after '--': oni-serve decides where vLLM listens "
                       "(off loopback, on 127.0.0.1 behind oni-serve's guard)")
        from torchrl_oni.net import is_loopback

        given = [name for name in _SERVED_BY_US if getattr(args, name) is not None]
        if given and is_loopback(args.host):
            flag = "--" + given[0].replace("_", "-")
            fail(PROG, f"{flag} applies to vLLM only off loopback, where oni-serve fronts it (vLLM has its "
                       "own limits: pass its flags after '--')")
    elif args.vllm_command is not None:
        fail(PROG, "--vllm-command is only for --backend vllm")
    api_key = _resolve_api_key(args)
    from torchrl_oni.net import check_exposure

    try:
        check_exposure(args.host, api_key, args.insecure_no_auth)
    except ValueError as err:
        fail(PROG, str(err))
    signals = _StopSignals()
    with signals.installed():
        try:
            if args.backend == "vllm":
                _serve_vllm(args, extra, api_key, signals)
            else:
                _serve_embedded(args, api_key, signals)
        except _Stopped:
            pass
    print(f"{PROG}: stopped", file=sys.stderr, flush=True)
    return 0


def _serving_message(model: str, api_key: Optional[str]) -> str:
    auth = "; clients must send its API key" if api_key else ""
    return f"{PROG}: serving {model!r}{auth}; Ctrl-C to stop"


def _serve_embedded(args, api_key: Optional[str], signals: _StopSignals) -> None:
    from torchrl_oni.serve.embedded import start_embedded_server
    from torchrl_oni.serve.http import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE,
                                        DEFAULT_READ_TIMEOUT)
    from torchrl_oni.serve.models import ModelNotInstalledError, WeightsMismatchError
    from torchrl_oni.serve.vllm import wait_for_model

    if args.backend == "embedded":
        from torchrl_oni.serve.models import find_model

        try:  # a path is checked here, a hub id fetched by the loader below
            find_model(args.model or DEFAULT_MODEL, download=False)
        except ValueError as err:
            fail(PROG, str(err))
        print(f"{PROG}: loading {args.model or DEFAULT_MODEL} ...", file=sys.stderr, flush=True)
    max_body = (DEFAULT_MAX_BODY_BYTES if args.max_body_mb is None
                else int(args.max_body_mb * 2 ** 20))
    loaded: dict = {}

    def load() -> None:
        try:
            loaded["handle"] = start_embedded_server(
                args.model, backend=args.backend, host=args.host, port=args.port,
                threads=args.threads, dtype=args.dtype, served_name=args.served_model_name,
                max_tokens_cap=args.max_tokens_cap, node_cache_mb=args.node_cache_mb, api_key=api_key,
                insecure_no_auth=args.insecure_no_auth,
                max_queue=args.max_queue or DEFAULT_MAX_QUEUE,
                read_timeout=args.read_timeout or DEFAULT_READ_TIMEOUT,
                max_body_bytes=max(1, max_body), allowed_hosts=args.allowed_host,
            )
        except BaseException as err:  # handed to the main thread
            loaded["error"] = err

    # The model loads (imports, conversion, torch) in a thread, so that a stop signal lands in
    # the main thread's wait below, never inside the loading code.
    loader = threading.Thread(target=load, name="oni-serve-load", daemon=True)
    loader.start()
    try:
        with signals.interruptible():
            while loader.is_alive():
                loader.join(0.2)
    except _Stopped:
        # Nothing to clean up but the half-loaded model; leaving without finalising the
        # interpreter spares the loader thread from being frozen mid-import.
        print(f"{PROG}: stopped", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)
    error = loaded.get("error")
    if isinstance(error, (ValueError, ModelNotInstalledError, WeightsMismatchError, OSError)):
        fail(PROG, str(error))
    if error is not None:
        raise error
    with loaded["handle"] as handle, signals.interruptible():
        try:
            wait_for_model(handle.url, handle.model, timeout=30, api_key=api_key)
        except TimeoutError as err:
            fail(PROG, str(err))
        spec = getattr(getattr(handle.server.engine, "loaded", None), "spec", None)
        if spec is not None and spec.kind != "packaged":
            checksum = f"sha256 {spec.sha256}" if spec.sha256 else "not hashed"
            print(f"{PROG}: {spec.description}, {checksum}", file=sys.stderr, flush=True)
        print(handle.url, flush=True)
        print(_serving_message(handle.model, api_key), file=sys.stderr, flush=True)
        _wait_forever()


def _serve_vllm(args, extra: List[str], api_key: Optional[str], signals: _StopSignals) -> None:
    from torchrl_oni.serve.vllm import VLLMLaunchError, VLLMServer, vllm_available

    if not args.model:
        fail(PROG, "--backend vllm needs --model (a model path or id)")
    launcher = None
    if args.vllm_command is not None:
        try:
            launcher = shlex.split(args.vllm_command)
        except ValueError as err:
            fail(PROG, f"--vllm-command: {err}")
        if not launcher:
            fail(PROG, "--vllm-command is empty")
    elif not vllm_available():
        fail(PROG, "vllm is not installed here (pip install vllm on a GPU node)")
    from torchrl_oni.net import is_loopback

    fronted = not is_loopback(args.host)
    if fronted:
        # vLLM's key guards only /v1 (/invocations, /tokenize... answer anyone): vLLM listens on
        # loopback with a key of its own, and oni-serve's guard faces the network
        import secrets

        server = VLLMServer(args.model, host="127.0.0.1", port=0,
                            served_model_name=args.served_model_name, extra_args=extra,
                            launcher=launcher, startup_timeout=args.startup_timeout,
                            api_key=secrets.token_urlsafe(32))
    else:
        server = VLLMServer(args.model, host=args.host, port=args.port,
                            served_model_name=args.served_model_name, extra_args=extra,
                            launcher=launcher, startup_timeout=args.startup_timeout,
                            api_key=api_key, insecure_no_auth=args.insecure_no_auth)
    print(f"{PROG}: starting vLLM (log: {server.log_path}) ...", file=sys.stderr, flush=True)
    front = None
    try:
        # Interruptible throughout: start() only spawns and polls (a signal inside Popen
        # leaves an unrecorded child, which the kernel's parent-death signal then stops).
        with signals.interruptible():
            try:
                server.start()
            except VLLMLaunchError as err:
                last = err.log_tail.strip().splitlines()[-1:] if err.log_tail else []
                detail = f" (last log line: {last[0].strip()!r})" if last else ""
                where = f"; full log: {err.log_path}" if err.log_path else ""
                fail(PROG, f"vLLM did not start: {err.reason}{detail}{where}")
            url = server.url
            if fronted:
                front = _front_vllm(args, server, api_key)
                url = front.url
            print(url, flush=True)
            print(_serving_message(server.served_model_name, api_key), file=sys.stderr,
                  flush=True)
            _wait_forever()
    finally:
        signals.hold()  # nothing may interrupt stopping vLLM's process group
        if front is not None:
            front.stop()
        server.stop()


def _front_vllm(args, server, api_key: Optional[str]):
    """oni-serve's guard in front of a vLLM on loopback (:mod:`torchrl_oni.serve.proxy`), where
    ``--host`` says; returns its started :class:`~torchrl_oni.serve.embedded.ServerHandle`."""
    from torchrl_oni.serve.embedded import ServerHandle
    from torchrl_oni.serve.http import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT
    from torchrl_oni.serve.proxy import FORWARDED_ROUTES, GuardedProxy
    from torchrl_oni.serve.vllm import wait_for_model

    max_body = DEFAULT_MAX_BODY_BYTES if args.max_body_mb is None else int(args.max_body_mb * 2 ** 20)
    proxy = GuardedProxy(server.url, model=server.served_model_name, api_key=api_key,
                         upstream_key=server.api_key, allowed_hosts=args.allowed_host,
                         max_body_bytes=max(1, max_body), read_timeout=args.read_timeout or DEFAULT_READ_TIMEOUT)
    try:
        front = ServerHandle(proxy, args.host, args.port, insecure_no_auth=args.insecure_no_auth).start()
    except (OSError, ValueError) as err:
        fail(PROG, str(err))
    try:
        wait_for_model(front.url, server.served_model_name, timeout=30, api_key=api_key)
    except TimeoutError as err:
        front.stop()
        fail(PROG, f"oni-serve's front of vLLM: {err}")
    print(f"{PROG}: vLLM listens on 127.0.0.1:{server.port} only; {args.host}:{front.port} forwards "
          f"{', '.join(path for _, path in FORWARDED_ROUTES)} to it", file=sys.stderr, flush=True)
    return front


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
