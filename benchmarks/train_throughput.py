"""End-to-end PPO throughput: frames/s of ``oni-train``'s loop and where the time goes.

Runs the real trainer (``MultiAsyncCollector`` over batched-env workers, GAE, ClipPPOLoss,
weight sync, CSV logging) for a bounded time per configuration and reports steady-state
frames/s (the first 25 % of each run, process start-up included, is discarded) and the
fraction of the trainer's time spent waiting for collected data.

Baseline in the same run: the same trainer with ONE game per worker, i.e. a straightforward
TorchRL PPO where every TensorDict carries a single NetHack game.

Usage: ``python benchmarks/train_throughput.py --seconds 120 [--workers 2] [--envs 32]``
Last line: one JSON object with ``fps``, ``collect_fraction``, ``baseline_fps``, ``ratio``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time




class _TimeLimit:
    """Stops the trainer after ``seconds`` by lowering its frame budget to what it has done."""

    name = "time_limit"

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.t0 = None

    def on_batch(self, batch, trainer):
        if self.t0 is None:
            self.t0 = time.perf_counter()
        return batch

    def after_update(self, trainer):
        if time.perf_counter() - self.t0 > self.seconds:
            trainer.cfg.frames = trainer.frames


def run(seconds: float, workers: int, envs: int, rollout: int, arch: str = "light", device: str = "auto") -> dict:
    from torchrl_oni.train import TrainConfig, Trainer
    from torchrl_oni.train.logging import read_metrics

    logdir = tempfile.mkdtemp(prefix="oni-bench-")
    cfg = TrainConfig(frames=10**9, workers=workers, envs_per_worker=envs, rollout=rollout, arch=arch, device=device,
                      logdir=logdir, progress=False, tensorboard=False, checkpoint_every=10**9,
                      minibatch_size=max(envs * rollout, 256))
    trainer = Trainer(cfg, hooks=[_TimeLimit(seconds)])
    t0 = time.perf_counter()
    summary = trainer.train()
    wall = time.perf_counter() - t0
    rows = read_metrics(logdir)
    cut = rows[len(rows) // 4] if len(rows) >= 4 else rows[0]
    last = rows[-1]
    steady = (last["frames"] - cut["frames"]) / max(last["time_s"] - cut["time_s"], 1e-9)
    return {
        "fps": steady,
        "fps_incl_startup": summary["frames"] / wall,
        "collect_fraction": last["collect_fraction"],
        "frames": summary["frames"],
        "iterations": last["iteration"],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="total time budget (default 120)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs", type=int, default=32, help="games per worker (default 32)")
    p.add_argument("--rollout", type=int, default=32)
    p.add_argument("--arch", default="light", help="policy network: light, oni (GRU), oni-lstm")
    p.add_argument("--device", default="auto", help="learner device (auto: cuda when there is one)")
    p.add_argument("--no-baseline", action="store_true")
    args = p.parse_args(argv)
    share = args.seconds if args.no_baseline else args.seconds * 0.65
    main_run = run(share, args.workers, args.envs, args.rollout, args.arch, args.device)
    rows = [(f"batched: {args.workers} workers x {args.envs} games", main_run)]
    base = None
    if not args.no_baseline:
        base = run(args.seconds - share, args.workers, 1, args.rollout, args.arch, args.device)
        rows.append((f"baseline: {args.workers} workers x 1 game", base))
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    print(f"\nPPO end to end, {args.arch} policy, {os.cpu_count()} cores, learner on {device}, rollout {args.rollout}")
    print(f"{'configuration':<40} {'frames/s':>10} {'incl. start':>12} {'waiting for data':>17}")
    for name, r in rows:
        print(f"{name:<40} {r['fps']:>10,.0f} {r['fps_incl_startup']:>12,.0f} {r['collect_fraction']:>17.0%}")
    out = {
        "fps": round(main_run["fps"]),
        "collect_fraction": round(main_run["collect_fraction"], 3),
        "learn_fraction": round(1 - main_run["collect_fraction"], 3),
        "workers": args.workers,
        "envs_per_worker": args.envs,
        "arch": args.arch,
        "fps_per_core": round(main_run["fps"] / (os.cpu_count() or 1)),
    }
    if base:
        out["baseline_fps"] = round(base["fps"])
        out["ratio"] = round(main_run["fps"] / max(base["fps"], 1e-9), 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
