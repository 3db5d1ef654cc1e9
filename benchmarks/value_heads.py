"""One value head for the mixed reward (ONI) vs separate extrinsic/intrinsic heads: which learns better?

Score with ONI's coefficients (``extrinsic_coeff 0.1``, ``intrinsic_coeff 0.4``, ONI-Retrieval),
the scripted annotator (so the comparison is not limited by a CPU LLM), the same seeds for
both settings. Reported per setting: the extrinsic episode return and the intrinsic reward
collected per episode, averaged over the last quarter of each run, then over seeds.

Usage: ``python benchmarks/value_heads.py --frames 300000 --seeds 0 1``
(smoke: ``--frames 4096 --seeds 0 --workers 1 --envs 4``; ``--workers``/``--envs`` default to
``oni-train``'s 2 workers × 32 games). Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile


def run(value_heads: int, seed: int, frames: int, **env) -> dict:
    from torchrl_oni.train import TrainConfig, Trainer
    from torchrl_oni.train.run_log import read_metrics

    logdir = tempfile.mkdtemp(prefix=f"oni-heads{value_heads}-s{seed}-")
    cfg = TrainConfig(task="score", frames=frames, seed=seed, logdir=logdir, value_heads=value_heads,
                      intrinsic_reward="retrieval", annotator="scripted", extrinsic_coeff=0.1,
                      intrinsic_coeff=0.4, progress=False, tensorboard=False, **env)
    Trainer.from_config(cfg).train()
    rows = [r for r in read_metrics(logdir) if "episode/return" in r]
    if not rows:
        raise SystemExit(f"error: no episode ended in {frames:,} frames ({logdir}): raise --frames")
    tail = rows[-max(1, len(rows) // 4):]
    mean = lambda k: statistics.mean(r.get(k, 0.0) for r in tail)  # noqa: E731
    return {
        "return": mean("episode/return"),
        "intrinsic_per_episode": mean("intrinsic/mean") * mean("episode/length"),
        "length": mean("episode/length"),
        "logdir": logdir,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frames", type=int, default=300_000)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--seconds", type=float, default=None, help="unused: the budget is --frames (kept for symmetry)")
    p.add_argument("--workers", type=int, default=None, help="env worker processes (default: oni-train's)")
    p.add_argument("--envs", type=int, default=None, help="games per worker (default: oni-train's)")
    args = p.parse_args(argv)
    env = {k: v for k, v in (("workers", args.workers), ("envs_per_worker", args.envs)) if v is not None}
    results = {1: [], 2: []}
    for seed in args.seeds:
        for heads in (1, 2):
            results[heads].append(run(heads, seed, args.frames, **env))
    print(f"\nScore, retrieval (scripted), ext 0.1 + int 0.4, {args.frames:,} frames, seeds {args.seeds}")
    print(f"{'value heads':<14} {'extrinsic return':>17} {'intrinsic / episode':>20} {'episode length':>15}")
    summary = {}
    for heads, rs in results.items():
        ret = statistics.mean(r["return"] for r in rs)
        intr = statistics.mean(r["intrinsic_per_episode"] for r in rs)
        length = statistics.mean(r["length"] for r in rs)
        per_seed = ", ".join(f"{r['return']:.1f}" for r in rs)
        print(f"{heads:<14} {ret:>17.2f} {intr:>20.3f} {length:>15.0f}   (returns per seed: {per_seed})")
        summary[f"return_{heads}_heads"] = round(ret, 3)
        summary[f"intrinsic_per_episode_{heads}_heads"] = round(intr, 4)
    summary["frames"] = args.frames
    summary["seeds"] = args.seeds
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
