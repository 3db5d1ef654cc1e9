"""Worker processes start from a fork server that imported torch, TorchRL and NLE once."""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the worker reports which heavy modules it holds before it imports anything itself
SCRIPT = """
import multiprocessing, sys
{setup}

def report(queue):
    queue.put(sorted(m for m in ("torch", "torchrl", "nle") if m in sys.modules))

if __name__ == "__main__":
    from torchrl_oni.worker_start import worker_context
    ctx = worker_context()
    queue = ctx.Queue()
    worker = ctx.Process(target=report, args=(queue,))
    worker.start()
    print(ctx.get_start_method(), queue.get(timeout=120))
    worker.join()
"""


def _worker_holds(tmp_path, setup):
    script = tmp_path / "start_one.py"
    script.write_text(textwrap.dedent(SCRIPT.format(setup=setup)))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_worker_from_the_fork_server_starts_with_the_heavy_imports_done(tmp_path):
    # importing TorchRL sets spawn for the program first: use_forkserver replaces it
    got = _worker_holds(tmp_path, "import torchrl\nfrom torchrl_oni.worker_start import use_forkserver\n"
                                  "use_forkserver()")
    assert got == "forkserver ['nle', 'torch', 'torchrl']"


def test_without_it_a_worker_is_spawned_and_imports_everything_itself(tmp_path):
    assert _worker_holds(tmp_path, "") == "spawn []"


class _Chosen(Exception):
    pass


def test_oni_train_and_oni_eval_choose_the_fork_server_before_any_work(monkeypatch, tmp_path):
    from torchrl_oni import evaluate
    from torchrl_oni.train import cli

    def chosen():
        raise _Chosen

    monkeypatch.setattr(cli, "use_forkserver", chosen)
    monkeypatch.setattr(evaluate, "use_forkserver", chosen)
    with pytest.raises(_Chosen):
        cli.main(["--frames", "4096", "--logdir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()
    with pytest.raises(_Chosen):
        evaluate.main([str(tmp_path / "run")])


@pytest.mark.slow
def test_worker_start_benchmark_times_both_start_methods():
    from helpers import BENCH, bench_json

    result, table = bench_json([BENCH / "worker_start.py", "--workers", "1", "--envs", "2", "--rounds", "1",
                                "--batches", "2"])
    assert set(result["first_batch_s"]) == {"spawn", "forkserver"}
    assert all(t[0] > 0 for t in result["first_batch_s"].values()) and result["forkserver_over_spawn"] > 0
    assert all(f[0] > 0 for f in result["steady_fps"].values()) and result["steady_forkserver_over_spawn"] > 0
    assert "forkserver" in table and "first batch s" in table


@pytest.mark.parametrize("args, message", [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--batches", "-1"], "--batches must be >= 0, got -1"),
    (["--workers", "two"], "argument --workers: invalid int value: 'two'"),
])
def test_worker_start_benchmark_refuses_bad_input_in_one_line(capfd, args, message):
    from helpers import BENCH, script_exit

    code, err = script_exit(BENCH / "worker_start.py", args, capfd)
    assert code == 2 and err.strip() == f"worker_start.py: error: {message} (see --help)"


def test_the_packages_own_workers_never_fork(tmp_path):
    # a script may set fork for TorchRL's workers (the tutorials do); oni-eval's games and the
    # policy server's clients still start without copying the caller's threads
    got = _worker_holds(tmp_path, 'multiprocessing.set_start_method("fork", force=True)')
    assert got == "spawn []"
