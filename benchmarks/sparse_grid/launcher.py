"""Running the grid: the ``oni-train``/``oni-eval`` processes, a pool of them, stop signals passed
on to them, an untrained checkpoint for ``random``, the earlier evaluation kept when ``--frames`` is
raised, and the progress lines of the training runs.

For whoever changes how runs are executed; it reads run folders through :mod:`sparse_grid.grid`.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import grid_archive
from sparse_grid.grid import (EARLIER_EVAL, EVAL_LOG, EVAL_MODULE, TRAIN_LOG, TRAIN_MODULE, Run, _read_json,
                              eval_command, inspect_run, say)
from torchrl_oni.run_folder import holds_run


class Launcher:
    """Runs oni-train/oni-eval commands, one per pool thread; passes stop signals on to them."""

    def __init__(self, parallel: int, seconds: Optional[float]):
        self.parallel = parallel
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.lock = threading.RLock()  # RLock: the signal handler may run while this thread holds it
        self.procs: set = set()
        self.stopped_by: Optional[int] = None
        self.launched = {"train": 0, "resume": 0, "eval": 0, "create": 0}
        self.training: Dict[str, Run] = {}  # the runs whose oni-train runs now, by name (progress lines)

    def may_start(self) -> bool:
        return self.stopped_by is None and (self.deadline is None or time.monotonic() < self.deadline)

    def stop(self, signum: int) -> None:
        with self.lock:
            first = self.stopped_by is None
            self.stopped_by = self.stopped_by or signum
            procs = list(self.procs)
        for proc in procs:  # they run in sessions of their own: the terminal's Ctrl-C reaches only us
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)
        if first:
            say(f"{signal.Signals(signum).name}: stopping; {len(procs)} running command(s) save and exit "
                "(run the same command again to continue)")

    def run(self, kind: str, module: str, argv: List[str], log_path: Path) -> int:
        cmd = [sys.executable, "-m", module, *argv]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"\n$ {display_command(module, argv)}    # {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            log.flush()
            with self.lock:
                if self.stopped_by is not None:
                    return 128 + self.stopped_by
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, env=_child_env())
                self.procs.add(proc)
                self.launched[kind] += 1
            try:
                return proc.wait()
            finally:
                with self.lock:
                    self.procs.discard(proc)


REPO = Path(__file__).resolve().parent.parent.parent


def _child_env() -> Dict[str, str]:
    """This environment, with this checkout importable (as the script itself imports it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def display_command(module: str, argv: Sequence[str]) -> str:
    return shlex.join(["oni-train" if module == TRAIN_MODULE else "oni-eval", *argv])


def keep_earlier_eval(run: Run) -> Optional[Path]:
    """Renames ``RUN/eval.json`` to ``RUN/eval_<frames>.json`` when it evaluated fewer frames than
    the run is now trained to (``--frames`` raised): the evaluation about to run replaces it, and
    it is the grid's figure for that budget. Returns the new path, or None when nothing was kept
    (no eval.json, or one of as many frames, e.g. evaluated with other flags: that one is redone).
    """
    from torchrl_oni.evaluate import EVAL_NAME

    path = run.logdir / EVAL_NAME
    result = _read_json(path)
    frames = None if result is None else result.get("frames_trained")
    if not isinstance(frames, int) or frames >= run.target_frames:
        return None
    kept = run.logdir / EARLIER_EVAL.format(frames=frames)
    os.replace(path, kept)
    say(f"{run.name}: the evaluation at {frames:,} frames is kept as {kept.name}")
    return kept


def create_untrained(run: Run) -> None:
    """The random policy: a freshly initialised checkpoint (the networks of ``Trainer``, no hook), no
    training."""
    from torchrl_oni.train import Trainer
    from torchrl_oni.train.build import build_run
    from torchrl_oni.train.ppo import write_config

    # the networks exactly as the run would start, from its seed (run.config: resolved by parse_train_flags)
    trainer = Trainer(build_run(run.config, intrinsic=False), run.config.ppo, run.config.log)
    write_config(run.config, str(run.logdir))
    trainer.save()


def execute(run: Run, launcher: Launcher, args, eval_args, final: bool) -> None:
    """Trains (or resumes) ``run`` if needed, then evaluates it once its caption store's run is trained.

    Sets ``run.outcome``; with ``final=False`` an evaluation that must wait is left for later.
    """
    if not launcher.may_start():
        run.outcome = "not started"
        return
    if run.status in ("train", "resume"):
        argv = run.train_args + (["--resume"] if run.status == "resume" else [])
        if run.status == "train" and holds_run(str(run.logdir)):
            # metrics of a run that died before its first checkpoint: nothing to continue, and
            # oni-train keeps a folder holding a run unless told to start it over
            argv.append("--overwrite")
        say(f"{run.name}: {'continuing' if run.status == 'resume' else 'training'} ({run.target_frames:,} frames)")
        with launcher.lock:
            launcher.training[run.name] = run
        try:
            rc = launcher.run(run.status, TRAIN_MODULE, argv, run.logdir / TRAIN_LOG)
        finally:
            with launcher.lock:
                launcher.training.pop(run.name, None)
        if rc != 0:
            run.outcome = "interrupted" if rc >= 128 or rc < 0 else "failed"
            say(f"{run.name}: oni-train {run.outcome} (exit {rc}); see {run.logdir / TRAIN_LOG}")
            return
        run.status = "eval"
    if run.status != "eval":
        return
    if run.store_from is not None and inspect_run(run.store_from, eval_args)[0] not in ("done", "eval"):
        run.outcome = "waiting"  # its labels are not final yet
        if not final:
            return
        if not run.store.exists():
            run.outcome = "failed"
            say(f"{run.name}: not evaluated: {run.store_from.name} has no caption store to judge it by")
            return
        say(f"{run.name}: evaluated with the labels of {run.store_from.name}, whose training is not finished")
    if not launcher.may_start():
        run.outcome = "not started"
        return
    keep_earlier_eval(run)
    rc = launcher.run("eval", EVAL_MODULE, eval_command(run, args), run.logdir / EVAL_LOG)
    if rc != 0:
        run.outcome = "interrupted" if rc >= 128 or rc < 0 else "failed"
        say(f"{run.name}: oni-eval {run.outcome} (exit {rc}); see {run.logdir / EVAL_LOG}")
        return
    run.outcome = "done"
    if args.archive is not None:
        kept = grid_archive.save(run.logdir, args.archive)
        say(f"{run.name}: kept in {grid_archive.archive_folder(args.archive, run.logdir)} ({', '.join(kept)}): "
            f"commit it")
    say(f"{run.name}: evaluated")


def last_metrics_row(path: Path) -> Optional[Dict[str, float]]:
    """The last complete row of a ``metrics.csv``, from its header and its last 64 KiB only (a
    50M-frame run's file holds tens of thousands of rows); None without one."""
    try:
        with open(path, "rb") as f:
            header = f.readline().decode("utf-8", "replace").rstrip("\r\n").split(",")
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    for line in reversed(tail.split("\n")[1:-1]):  # [0] may be cut by the seek, [-1] by a write in progress
        values = line.rstrip("\r").split(",")
        if len(values) != len(header) or values == header:
            continue
        try:
            return {k: float(v) for k, v in zip(header, values) if v != ""}
        except ValueError:
            continue
    return None


def progress_line(run: Run) -> Optional[str]:
    """``run``'s training progress from its metrics.csv: frames, share of the budget, frames/s,
    time left at that rate.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> _ = (d / "metrics.csv").write_text("frames,time_s,fps\\n1024,1.0,900\\n7215104,1091.8,6608.2\\n")
        >>> run = Run("staircase", "none", None, 0, d, [], target_frames=10_000_000)
        >>> progress_line(run)
        'staircase/none/seed0: 7,215,104 of 10,000,000 frames (72 %), 6,608 frames/s, about 7 min left'
    """
    from torchrl_oni.run_folder import METRICS_NAME

    row = last_metrics_row(run.logdir / METRICS_NAME)
    if row is None or "frames" not in row:
        return None
    frames, fps = row["frames"], row.get("fps", 0.0)
    line = f"{run.name}: {frames:,.0f} of {run.target_frames:,} frames ({100 * frames / max(run.target_frames, 1):.0f} %)"
    if fps > 0:
        left = max(run.target_frames - frames, 0) / fps
        when = f"{left / 3600:.1f} h" if left >= 5400 else f"{max(1, round(left / 60))} min"
        line += f", {fps:,.0f} frames/s, about {when} left"
    return line


def run_pool(runs: List[Run], launcher: Launcher, args, eval_args, final: bool) -> None:
    """Executes ``runs`` ``launcher.parallel`` at a time; returns when all are over. Every
    ``args.status_every`` seconds it says how far each training run has come (:func:`progress_line`)."""
    every = getattr(args, "status_every", 0) or 0
    next_status = time.monotonic() + every
    with ThreadPoolExecutor(max_workers=launcher.parallel, thread_name_prefix="grid") as pool:
        futures = [pool.submit(execute, run, launcher, args, eval_args, final) for run in runs]
        pending = set(futures)
        while pending:  # short waits: signal handlers run in this thread between them
            _, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            if every and time.monotonic() >= next_status:
                next_status = time.monotonic() + every
                with launcher.lock:
                    training = list(launcher.training.values())
                for line in filter(None, map(progress_line, training)):
                    say(line)
    for future in futures:
        future.result()  # what went wrong in a thread (a full disk, a bug) is raised here


@contextlib.contextmanager
def forward_signals(launcher: Launcher):
    """SIGINT/SIGTERM/SIGUSR1 stop new launches and reach the running commands."""
    def handler(signum, frame):
        launcher.stop(signum)

    sigs = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else [])
    previous = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
