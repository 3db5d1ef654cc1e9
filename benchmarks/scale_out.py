"""Scale-out overhead: the same PPO run with env workers as local processes, then as Ray actors.

Same machine, same workers × games, same time budget: ``oni-train``'s loop (``Trainer``) with
``--backend local`` (``MultiAsyncCollector``, one process per worker) and ``--backend ray``
(``RayCollector``, one Ray actor per worker; without ``--ray-address`` a Ray instance is started
for the run, sized to the workers). Reported per backend: steady-state frames/s (the first 25 %
of the metrics rows discarded), the fraction of the learner's time spent waiting for data, and
the start-up time (``train()`` called → first batch in the learner's hands: process or actor
start, Ray's own start, the first rollout).

Usage: ``python benchmarks/scale_out.py --seconds 120 [--workers 2] [--envs 32] [--rollout 32]``
Last line: one JSON object with ``local_fps``, ``ray_fps``, ``ray_over_local``,
``local_startup_s``, ``ray_startup_s``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from torchrl_oni.train.hooks import TrainHook


class _Clock(TrainHook):
    """Notes when the first batch arrives, and stops the trainer ``seconds`` after it."""

    name = "clock"
    stages = ("batch", "post_update")

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.t_first = None

    def on_batch(self, batch, trainer):
        if self.t_first is None:
            self.t_first = time.perf_counter()
        return batch

    def after_update(self, trainer):
        if time.perf_counter() - self.t_first > self.seconds:
            trainer.total_frames = trainer.frames


def run(backend: str, seconds: float, args) -> dict:
    from torchrl_oni.train import TrainConfig, Trainer
    from torchrl_oni.train.run_log import read_metrics

    logdir = tempfile.mkdtemp(prefix=f"oni-scale-{backend}-")
    extra = dict(backend=backend)
    if backend == "ray" and args.ray_address:
        extra["ray_address"] = args.ray_address
    cfg = TrainConfig(frames=10**9, workers=args.workers, envs_per_worker=args.envs, rollout=args.rollout,
                      logdir=logdir, progress=False, tensorboard=False, checkpoint_every=10**9,
                      minibatch_size=max(args.envs * args.rollout, 256), seed=args.seed, **extra)
    clock = _Clock(seconds)
    trainer = Trainer.from_config(cfg, hooks=[clock])
    t0 = time.perf_counter()
    summary = trainer.train()
    rows = read_metrics(logdir)
    cut = rows[len(rows) // 4] if len(rows) >= 4 else rows[0]
    last = rows[-1]
    return {
        "fps": (last["frames"] - cut["frames"]) / max(last["time_s"] - cut["time_s"], 1e-9),
        "startup_s": clock.t_first - t0,
        "collect_fraction": last["collect_fraction"],
        "frames": summary["frames"],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="collection time per backend (default 120), "
                   "start-up not included")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs", type=int, default=32, help="games per worker (default 32)")
    p.add_argument("--rollout", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    args = p.parse_args(argv)
    try:
        import ray  # noqa: F401
    except ImportError:
        p.error("needs Ray: pip install 'torchrl_oni[ray]'")
    results = {backend: run(backend, args.seconds, args) for backend in ("local", "ray")}
    print(f"\nPPO end to end, light policy, {os.cpu_count()} cores, {args.workers} workers x {args.envs} games, "
          f"rollout {args.rollout}")
    print(f"{'backend':<10} {'frames/s':>10} {'start-up s':>11} {'waiting for data':>17} {'frames':>10}")
    for backend, r in results.items():
        print(f"{backend:<10} {r['fps']:>10,.0f} {r['startup_s']:>11.1f} {r['collect_fraction']:>17.0%} "
              f"{r['frames']:>10,.0f}")
    local, ray_ = results["local"], results["ray"]
    print(json.dumps({
        "local_fps": round(local["fps"]),
        "ray_fps": round(ray_["fps"]),
        "ray_over_local": round(ray_["fps"] / max(local["fps"], 1e-9), 3),
        "local_startup_s": round(local["startup_s"], 1),
        "ray_startup_s": round(ray_["startup_s"], 1),
        "local_collect_fraction": round(local["collect_fraction"], 3),
        "ray_collect_fraction": round(ray_["collect_fraction"], 3),
        "workers": args.workers,
        "envs_per_worker": args.envs,
        "rollout": args.rollout,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
