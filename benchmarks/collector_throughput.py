"""One env worker's collector, in this process: TorchRL's ``Collector`` against the in-place rollout.

What one ``local``-backend worker process runs, measured without the process around it: a
collector over one :class:`~torchrl_oni.envs.NLEBatchEnv` of ``--envs`` games (the CPU default,
32), rollout ``--rollout`` (32), the light policy acting on one torch thread. Rows:

==========================  ==================================================================
row                         what collects
==========================  ==================================================================
``torchrl``                 TorchRL's ``Collector`` (the worker before ``NLERolloutCollector``)
``fast``                    :class:`~torchrl_oni.train._rollout.NLERolloutCollector`, the
                            in-place rollout ``make_local_collector`` gives its workers
``baseline-code``           with ``--baseline-code DIR``: the worker's collector of the
                            checkout in DIR (``PYTHONPATH=DIR``, a subprocess kept for the
                            whole run), what that code's ``make_local_collector`` uses
==========================  ==================================================================

With ``--sweep-envs K1 K2 ...`` the rows are instead this code's worker collector at each number
of games per worker (the worker's cache against its fixed costs per step and per batch: how
many games a worker should play), each against the first K; with ``--concurrent`` and two K, the
two run at once as below.

Frames/s are frames over the CPU time of the collecting thread (``time.thread_time()``), so
another load on the machine slows the rows less than it would wall-clock rates; rows take turns
in ``--rounds`` interleaved rounds and the median round is reported. ``fast_over_torchrl`` is the
ratio of the two medians.

With ``--concurrent`` (and ``--baseline-code``) the two checkouts' workers run at the same time,
each a subprocess pinned to a core of its own, the cores swapped every round, and the ratio is
the median of the rounds' ratios: on a VM whose speed drifts by several per cent from one minute
to the next, rows that take turns carry that drift into their ratio, rows that run together
share it (there is no ``torchrl`` row: two cores, two rows).

With ``--acting server`` the worker's policy is a :class:`~torchrl_oni.train.acting.PolicyServer`
client (each row its own server, a thread of this process), so the rows measure what the worker
itself spends around the answers (``--arch oni``: ONI's GRU, whose env carries InitTracker and the
recurrent state's primer).

Usage: ``python benchmarks/collector_throughput.py --seconds 60 [--envs 32] [--rollout 32]
[--rounds 5] [--arch oni] [--acting server] [--baseline-code DIR [--baseline-envs K] [--concurrent]]`` or ``--sweep-envs 16 32 64 128``
(``--sweep-envs 16 32 --concurrent``).
Output: a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings


_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout


def _worker_collector_class(which: str):
    """``torchrl``: TorchRL's ``Collector``; ``own``: the collector this code's workers use."""
    from torchrl.collectors import Collector

    if which == "torchrl":
        return Collector
    try:  # code from before the in-place rollout (--baseline-code): TorchRL's
        from torchrl_oni.train._rollout import NLERolloutCollector
    except ImportError:
        return Collector
    return NLERolloutCollector


class _Measured:
    """One collector over one worker's env, iterated in rounds of a given thread time."""

    def __init__(self, which: str, envs: int, rollout: int, seed: int = 0, arch: str = "light",
                 acting: str = "workers"):
        import torch

        from torchrl_oni.train.config import TrainConfig
        from torchrl_oni.train.env_factory import make_env_factory
        from torchrl_oni.train.policy import acting_copy, make_actor_critic, recurrent_primer

        torch.set_num_threads(1)
        cfg = TrainConfig(workers=1, envs_per_worker=envs, rollout=rollout, seed=seed).resolved()
        probe = make_env_factory(cfg, 0)()
        torch.manual_seed(seed)
        actor = make_actor_critic(probe, arch=arch)[0]
        probe.close()
        primer = recurrent_primer(actor)
        factory = make_env_factory(cfg, 0, primer.primers if primer is not None else None)
        env = factory()
        self.server = None
        if acting == "server":  # the worker's policy is a client of a server thread of this process
            from torchrl_oni.train.acting import PolicyServer

            self.server = PolicyServer(actor, device="cpu", num_workers=1, example=factory)
            policy = self.server.worker_policies()[0]
        else:
            policy = acting_copy(actor)
        cls = _worker_collector_class(which)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchRL's FutureWarnings about options the workers leave alone
            self.collector = cls(env, policy, frames_per_batch=envs * rollout, total_frames=-1, device="cpu",
                                 storing_device="cpu", split_trajs=False)
        self.kind = cls.__name__
        self.batches = iter(self.collector)
        next(self.batches)  # warm-up: the first batch, the first games' starts

    def round(self, seconds: float) -> dict:
        frames, games, start = 0, None, time.thread_time()
        while time.thread_time() - start < seconds:
            batch = next(self.batches)
            frames, games = frames + batch.numel(), batch.batch_size[0]
        cpu = time.thread_time() - start
        # rollouts made on the in-place path so far (None: a collector without it)
        return {"frames": frames, "cpu_s": cpu, "fps": frames / cpu, "games": games,
                "in_place_rollouts": getattr(self.collector, "fast_rollouts", None),
                # the cores this thread may run on (--concurrent pins each row to one)
                "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}

    def close(self):
        self.collector.shutdown()
        if self.server is not None:
            self.server.shutdown()


class _Elsewhere:
    """The same measurement by the package in another checkout: a subprocess answering rounds."""

    def __init__(self, code_dir: str, envs: int, rollout: int, arch: str = "light", acting: str = "workers"):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(code_dir) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.code_dir = code_dir
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", "--envs", str(envs), "--rollout", str(rollout),
             "--arch", arch, "--acting", acting],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=code_dir)
        self.kind = self.answer()["kind"]

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()[-2000:]
            raise SystemExit(f"collector_throughput.py: error: the worker of the checkout {self.code_dir} "
                             f"failed: {' | '.join(err.strip().splitlines()[-3:])}")
        return json.loads(line)

    def ask(self, seconds: float) -> None:
        """Starts a round of ``seconds`` of the collecting thread's CPU time (:meth:`answer` ends it)."""
        self.proc.stdin.write(f"{seconds}\n")
        self.proc.stdin.flush()

    def round(self, seconds: float) -> dict:
        self.ask(seconds)
        return self.answer()

    def pin(self, core: int) -> None:
        """Every thread of the subprocess on ``core`` only."""
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            try:
                os.sched_setaffinity(int(tid), {core})
            except ProcessLookupError:  # a thread that ended meanwhile
                pass

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def _serve(envs: int, rollout: int, arch: str, acting: str) -> int:
    """``--serve``: this code's worker collector, one round per line of stdin (seconds), one JSON line each."""
    measured = _Measured("own", envs, rollout, arch=arch, acting=acting)
    print(json.dumps({"kind": measured.kind}), flush=True)
    for line in sys.stdin:
        print(json.dumps(measured.round(float(line))), flush=True)
    measured.close()
    return 0


def _rounds(rows: dict, args, cores: list = None) -> dict:
    """Every row's rounds, interleaved; the rows are closed at the end. With ``cores``
    (``--concurrent``: two subprocess rows) the rows run each round at once, each pinned to a core
    of its own, the cores swapped every round."""
    share = args.seconds / (args.rounds * (1 if cores else len(rows)))
    results = {name: [] for name in rows}
    try:
        for rnd in range(args.rounds):
            said = ""
            if cores:
                order = cores if rnd % 2 == 0 else cores[::-1]
                for row, core in zip(rows.values(), order):
                    row.pin(core)
                    row.ask(share)
                for name, row in rows.items():
                    results[name].append(row.answer())
                said = f", cores {order}"
            else:
                for name, row in rows.items():
                    results[name].append(row.round(share))
            print(f"[round {rnd + 1}/{args.rounds}{said}] " + ", ".join(
                f"{name} {results[name][-1]['fps']:,.0f}" for name in rows) + " frames/s", flush=True)
    finally:
        for row in rows.values():
            row.close()
    return results


def _concurrent(args, cores: list) -> int:
    """``--concurrent``: this code against ``--baseline-code``, both at once on a core each."""
    how = dict(arch=args.arch, acting=args.acting)
    rows = {"fast": _Elsewhere(_HERE, args.envs, args.rollout, **how),
            "baseline-code": _Elsewhere(args.baseline_code, args.baseline_envs, args.rollout, **how)}
    results = _rounds(rows, args, cores)
    fps = {name: statistics.median(r["fps"] for r in res) for name, res in results.items()}
    paired = [f["fps"] / b["fps"] for f, b in zip(results["fast"], results["baseline-code"])]
    print(f"\none worker's collector, this code and --baseline-code at once, one core each (swapped every round): "
          f"{args.envs} games (baseline {args.baseline_envs}), rollout {args.rollout}, {args.arch} policy, "
          f"1 torch thread; frames per CPU second "
          f"of the collecting thread, median of {args.rounds} round(s)")
    print(f"{'row':<15} {'collector':<22} {'frames/s':>10}")
    for name, row in rows.items():
        print(f"{name:<15} {row.kind:<22} {fps[name]:>10,.0f}")
    print(f"this code / baseline, round by round: {', '.join(f'{r:.3f}' for r in paired)}; "
          f"median {statistics.median(paired):.3f}")
    print(json.dumps({"benchmark": "collector_throughput", "concurrent": True, "cores": cores,
                      "envs": args.envs, "baseline_envs": args.baseline_envs, "rollout": args.rollout,
                      "arch": args.arch, "acting": args.acting,
                      "seconds": args.seconds, "rounds": args.rounds, "cpu_count": os.cpu_count(),
                      "fps": {name: round(v) for name, v in fps.items()},
                      "rounds_fps": {name: [round(r["fps"]) for r in res] for name, res in results.items()},
                      "collectors": {name: row.kind for name, row in rows.items()},
                      # games in each row's batches, as collected
                      "games": {name: res[-1]["games"] for name, res in results.items()},
                      "baseline_code": args.baseline_code,
                      # each round's two rows ran at the same moments: the ratio is read round by round
                      "fast_over_baseline_code_rounds": [round(r, 3) for r in paired],
                      # the cores the rows' collecting threads ran on, round by round ([fast, baseline])
                      "rounds_cores": [f["cpus"] + b["cpus"] for f, b in zip(results["fast"], results["baseline-code"])],
                      "fast_over_baseline_code": round(statistics.median(paired), 3)}))
    return 0


def _sweep(args, cores: list = None) -> int:
    """``--sweep-envs``: this code's worker collector at each number of games per worker; with
    ``cores`` (``--concurrent``, two K) both at once, each a subprocess on a core of its own, and
    the ratio read round by round."""
    ks = list(dict.fromkeys(args.sweep_envs))
    if cores:
        rows = {f"K={k}": _Elsewhere(_HERE, k, args.rollout) for k in ks}
    else:
        rows = {f"K={k}": _Measured("own", k, args.rollout) for k in ks}
    kind = next(iter(rows.values())).kind
    results = _rounds(rows, args, cores)
    fps = {name: statistics.median(r["fps"] for r in res) for name, res in results.items()}
    if cores:  # each K against the first in the same round, then the median of those ratios
        rounds_vs_first = {str(k): [r["fps"] / f["fps"] for r, f in zip(results[f"K={k}"], results[f"K={ks[0]}"])]
                           for k in ks}
        vs_first = {k: statistics.median(v) for k, v in rounds_vs_first.items()}
        where = "two subprocesses at once, one core each (swapped every round)"
    else:
        vs_first = {str(k): fps[f"K={k}"] / fps[f"K={ks[0]}"] for k in ks}
        where = "in this process"
    print(f"\none worker's collector ({kind}) {where} by games per worker: rollout {args.rollout}, light "
          f"policy, 1 torch thread; frames per CPU second of the collecting thread, median of {args.rounds} round(s)"
          + ("; the ratio is the median of the rounds' ratios" if cores else ""))
    print(f"{'games':>6} {'frames/s':>10} {'vs K=' + str(ks[0]):>9}")
    for k in ks:
        print(f"{k:>6} {fps[f'K={k}']:>10,.0f} {vs_first[str(k)]:>8.2f}x")
    best = max(ks, key=lambda k: vs_first[str(k)])
    out = {"benchmark": "collector_throughput", "sweep_envs": ks, "rollout": args.rollout,
           "seconds": args.seconds, "rounds": args.rounds, "cpu_count": os.cpu_count(), "collector": kind,
           "fps": {str(k): round(fps[f"K={k}"]) for k in ks},
           "vs_first": {k: round(v, 3) for k, v in vs_first.items()},
           "rounds_fps": {str(k): [round(r["fps"]) for r in results[f"K={k}"]] for k in ks},
           "fastest": best}
    if cores:
        out.update(concurrent=True, cores=cores,
                   vs_first_rounds={k: [round(r, 3) for r in v] for k, v in rounds_vs_first.items()},
                   # the cores the rows' collecting threads ran on, round by round (in --sweep-envs order)
                   rounds_cores=[sum((results[f"K={k}"][i]["cpus"] for k in ks), []) for i in range(args.rounds)])
    print(json.dumps(out))
    return 0


def main(argv=None) -> int:
    from torchrl_oni.cli_errors import OneLineArgumentParser

    p = OneLineArgumentParser(prog="collector_throughput.py", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="total CPU-time budget of the rounds (default 60)")
    p.add_argument("--envs", type=int, default=32, help="games in the worker's env (default 32, the CPU default)")
    p.add_argument("--rollout", type=int, default=32, help="steps per game in one batch (default 32)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every row (default 5)")
    p.add_argument("--baseline-code", metavar="DIR", default=None,
                   help="also measure the worker's collector of the checkout in DIR (today's code)")
    p.add_argument("--baseline-envs", type=int, default=None, metavar="K",
                   help="with --baseline-code: the baseline's games per worker (default: --envs), e.g. its own "
                        "default when this code's differs")
    p.add_argument("--sweep-envs", type=int, nargs="+", metavar="K", default=None,
                   help="instead: this code's worker collector at each number of games per worker")
    p.add_argument("--arch", default="light", choices=("light", "oni"),
                   help="the policy: light (default) or ONI's GRU (its env gets InitTracker and the state's primer)")
    p.add_argument("--acting", default="workers", choices=("workers", "server"),
                   help="workers: the worker's own copy acts (default); server: a PolicyServer thread of this "
                        "process acts, and the rows measure the worker's own CPU time around its answers")
    p.add_argument("--concurrent", action="store_true",
                   help="with --baseline-code: run this code's worker and the baseline's at once, each a "
                        "subprocess on a core of its own, cores swapped every round (the machine's drift then "
                        "falls on both alike; the ratio is the median of the rounds' ratios); with two "
                        "--sweep-envs: the two numbers of games at once, the same way")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # a --baseline-code subprocess
    args = p.parse_args(argv)
    if not args.seconds > 0:
        p.error(f"--seconds must be > 0, got {args.seconds:g}")
    if args.envs < 1:
        p.error(f"--envs must be >= 1, got {args.envs}")
    if args.rollout < 2:
        p.error(f"--rollout must be >= 2, got {args.rollout}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.baseline_code and not os.path.isdir(os.path.join(args.baseline_code, "torchrl_oni")):
        p.error(f"--baseline-code {args.baseline_code}: no torchrl_oni package there")
    if args.baseline_envs is not None:
        if not args.baseline_code:
            p.error("--baseline-envs describes the --baseline-code run: give --baseline-code DIR")
        if args.baseline_envs < 1:
            p.error(f"--baseline-envs must be >= 1, got {args.baseline_envs}")
    else:
        args.baseline_envs = args.envs
    if args.sweep_envs is not None:
        if min(args.sweep_envs) < 1:
            p.error(f"--sweep-envs: every K must be >= 1, got {min(args.sweep_envs)}")
        if args.baseline_code:
            p.error("--sweep-envs measures this code alone: leave out --baseline-code")
        if (args.arch, args.acting) != ("light", "workers"):
            p.error("--sweep-envs measures the light policy on the worker: leave out --arch and --acting")
    if args.concurrent:
        if args.sweep_envs is not None:
            if len(set(args.sweep_envs)) != 2:
                p.error(f"--concurrent runs two --sweep-envs at once: give two numbers of games, "
                        f"got {len(set(args.sweep_envs))}")
        elif not args.baseline_code:
            p.error("--concurrent runs this code beside --baseline-code DIR (or two --sweep-envs): give it")
        cores = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else []
        if len(cores) < 2:
            p.error("--concurrent needs two cores this process may use (and Linux's sched_setaffinity)")
    if args.serve:
        return _serve(args.envs, args.rollout, args.arch, args.acting)
    if args.sweep_envs is not None:
        return _sweep(args, cores if args.concurrent else None)
    if args.concurrent:
        return _concurrent(args, cores)

    how = dict(arch=args.arch, acting=args.acting)
    rows = {"torchrl": _Measured("torchrl", args.envs, args.rollout, **how),
            "fast": _Measured("own", args.envs, args.rollout, **how)}
    if args.baseline_code:
        rows["baseline-code"] = _Elsewhere(args.baseline_code, args.baseline_envs, args.rollout, **how)
    results = _rounds(rows, args)
    fps = {name: statistics.median(r["fps"] for r in res) for name, res in results.items()}
    ratio = fps["fast"] / fps["torchrl"]
    acting = "acting in the worker" if args.acting == "workers" else "acting in a policy server thread"
    print(f"\none worker's collector in this process: {args.envs} games, rollout {args.rollout}, {args.arch} policy "
          f"{acting}, 1 torch thread; frames per CPU second of the collecting thread, median of {args.rounds} "
          "round(s)")
    print(f"{'row':<15} {'collector':<22} {'frames/s':>10} {'vs torchrl':>11}")
    for name, row in rows.items():
        print(f"{name:<15} {row.kind:<22} {fps[name]:>10,.0f} {fps[name] / fps['torchrl']:>10.2f}x")
    out = {"benchmark": "collector_throughput", "envs": args.envs, "rollout": args.rollout, "arch": args.arch,
           "acting": args.acting, "baseline_envs": args.baseline_envs if args.baseline_code else None,
           "seconds": args.seconds, "rounds": args.rounds, "cpu_count": os.cpu_count(),
           "fps": {name: round(v) for name, v in fps.items()},
           "fast_over_torchrl": round(ratio, 3),
           # paired: each round's two rows ran back to back, so a slower stretch of the machine hits both
           "fast_over_torchrl_rounds": [round(f["fps"] / t["fps"], 3) for f, t in zip(results["fast"],
                                                                                      results["torchrl"])],
           "rounds_fps": {name: [round(r["fps"]) for r in res] for name, res in results.items()},
           "collectors": {name: row.kind for name, row in rows.items()},
           "in_place_rollouts": {name: res[-1].get("in_place_rollouts") for name, res in results.items()},
           "baseline_code": args.baseline_code}
    if args.baseline_code:
        out["fast_over_baseline_code"] = round(fps["fast"] / fps["baseline-code"], 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
