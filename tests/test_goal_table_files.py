"""ELLM's shared goal table on disk: allocated in full up front, never left behind by a dead
process, and a full ``/dev/shm`` is a warning (or one line), not a bus error."""
import errno
import os
import subprocess
import sys
import tempfile

import pytest

from torchrl_oni.rewards.ellm import conditioning
from torchrl_oni.rewards.ellm.conditioning import SharedGoalEmbeddings, remove_stale_tables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tables(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("oni-goal-embeddings-"))


def test_a_killed_process_leaves_a_table_the_next_one_removes(tmp_path):
    script = ("import os, signal\nfrom torchrl_oni.rewards.ellm import SharedGoalEmbeddings\n"
              f"t = SharedGoalEmbeddings(dim=4, capacity=16, directory={str(tmp_path)!r})\n"
              "print(t.path, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == -9
    left = done.stdout.strip()
    assert os.path.isdir(left) and len(_tables(tmp_path)) == 1  # kill -9: no finaliser ran
    table = SharedGoalEmbeddings(dim=4, capacity=16, directory=str(tmp_path))
    assert not os.path.exists(left) and _tables(tmp_path) == [os.path.basename(table.path)]
    table.close()
    assert _tables(tmp_path) == []


def test_tables_of_live_processes_and_unknown_folders_stay(tmp_path):
    mine = SharedGoalEmbeddings(dim=4, capacity=16, directory=str(tmp_path))
    foreign = tmp_path / "oni-goal-embeddings-no-owner"
    foreign.mkdir()
    reused = tmp_path / "oni-goal-embeddings-reused"
    reused.mkdir()
    (reused / "owner").write_text(f"{os.getpid()} 1")  # our PID, another start time: a dead process's
    assert remove_stale_tables(str(tmp_path)) == 1
    assert os.path.isdir(mine.path) and foreign.is_dir() and not reused.exists()
    mine.close()


def test_a_full_default_place_falls_back_to_disk_and_a_chosen_one_is_one_line(tmp_path, monkeypatch, caplog):
    small = tmp_path / "shm"
    small.mkdir()
    real = os.posix_fallocate

    def fallocate(fd, offset, size):  # a 64 MB /dev/shm: no room in it, room elsewhere
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(small)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, size)

    monkeypatch.setattr(conditioning.os, "posix_fallocate", fallocate)
    monkeypatch.setattr(conditioning, "_default_directory", lambda: str(small))
    with caplog.at_level("WARNING", logger=conditioning.log.name):
        table = SharedGoalEmbeddings(dim=4, capacity=16)
    assert os.path.dirname(table.path) == tempfile.gettempdir() and _tables(small) == []
    assert any("no room for the shared goal table" in r.getMessage() for r in caplog.records)
    table.put(__import__("torch").tensor([3]), __import__("torch").ones(1, 4))
    table.close()
    with pytest.raises(OSError, match=r"no room for the shared goal table .* --ellm-goal-table-dir"):
        SharedGoalEmbeddings(dim=4, capacity=16, directory=str(small))
    assert _tables(small) == []  # nothing left half-made


def test_the_files_are_allocated_in_full(tmp_path):
    table = SharedGoalEmbeddings(dim=8, capacity=64, directory=str(tmp_path))
    used = sum(os.stat(os.path.join(table.path, n)).st_blocks * 512 for n in ("keys", "values", "size"))
    assert used >= table.nbytes  # no sparse file that a full tmpfs turns into a bus error later
    table.close()


def test_oni_train_names_a_goal_table_dir_that_is_not_there(tmp_path, capfd):
    from helpers import main_in_process

    from torchrl_oni.train.cli import main

    done = main_in_process(main, ["--intrinsic-reward", "ellm", "--annotator", "scripted", "--ellm-encoder", "hashed",
                                  "--ellm-goal-conditioned", "--ellm-goal-table-dir", tmp_path / "nope", "--logdir",
                                  tmp_path / "run", "--frames", "4096"], capfd)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"oni-train: error: --ellm-goal-table-dir {tmp_path / 'nope'}: no such directory"
