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

* **weights through the object store**
  (:class:`~torchrl_oni.train.weight_sync.ObjectStoreWeightSyncScheme`, a TorchRL
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
  127.0.0.1 only (GCS, raylet, workers and agents; Ray's local-only mode,
  :func:`~torchrl_oni.train.ray_session.closed_ray_instance`),
  with token authentication on (the token file ``~/.ray/auth_token`` mode 0600), and keeps its
  session files (sockets, logs) under a private 0700 folder removed at the end instead of the
  world-writable ``/tmp/ray``; joining a cluster checks whether it answers a client without a
  token and warns once if it does (:func:`~torchrl_oni.train.ray_session.cluster_requires_auth`).
  A Ray without token authentication (before 2.52) is refused;
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
import signal
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.collectors import Collector, MultiAsyncCollector
from torchrl.collectors.distributed import RayCollector

from .ray_session import (DEFAULT_OBJECT_STORE_MEMORY, _probe, _remove_session_root, _warn_once, closed_ray_instance,
                          cluster_requires_auth, ray_init_kwargs)
from .weight_sync import ObjectStoreWeightSyncScheme

__all__ = [
    "RayEnvCollector",
    "LocalEnvCollector",
    "ServedPolicyCollector",
    "make_local_collector",
    "make_ray_collector",
]

log = logging.getLogger("torchrl_oni.train")


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
    (:attr:`LocalEnvCollector.prefetch`). Each worker runs
    :class:`~torchrl_oni.train._rollout.NLERolloutCollector`: TorchRL's ``Collector`` whose rollout
    fills the batch in place, without a TensorDict per step, where it can."""
    import multiprocessing

    from torchrl.weight_update import SharedMemWeightSyncScheme

    from ..spawn_check import check_main_guard
    from ._rollout import NLERolloutCollector

    # a script without a __main__ guard would hang TorchRL's collector start, under the start method
    # TorchRL will use: the one the user set (a script may choose "fork", which re-imports nothing,
    # as the tutorials do), else "spawn"
    check_main_guard(multiprocessing.get_start_method(allow_none=True) or "spawn")
    common = dict(frames_per_batch=frames_per_batch, total_frames=total_frames, device="cpu",
                  storing_device="cpu", split_trajs=False, num_sub_threads=1, collector_class=NLERolloutCollector)
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
