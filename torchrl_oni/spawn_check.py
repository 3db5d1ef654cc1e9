"""Refuse, with one clear line, to start worker processes from a script they would re-run.

TorchRL starts env workers (and the policy server's clients) with multiprocessing's ``spawn``:
each new process imports the user's ``__main__`` script again. A script without an
``if __name__ == "__main__":`` guard then builds a second trainer inside every worker, which
fails there ("start a new process before the current process has finished its bootstrapping
phase"), while the trainer waits forever in TorchRL's collector for a worker that will never
report ready. This module reads the script before any worker starts and names the fix instead.

Example:
    >>> import textwrap, tempfile, os
    >>> from torchrl_oni.spawn_check import has_main_guard
    >>> has_main_guard(textwrap.dedent('''
    ...     import torchrl_oni
    ...     if __name__ == "__main__":
    ...         train()
    ... '''))
    True
    >>> has_main_guard("from torchrl_oni.train import Trainer\\nTrainer.from_config(cfg).train()\\n")
    False
"""
from __future__ import annotations

import ast
import os
import sys
from typing import Optional

__all__ = ["MainGuardError", "has_main_guard", "check_main_guard"]


class MainGuardError(RuntimeError):
    """Worker processes would re-run a script without a ``__main__`` guard."""


def _is_main_test(test: ast.expr) -> bool:
    # `__name__ == "__main__"` or `"__main__" == __name__`
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def has_main_guard(source: str) -> bool:
    """Whether the module's top level has an ``if __name__ == "__main__":`` block."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True  # not ours to judge: the interpreter already ran it
    return any(isinstance(node, ast.If) and _is_main_test(node.test) for node in tree.body)


def check_main_guard(start_method: Optional[str] = "spawn") -> None:
    """Raise :class:`MainGuardError` when processes started with ``start_method`` would re-import
    a ``__main__`` script that has no guard. Interactive sessions and notebooks (no script file),
    ``python -m`` modules of installed packages with a guard, and ``fork`` are left alone."""
    if start_method == "fork":
        return
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name.rpartition(".")[2] == "__main__":
        return  # `python -m package`: multiprocessing never runs a package's __main__ again
    path = getattr(main, "__file__", None)
    if not path or not path.endswith(".py") or not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError):
        return
    if not has_main_guard(source):
        raise MainGuardError(
            f"{path} has no `if __name__ == \"__main__\":` guard: worker processes start by importing "
            "the script again, and each would start its own training while this one waits for them. "
            "Put the code that builds and trains under that guard."
        )
