"""Where env workers run, by name: the registry behind ``--backend``.

A backend is one :class:`Backend` entry: how to check its settings before anything starts, how
to build the collector the trainer iterates (the contract is written in
:mod:`torchrl_oni.train.distributed`), and what it can do. Adding one is one call to
:func:`register_backend` in the module that defines it; ``--backend`` lists every registered
name, and the trainer asks the entry, never the name, what the backend supports.
:func:`make_collector` and :func:`check_backend` do the same for a backend given by name.

This module imports no TorchRL and no Ray: ``oni-train --help`` reads the names from here, and
the built-in backends load their collectors (:mod:`torchrl_oni.train.distributed`) only when one
is built (Ray's check, :func:`~torchrl_oni.train.ray_session.check_ray`, imports Ray only when it
runs). The imports run one way: this registry loads the collectors' module, which knows
nothing of the registry.

=====================  ===========================================================================
field                  meaning
=====================  ===========================================================================
``name``               the ``--backend`` value
``help``               one line for ``--help``
``make``               ``make(env_factories, policy, *, frames_per_batch, total_frames, dist,
                       worker_policies, exploration_type)`` → collector; ``dist`` is the
                       ``distributed`` section of the configuration
``check``              ``check(dist)``: ``ValueError`` with one sentence if it cannot run here
``serves_policy``      its workers can act through a :class:`~torchrl_oni.train.acting.PolicyServer`
``restart_workers``    the trainer starts its workers again when one dies (``--worker-restarts``);
                       ``False`` where the backend handles faults itself (Ray restarts actors)
=====================  ===========================================================================

Example:
    >>> from torchrl_oni.train.backends import backend_names, get_backend
    >>> backend_names()
    ('local', 'ray')
    >>> get_backend("local").serves_policy
    True
    >>> get_backend("slurm")
    Traceback (most recent call last):
    ...
    ValueError: unknown --backend 'slurm' (local or ray)
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence, Tuple

from ..registry import Registry
from .ray_session import check_ray

__all__ = ["Backend", "register_backend", "get_backend", "backend_names", "check_backend_settings", "check_backend",
           "make_collector"]


def _no_check(dist) -> None:
    return None


@dataclass(frozen=True)
class Backend:
    name: str
    help: str
    make: Callable[..., Any]
    check: Callable[[Any], None] = _no_check
    serves_policy: bool = False
    restart_workers: bool = False


_REGISTRY: Registry[Backend] = Registry("--backend")
_BACKENDS = _REGISTRY.entries  # name -> entry (tests add one with monkeypatch.setitem)


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Adds ``backend`` under its name (``replace=True`` to override an existing one)."""
    return _REGISTRY.register(backend, replace=replace)


def backend_names() -> Tuple[str, ...]:
    return _REGISTRY.names()


def get_backend(name: str) -> Backend:
    return _REGISTRY.get(name)


# ---------------------------------------------------------------------- the built-in backends
def _collectors():
    # loaded when a collector is built, not on import: it brings TorchRL and
    # Ray's wrappers, which `oni-train --help` and the config never need
    return importlib.import_module("torchrl_oni.train.distributed")


def _make_local(env_factories, policy, *, frames_per_batch: int, total_frames: int, dist=None,
                worker_policies=None, exploration_type=None):
    prefetch = getattr(dist, "prefetch_batches", None) or 0
    return _collectors().make_local_collector(env_factories, policy, frames_per_batch=frames_per_batch, total_frames=total_frames,
                                worker_policies=worker_policies, exploration_type=exploration_type,
                                prefetch=prefetch)


def _check_local(dist) -> None:
    if getattr(dist, "ray_address", None) is not None:
        raise ValueError("--ray-address needs --backend ray")


def _make_ray(env_factories, policy, *, frames_per_batch: int, total_frames: int, dist=None,
              worker_policies=None, exploration_type=None):
    if worker_policies is not None or exploration_type is not None:
        what = "a PolicyServer's worker policies" if worker_policies is not None else "exploration_type"
        raise ValueError(f"{what} needs --backend local: Ray actors cannot reach a server in this process")
    options = {}
    if dist is not None:
        options = dict(ray_address=dist.ray_address, num_cpus_per_actor=dist.ray_num_cpus_per_actor,
                       max_restarts=dist.ray_max_restarts)
        # make_collector's callers may also size the object store and the dead-cluster timeout
        # (None, or not given: the Ray collector's own defaults)
        options.update({k: getattr(dist, k) for k in ("object_store_memory", "worker_timeout")
                        if getattr(dist, k, None) is not None})
    return _collectors().make_ray_collector(env_factories, policy, frames_per_batch=frames_per_batch, total_frames=total_frames,
                              **options)


def _check_ray(dist) -> None:
    check_ray(getattr(dist, "ray_address", None))


register_backend(Backend(
    "local", "env workers in processes on this machine (TorchRL's MultiAsyncCollector)",
    _make_local, _check_local, serves_policy=True, restart_workers=True,
))
register_backend(Backend(
    "ray", "env workers as Ray actors on any node of a Ray cluster (TorchRL's RayCollector)",
    _make_ray, _check_ray,
))


def check_backend_settings(dist) -> None:
    """The ``distributed`` section's backend exists and can run here (one-sentence ``ValueError``)."""
    get_backend(dist.backend).check(dist)


def check_backend(backend: str, ray_address: Optional[str] = None) -> None:
    """Raises ``ValueError`` with one sentence if the backend cannot be used here (the registered
    backend's own check).

    Example:
        >>> check_backend("local")
        >>> check_backend("ray", "head-node")
        Traceback (most recent call last):
        ...
        ValueError: --ray-address 'head-node': expected auto or HOST:PORT
    """
    get_backend(backend).check(SimpleNamespace(backend=backend, ray_address=ray_address))


def make_collector(
    backend: str,
    env_factories: Sequence[Callable],
    policy,
    frames_per_batch: int,
    total_frames: int,
    ray_address: Optional[str] = None,
    *,
    num_cpus_per_actor: float = 1.0,
    max_restarts: int = 3,
    object_store_memory: Optional[int] = None,
    worker_timeout: float = 600.0,
    worker_policies: Optional[Sequence[Any]] = None,
    exploration_type=None,
):
    """The trainer's collector: one env worker per factory, here or on a Ray cluster (the contract
    the trainer relies on: :mod:`torchrl_oni.train.distributed`).

    Args:
        backend: ``"local"`` (``MultiAsyncCollector``, one process per factory) or ``"ray"`` (one
            Ray actor per factory, anywhere in the cluster), or any registered backend.
        env_factories: picklable callables returning a batched env of K games (one per worker).
        policy: the acting policy (a CPU ``torch.nn.Module``); with ``"ray"`` only its
            architecture travels, its weights are the first update; unused with ``worker_policies``.
        frames_per_batch: frames of one worker's batch (K × rollout).
        total_frames: the iterator stops after this many frames.
        ray_address: ``None`` starts a Ray instance on this machine for the run (stopped by
            ``shutdown``); ``"auto"`` or ``"HOST:PORT"`` joins a running cluster.
        num_cpus_per_actor: CPUs Ray reserves for each env actor (1: one NetHack process per core).
        max_restarts: how many times Ray restarts a dead env actor.
        object_store_memory: bytes of object store of a Ray instance started for the run (``None``:
            :data:`torchrl_oni.train.ray_session.DEFAULT_OBJECT_STORE_MEMORY`).
        worker_timeout: seconds without any batch before the run fails (every worker dead or
            unplaceable).
        worker_policies: one policy per factory, used by that worker instead of a copy of
            ``policy`` (``"local"`` only): :meth:`PolicyServer.worker_policies()
            <torchrl_oni.train.acting.PolicyServer.worker_policies>`, whose server acts for all
            workers on the learner's device. The weights then live on the server: update them
            with ``server.update_weights``; the collector's ``update_policy_weights_`` does
            nothing (it may still be called).
        exploration_type: the workers' interaction type (``None``: TorchRL's default, RANDOM);
            ``ExplorationType.DETERMINISTIC`` acts greedily (``"local"`` only).

    Returns:
        ``MultiAsyncCollector`` or :class:`~torchrl_oni.train.distributed.RayEnvCollector`: iterate
        it, call ``update_policy_weights_(weights)`` after each update, ``shutdown()`` at the end.

    Example:
        >>> from torchrl_oni.envs import NLEBatchEnv
        >>> from torchrl_oni.train.config import TrainConfig
        >>> from torchrl_oni.train.policy import make_actor_critic
        >>> from torchrl_oni.train.env_factory import make_env_factory
        >>> cfg = TrainConfig(workers=1, envs_per_worker=2, rollout=8)
        >>> actor, _ = make_actor_critic(NLEBatchEnv("score", num_envs=1, seed=0))
        >>> collector = make_collector("local", [make_env_factory(cfg, 0)], actor,
        ...                            frames_per_batch=16, total_frames=32)
        >>> [tuple(batch.shape) for batch in collector]
        [(2, 8), (2, 8)]
        >>> collector.shutdown()
    """
    dist = SimpleNamespace(backend=backend, ray_address=ray_address, ray_num_cpus_per_actor=num_cpus_per_actor,
                           ray_max_restarts=max_restarts, object_store_memory=object_store_memory,
                           worker_timeout=worker_timeout)
    chosen = get_backend(backend)
    chosen.check(dist)
    return chosen.make(env_factories, policy, frames_per_batch=frames_per_batch, total_frames=total_frames, dist=dist,
                       worker_policies=worker_policies, exploration_type=exploration_type)

