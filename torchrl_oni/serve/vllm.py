"""Launching a vLLM OpenAI-compatible server as a subprocess, for GPU nodes.

:class:`VLLMServer` runs ``python -m vllm.entrypoints.openai.api_server --model M --host H
--port P [--served-model-name N] [extra args]`` (the module form: the ``vllm`` console script is
broken in some CPU builds), writes its output to a log file, waits until ``/v1/models`` lists the
served name, and stops the process on :meth:`~VLLMServer.stop` or when the ``with`` block ends.
If the process dies while starting, or does not answer in time, :class:`VLLMLaunchError` says so
with the last lines of its log.

The command prefix is swappable (``launcher=``), which is how the tests run the launcher logic
against a small fake server without vLLM installed.

Example:
    >>> from torchrl_oni.serve.vllm import vllm_command
    >>> vllm_command("meta-llama/Llama-3.1-8B-Instruct", port=9001, served_model_name="llama",
    ...              extra_args=["--dtype", "float16"], python="python")[2:]
    ['vllm.entrypoints.openai.api_server', '--model', 'meta-llama/Llama-3.1-8B-Instruct', '--host', '127.0.0.1', '--port', '9001', '--served-model-name', 'llama', '--dtype', 'float16']
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Sequence

__all__ = ["VLLM_MODULE", "VLLMLaunchError", "VLLMServer", "vllm_command", "wait_for_model",
           "vllm_available"]

VLLM_MODULE = "vllm.entrypoints.openai.api_server"


class VLLMLaunchError(RuntimeError):
    """The server process failed to start or to answer in time (the message has its log tail)."""


def vllm_available() -> bool:
    """Whether ``vllm`` can be imported here (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def vllm_command(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: Optional[str] = None,
    extra_args: Sequence[str] = (),
    python: Optional[str] = None,
    launcher: Optional[Sequence[str]] = None,
) -> List[str]:
    """The argv that starts the server.

    Args:
        model: a model path or hub id, as vLLM takes it.
        host, port: where it listens.
        served_model_name: the name clients send (vLLM's default is ``model``).
        extra_args: passed through unchanged (``--dtype``, ``--max-model-len``, ...).
        python: the interpreter (default: this one).
        launcher: replaces ``[python, "-m", VLLM_MODULE]`` (e.g. a fake server in tests).
    """
    prefix = list(launcher) if launcher else [python or sys.executable, "-m", VLLM_MODULE]
    cmd = prefix + ["--model", model, "--host", host, "--port", str(port)]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    return cmd + list(extra_args)


def _listed_models(url: str, timeout: float = 2.0) -> List[str]:
    with urllib.request.urlopen(url.rstrip("/") + "/models", timeout=timeout) as resp:
        body = json.load(resp)
    return [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]


def wait_for_model(url: str, model: Optional[str] = None, timeout: float = 60.0,
                   process: Optional[subprocess.Popen] = None, interval: float = 0.25) -> List[str]:
    """Polls ``{url}/models`` until it answers (and lists ``model`` when given).

    Returns:
        The listed model ids.

    Raises:
        TimeoutError: not ready within ``timeout`` seconds.
        ChildProcessError: ``process`` exited first.
    """
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        if process is not None and process.poll() is not None:
            raise ChildProcessError(f"server process exited with code {process.returncode}")
        try:
            models = _listed_models(url)
            if model is None or model in models:
                return models
            last = f"listed {models}, not {model!r}"
        except (urllib.error.URLError, OSError, ValueError) as err:
            last = str(getattr(err, "reason", err))
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url}/models not ready after {timeout:.0f} s ({last})")
        time.sleep(interval)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


class VLLMServer:
    """A vLLM (or compatible) server subprocess, ready once ``/v1/models`` lists the model.

    Args:
        model: the model path or id passed as ``--model``.
        host: listen address (``0.0.0.0`` to serve other nodes).
        port: listen port; 0 picks a free one.
        served_model_name: the name clients use; defaults to ``model``.
        extra_args: more server flags, passed through.
        launcher: replaces ``python -m vllm.entrypoints.openai.api_server``.
        startup_timeout: seconds to wait for readiness (vLLM may take minutes to load).
        log_path: where the server's output goes (default: a temporary file).
        env: extra environment variables for the process.

    Example:
        >>> srv = VLLMServer("my-model", port=9001, served_model_name="m")
        >>> srv.url, srv.command[-4:]
        ('http://127.0.0.1:9001/v1', ['--port', '9001', '--served-model-name', 'm'])
    """

    def __init__(
        self,
        model: str,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        served_model_name: Optional[str] = None,
        extra_args: Sequence[str] = (),
        launcher: Optional[Sequence[str]] = None,
        startup_timeout: float = 900.0,
        log_path: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
    ) -> None:
        if port == 0:
            from torchrl_oni.serve.embedded import free_port

            port = free_port(host if host not in ("0.0.0.0", "") else "127.0.0.1")
        self.model = model
        self.host = host
        self.port = int(port)
        self.served_model_name = served_model_name or model
        self.command = vllm_command(model, host=host, port=self.port,
                                    served_model_name=served_model_name,
                                    extra_args=extra_args, launcher=launcher)
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else Path(
            tempfile.mkstemp(prefix="oni-vllm-", suffix=".log")[1])
        self.env = env
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self) -> "VLLMServer":
        """Starts the process and blocks until the model is listed.

        Raises:
            VLLMLaunchError: the process could not start, exited, or timed out (then it is killed).
        """
        env = dict(os.environ, **(self.env or {}))
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env,
                                            start_new_session=True)
        except OSError as err:
            raise VLLMLaunchError(f"cannot run {self.command[0]!r}: {err}") from None
        finally:
            log.close()
        try:
            wait_for_model(self.url, self.served_model_name, self.startup_timeout, self.process)
        except ChildProcessError:
            code = self.process.returncode
            raise VLLMLaunchError(
                f"server exited with code {code} while starting; last lines of {self.log_path}:\n"
                f"{_tail(self.log_path)}") from None
        except TimeoutError as err:
            self.stop()
            raise VLLMLaunchError(f"{err}; last lines of {self.log_path}:\n"
                                  f"{_tail(self.log_path)}") from None
        return self

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace`` seconds. Idempotent."""
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)  # its own session: reaches vLLM's worker processes too
            except (ProcessLookupError, PermissionError):
                proc.send_signal(sig)
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "VLLMServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
