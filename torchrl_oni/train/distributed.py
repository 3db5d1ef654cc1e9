"""Where the env workers run: local processes or Ray actors on any node, behind one collector.

The collectors :class:`~torchrl_oni.train.ppo.Trainer` iterates, for the two backends built in
(registered by name in :mod:`torchrl_oni.train.backends`, whose
:func:`~torchrl_oni.train.backends.make_collector` builds one; this module knows nothing of that
registry):

* ``"local"``: TorchRL's ``MultiAsyncCollector``, one process per env factory on this machine;
* ``"ray"``: TorchRL's ``RayCollector`` (``torchrl.collectors.distributed``), one Ray actor per env
  factory, placed by Ray on any node of a cluster (``ray_address="auto"`` or ``"HOST:PORT"``; no
  address starts a Ray instance on this machine for the run and stops it at the end).

Contract, the same for both (what the trainer relies on):

* ``for batch in collector``: one worker's TensorDict ``[K, T]`` at a time, first ready first
  served; the worker keeps playing while the learner learns on it; the iterator counts the
  frames delivered (``"local"`` with ``prefetch``: a thread takes up to that many batches ahead
  of the trainer, :mod:`torchrl_oni.train.prefetch`);
* ``collector.update_policy_weights_(weights)``: ``TensorDict.from_module(actor)`` on CPU; does
  not wait for the workers;
* ``collector.shutdown()``: stops the workers (and the Ray instance the run started);
* ``collector.last_worker``: the index of the worker whose batch came last (None: unknown), and,
  for a backend whose workers the trainer restarts (``"local"``), ``collector.procs``: the worker
  processes, which the trainer's stall watchdog (:mod:`torchrl_oni.train.watchdog`) kills when
  they go silent.

With ``worker_policies`` (``"local"`` only) the workers act through a
:class:`~torchrl_oni.train.acting.PolicyServer` on the learner's device instead of their own CPU
copies: the weights live on the server (``server.update_weights``), and the collector's
``update_policy_weights_`` does nothing.

What the Ray backend adds on top of ``RayCollector`` (TorchRL 0.14.1), and why:

* **weights through the object store** (:class:`ObjectStoreWeightSyncScheme`, a TorchRL
  ``WeightSyncScheme``): ``ray.put`` once per update, then one queued ``update_policy_weights_``
  call per actor, applied between two of its batches. ``RayCollector``'s default
  ``RayWeightSyncScheme`` sends over a gloo process group of fixed size and waits for every actor
  to finish its rollout (the learner stalls ~one rollout per update, measured), and a restarted
  actor cannot rejoin the group;
* **the next rollout is requested before the batch is handed over** (as ``MultiAsyncCollector``
  does); ``RayCollector`` asks only after the learner's update, leaving the worker idle
  meanwhile. A batch is played with the weights its worker had when the batch began;
* **faults**: actors are created with Ray's ``max_restarts``; when one dies (its process, or its
  node) the run goes on with the others, says so once in the log, re-requests the worker with
  back-off until Ray has restarted it, and its first rollout after the restart carries the
  current weights. A batch lost in flight is never counted; a worker Ray reports dead for good
  is dropped. ``RayCollector`` itself stops at the first dead actor;
* **closed by default**: a Ray instance started for the run (no ``ray_address``) listens on
  127.0.0.1 only (GCS, raylet, workers and agents; Ray's local-only mode, :func:`closed_ray_instance`),
  with token authentication on (the token file ``~/.ray/auth_token`` mode 0600), and keeps its
  session files (sockets, logs) under a private 0700 folder removed at the end instead of the
  world-writable ``/tmp/ray``; joining a cluster checks whether it answers a client without a
  token and warns once if it does (:func:`cluster_requires_auth`). A Ray without token
  authentication (before 2.52) is refused;
* **small actor constructor arguments**: actors receive a weightless copy of the policy (NaN
  until the first weights arrive, so a missed update fails loudly). Arguments over 100 kB go to
  Ray's object store, and Ray cannot restart an actor whose arguments lived on a dead node
  (ray-project/ray#53727).

A collector is built through the registry: see :func:`torchrl_oni.train.backends.make_collector`
(its example runs the local backend end to end).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import logging
import math
import os
import queue
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.collectors import Collector, MultiAsyncCollector
from torchrl.collectors.distributed import RayCollector
from torchrl.weight_update import WeightSyncScheme

__all__ = [
    "ObjectStoreWeightSyncScheme",
    "RayEnvCollector",
    "LocalEnvCollector",
    "ServedPolicyCollector",
    "check_ray",
    "closed_ray_instance",
    "cluster_requires_auth",
    "make_local_collector",
    "make_ray_collector",
    "ray_init_kwargs",
]

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


_AUTH_PROBE = """
import sys
from ray._private.services import canonicalize_bootstrap_address
from ray._raylet import GcsClient
# HOST:PORT as given (Ray would turn 127.0.0.1 into this node's address); 'auto' from Ray's address file
address = sys.argv[1] if sys.argv[1] != "auto" else canonicalize_bootstrap_address("auto")
try:
    GcsClient(address=address).internal_kv_get(b"oni-auth-probe", namespace=None, timeout=5)
except Exception as err:
    print("refused" if "auth" in (type(err).__name__ + str(err)).lower() else "unknown")
else:
    print("open")
"""


def cluster_requires_auth(ray_address: str, timeout: float = 30.0) -> Optional[bool]:
    """Whether the Ray cluster at ``ray_address`` refuses a client without its token: True
    (refused), False (it answered one: anyone who reaches its port can run code on it), None (no
    answer either way). Asks its GCS from a child process with ``RAY_AUTH_MODE=disabled`` and no
    token (Ray keeps one authentication mode per process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env["RAY_AUTH_MODE"] = "disabled"
    try:
        done = subprocess.run([sys.executable, "-c", _AUTH_PROBE, ray_address], env=env, capture_output=True,
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


# ---------------------------------------------------------------------------------- weights
class _ActorTransport:
    """One actor's end of :class:`ObjectStoreWeightSyncScheme`: queues a weight update on it."""

    def __init__(self, actor):
        self.actor = actor

    def send_weights(self, weights_ref) -> Any:
        return self.actor.update_policy_weights_.remote(weights_ref)

    def setup_connection_and_weights_on_sender(self) -> None:
        pass  # nothing to connect: the first update carries the weights

    def setup_connection_and_weights_on_receiver(self, **kwargs) -> None:
        return None


class ObjectStoreWeightSyncScheme(WeightSyncScheme):
    """TorchRL weight sync for Ray actors through Ray's object store, without waiting.

    ``send`` puts the weights in the object store once and queues one
    ``update_policy_weights_(ref)`` call per actor (TorchRL's own ``Collector`` method: it copies
    them into the actor's policy in place). A Ray actor runs its calls in the order they were
    submitted, so an actor busy with a rollout applies the update right after it, before its next
    one; the learner never waits. Updates that failed because their actor died are dropped
    (the collector re-sends :attr:`latest` with the actor's first rollout after its restart);
    any other failure, e.g. weights that do not fit the policy, is raised at the next ``send``.

    Args:
        strategy: ``"tensordict"`` (TorchRL's default weight format).
    """

    def __init__(self, strategy: str = "tensordict"):
        super().__init__(strategy)
        self.latest = None  # ObjectRef of the last weights sent
        self._in_flight: List[Any] = []

    def create_transport(self, *, remote_actor=None, **kwargs) -> _ActorTransport:
        return _ActorTransport(remote_actor)

    def _init_on_sender_impl(self, model_id: str, context: Any = None, **kwargs) -> None:
        self.model_id = model_id
        actors = kwargs.get("remote_collectors")
        if actors is None and context is not None:
            actors = context.remote_collectors
        if not actors:
            raise ValueError("ObjectStoreWeightSyncScheme needs the remote collectors (Ray actors)")
        for idx, actor in enumerate(actors):
            self._register_worker_sender(worker_idx=idx, transport=self.create_transport(remote_actor=actor))
        if context is not None:
            self.context = context
        if kwargs.get("model") is not None:
            self.model = kwargs["model"]

    def _init_on_receiver_impl(self, model_id: str, context: Any = None, **kwargs) -> None:
        self.model_id = model_id  # the actor's Collector.update_policy_weights_ applies the weights

    def _setup_connection_and_weights_on_receiver_impl(self, *, worker_idx=None) -> None:
        pass

    def forget(self, worker_idx: int) -> None:
        """Stops sending to a worker that is gone for good."""
        if self._sender_transports is not None:
            self._sender_transports.pop(worker_idx, None)

    def send(self, weights: Any = None, worker_ids=None) -> None:
        import ray

        if not self.synchronized_on_sender:
            raise RuntimeError("Must be synchronized on sender before sending weights")
        weights = self.prepare_weights(weights=weights, model_id=self._model_id, strategy=self._strategy,
                                       context=self.context)
        if weights is None:
            raise RuntimeError("no weights to send: pass them, or give the scheme a model")
        if isinstance(weights, TensorDictBase):
            weights = weights.data.cpu()
        self._reap()
        self.latest = ray.put(weights)
        if isinstance(worker_ids, int):
            worker_ids = [worker_ids]
        targets = sorted(self._sender_transports or {}) if worker_ids is None else worker_ids
        for idx in targets:
            transport = (self._sender_transports or {}).get(idx)
            if transport is not None:
                self._in_flight.append(transport.send_weights(self.latest))

    def _reap(self) -> None:
        """Collects finished updates: actor deaths are the collector's business, the rest raises."""
        import ray
        from ray.exceptions import RayActorError

        if not self._in_flight:
            return
        done, self._in_flight = ray.wait(self._in_flight, num_returns=len(self._in_flight), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError:
                pass

    def shutdown(self) -> None:
        super().shutdown()
        self._in_flight = []
        self.latest = None

    def __getstate__(self):
        state = super().__getstate__()
        state["latest"] = None
        state["_in_flight"] = []
        state["_sender_transports"] = None
        return state


# ---------------------------------------------------------------------------------- actors
class _PolicySkeleton:
    """Policy factory for the actors: the architecture without its weights (a few kB to pickle).

    The actor's copy is filled with NaN: it acts only after the learner's weights arrive (the
    first update is queued before the first rollout), and a missing update fails loudly.
    """

    def __init__(self, policy: torch.nn.Module):
        self.skeleton = copy.deepcopy(policy).to("meta")

    def __call__(self) -> torch.nn.Module:
        policy = copy.deepcopy(self.skeleton).to_empty(device="cpu")
        with torch.no_grad():
            for tensor in TensorDict.from_module(policy).values(True, True):
                tensor.fill_(math.nan if tensor.is_floating_point() else 0)
        return policy


class EnvWorker(Collector):
    """The Ray actor: TorchRL's single-process ``Collector`` over one batched env, plus two calls."""

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with it
        return f"EnvWorker{getattr(self, '_worker_idx', '')}"

    def node(self):
        """``(node id, IP address)`` of the Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def next_with_weights(self, weights: TensorDictBase):
        """Loads ``weights`` then collects a batch: a restarted actor's first call, one task so
        that it cannot act with its constructor's (NaN) weights."""
        self.update_policy_weights_(weights)
        return self.next()


def _results(refs: List[Any]) -> List[Any]:
    """``ray.get(refs)``, waited for in Python so that Ctrl-C/SIGTERM handlers keep their exception."""
    futures = [ref.future() for ref in refs]
    concurrent.futures.wait(futures)
    return [future.result() for future in futures]


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:160]}{'…' if len(text) > 160 else ''}"


class RayEnvCollector(RayCollector):
    """TorchRL's ``RayCollector`` that prefetches, counts delivered frames and outlives dead actors.

    Built by :func:`~torchrl_oni.train.backends.make_collector`; the keyword arguments are ``RayCollector``'s plus
    ``worker_timeout`` (seconds without any batch before the run fails) and ``retry_backoff``
    (first and longest wait between two requests to a worker that Ray is restarting).

    Attributes:
        last_worker: index of the worker that produced the last batch.
        worker_nodes: ``(node id, IP address)`` of each worker, as first placed.
        workers_alive: workers neither restarting nor gone.
    """

    def __init__(self, *args, worker_timeout: float = 600.0, retry_backoff=(1.0, 30.0), **kwargs):
        super().__init__(*args, **kwargs)
        self.worker_timeout = worker_timeout
        self.retry_backoff = retry_backoff
        self.last_worker: Optional[int] = None
        self.worker_nodes: List[tuple] = []
        self._actors = list(self.remote_collectors)  # shutdown() empties remote_collectors
        self._dropped: set = set()
        self._down: Dict[int, dict] = {}  # worker -> since, retry_at, backoff, died (ActorDiedError in a row)
        # requested batches: future of the ObjectRef -> (worker, ObjectRef). Waiting on the futures
        # (Python) rather than ray.wait (C++) lets a signal handler's exception through: Ray turns
        # any exception raised by a handler during ray.wait into a plain KeyboardInterrupt
        self._pending: Dict[Any, tuple] = {}

    @property
    def workers_alive(self) -> int:
        return len(self._actors) - len(self._dropped) - len(self._down)

    @property
    def _scheme(self) -> ObjectStoreWeightSyncScheme:
        return self._weight_sync_schemes["policy"]

    def _where(self, idx: int) -> str:
        return f" on {self.worker_nodes[idx][1]}" if idx < len(self.worker_nodes) else ""

    # ------------------------------------------------------------------ faults
    def _on_actor_error(self, idx: int, err: BaseException) -> None:
        from ray.exceptions import ActorDiedError

        now = time.monotonic()
        down = self._down.get(idx)
        if down is None:  # first failure since its last batch: the one log line of this incident
            down = self._down[idx] = dict(since=now, retry_at=now, backoff=self.retry_backoff[0], died=0)
            log.warning("env worker %d%s died (%s); training goes on with %d of %d workers while Ray restarts it",
                        idx, self._where(idx), _short(err), self.workers_alive, len(self._actors))
        else:
            down["retry_at"] = now + down["backoff"]
            down["backoff"] = min(2 * down["backoff"], self.retry_backoff[1])
        # ActorDiedError on the request sent after the first one too: dead, not restarting
        down["died"] = down["died"] + 1 if isinstance(err, ActorDiedError) else 0
        if down["died"] >= 2:
            del self._down[idx]
            self._dropped.add(idx)
            self._scheme.forget(idx)
            log.warning("env worker %d%s is gone for good (no restart left); continuing with %d of %d workers",
                        idx, self._where(idx), self.workers_alive, len(self._actors))

    def _request(self, idx: int, ref) -> None:
        self._pending[ref.future()] = (idx, ref)

    def _resubmit_due(self) -> None:
        now = time.monotonic()
        waiting = {idx for idx, _ in self._pending.values()}
        for idx, down in self._down.items():
            if down["retry_at"] <= now and idx not in waiting:
                # a restarted actor has re-run its constructor: its first task carries the weights
                self._request(idx, self._actors[idx].next_with_weights.remote(self._scheme.latest))

    # ------------------------------------------------------------------ iteration
    def _async_iterator(self):
        from ray.exceptions import ObjectLostError, RayActorError

        self._pending = {}
        for idx, actor in enumerate(self._actors):
            self._request(idx, actor.next.remote())
        last_batch = time.monotonic()
        while self.collected_frames < self.total_frames and not self._stop_event.is_set():
            self._resubmit_due()
            if not self._pending:
                if not self._down:
                    raise ConnectionError(f"all {len(self._actors)} env workers are gone (Ray reports them dead)")
                time.sleep(1.0)
                continue
            # while a worker is down, wake up every second to request it again when due
            timeout = 1.0 if self._down else max(self.worker_timeout, 1.0)
            ready, _ = concurrent.futures.wait(self._pending, timeout=timeout,
                                               return_when=concurrent.futures.FIRST_COMPLETED)
            if not ready:
                if time.monotonic() - last_batch > self.worker_timeout:
                    raise TimeoutError(
                        f"no env worker delivered a batch in {self.worker_timeout:.0f} s ({self.workers_alive} of "
                        f"{len(self._actors)} workers alive; `ray status` shows the cluster)")
                continue
            future = next(iter(ready))
            idx, _ = self._pending.pop(future)
            try:
                batch = future.result()
            except (RayActorError, ObjectLostError) as err:  # the actor died, or the node holding its batch
                self._on_actor_error(idx, err)
                continue
            if idx in self._down:
                down = self._down.pop(idx)
                log.warning("env worker %d%s is back after %.0f s; %d of %d workers", idx, self._where(idx),
                            time.monotonic() - down["since"], self.workers_alive, len(self._actors))
            # request the next batch first: the worker plays while the learner learns on this one
            self._request(idx, self._actors[idx].next.remote())
            self.collected_frames += batch.numel()
            self.last_worker = idx
            yield batch
            last_batch = time.monotonic()  # the learner's time with the batch is not the workers' silence
        self._pending = {}
        if self._collection_thread is None:
            self.shutdown()

    def shutdown(self, timeout: Optional[float] = None, shutdown_ray: bool = False) -> None:
        """Kills the actors, drops the batches in flight; never raises (it runs before the final save)."""
        self._pending = {}
        try:
            super().shutdown(timeout=timeout, shutdown_ray=shutdown_ray)
        except Exception as err:  # the cluster itself is gone: nothing left to stop
            log.warning("could not stop the Ray env workers cleanly (%s)", _short(err))
            self._runtime_lease.release()
        _remove_session_root(getattr(self, "session_root", None))


def _remove_session_root(root: Optional[str]) -> None:
    """Removes the private folder of a run's own Ray instance once that instance is stopped."""
    import ray

    if root and not ray.is_initialized():
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------------- served acting
class _Given:
    """Policy factory returning a given policy (a PolicyServer's worker policy), for ``policy_factory``."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self):
        return self.policy


class LocalEnvCollector(MultiAsyncCollector):
    """TorchRL's ``MultiAsyncCollector`` that says which worker produced each batch, and can
    take batches from its workers while the trainer is busy elsewhere.

    Attributes:
        last_worker: index of the worker whose batch was handed over last (as
            :class:`RayEnvCollector`'s); the trainer's stall watchdog
            (:mod:`torchrl_oni.train.watchdog`) times each worker's silence from it.
        prefetch: batches a background thread may take from the workers ahead of the trainer
            (:class:`~torchrl_oni.train.prefetch.Prefetcher`; each taken batch re-arms its
            worker at once instead of when the trainer asks); 0: TorchRL's own iterator.
    """

    last_worker: Optional[int] = None
    prefetch: int = 0
    _prefetcher = None
    _fetched_worker: Optional[int] = None

    def _get_from_queue(self, timeout=None):
        prefetcher = self._prefetcher
        if prefetcher is None or timeout is None:
            got = super()._get_from_queue(timeout=timeout)
        else:  # the prefetch thread: short waits, so that close() is not kept waiting
            from .prefetch import PrefetchStopped

            deadline = time.monotonic() + timeout
            while True:
                if prefetcher.stopping.is_set():
                    raise PrefetchStopped
                try:
                    got = super()._get_from_queue(timeout=min(0.05, max(deadline - time.monotonic(), 1e-3)))
                    break
                except (queue.Empty, TimeoutError):  # past the deadline: the caller's own timeout loop
                    if time.monotonic() >= deadline:
                        raise
        # TorchRL 0.14: (worker index, batch count, batch); anything else leaves the index unknown
        try:
            self._fetched_worker = int(got[0])
        except (TypeError, ValueError, IndexError):
            self._fetched_worker = None
        if prefetcher is None:
            self.last_worker = self._fetched_worker
        return got

    def iterator(self):
        if not self.prefetch:
            yield from super().iterator()
            return
        from .prefetch import Prefetcher

        def batches_and_workers():
            for batch in super(LocalEnvCollector, self).iterator():
                yield batch, self._fetched_worker

        self._prefetcher = Prefetcher(batches_and_workers(), self.prefetch, name="collector-prefetch")
        try:
            for batch, worker in self._prefetcher:
                self.last_worker = worker
                yield batch
        finally:
            self._stop_prefetch()

    def _stop_prefetch(self) -> None:
        prefetcher = self._prefetcher
        if prefetcher is not None:
            prefetcher.close()
            self._prefetcher = None

    def shutdown(self, *args, **kwargs):
        # the thread sends "continue" on the workers' pipes: it must be gone before "close" is sent
        self._stop_prefetch()
        schemes = dict(getattr(self, "_weight_sync_schemes", None) or {})
        try:
            return super().shutdown(*args, **kwargs)
        finally:
            # TorchRL drops its schemes without shutting them down; one left to the garbage
            # collector at interpreter exit puts on a multiprocessing queue there, whose feeder
            # thread can no longer start: the process never exits
            for scheme in schemes.values():
                with contextlib.suppress(Exception):
                    scheme.shutdown()


class ServedPolicyCollector(LocalEnvCollector):
    """``MultiAsyncCollector`` whose workers act through a :class:`~torchrl_oni.train.acting.PolicyServer`.

    Each worker's policy is a client of the server. The weights live on the server, so
    :meth:`update_policy_weights_` does nothing: call ``server.update_weights`` instead.
    """

    def update_policy_weights_(self, *args, **kwargs) -> None:
        return None


def make_local_collector(env_factories: Sequence[Callable], policy: torch.nn.Module, *, frames_per_batch: int,
                         total_frames: int, worker_policies=None, exploration_type=None, prefetch: int = 0):
    """The ``local`` backend: ``MultiAsyncCollector`` (:class:`LocalEnvCollector`), one process per
    factory on this machine (:class:`ServedPolicyCollector` when the workers act through a policy
    server); ``prefetch``: batches taken from the workers ahead of the trainer
    (:attr:`LocalEnvCollector.prefetch`)."""
    import multiprocessing

    from torchrl.weight_update import SharedMemWeightSyncScheme

    from ..spawn_check import check_main_guard

    # a script without a __main__ guard would hang TorchRL's collector start, under the start method
    # TorchRL will use: the one the user set (a script may choose "fork", which re-imports nothing,
    # as the tutorials do), else "spawn"
    check_main_guard(multiprocessing.get_start_method(allow_none=True) or "spawn")
    common = dict(frames_per_batch=frames_per_batch, total_frames=total_frames, device="cpu",
                  storing_device="cpu", split_trajs=False, num_sub_threads=1)
    if exploration_type is not None:
        common["exploration_type"] = exploration_type
    if worker_policies is not None:
        worker_policies = list(worker_policies)
        if len(worker_policies) != len(env_factories):
            raise ValueError(f"{len(worker_policies)} worker policies for {len(env_factories)} env workers")
        collector = ServedPolicyCollector(list(env_factories), policy_factory=[_Given(p) for p in worker_policies],
                                          **common)
    else:
        collector = LocalEnvCollector(
            list(env_factories),
            policy,
            **common,
            # the learner does not wait for every worker to acknowledge new weights (waiting cost
            # 7 ms an update of 36 ms, light policy on 2 cores); each worker's background thread
            # copies them into its policy when it reads the instruction, as it did before
            weight_sync_schemes={"policy": SharedMemWeightSyncScheme(sync=False)},
        )
    collector.prefetch = int(prefetch)
    return collector


def make_ray_collector(env_factories: Sequence[Callable], policy: torch.nn.Module, *, frames_per_batch: int,
                       total_frames: int, ray_address: Optional[str] = None, num_cpus_per_actor: float = 1.0,
                       max_restarts: int = 3, object_store_memory: int = DEFAULT_OBJECT_STORE_MEMORY,
                       worker_timeout: float = 600.0):
    """The ``ray`` backend: :class:`RayEnvCollector`, one Ray actor per factory on any node."""
    import ray

    n = len(env_factories)
    t0 = time.perf_counter()
    init = ray_init_kwargs(ray_address, n * num_cpus_per_actor, object_store_memory)
    own = ray_address is None and not ray.is_initialized()
    if not ray.is_initialized():
        _probe(ray_address)
        if ray_address is not None and cluster_requires_auth(ray_address) is False:
            _warn_once(f"open:{ray_address}", "Ray: the cluster at %s answers clients without a token: anyone who "
                       "reaches its port can run code on every node. Start every node with RAY_AUTH_MODE=token and "
                       "the same RAY_AUTH_TOKEN, and run oni-train with them (docs/cluster.md)", ray_address)
    # ray.init replaces the SIGTERM handler with sys.exit; the application's (oni-train's: save a
    # checkpoint, then stop) is put back below
    sigterm = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    scheme = ObjectStoreWeightSyncScheme()
    remote = dict(num_cpus=num_cpus_per_actor, num_gpus=0, max_restarts=max_restarts, max_task_retries=0)
    session_root = None
    try:
        with warnings.catch_warnings(), (closed_ray_instance() if own else contextlib.nullcontext()) as temp_dir:
            # RayCollector warns that a policy_factory's weights cannot be read from here: they are sent
            warnings.filterwarnings("ignore", message="The policy is not an nn.Module")
            if temp_dir is not None:
                init["_temp_dir"], session_root = temp_dir, os.path.dirname(temp_dir)
            collector = RayEnvCollector(
                list(env_factories),
                policy_factory=_PolicySkeleton(policy),
                frames_per_batch=frames_per_batch,
                total_frames=total_frames,
                device="cpu",
                storing_device="cpu",
                collector_class=EnvWorker,
                sync=False,
                ray_init_config=init,
                remote_configs=remote,
                weight_sync_schemes={"policy": scheme},
                worker_timeout=worker_timeout,
            )
    except ConnectionError as err:
        _remove_session_root(session_root)
        raise ConnectionError(f"--ray-address {ray_address}: no Ray cluster answers, or it refused this process "
                              f"(same RAY_AUTH_MODE/RAY_AUTH_TOKEN as the cluster?): {_short(err)}") from None
    except BaseException:
        _remove_session_root(session_root)
        raise
    finally:
        if callable(sigterm) and signal.getsignal(signal.SIGTERM) is not sigterm:
            signal.signal(signal.SIGTERM, sigterm)
    collector.session_root = session_root
    try:
        scheme.model = policy  # update_policy_weights_() without weights reads them from here
        _results([actor.__ray_ready__.remote() for actor in collector.remote_collectors])  # actors built
        collector.update_policy_weights_(TensorDict.from_module(policy))  # queued before the first rollout
        collector.worker_nodes = _results([actor.node.remote() for actor in collector.remote_collectors])
    except BaseException:
        collector.shutdown()
        raise
    ips = sorted({ip for _, ip in collector.worker_nodes})
    log.info("Ray: %d env workers on %d node(s) (%s), started in %.1f s", n, len(ips), ", ".join(ips),
             time.perf_counter() - t0)
    return collector
