"""A grid's runs kept in the repository, rung by rung: what the analysis needs and what resumes them.

A machine's ``runs/`` can vanish between working days (a 10M-frame ladder was lost that way). With
``sparse_tasks.py --archive DIR``, each run that finishes a rung (trained to ``--frames`` and
evaluated) is copied to ``DIR/<task>/<setting>/seed<k>/``:

* ``eval_<frames>.json``: every evaluation of the run, one per rung (the analysis reads them);
* ``config.yaml``: the run's settings (the grid compares them with its flags);
* ``metrics.csv``: the training log thinned to one row per :data:`THIN_FRAMES` frames and the
  columns the curves read (:data:`COLUMNS`): tens of KiB for a 50M-frame run instead of ~40 MiB;
* ``checkpoint.pt.gz`` and ``captions.pt.gz``: the last rung's checkpoint and caption store,
  gzipped (a few MiB each), so a lost folder costs at most the rung under way.

Commit the folder as each rung lands. Before the grid looks at its runs, every run folder that is
missing (or holds no run yet) is rebuilt from the archive: the checkpoint and store of the last
rung, its evaluation as ``eval.json`` (so the run counts as done at that budget), the earlier
rungs' evaluations and the thinned log; ``--frames`` raised then continues it with ``--resume``.
A folder that holds a run is never written to.

Example:
    >>> import tempfile, json
    >>> root, archive = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
    >>> run = root / "staircase" / "none" / "seed0"; run.mkdir(parents=True)
    >>> _ = (run / "checkpoint.pt").write_bytes(b"weights")
    >>> _ = (run / "config.yaml").write_text("seed: 0\\n")
    >>> _ = (run / "eval.json").write_text(json.dumps({"frames_trained": 2048}))
    >>> sorted(save(run, archive))
    ['checkpoint.pt.gz', 'config.yaml', 'eval_2048.json']
    >>> again = Path(tempfile.mkdtemp()) / "staircase" / "none" / "seed0"
    >>> sorted(restore(archive, again))
    ['checkpoint.pt', 'config.yaml', 'eval.json']
    >>> (again / "checkpoint.pt").read_bytes()
    b'weights'
"""
from __future__ import annotations

import csv
import gzip
import json
import os
import re
import shutil
from pathlib import Path
from typing import List, Optional

__all__ = ["archive_folder", "save", "restore", "thin_metrics", "THIN_FRAMES", "COLUMNS"]

CHECKPOINT, STORE, CONFIG, METRICS, EVAL = "checkpoint.pt", "captions.pt", "config.yaml", "metrics.csv", "eval.json"
EVAL_AT = "eval_{frames}.json"
EVAL_AT_PATTERN = re.compile(r"eval_(\d+)\.json$")
# one row per this many frames: 500 rows over a 50M-frame run, finer than any curve is read
THIN_FRAMES = 100_000
# the columns the curves and tables read (sparse_tasks.py, oni-plot); the rest stays on the machine
COLUMNS = ("frames", "time_s", "fps", "episodes", "episode/", "reward/", "intrinsic/", "labels/seen_coverage",
           "labels/seen_captions", "labels/seen_labelled", "labels/labelled", "labels/positive_fraction",
           "annotation/labels_total", "annotation/queue_depth", "collect_fraction")


def archive_folder(archive: Path, logdir: Path) -> Path:
    """Where run folder ``ROOT/<task>/<setting>/seed<k>`` is kept: ``archive/<task>/<setting>/seed<k>``."""
    return Path(archive).joinpath(*Path(logdir).parts[-3:])


def _gzip(src: Path, dst: Path) -> None:
    tmp = dst.with_suffix(dst.suffix + ".tmp")
    with open(src, "rb") as f, gzip.GzipFile(tmp, "wb", compresslevel=6, mtime=0) as g:
        shutil.copyfileobj(f, g)
    os.replace(tmp, dst)


def _gunzip(src: Path, dst: Path) -> None:
    tmp = dst.with_suffix(dst.suffix + ".tmp")
    with gzip.open(src, "rb") as g, open(tmp, "wb") as f:
        shutil.copyfileobj(g, f)
    os.replace(tmp, dst)


def _frames_of(path: Path) -> Optional[int]:
    try:
        frames = json.loads(path.read_text(encoding="utf-8")).get("frames_trained")
    except (OSError, ValueError, AttributeError):
        return None
    return frames if isinstance(frames, int) else None


def thin_metrics(src: Path, dst: Path, every: int = THIN_FRAMES) -> int:
    """Writes ``src``'s rows at most one per ``every`` frames (and its last), columns of
    :data:`COLUMNS` only; returns the rows written.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> rows = "\\n".join(f"{1024 * i},{i},9,{i % 3}" for i in range(1, 400))
        >>> _ = (d / "m.csv").write_text("frames,time_s,train/loss,episodes\\n" + rows + "\\n")
        >>> thin_metrics(d / "m.csv", d / "t.csv", every=100_000)  # 1,024, 100,352, ..., 401,408 and the last
        6
        >>> (d / "t.csv").read_text().splitlines()[:2]
        ['frames,time_s,episodes', '1024,1,1']
    """
    with open(src, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return 0
        keep = [i for i, name in enumerate(header) if name.startswith(COLUMNS)]
        out, last, next_at = [], None, None
        for row in reader:
            if len(row) != len(header):
                continue  # a row cut by a crash mid-write
            try:
                frames = float(row[0])
            except ValueError:
                continue
            last = row
            if next_at is None or frames >= next_at:
                out.append(row)
                next_at = (frames // every + 1) * every
        if last is not None and (not out or out[-1] is not last):
            out.append(last)
    tmp = dst.with_suffix(dst.suffix + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow([header[i] for i in keep])
        writer.writerows([row[i] for i in keep] for row in out)
    os.replace(tmp, dst)
    return len(out)


def save(logdir: Path, archive: Path) -> List[str]:
    """Copies a run that just finished a rung (``eval.json`` evaluates its checkpoint) into the
    archive; returns the archive's file names written. Earlier rungs' files stay."""
    logdir, dest = Path(logdir), archive_folder(archive, logdir)
    frames = _frames_of(logdir / EVAL)
    if frames is None:
        return []
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    evals = {frames: logdir / EVAL}
    for path in logdir.glob("eval_*.json"):
        m = EVAL_AT_PATTERN.match(path.name)
        if m:
            evals.setdefault(int(m.group(1)), path)
    for at, path in sorted(evals.items()):
        target = dest / EVAL_AT.format(frames=at)
        if not target.exists() or target.read_bytes() != path.read_bytes():
            shutil.copyfile(path, target)
            written.append(target.name)
    if (logdir / CONFIG).exists():
        shutil.copyfile(logdir / CONFIG, dest / CONFIG)
        written.append(CONFIG)
    if (logdir / METRICS).exists():
        thin_metrics(logdir / METRICS, dest / METRICS)
        written.append(METRICS)
    for name in (CHECKPOINT, STORE):
        if (logdir / name).exists():
            _gzip(logdir / name, dest / f"{name}.gz")
            written.append(f"{name}.gz")
    return written


def restore(archive: Path, logdir: Path) -> List[str]:
    """Rebuilds a missing run folder from the archive (see the module docstring); returns the file
    names written, none when the folder holds a run (a checkpoint or a config) or nothing is kept."""
    logdir, src = Path(logdir), archive_folder(archive, logdir)
    if not src.is_dir() or (logdir / CHECKPOINT).exists() or (logdir / CONFIG).exists():
        return []
    evals = {}
    for path in src.glob("eval_*.json"):
        m = EVAL_AT_PATTERN.match(path.name)
        if m:
            evals[int(m.group(1))] = path
    if not evals:
        return []
    logdir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in (CHECKPOINT, STORE):
        if (src / f"{name}.gz").exists():
            _gunzip(src / f"{name}.gz", logdir / name)
            os.utime(logdir / name, (1.0, 1.0))  # older than the evaluation restored with it
            written.append(name)
    for name in (CONFIG, METRICS):
        if (src / name).exists():
            shutil.copyfile(src / name, logdir / name)
            written.append(name)
    last = max(evals)
    for at, path in sorted(evals.items()):
        # the last rung's evaluation judged the restored checkpoint: it is the run's eval.json
        target = logdir / (EVAL if at == last else EVAL_AT.format(frames=at))
        shutil.copyfile(path, target)
        written.append(target.name)
    return written
