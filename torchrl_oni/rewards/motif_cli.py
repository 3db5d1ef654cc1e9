"""Old import path of offline Motif's commands, kept for one release.

``oni-collect-pairs``, ``oni-annotate-pairs`` and ``oni-train-reward`` take ``oni-train``'s
annotator settings and read its run folders, so they moved to :mod:`torchrl_oni.train.motif_cli`;
:mod:`torchrl_oni.rewards` is the library and imports nothing of :mod:`torchrl_oni.train`. This
alias resolves its names only when one is read, through :func:`importlib.import_module`, so
console scripts installed before the move (``torchrl_oni.rewards.motif_cli:collect_pairs_main``)
keep working. New code imports from :mod:`torchrl_oni.train.motif_cli`.

Example:
    >>> from torchrl_oni.rewards import motif_cli
    >>> from torchrl_oni.train import motif_cli as commands
    >>> motif_cli.collect_pairs_main is commands.collect_pairs_main
    True
"""
import importlib
import sys

__all__ = ["collect_pairs_main", "annotate_pairs_main", "train_reward_main", "main"]

_HOME = "torchrl_oni.train.motif_cli"


def __getattr__(name):
    if name in __all__:
        return getattr(importlib.import_module(_HOME), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(importlib.import_module(_HOME).main())
