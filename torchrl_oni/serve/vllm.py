"""Launching a vLLM OpenAI-compatible server as a subprocess, for GPU nodes.

:class:`VLLMServer` runs ``python -m vllm.entrypoints.openai.api_server --model M --host H
--port P [--served-model-name N] [extra args]`` (the module form: the ``vllm`` console script is
broken in some CPU builds), writes its output to a log file, waits until ``/v1/models`` lists the
served name, and stops the process on :meth:`~VLLMServer.stop` or when the ``with`` block ends.
If the process dies while starting, or does not answer in time, :class:`VLLMLaunchError` says so
with the last lines of its log.

No vLLM process outlives its launcher: the server runs in its own process group (vLLM's engine
and worker processes included), which :meth:`~VLLMServer.stop` signals as a whole; an exception
or a signal that interrupts :meth:`~VLLMServer.start` stops it too; and on Linux the server gets
SIGTERM from the kernel if the launching process dies, even by SIGKILL (``PR_SET_PDEATHSIG``,
set when it is started from the main thread, since the kernel ties it to the launching thread).

An API key reaches vLLM through ``VLLM_API_KEY`` in its environment (vLLM's own variable, the
same as its ``--api-key``), so that it does not show in ``ps``; the readiness probe sends it.

The command prefix is swappable (``launcher=``), which is how the tests run the launcher logic
against a small fake server without vLLM installed.

Example:
    >>> from torchrl_oni.serve.vllm import vllm_command
    >>> vllm_command("meta-llama/Llama-3.1-8B-Instruct", port=9001, served_model_name="llama",
    ...              extra_args=["--dtype", "float16"], python="python")[2:]
    ['vllm.entrypoints.openai.api_server', '--model', 'meta-llama/Llama-3.1-8B-Instruct', '--host', '127.0.0.1', '--port', '9001', '--served-model-name', 'llama', '--dtype', 'float16']
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from torchrl_oni.net import check_exposure, free_port

__all__ = ["VLLM_MODULE", "VLLMLaunchError", "VLLMServer", "vllm_command", "wait_for_model",
           "vllm_available"]

VLLM_MODULE = "vllm.entrypoints.openai.api_server"


class VLLMLaunchError(RuntimeError):
    """The server process failed to start or to answer in time (the message has its log tail).

    Attributes:
        reason: what went wrong, in one line.
        log_path: the server's log file (None if the process never started).
        log_tail: the last lines of that log.
    """

    def __init__(self, reason: str, log_path: Optional[Path] = None, log_tail: str = "") -> None:
        message = reason if log_path is None else (
            f"{reason}; last lines of {log_path}:\n{log_tail}")
        super().__init__(message)
        self.reason, self.log_path, self.log_tail = reason, log_path, log_tail


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


def _listed_models(url: str, timeout: float = 2.0, api_key: Optional[str] = None) -> List[str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(url.rstrip("/") + "/models", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        body = json.load(resp)
    return [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]


def wait_for_model(url: str, model: Optional[str] = None, timeout: float = 60.0,
                   process: Optional[subprocess.Popen] = None, interval: float = 0.25,
                   api_key: Optional[str] = None) -> List[str]:
    """Polls ``{url}/models`` until it answers (and lists ``model`` when given).

    ``api_key`` is sent as ``Authorization: Bearer`` (a server with a key answers 401 without).

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
            models = _listed_models(url, api_key=api_key)
            if model is None or model in models:
                return models
            last = f"listed {models}, not {model!r}"
        except (urllib.error.URLError, OSError, ValueError) as err:
            last = str(getattr(err, "reason", err))
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url}/models not ready after {timeout:.0f} s ({last})")
        time.sleep(interval)


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _exit_with_parent() -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` that has Linux SIGTERM the child when this process dies, or None.

    None off Linux, where ``prctl`` is missing, or outside the main thread: the kernel sends the
    signal when the *thread* that forked exits, which for the main thread is the process' end.
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:  # runs in the child between fork and exec: no imports, no locks
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _group_alive(pgid: int) -> bool:
    """Whether a running process is left in process group ``pgid``.

    Signal 0 probes without killing; on Linux, members that are only zombies (exited, waiting
    for a parent that may never reap them, as PID 1 in some containers) do not count.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc"):
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state ppid pgrp
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


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
        api_key: the key clients must send (passed as ``VLLM_API_KEY``); None: no key.
        insecure_no_auth: allow a ``host`` other machines can reach without ``api_key``.

    Raises:
        ValueError: a non-loopback ``host`` without ``api_key`` or ``insecure_no_auth``.

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
        api_key: Optional[str] = None,
        insecure_no_auth: bool = False,
    ) -> None:
        check_exposure(host, api_key, insecure_no_auth)
        if port == 0:

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
        self.api_key = api_key or None
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self) -> "VLLMServer":
        """Starts the process and blocks until the model is listed.

        Whatever interrupts the wait (an exception, Ctrl-C, a signal handler that raises) stops
        the process before propagating.

        Raises:
            VLLMLaunchError: the process could not start, exited, or timed out (then it is killed).
        """
        env = dict(os.environ, **(self.env or {}))
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env,
                                            start_new_session=True,
                                            preexec_fn=_exit_with_parent())
        except OSError as err:
            raise VLLMLaunchError(f"cannot run {self.command[0]!r}: {err}") from None
        finally:
            log.close()
        try:
            wait_for_model(self.url, self.served_model_name, self.startup_timeout, self.process,
                           api_key=self.api_key)
        except ChildProcessError:
            code = self.process.returncode
            self.stop()  # its workers may outlive it in the process group
            raise VLLMLaunchError(f"server exited with code {code} while starting",
                                  self.log_path, _tail(self.log_path)) from None
        except TimeoutError as err:
            self.stop()
            raise VLLMLaunchError(str(err), self.log_path, _tail(self.log_path)) from None
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace`` seconds. Idempotent.

        The group is signalled even when the server process itself has already exited, since
        processes it started (vLLM's engine and workers) may still run in it.
        """
        proc = self.process
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)  # its own session: reaches vLLM's worker processes too
            except ProcessLookupError:  # the whole group is gone
                proc.poll()
                return
            except PermissionError:
                if proc.poll() is None:
                    proc.send_signal(sig)
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(proc.pid):
                return
            if sig == signal.SIGTERM:  # the leader left, stragglers remain: give them a moment
                deadline = time.monotonic() + min(grace, 5.0)
                while time.monotonic() < deadline and _group_alive(proc.pid):
                    time.sleep(0.05)
                if not _group_alive(proc.pid):
                    return

    def __enter__(self) -> "VLLMServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
