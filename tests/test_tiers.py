"""The test tiers of tests/conftest.py: every test it names (slow, alone, in the Ray group) exists
(a renamed test would drop out of its list, and out of its tier, unnoticed)."""
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ALONE, RAY, SLOW

ROOT = Path(__file__).resolve().parent.parent


def test_the_lists_are_sorted_and_without_repeats():
    assert SLOW == sorted(set(SLOW)) and ALONE == sorted(set(ALONE))


@pytest.mark.slow
def test_every_listed_test_exists():
    named = [*SLOW, *ALONE, *RAY]
    files = sorted({entry.split("::")[0] for entry in named})
    assert all((ROOT / f).is_file() for f in files), [f for f in files if not (ROOT / f).is_file()]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *files],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    collected = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    names = collected | {nodeid.split("[")[0] for nodeid in collected}
    assert [entry for entry in named if entry not in names and "::" in entry] == []


class _Item:
    def __init__(self, nodeid, fixturenames=()):
        self.nodeid, self.fixturenames, self.marks = nodeid, fixturenames, []

    def add_marker(self, mark):
        self.marks.append((mark.name, mark.args))


class _Config:
    class pluginmanager:
        @staticmethod
        def hasplugin(name):
            return name == "xdist"


def test_the_hook_marks_the_listed_tests_and_groups_ray_and_shared_fixtures(monkeypatch):
    import conftest

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # as in the controller: no sorting
    items = [_Item(SLOW[0]), _Item(ALONE[0] + "[prefetch]"), _Item("tests/test_ray_backend.py::test_x", ["cluster"]),
             _Item("tests/test_replay.py::test_y", ["browser", "tmp_path"]), _Item("tests/test_stats.py::test_z")]
    conftest.pytest_collection_modifyitems(_Config, items)
    assert [item.marks for item in items] == [
        [("slow", ())], [("alone", ()), ("xdist_group", ("alone",))], [("xdist_group", ("ray",))],
        [("xdist_group", ("tests/test_replay.py",))], []]
