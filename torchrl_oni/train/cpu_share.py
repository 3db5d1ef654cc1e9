"""How the cores were shared: the CPU time of a run's process tree, and one member's share of it.

On a CPU-only machine the embedded judge and the trainer (learner, env workers) compete for the
same cores, and whether ONI keeps up depends on the judge's share (``oni-train`` reports it in
its summary). CPU time comes from ``/proc`` (Linux); elsewhere :meth:`CpuShare.sample` returns
None and nothing is reported.

Processes come and go (env workers restarted after a fault, the judge restarted): each one's
last reading is kept, so the share covers every process the run had, not only the living ones.

Example:
    >>> import os
    >>> share = CpuShare(os.getpid(), part_pid=os.getpid())
    >>> s = share.sample()
    >>> s is None or s == 1.0   # the part is the whole tree here
    True
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Dict, Iterable, Optional, Set

__all__ = ["CpuShare", "process_cpu_seconds"]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PROC = Path("/proc")


def _stat_fields(pid: int) -> Optional[list]:
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after it
    return raw[raw.rindex(")") + 2:].split()


def process_cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds of one process (all its threads), or None if it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    # after the name: state(0) ppid(1) ... utime(11) stime(12)
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _children(pids: Iterable[int]) -> Dict[int, int]:
    """Every process below ``pids``: ``{pid: parent}``."""
    parents: Dict[int, int] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                parents[int(entry.name)] = int(fields[1])
    tree: Set[int] = set(pids)
    found: Dict[int, int] = {}
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                found[pid] = parent
                grew = True
    return found


class CpuShare:
    """The share of a process tree's CPU time used by one subtree.

    Args:
        root_pid: the run's process (its descendants count too).
        part_pid: the process whose subtree is measured (e.g. the embedded judge's server).
        every_s: reading ``/proc`` costs milliseconds; :meth:`sample` reads it at most this
            often and answers from the last reading in between.
    """

    def __init__(self, root_pid: int, part_pid: int, every_s: float = 0.0) -> None:
        self.root_pid = int(root_pid)
        self.part_pid = int(part_pid)
        self.every_s = float(every_s)
        self._read_at = float("-inf")
        self._share: Optional[float] = None
        self.last: Dict[int, float] = {}  # pid -> last CPU seconds read
        self.part: Set[int] = {self.part_pid}
        self.available = _PROC.is_dir() and process_cpu_seconds(self.root_pid) is not None

    def sample(self) -> Optional[float]:
        """Reads the tree again; the part's share of all CPU seconds so far (None: not on Linux)."""
        if not self.available:
            return None
        now = time.monotonic()
        if now - self._read_at < self.every_s:
            return self._share
        self._read_at = now
        below = _children([self.root_pid])
        for pid in [self.root_pid, *below]:
            if pid in self.part or below.get(pid) in self.part:
                self.part.add(pid)
            seconds = process_cpu_seconds(pid)
            if seconds is not None:
                self.last[pid] = seconds
        total = sum(self.last.values())
        self._share = self.seconds() / total if total > 0 else None
        return self._share

    def seconds(self) -> float:
        """CPU seconds of the part, as last read."""
        return sum(v for pid, v in self.last.items() if pid in self.part)
