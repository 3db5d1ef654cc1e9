"""Run logging: one wide ``metrics.csv`` per run, TensorBoard and wandb through TorchRL's loggers.

``metrics.csv`` has one row per logged PPO iteration and one column per metric; a metric that
first appears later (e.g. episode returns once an episode has ended) adds a column and the file
is rewritten, atomically, with the new header. It is the file ``oni-plot`` and the tutorials read.

Example:
    >>> import tempfile, csv, os
    >>> from torchrl_oni.train.logging import RunLogger
    >>> d = tempfile.mkdtemp()
    >>> log = RunLogger(d, tensorboard=False)
    >>> log.log({"frames": 512, "fps": 900.0})
    >>> log.log({"frames": 1024, "fps": 950.0, "episode/return": 3.5})
    >>> log.close()
    >>> rows = list(csv.DictReader(open(os.path.join(d, "metrics.csv"))))
    >>> [r["episode/return"] for r in rows]
    ['', '3.5']
"""
from __future__ import annotations

import collections
import csv
import math
import os
from typing import Dict, Iterable, List, Optional

import numpy as np

__all__ = ["RunLogger", "EpisodeWindow", "read_metrics"]


class RunLogger:
    """Writes metrics to ``<run_dir>/metrics.csv`` and optionally TensorBoard / wandb."""

    def __init__(
        self,
        run_dir: str,
        *,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_mode: str = "offline",
        exp_name: str = "oni",
        config: Optional[dict] = None,
        resume: bool = False,
    ):
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.csv_path = os.path.join(run_dir, "metrics.csv")
        self.rows: List[Dict[str, float]] = []
        self.columns: List[str] = []
        if resume and os.path.exists(self.csv_path):
            self.rows = read_metrics(self.csv_path)
            for row in self.rows:
                for k in row:
                    if k not in self.columns:
                        self.columns.append(k)
        self.backends = []
        if tensorboard:
            from torchrl.record.loggers import TensorboardLogger

            self.backends.append(TensorboardLogger(exp_name, log_dir=os.path.join(run_dir, "tensorboard")))
        if wandb:
            try:
                from torchrl.record.loggers import WandbLogger

                if wandb_mode == "offline":
                    os.environ.setdefault("WANDB_MODE", "offline")
                logger = WandbLogger(
                    exp_name, offline=wandb_mode == "offline", save_dir=run_dir, project="torchrl_oni",
                    log_env_packages=False,
                )
                if config:
                    logger.log_hparams(config)
                self.backends.append(logger)
            except ImportError as err:
                raise RuntimeError("wandb logging needs `pip install wandb` (or torchrl_oni[wandb])") from err

    def log(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and _finite_number(v)}
        step = int(clean.get("frames", len(self.rows))) if step is None else step
        new_columns = [k for k in clean if k not in self.columns]
        self.columns.extend(new_columns)
        self.rows.append(clean)
        if new_columns or len(self.rows) == 1:
            self._rewrite()
        else:
            with open(self.csv_path, "a", newline="") as f:
                csv.DictWriter(f, self.columns).writerow(clean)
        for backend in self.backends:
            for k, v in clean.items():
                if k != "frames":
                    backend.log_scalar(k, v, step=step)

    def _rewrite(self) -> None:
        tmp = self.csv_path + ".tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, self.columns)
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.csv_path)

    def close(self) -> None:
        for backend in self.backends:
            exp = getattr(backend, "experiment", None)
            for closer in ("close", "finish", "flush"):
                fn = getattr(exp, closer, None)
                if callable(fn):
                    try:
                        fn()
                    except Exception:
                        pass
                    break


def _finite_number(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def read_metrics(path: str) -> List[Dict[str, float]]:
    """Reads a ``metrics.csv`` (or the run folder holding it) into a list of dicts of floats."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.csv")
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.append({k: float(v) for k, v in row.items() if v not in ("", None)})
    return rows


class EpisodeWindow:
    """Keeps the statistics of the last N finished episodes and averages them for the logs."""

    def __init__(self, size: int = 100):
        self.window: Dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=size))
        self.size = size
        self.episodes = 0

    def add(self, stats: Dict[str, Iterable[float]]) -> int:
        n = 0
        for k, values in stats.items():
            values = list(np.asarray(values, dtype=np.float64).reshape(-1))
            n = max(n, len(values))
            self.window[k].extend(values)
        self.episodes += n
        return n

    def means(self, prefix: str = "episode/") -> Dict[str, float]:
        return {prefix + k: float(np.mean(v)) for k, v in self.window.items() if len(v)}
