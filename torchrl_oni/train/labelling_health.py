"""Whether labels are still coming, seen from the trainer: one :class:`LabellingHealth` per run.

ONI pays only labelled captions. When the LLM server dies or stalls, training goes on and every
new caption (the rare ones, where progress shows) pays nothing until labels come back; the
coverage of *steps* stays high because the frequent captions were labelled first, so coverage
alone never says it. This watcher is told, once an update, how many labels exist, how many
captions wait and which servers are up, and answers with the lines a person must read:

* every server down (its circuit breaker open): ``the LLM server at URL is not answering since
  HH:MM:SS …``, whatever the coverage, at most once a minute;
* no label for :data:`STALL_S` seconds while captions wait (a server that hangs, refuses the key,
  answers nonsense): ``no caption labelled for 75 s while 4,156 wait: <cause>``;
* a server that answers again: one line at once, with how long it was down.

Its clock starts at the first update (training under way, the server checked), never while an
embedded server boots. :meth:`state` is the progress bar's ``llm=…`` field; :meth:`metrics` the
logged ``annotation/stalled_s`` (the stall now) and ``annotation/stalled_total_s`` (the run's).

Example:
    >>> now = [0.0]
    >>> watch = LabellingHealth(clock=lambda: now[0], wall=lambda: 0.0)
    >>> url = "http://127.0.0.1:8000"
    >>> watch.update(labels=10, waiting=0, servers=[(url, True, "")])
    []
    >>> now[0] = 30.0
    >>> watch.update(labels=10, waiting=250, servers=[(url, False, "connection error")])[0][:52]
    'the LLM server at http://127.0.0.1:8000 is not answe'
    >>> watch.state()
    'down 0s'
    >>> now[0] = 95.0
    >>> watch.update(labels=12, waiting=4000, servers=[(url, True, "")])
    ['the LLM server at http://127.0.0.1:8000 answers again after 1 min 5 s down']
    >>> watch.state(), watch.metrics()["annotation/stalled_total_s"]
    ('ok', 65.0)
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["LabellingHealth", "STALL_S", "SAY_EVERY_S", "LARGE_STALL_SHARE", "duration"]

# no label for this long while captions wait is a stall (the embedded CPU judge labels a request
# of 32 captions in a few seconds; a vLLM server in well under one)
STALL_S = 60.0
# one warning line a minute at most, so the progress bar stays readable
SAY_EVERY_S = 60.0
# the summary's ``!!`` line: labelling stopped for this share of the run or more
LARGE_STALL_SHARE = 0.1

Server = Tuple[str, bool, str]  # (url, up, last error)


def duration(seconds: float) -> str:
    """``"45 s"``, ``"2 min 5 s"``, ``"1 h 3 min"``.

    Example:
        >>> duration(45.2), duration(125), duration(3800)
        ('45 s', '2 min 5 s', '1 h 3 min')
    """
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s" if s % 60 else f"{s // 60} min"
    return f"{s // 3600} h {(s % 3600) // 60} min"


class LabellingHealth:
    """Follows labels and servers update by update; says when labelling stops and resumes.

    Args:
        clock: monotonic seconds (tests pass their own).
        wall: wall-clock seconds, for the ``since HH:MM:SS`` a person compares with their logs.
        stall_s: seconds without a label, while captions wait, that make a stall.
        every_s: seconds between two warnings of the same kind.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 stall_s: float = STALL_S, every_s: float = SAY_EVERY_S):
        self.clock, self.wall = clock, wall
        self.stall_s, self.every_s = float(stall_s), float(every_s)
        self.started: Optional[float] = None  # the first update: the coverage alarm's clock too
        self.labels = 0
        self.last_label_at: Optional[float] = None
        self.down: Dict[str, Tuple[float, float, str]] = {}  # url -> (since, wall since, last error)
        self.stalled_since: Optional[float] = None
        self.stalled_total_s = 0.0
        self.stalls = 0
        self.last_said = float("-inf")
        self.waiting = 0

    # ------------------------------------------------------------------ each update
    def update(self, labels: int, waiting: int, servers: Sequence[Server] = (),
               cause: Optional[Callable[[], str]] = None) -> List[str]:
        """The lines to print now (often none).

        Args:
            labels: labels (and preferences) made since the start of the run.
            waiting: captions (or pairs) waiting for a label, in the queue or with the LLM.
            servers: ``(url, up, last_error)`` of each LLM server (empty for annotators without one).
            cause: says why no label came (asked only when a stall is reported).
        """
        now = self.clock()
        if self.started is None:
            self.started = self.last_label_at = now
        if labels > self.labels:
            self.labels, self.last_label_at = int(labels), now
        self.waiting = int(waiting)
        lines: List[str] = []
        for url, up, error in servers:
            if not up and url not in self.down:
                self.down[url] = (now, self.wall(), error or "")
            elif not up:
                self.down[url] = (*self.down[url][:2], error or self.down[url][2])
            elif up and url in self.down:
                lines.append(f"the LLM server at {url} answers again after {duration(now - self.down.pop(url)[0])} down")
        all_down = bool(servers) and all(url in self.down for url, _, _ in servers)
        no_labels = waiting > 0 and now - self.last_label_at >= self.stall_s
        stalled = (all_down and waiting > 0) or no_labels
        if stalled and self.stalled_since is None:
            # labelling stopped when the last server went down, or at the last label
            since = max(self.down[u][0] for u, _, _ in servers) if all_down else self.last_label_at
            self.stalled_since = max(since, self.started)
            self.stalls += 1
        elif not stalled and self.stalled_since is not None:
            self.stalled_total_s += now - self.stalled_since
            self.stalled_since = None
        if lines:
            return lines  # the good news at once; the next warning waits its minute
        if now - self.last_said < self.every_s:
            return lines
        if self.down:
            lines.append(self._down_line(now, servers, stalled))
        elif stalled:
            why = cause() if cause is not None else ""
            lines.append(f"no caption labelled for {duration(now - self.last_label_at)} while {waiting:,} wait; "
                         f"new captions pay nothing until labels come back" + (f": {why}" if why else ""))
        if lines:
            self.last_said = now
        return lines

    def _down_line(self, now: float, servers: Sequence[Server], stalled: bool) -> str:
        urls = [u for u, _, _ in servers if u in self.down] or list(self.down)
        first = min(self.down[u][0] for u in urls)
        wall = min(self.down[u][1] for u in urls)
        errors = sorted({self.down[u][2] for u in urls if self.down[u][2]})
        head = (f"the LLM server at {urls[0]} is" if len(urls) == 1 else
                f"the LLM servers at {', '.join(urls)} are")
        line = f"{head} not answering since {time.strftime('%H:%M:%S', time.localtime(wall))} ({duration(now - first)})"
        if errors:
            line += f"; last error: {errors[0]}"
        up = len(servers) - len(urls)
        if up > 0:
            return line + f"; the other {up} server{'s' if up > 1 else ''} go on labelling"
        if stalled:
            return line + (f"; labelling has stopped: {self.waiting:,} captions wait and new captions pay nothing "
                           f"until it answers (training goes on)")
        return line

    # ------------------------------------------------------------------ reading it
    def stalled_for(self) -> float:
        """Seconds since labelling stopped (0 while labels come)."""
        return 0.0 if self.stalled_since is None else self.clock() - self.stalled_since

    def state(self) -> str:
        """The progress bar's ``llm`` field: ``ok``, ``down 45s`` (every server out) or ``stalled 70s``."""
        if self.stalled_since is None:
            return "ok"
        what = "down" if self.down else "stalled"
        return f"{what} {self.stalled_for():.0f}s"

    def total_stalled_s(self) -> float:
        """Seconds of the run (so far) during which labelling had stopped."""
        return self.stalled_total_s + self.stalled_for()

    def elapsed(self) -> float:
        """Seconds since the first update (0 before it)."""
        return 0.0 if self.started is None else self.clock() - self.started

    def metrics(self) -> Dict[str, float]:
        return {"annotation/stalled_s": self.stalled_for(), "annotation/stalled_total_s": self.total_stalled_s(),
                "annotation/stalls": float(self.stalls)}

    def summary_lines(self, never_labelled: int, seen: int, unit: str = "captions") -> Tuple[List[str], List[str]]:
        """``(plain lines, !! lines)`` for the end of the run: how long labelling was stopped, how
        many captions never got a label, and a warning when that was a large share of the run."""
        total, run = self.total_stalled_s(), self.elapsed()
        plain = [f"labelling stopped for {duration(total)} of {duration(run)}"
                 + (f" ({self.stalls} time{'s' if self.stalls != 1 else ''})" if self.stalls else "")]
        if seen:
            plain.append(f"{never_labelled:,} of {seen:,} {unit} seen were never labelled")
        loud = []
        if run > 0 and total >= LARGE_STALL_SHARE * run and total >= self.stall_s:
            loud.append(f"labelling was stopped for {duration(total)}, {total / run:.0%} of the run: captions first "
                        f"seen then paid nothing ({never_labelled:,} of {seen:,} {unit} never labelled); see the "
                        f"warnings above for the server(s) that stopped answering")
        return plain, loud
