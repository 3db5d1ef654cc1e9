"""Where env workers run, by name: the registry behind ``--backend``.

A backend is one :class:`Backend` entry: how to check its settings before anything starts, how
to build the collector the trainer iterates (the contract is written in
:mod:`torchrl_oni.train.distributed`), and what it can do. Adding one is one call to
:func:`register_backend` in the module that defines it; ``--backend`` lists every registered
name, and the trainer asks the entry, never the name, what the backend supports.

This module imports no TorchRL and no Ray: ``oni-train --help`` reads the names from here, and
the built-in backends load their collectors only when one is built.

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
from typing import Any, Callable, Tuple

from ..registry import Registry

__all__ = ["Backend", "register_backend", "get_backend", "backend_names", "check_backend_settings"]


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
    # by name, like an entry point: the collectors' module imports this registry, and loading it
    # here (TorchRL, Ray's wrappers) must wait until a collector is actually built
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
        options.update({k: getattr(dist, k) for k in ("object_store_memory", "worker_timeout") if hasattr(dist, k)})
    return _collectors().make_ray_collector(env_factories, policy, frames_per_batch=frames_per_batch, total_frames=total_frames,
                              **options)


def _check_ray(dist) -> None:
    _collectors().check_ray(getattr(dist, "ray_address", None))


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

