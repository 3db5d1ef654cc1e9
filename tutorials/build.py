"""Builds the tutorial notebooks from their sources, optionally executed with their outputs.

The tutorials are kept as plain Python scripts in jupytext's "percent" format
(``tutorials/NN_*.py``: ``# %% [markdown]`` comment blocks and ``# %%`` code cells), so they read
and diff like code. This script turns them into ``.ipynb`` notebooks:

    python tutorials/build.py                    # notebooks without outputs, in tutorials/_build/
    python tutorials/build.py --execute          # run each one (small setting), save its outputs
    python tutorials/build.py --execute --full 04_train_and_plot --out /tmp/nb

Each notebook runs top to bottom with nbclient, in a fresh temporary folder (its runs and files
go there and are removed afterwards), with ``ONI_TUTORIAL_SMALL=1`` (``--full``: ``0``, the
bigger setting) and figures saved inline; each one's wall time is printed. A notebook that fails
is still written, with the error in its outputs, and the exit code is 1.

Opening a source directly in Jupyter also works with the jupytext extension (right-click,
"Open With", "Notebook"); ``jupytext.toml`` here keeps its version header out of the sources.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "_build"
SMALL_ENV = "ONI_TUTORIAL_SMALL"  # read by each tutorial's scale cell
INLINE_FIGURES = "module://matplotlib_inline.backend_inline"  # figures become image/png outputs


def sources() -> List[Path]:
    """The tutorial sources, in reading order."""
    return sorted(HERE.glob("[0-9][0-9]_*.py"))


def to_notebook(path: Path):
    """The notebook (an ``nbformat`` v4 node, no outputs) that a percent-format source describes."""
    import jupytext

    nb = jupytext.read(path)
    nb.metadata.pop("jupytext", None)  # how the source was written: not part of the notebook
    nb.metadata.setdefault("kernelspec", {"name": "python3", "display_name": "Python 3", "language": "python"})
    return nb


def execute(nb, workdir: Path, small: bool = True, timeout: int = 1800) -> float:
    """Runs ``nb`` in place, top to bottom, in ``workdir``; returns the wall time in seconds.

    Raises ``nbclient.exceptions.CellExecutionError`` at the first failing cell (``nb`` then holds
    the outputs up to it, the error included).
    """
    from nbclient import NotebookClient

    env = dict(os.environ, **{SMALL_ENV: "1" if small else "0", "MPLBACKEND": INLINE_FIGURES})
    client = NotebookClient(nb, timeout=timeout, kernel_name=nb.metadata.kernelspec.get("name", "python3"),
                            resources={"metadata": {"path": str(workdir)}})
    t0 = time.perf_counter()
    client.execute(env=env)  # passed to the kernel manager: the kernel's environment, not ours
    return time.perf_counter() - t0


def write(nb, path: Path) -> Path:
    import nbformat

    from torchrl_oni.atomic import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    text = nbformat.writes(nb) + "\n"
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def _select(names: List[str], parser: argparse.ArgumentParser) -> List[Path]:
    found = sources()
    if not names:
        return found
    by_name: Dict[str, Path] = {}
    for path in found:
        by_name.update({path.stem: path, path.name: path, path.stem[:2]: path})
    unknown = [n for n in names if n not in by_name]
    if unknown:
        parser.error(f"unknown tutorial {unknown[0]!r}; choose from {', '.join(p.stem for p in found)}")
    return [by_name[n] for n in names]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="build.py", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="TUTORIAL",
                        help="tutorials to build: 01, 01_transforms_in_your_pipeline or its .py (default: all)")
    parser.add_argument("--execute", action="store_true", help="run each notebook and save its outputs")
    parser.add_argument("--full", action="store_true", help="with --execute: the bigger setting (SMALL = False)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                        help=f"where the .ipynb files go (default: {DEFAULT_OUT.relative_to(HERE.parent)})")
    parser.add_argument("--timeout", type=int, default=1800, metavar="SECONDS",
                        help="with --execute: the longest one cell may run (default: 1800)")
    args = parser.parse_args(argv)
    if args.full and not args.execute:
        parser.error("--full needs --execute")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    failed = 0
    for src in _select(args.names, parser):
        nb = to_notebook(src)
        target = args.out / f"{src.stem}.ipynb"
        if not args.execute:
            print(f"wrote {write(nb, target)}")
            continue
        from nbclient.exceptions import CellExecutionError

        with tempfile.TemporaryDirectory(prefix="oni_tutorial_") as work:
            t0 = time.perf_counter()
            try:
                seconds = execute(nb, Path(work), small=not args.full, timeout=args.timeout)
                status = f"{seconds:.1f} s"
            except CellExecutionError as err:  # keep the notebook: its outputs show where and why
                failed += 1
                reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
                status = f"FAILED after {time.perf_counter() - t0:.1f} s: {reason}"
        print(f"{src.stem}: {status} -> {write(nb, target)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
