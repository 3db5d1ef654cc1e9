"""How worker processes start: from a fork server that has already imported torch, TorchRL and NLE.

TorchRL starts env workers with ``spawn`` unless the program chose a start method, and so do
``oni-eval``'s game processes and the policy server's clients: each new process imports torch,
tensordict, TorchRL and NLE again before it steps a game, seconds per worker and more on a busy
machine. A fork server imports them once; every worker after that is a fork of the server, ready
at once. It is still not a fork of the trainer (no copied threads, CUDA context or open files),
which is why ``spawn`` is chosen over ``fork``, and it re-imports a ``__main__`` script as
``spawn`` does (:mod:`torchrl_oni.spawn_check` still applies).

``oni-train`` and ``oni-eval`` call :func:`use_forkserver` at start. A script of your own can call
it first thing under its ``if __name__ == "__main__":`` guard. It replaces the start method in
effect: importing TorchRL sets ``spawn`` for the whole program, so a choice made before cannot be
told from TorchRL's; call it only where the fork server is what you want.

Example:
    >>> import multiprocessing
    >>> from torchrl_oni.worker_start import use_forkserver, worker_context
    >>> method = use_forkserver()  # "forkserver" (on Windows, which has none: the method in effect)
    >>> multiprocessing.get_start_method() == method == worker_context().get_start_method()
    True
"""
from __future__ import annotations

import multiprocessing
from typing import Sequence

__all__ = ["PRELOAD", "use_forkserver", "worker_context"]

#: what the fork server imports before its first fork: the heavy imports every worker makes
#: (a name that fails to import is skipped by multiprocessing, and the worker imports it itself)
PRELOAD = ("torch", "tensordict", "torchrl", "nle", "torchrl_oni.envs", "torchrl_oni.train._rollout",
           "torchrl_oni._eval_play")


def use_forkserver(preload: Sequence[str] = PRELOAD) -> str:
    """Make a fork server preloaded with ``preload`` the start method of this program's worker
    processes; returns the start method in effect ("forkserver", or the one there was where the
    platform has no fork server)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():  # Windows
        return multiprocessing.get_start_method()
    inheriting = getattr(multiprocessing.current_process(), "_inheriting", False)
    if multiprocessing.parent_process() is not None or inheriting:
        # a worker, or one still importing an unguarded script again (multiprocessing's own flag
        # for that phase): only the parent starts workers
        return multiprocessing.get_start_method()
    multiprocessing.set_forkserver_preload(list(preload))
    multiprocessing.set_start_method("forkserver", force=True)
    # started now, the server makes its imports beside this process's own instead of after them
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return "forkserver"


def worker_context():
    """The multiprocessing context for this package's own worker processes (``oni-eval``'s games,
    the policy server's clients): the fork server where the program chose it (:func:`use_forkserver`),
    else ``spawn``; never ``fork``, since the caller may hold threads (a learner, tqdm, an annotation
    worker) that a fork would copy mid-step."""
    method = multiprocessing.get_start_method(allow_none=True)
    return multiprocessing.get_context("forkserver" if method == "forkserver" else "spawn")
