"""The sparse-task grid behind ``benchmarks/sparse_tasks.py`` (its docstring is the usage), one module per concern.

For whoever changes the grid: the modules run down these layers, none imports one above it.

- :mod:`sparse_grid.grid`: the grid itself, its runs and the state of their folders (bottom layer);
- :mod:`sparse_grid.analysis`: the numbers, from eval.json and metrics.csv: means, CIs, pairings;
- :mod:`sparse_grid.report`: the tables and figures made of them;
- :mod:`sparse_grid.launcher`: the oni-train/oni-eval processes, their signals and progress lines;
- :mod:`sparse_grid.cli`: the command line that plans, runs and reports a grid (top layer).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # this checkout's torchrl_oni
