"""Run logging: one wide ``metrics.csv`` per run, TensorBoard and wandb through TorchRL's loggers.

``metrics.csv`` has one row per logged PPO iteration and one column per metric; a metric that
first appears later (e.g. episode returns once an episode has ended) adds a column and the file
is rewritten, atomically, with the new header. It is the file ``oni-plot`` and the tutorials read.

The record stays one increasing curve across crashes and resumes:

* logging a row with the same ``frames`` as the last one **updates** that row instead of adding
  a duplicate (the trainer's final row after its last iteration);
* ``RunLogger(..., resume_at=N)`` continues the record of a run resumed from a checkpoint taken
  at ``N`` frames: rows logged after that checkpoint (``frames > N``, by a process that was
  then killed) are dropped and the file is rewritten atomically, and ``time_s`` goes on from
  the last kept row (or from ``time_offset``) instead of restarting at 0;
* :class:`EpisodeWindow` has ``state_dict()`` / ``load_state_dict()`` so the episode statistics
  of a resumed run average the same episodes as before the stop.

A ``metrics.csv`` that cannot be parsed raises :class:`MetricsFileError` (a ``ValueError``)
with a one-line message.

Example:
    >>> import tempfile, csv, os
    >>> from torchrl_oni.train.run_log import RunLogger, read_metrics
    >>> d = tempfile.mkdtemp()
    >>> log = RunLogger(d, tensorboard=False)
    >>> log.log({"frames": 512, "time_s": 2.0, "fps": 900.0})
    >>> log.log({"frames": 1024, "time_s": 4.0, "fps": 950.0, "episode/return": 3.5})
    >>> log.log({"frames": 1536, "time_s": 6.0, "fps": 960.0})  # then the process is killed
    >>> log.close()
    >>> rows = list(csv.DictReader(open(os.path.join(d, "metrics.csv"))))
    >>> [r["episode/return"] for r in rows]
    ['', '3.5', '']
    >>> log = RunLogger(d, tensorboard=False, resume_at=1024)  # the checkpoint was at 1024 frames
    >>> log.log({"frames": 1536, "time_s": 1.5, "fps": 1000.0})  # time_s of the new process
    >>> log.log({"frames": 1536, "time_s": 1.6, "fps": 1000.0, "labels": 7.0})  # same frames: updated
    >>> log.close()
    >>> [(r["frames"], r["time_s"]) for r in read_metrics(d)]
    [(512.0, 2.0), (1024.0, 4.0), (1536.0, 5.6)]
"""
from __future__ import annotations

import collections
import csv
import io
import math
import os
from typing import Dict, Iterable, List, Optional

import numpy as np

from ..atomic import atomic_write
from ..run_folder import METRICS_NAME

__all__ = ["RunLogger", "EpisodeWindow", "read_metrics", "MetricsFileError", "METRICS_NAME"]

FRAMES, TIME = "frames", "time_s"


class MetricsFileError(ValueError):
    """A ``metrics.csv`` that cannot be parsed (one-line message naming the file and line)."""


class RunLogger:
    """Writes metrics to ``<run_dir>/metrics.csv`` and optionally TensorBoard / wandb.

    Args:
        run_dir: the run folder.

    Keyword Args:
        tensorboard, wandb, wandb_mode, exp_name, config: the extra backends.
        resume (bool): keep the rows already in ``metrics.csv`` (default: start a new file).
        resume_at (int, optional): resume at a checkpoint taken at this many frames: implies
            ``resume``, and rows with ``frames`` above it are dropped (the file is rewritten
            atomically).
        time_offset (float, optional): added to the ``time_s`` of every row logged from now on.
            Default when resuming: the ``time_s`` of the last kept row, so time goes on; 0
            otherwise.

    Raises:
        MetricsFileError: when resuming, the existing ``metrics.csv`` cannot be parsed.
    """

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
        resume_at: Optional[int] = None,
        time_offset: Optional[float] = None,
    ):
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.csv_path = os.path.join(run_dir, METRICS_NAME)
        self.rows: List[Dict[str, float]] = []
        self.columns: List[str] = []
        resume = resume or resume_at is not None
        if resume and os.path.exists(self.csv_path):
            rows, torn = _read_rows(self.csv_path, drop_torn_tail=True)
            kept = rows if resume_at is None else [r for r in rows if r.get(FRAMES, -math.inf) <= resume_at]
            self.rows = kept
            for row in kept:
                for k in row:
                    if k not in self.columns:
                        self.columns.append(k)
            if torn or len(kept) != len(rows):
                self._rewrite()
        if time_offset is None:
            times = [r[TIME] for r in self.rows if TIME in r] if resume else []
            time_offset = times[-1] if times else 0.0
        self.time_offset = float(time_offset)
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
        """Adds a row (``None`` and non-finite values are left out); ``time_s`` gets ``time_offset``.

        A row with the same ``frames`` as the last row updates that row: its values replace the
        earlier ones, metrics only the earlier row had are kept.
        """
        clean = {k: float(v) for k, v in metrics.items() if v is not None and _finite_number(v)}
        if TIME in clean:
            clean[TIME] += self.time_offset
        step = int(clean.get(FRAMES, len(self.rows))) if step is None else step
        new_columns = [k for k in clean if k not in self.columns]
        self.columns.extend(new_columns)
        last = self.rows[-1] if self.rows else None
        if last is not None and FRAMES in clean and last.get(FRAMES) == clean[FRAMES]:
            changed = {k: v for k, v in clean.items() if last.get(k) != v}
            self.rows[-1] = {**last, **clean}
            self._rewrite()
        else:
            changed = clean
            self.rows.append(clean)
            if new_columns or len(self.rows) == 1:
                self._rewrite()
            else:
                with open(self.csv_path, "a", newline="") as f:
                    csv.DictWriter(f, self.columns).writerow(clean)
        values = {k: v for k, v in changed.items() if k != FRAMES}
        for backend in self.backends:
            if values:
                _log_row(backend, values, step)

    def _rewrite(self) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, self.columns)
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write(self.csv_path, lambda f: f.write(text.getvalue().encode()))

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


def _log_row(backend, values: Dict[str, float], step: int) -> None:
    """One row to one backend in one write. TensorBoard: one event holding every value (what
    ``add_scalar`` writes, one value at a time: ~100 events a row cost a CPU trainer 3.5 ms an
    update, most of it handing each event to the writer thread). wandb: one history row
    (``log_metrics``), not one per metric."""
    from torchrl.record.loggers import TensorboardLogger

    if isinstance(backend, TensorboardLogger):
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        backend.experiment._get_file_writer().add_summary(summary, step)
    else:
        backend.log_metrics(values, step=step)


def _finite_number(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def read_metrics(path: str) -> List[Dict[str, float]]:
    """Reads a ``metrics.csv`` (or the run folder holding it) into a list of dicts of floats.

    Raises:
        FileNotFoundError: no such file.
        MetricsFileError: a line that is not a row of numbers under the header (one-line message).
    """
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_NAME)
    return _read_rows(path, drop_torn_tail=False)[0]


def _read_rows(path: str, drop_torn_tail: bool):
    """``(rows, torn)``; with ``drop_torn_tail`` a last line without its newline (an append cut
    short by a kill; RunLogger ends every line) is left out and ``torn`` is True."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise MetricsFileError(f"{path}: not a metrics file (not UTF-8 text)") from None
    torn = False
    if drop_torn_tail and text and not text.endswith("\n"):
        text, torn = text[: text.rfind("\n") + 1], True
    rows = []
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        header = reader.fieldnames or []
        if text.strip() and FRAMES not in header:
            raise MetricsFileError(f"{path}: not a metrics file (no '{FRAMES}' column in the header)")
        for row in reader:
            if None in row:
                raise MetricsFileError(f"{path}: line {reader.line_num}: more values than columns")
            parsed = {}
            for k, v in row.items():
                if v in ("", None):
                    continue
                try:
                    parsed[k] = float(v)
                except ValueError:
                    raise MetricsFileError(
                        f"{path}: line {reader.line_num}: {v[:40]!r} in column {k!r} is not a number") from None
            rows.append(parsed)
    except csv.Error as err:
        raise MetricsFileError(f"{path}: not a metrics file ({err})") from None
    return rows, torn


class EpisodeWindow:
    """Keeps the statistics of the last N finished episodes and averages them for the logs.

    Example:
        >>> w = EpisodeWindow(size=2)
        >>> w.add({"return": [1.0, 2.0, 4.0]})
        3
        >>> restored = EpisodeWindow(size=2)
        >>> restored.load_state_dict(w.state_dict())  # plain lists: fits a weights_only checkpoint
        >>> restored.means(), restored.episodes
        ({'episode/return': 3.0}, 3)
    """

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

    def state_dict(self) -> dict:
        """The window's values (lists of floats) and the episode count."""
        return {"episodes": int(self.episodes), "window": {k: [float(x) for x in v] for k, v in self.window.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict`; a smaller window keeps the newest values."""
        self.episodes = int(state["episodes"])
        self.window.clear()
        for k, values in state["window"].items():
            self.window[k].extend(float(x) for x in values)
