"""The judge's share of a run's CPU time, read from /proc (what oni-train's summary reports)."""
import os
import subprocess
import sys
import time

import pytest

from torchrl_oni.train.cpu_share import CpuShare, process_cpu_seconds

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def _burn_here(seconds: float) -> None:
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass


def test_a_busy_part_and_an_idle_part_are_told_apart():
    busy = subprocess.Popen([sys.executable, "-c", BUSY.format(s=1.0) + "time.sleep(30)"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 60
        while (process_cpu_seconds(busy.pid) or 0) < 1.0 and time.monotonic() < deadline:
            time.sleep(0.1)
        busy_share, idle_share = CpuShare(os.getpid(), busy.pid), CpuShare(os.getpid(), idle.pid)
        b, i = busy_share.sample(), idle_share.sample()
    finally:
        busy.kill(), idle.kill()
        busy.wait(), idle.wait()
    # the busy child burnt ~1 s, the idle one next to nothing; the share is the part over the tree
    # (this process's own CPU time, e.g. pytest's imports, is in the tree too)
    assert busy_share.seconds() >= 0.9 and idle_share.seconds() < 0.3
    assert b == pytest.approx(busy_share.seconds() / sum(busy_share.last.values()))
    assert i == pytest.approx(idle_share.seconds() / sum(idle_share.last.values()))
    assert b > i and os.getpid() in busy_share.last and busy.pid in busy_share.last


def test_a_part_that_exits_keeps_its_last_reading_and_grandchildren_count():
    # the part starts a child of its own that burns: the part's subtree is what counts
    code = ("import subprocess, sys\n"
            f"subprocess.run([sys.executable, '-c', {BUSY.format(s=0.8)!r} + 'time.sleep(3)'])\n")
    part = subprocess.Popen([sys.executable, "-c", code])
    share = CpuShare(os.getpid(), part.pid)
    seen = 0.0
    deadline = time.monotonic() + 60
    while part.poll() is None and time.monotonic() < deadline:
        share.sample()
        seen = max(seen, share.seconds())
        time.sleep(0.2)
    part.wait()
    assert seen >= 0.7  # the grandchild's CPU time was read while it lived
    share.sample()  # all of the part's processes are gone now
    assert share.seconds() == pytest.approx(seen, abs=0.3)


def test_readings_are_rate_limited():
    share = CpuShare(os.getpid(), os.getpid(), every_s=3600)
    first = share.sample()
    before = dict(share.last)
    _burn_here(0.2)
    assert share.sample() == first and share.last == before  # answered from the last reading
    fresh = CpuShare(os.getpid(), os.getpid())
    fresh.sample()
    assert fresh.last[os.getpid()] > before[os.getpid()]
