"""Objects guarded by a lock that still copy and pickle: each copy gets a lock of its own.

A ``threading.Lock`` can be neither pickled nor deep-copied, yet reward sources, encoders and
statistics that hold one must travel into env workers (``ParallelEnv`` factories) and be
deep-copied by TorchRL (a collector's ``postproc``). :class:`OwnLockOnCopy` writes the copy
rule once: the state is read under the lock (no half-updated cache), the lock stays out, and the
copy makes a new one. A class adjusts what its copies carry in :meth:`~OwnLockOnCopy._copy_state`.

Example:
    >>> import copy, threading
    >>> class Counter(OwnLockOnCopy):
    ...     def __init__(self):
    ...         self._lock = threading.Lock()
    ...         self.n = 0
    >>> c = Counter(); c.n = 3
    >>> d = copy.deepcopy(c)  # pickling goes through the same two methods
    >>> d.n, d._lock is c._lock, d._lock.locked()
    (3, False, False)
"""
from __future__ import annotations

import threading

__all__ = ["OwnLockOnCopy"]


class OwnLockOnCopy:
    """Mixin for a class whose ``self._lock`` is a ``threading.Lock`` (see the module docstring)."""

    def __getstate__(self) -> dict:
        with self._lock:
            state = dict(self.__dict__)
            self._copy_state(state)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _copy_state(self, state: dict) -> None:
        """Adjusts the copied ``state`` in place, under the lock (e.g. copies a cache)."""
