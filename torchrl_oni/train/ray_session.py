"""The run's Ray session, closed by default: what ``--backend ray`` checks before anything
starts, and how a run starts, joins and leaves a Ray instance.

* :func:`check_ray`: a well-formed ``--ray-address``, and a Ray with token authentication (2.52
  or later; without it anyone who reaches its ports can run code in the run);
* :func:`ray_init_kwargs`: the ``ray.init`` arguments: join a cluster, or start a Ray instance
  sized for the run's actors;
* :func:`closed_ray_instance`: around the ``ray.init`` that starts a run's own instance: it
  listens on 127.0.0.1 only (GCS, raylet, workers and agents; Ray's local-only mode), with token
  authentication on (the token file ``~/.ray/auth_token`` mode 0600), and keeps its session
  files (sockets, logs) under a private 0700 folder removed at the end instead of the
  world-writable ``/tmp/ray``;
* :func:`cluster_requires_auth`: whether a cluster refuses a client without its token (asked from
  a child process that runs this module: ``python -m torchrl_oni.train.ray_session ADDRESS``);
  joining one that does not is warned about once.

The collectors that use it: :mod:`torchrl_oni.train.distributed`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

__all__ = ["DEFAULT_OBJECT_STORE_MEMORY", "LOCAL_ONLY_ENV", "check_ray", "closed_ray_instance",
           "cluster_requires_auth", "ray_init_kwargs"]

log = logging.getLogger("torchrl_oni.train")

DEFAULT_OBJECT_STORE_MEMORY = 200 * 2**20  # bytes; batches are a few MB, weights under 1 MB
_ADDRESS = re.compile(r"^(auto|[^\s:/]+:\d{1,5})$")


def check_ray(ray_address: Optional[str]) -> None:
    """The Ray backend's check: a well-formed address, and Ray installed."""
    if ray_address is not None and not _ADDRESS.match(ray_address):
        raise ValueError(f"--ray-address {ray_address!r}: expected auto or HOST:PORT")
    try:
        import ray
    except ImportError:
        raise ValueError("--backend ray needs Ray: pip install 'torchrl_oni[ray]'") from None
    if not _has_token_auth():
        raise ValueError(f"--backend ray needs a Ray with token authentication (2.52 or later), not "
                         f"{getattr(ray, '__version__', '?')}: without it anyone who reaches its ports can run code "
                         f"in the run; pip install 'ray[default]>=2.52'")


def _has_token_auth() -> bool:
    """Whether the installed Ray has token authentication (``RAY_AUTH_MODE=token``, Ray 2.52+)."""
    try:
        from ray._raylet import AuthenticationMode  # noqa: F401
    except ImportError:
        return False
    return True


LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch to a local-only instance (``0``): every node address is 127.0.0.1, so its gRPC
servers (GCS, raylet, workers) and agents bind the loopback only. Read by Ray when it starts its
processes (and by :func:`ray._private.services.get_node_ip_address` at import), hence set in the
environment the Ray processes inherit."""

_warned: set = set()


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def _token_file() -> Optional[Path]:
    """The file Ray reads its token from here (``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``),
    None when ``RAY_AUTH_TOKEN`` gives the token itself."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return None
    given = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(given) if given else Path.home() / ".ray" / "auth_token"


def _private_token_file() -> None:
    """A token file only its owner reads: Ray writes ``~/.ray/auth_token`` with the umask's mode
    (0644 usually), which other users of the machine can read. Made here with mode 0600 when
    missing (Ray's own generator), tightened to 0600 when it is ours and looser."""
    path = _token_file()
    if path is None:
        return
    try:
        if not path.exists():
            try:
                from ray._private.authentication.authentication_token_generator import (
                    generate_new_authentication_token,
                )
                token = generate_new_authentication_token()
            except ImportError:  # a Ray that generates its tokens elsewhere
                import secrets

                token = secrets.token_hex(32)
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token)
            log.info("Ray: a new token for the run's Ray instance in %s (mode 0600)", path)
            return
        info = path.stat()
        if info.st_uid == os.getuid() and info.st_mode & 0o077:
            path.chmod(0o600)
            log.info("Ray: %s was readable by others (mode %o); now 0600", path, stat.S_IMODE(info.st_mode))
    except OSError as err:  # a read-only home: Ray's own handling decides
        log.warning("Ray: cannot make the token file %s private (%s)", path, err)


def _session_root() -> str:
    """A private folder (0700) for the run's Ray session; short, since Ray's Unix socket paths
    under it must stay below 108 characters."""
    base = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="oni-ray-", dir=base if len(base) <= 40 else "/tmp")


@contextlib.contextmanager
def closed_ray_instance():
    """Around the ``ray.init`` that starts a run's own Ray instance: closed by default.

    * every Ray process binds 127.0.0.1 (:data:`LOCAL_ONLY_ENV` for the processes Ray starts,
      Ray's ``ENABLE_RAY_CLUSTER`` flag for this one; both restored on exit, once Ray's processes
      have them): without it GCS, raylet and workers listen on every interface and the agents
      on the node's address;
    * token authentication on (``RAY_AUTH_MODE=token``, as Ray 2.60 does for a new instance
      and 2.52 does not), with a private token file (:func:`_private_token_file`), unless
      ``RAY_AUTH_MODE`` says otherwise (then a warning);
    * yields a folder inside a private one (0700) to pass as ``_temp_dir``: Ray makes its temp
      folder world-writable (``/tmp/ray`` is 0777 without the sticky bit), its sockets and logs
      included, and the private parent keeps other users out. The caller removes the parent
      after ``ray.shutdown()``.
    """
    import ray._private.ray_constants as ray_constants

    saved_env, saved_flag = os.environ.get(LOCAL_ONLY_ENV), getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    os.environ[LOCAL_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is None:
        os.environ["RAY_AUTH_MODE"] = "token"  # kept: this process talks to the instance with it
        try:
            from ray._raylet import Config

            Config.initialize("")  # Ray reads the mode from its config, made at import
        except (ImportError, AttributeError):
            pass
    elif mode.lower() != "token":
        _warn_once("auth-mode", "Ray: the run's Ray instance starts without token authentication (RAY_AUTH_MODE=%s): "
                   "any user of this machine can run code in it; unset RAY_AUTH_MODE or set it to token", mode)
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        _private_token_file()
    root = _session_root()
    try:
        yield os.path.join(root, "ray")
    finally:
        if saved_env is None:
            os.environ.pop(LOCAL_ONLY_ENV, None)
        else:
            os.environ[LOCAL_ONLY_ENV] = saved_env
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag


def _auth_probe(ray_address: str) -> str:
    """What the GCS at ``ray_address`` does with a client without a token: ``"refused"``, ``"open"``
    or ``"unknown"``. Run in the child process of :func:`cluster_requires_auth` (``python -m
    torchrl_oni.train.ray_session ADDRESS`` prints it), whose ``RAY_AUTH_MODE`` is ``disabled``."""
    from ray._private.services import canonicalize_bootstrap_address
    from ray._raylet import GcsClient

    # HOST:PORT as given (Ray would turn 127.0.0.1 into this node's address); 'auto' from Ray's address file
    address = ray_address if ray_address != "auto" else canonicalize_bootstrap_address("auto")
    try:
        GcsClient(address=address).internal_kv_get(b"oni-auth-probe", namespace=None, timeout=5)
    except Exception as err:
        return "refused" if "auth" in (type(err).__name__ + str(err)).lower() else "unknown"
    return "open"


def cluster_requires_auth(ray_address: str, timeout: float = 30.0) -> Optional[bool]:
    """Whether the Ray cluster at ``ray_address`` refuses a client without its token: True
    (refused), False (it answered one: anyone who reaches its port can run code on it), None (no
    answer either way). Asks its GCS from a child process with ``RAY_AUTH_MODE=disabled`` and no
    token (Ray keeps one authentication mode per process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env["RAY_AUTH_MODE"] = "disabled"
    try:
        done = subprocess.run([sys.executable, "-m", __name__, ray_address], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    answer = done.stdout.strip().splitlines()[-1:] or [""]
    return {"refused": True, "open": False}.get(answer[0])


def _probe(ray_address: Optional[str], timeout: float = 10.0) -> None:
    """Fails fast on a HOST:PORT where nothing listens: ``ray.init`` retries such an address for
    minutes before giving up."""
    if ray_address is None or not re.match(r"^[^\s:/]+:\d+$", ray_address):
        return
    host, port = ray_address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as err:
        raise ConnectionError(f"--ray-address {ray_address}: nothing answers there ({err}); is the head started "
                              f"(ray start --head --port {port})?") from None


def ray_init_kwargs(ray_address: Optional[str], num_cpus: float,
                    object_store_memory: int = DEFAULT_OBJECT_STORE_MEMORY) -> Dict[str, Any]:
    """``ray.init`` arguments: join a cluster, or start a Ray instance sized for ``num_cpus``.

    A Ray instance started for the run offers exactly the CPUs its actors reserve (no
    oversubscription of a small machine), a small object store and no dashboard, and its node
    address is 127.0.0.1 (with :func:`closed_ray_instance` around ``ray.init``, every port it
    opens is on the loopback). A cluster's sizes belong to its ``ray start`` commands, so joining
    one passes only the address.

    Example:
        >>> ray_init_kwargs(None, num_cpus=2)["num_cpus"], ray_init_kwargs("auto", 2)["address"]
        (2, 'auto')
        >>> ray_init_kwargs(None, num_cpus=2)["_node_ip_address"]
        '127.0.0.1'
    """
    common = dict(log_to_driver=True, logging_level=logging.WARNING)
    if ray_address is not None:
        return dict(address=ray_address, **common)
    return dict(num_cpus=num_cpus, num_gpus=0, object_store_memory=int(object_store_memory),
                include_dashboard=False, _node_ip_address="127.0.0.1", **common)


def _remove_session_root(root: Optional[str]) -> None:
    """Removes the private folder of a run's own Ray instance once that instance is stopped."""
    import ray

    if root and not ray.is_initialized():
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":  # cluster_requires_auth's child process
    print(_auth_probe(sys.argv[1]))
