"""How long env workers take to start: spawned (TorchRL's default) against forks of a preloaded fork server.

Each round runs, in a fresh Python process per row, what ``oni-train`` does before its first
update: build ``--workers`` env workers of ``--envs`` games (``make_local_collector``, the light
policy) and take one batch from them. A row's time is from the process's start (its imports
included) to that first batch, and that plus the workers' shutdown. Rows:

===============  ===========================================================================
row              how the workers start
===============  ===========================================================================
``spawn``        TorchRL's default: each worker imports torch, TorchRL and NLE itself
``forkserver``   :func:`torchrl_oni.worker_start.use_forkserver`, what ``oni-train`` and
                 ``oni-eval`` use: forks of one process that imported them once
===============  ===========================================================================

Rows take turns in ``--rounds`` rounds; the median is reported, and ``forkserver_over_spawn`` is
the ratio of the medians of the time to the first batch (below 1: faster). With ``--batches N`` the
workers then deliver N more batches, and ``steady_forkserver_over_spawn`` compares their frames/s
after the start (the workers run the same code either way: it should be 1).

Usage: ``python benchmarks/worker_start.py [--workers 2] [--envs 32] [--rounds 5] [--batches 0]``. Output: a
table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

ROWS = ("spawn", "forkserver")
ROLLOUT = 8  # steps per game in a batch


def _one_start(method: str, workers: int, envs: int, batches: int) -> dict:
    """In this (fresh) process: the workers' start to their first batch, the frames/s of
    ``batches`` more, and their shutdown."""
    t0 = time.perf_counter()
    from torchrl_oni.worker_start import use_forkserver

    if method == "forkserver":
        use_forkserver()
    from torchrl_oni.train.config import TrainConfig
    from torchrl_oni.train.distributed import make_local_collector
    from torchrl_oni.train.env_factory import make_env_factory
    from torchrl_oni.train.policy import acting_copy, make_actor_critic

    cfg = TrainConfig(workers=workers, envs_per_worker=envs, rollout=ROLLOUT).resolved()
    factories = [make_env_factory(cfg, w) for w in range(workers)]
    env = factories[0]()
    actor = make_actor_critic(env)[0]
    env.close()
    batch = envs * ROLLOUT  # one rollout of every game of a worker
    collector = make_local_collector(factories, acting_copy(actor), frames_per_batch=batch,
                                     total_frames=batch * (1 + batches))
    first = None
    for _ in collector:
        if first is None:
            first = time.perf_counter() - t0
    steady_s = time.perf_counter() - t0 - first
    shutdown_from = time.perf_counter()
    collector.shutdown()
    # the --batches after the first are not part of the start: the total is first batch + shutdown
    return {"first_batch_s": first, "total_s": first + time.perf_counter() - shutdown_from,
            "steady_fps": batch * batches / steady_s if batches else None}


def main(argv=None) -> int:
    from torchrl_oni.cli_errors import OneLineArgumentParser

    p = OneLineArgumentParser(prog="worker_start.py", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="env worker processes (default 2)")
    p.add_argument("--envs", type=int, default=32, help="games per worker (default 32, the CPU default)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the rows taking turns (default 5)")
    p.add_argument("--batches", type=int, default=0,
                   help="batches after the first, timed as the workers' steady frames/s (default 0: none)")
    p.add_argument("--one", choices=ROWS, help=argparse.SUPPRESS)  # a row's own process
    args = p.parse_args(argv)
    for flag, least in (("workers", 1), ("envs", 1), ("rounds", 1), ("batches", 0)):
        if getattr(args, flag) < least:
            p.error(f"--{flag} must be >= {least}, got {getattr(args, flag)}")
    if args.one:
        print(json.dumps(_one_start(args.one, args.workers, args.envs, args.batches)))
        return 0
    got = {row: [] for row in ROWS}
    for rnd in range(args.rounds):
        for row in ROWS:
            done = subprocess.run([sys.executable, __file__, "--one", row, "--workers", str(args.workers),
                                   "--envs", str(args.envs), "--batches", str(args.batches)],
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                print(f"worker_start.py: error: the {row} row failed: {done.stderr.strip()[-500:]}", file=sys.stderr)
                return 1
            got[row].append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"[round {rnd + 1}/{args.rounds}] " + ", ".join(
            f"{row} {got[row][-1]['first_batch_s']:.2f} s" for row in ROWS), file=sys.stderr, flush=True)
    keys = ("first_batch_s", "total_s") + (("steady_fps",) if args.batches else ())
    med = {row: {k: statistics.median(r[k] for r in got[row]) for k in keys} for row in ROWS}
    print(f"\n{args.workers} env workers of {args.envs} games, light policy: from the process's start to the first "
          f"batch, and to the workers' shutdown (median of {args.rounds} rounds)")
    steady_head = f" {'frames/s after':>15}" if args.batches else ""
    print(f"{'row':<12} {'first batch s':>14} {'with shutdown s':>16}{steady_head}")
    for row in ROWS:
        steady = f" {med[row]['steady_fps']:>15,.0f}" if args.batches else ""
        print(f"{row:<12} {med[row]['first_batch_s']:>14.2f} {med[row]['total_s']:>16.2f}{steady}")
    result = {"benchmark": "worker_start", "workers": args.workers, "envs": args.envs, "rounds": args.rounds,
              "batches": args.batches}
    for k in keys:
        result[k] = {row: [round(r[k], 3) for r in got[row]] for row in ROWS}
    result["forkserver_over_spawn"] = round(med["forkserver"]["first_batch_s"] / med["spawn"]["first_batch_s"], 3)
    if args.batches:
        result["steady_forkserver_over_spawn"] = round(med["forkserver"]["steady_fps"] / med["spawn"]["steady_fps"], 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
