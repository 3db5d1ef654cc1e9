"""What each intrinsic reward costs the trainer: training frames/s with it vs ``none``, same run.

Each reward type trains the real :class:`~torchrl_oni.train.Trainer` (collector workers, PPO,
the intrinsic hooks of ``oni-train``) for the same number of frames; runs are interleaved
round-robin so drifting machine load hits every type alike, and each type's steady-state rate
(the first ``--warmup`` iterations excluded) is the median over rounds.

Labels come from the **scripted annotator**, in the trainer process: the LLM's own compute is
not on the training cores (in real runs it lives on a GPU server, or the embedded server's one
thread), so what is measured is the trainer-side cost: store inserts and lookups, the
annotation worker thread, reward inference, reward-model training (classification/ranking, on
ONI's schedule: 32 steps per new-label batch), pair queueing (ranking), BoW embedding (bow).
ELLM gets its goals from the scripted goal suggester (rules, as the scripted annotator for
labels) through its goal worker thread; what is measured is state captions, the goal table, and
embedding transition messages with the default encoder (MiniLM when installed) on the learner.

A type may name where its reward model trains, ``<type>/inline`` or ``<type>/background``
(``--rm-training``; plain ``<type>`` is the run's default, inline on a CPU learner), to compare
the two in the same rounds; ``--rm-time-fraction`` applies to every run (0: ONI's schedule, no cap).

Usage::

    python benchmarks/reward_overhead.py --seconds 240
    python benchmarks/reward_overhead.py --kinds ellm,retrieval  # only some types (and none)
    python benchmarks/reward_overhead.py --kinds classification/inline,classification/background \
        --rm-time-fraction 0

Prints a table, then, as the LAST line, one JSON object with ``fps_<type>`` and
``ratio_<type>`` (= fps_type / fps_none) for retrieval, classification, ranking, bow and ellm
(``/`` in a name becomes ``_``: ``ratio_classification_background``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torchrl_oni.train import TrainConfig, Trainer  # noqa: E402
from torchrl_oni.train.run_log import read_metrics  # noqa: E402

KINDS = ("none", "retrieval", "classification", "ranking", "bow", "ellm")


def steady_fps(logdir: str, warmup: int) -> float:
    rows = read_metrics(logdir)
    start = rows[min(warmup, len(rows) - 2)]
    end = rows[-1]
    return (end["frames"] - start["frames"]) / max(end["time_s"] - start["time_s"], 1e-9)


TRAINING = ("inline", "background")


def run_once(name: str, frames: int, args, root: str) -> tuple:
    """One training run of reward ``name``: its steady frames/s, and its reward model's gradient
    steps (what the time its training costs bought; 0 without a model)."""
    kind, _, training = name.partition("/")
    logdir = tempfile.mkdtemp(prefix=f"{kind}-", dir=root)
    cfg = TrainConfig(
        frames=frames, workers=args.workers, envs_per_worker=args.envs_per_worker, rollout=32,
        intrinsic_reward=kind, annotator="scripted",
        logdir=logdir, progress=False, tensorboard=False, checkpoint_every=10**9, seed=args.seed,
        minibatch_size=args.minibatch_size, rm_training=training or "auto", rm_time_fraction=args.rm_time_fraction,
    )
    Trainer.from_config(cfg).train()
    steps = max((r.get("reward_model/steps", 0) for r in read_metrics(logdir)), default=0)
    return steady_fps(logdir, args.warmup), steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=240.0, help="rough total time budget")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--envs-per-worker", type=int, default=16)
    p.add_argument("--minibatch-size", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3, help="iterations left out of each rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma-separated reward types to compare with none (default: {','.join(KINDS[1:])}); "
                        "<type>/inline or <type>/background picks where its reward model trains")
    p.add_argument("--rm-time-fraction", type=float, default=None,
                   help="cap on the reward model's share of wall time, every run (default: the run's, 0.1 on CPU)")
    args = p.parse_args()
    kinds = ("none",) + tuple(k for k in args.kinds.split(",") if k and k != "none")
    unknown = sorted(k for k in kinds
                     if k.partition("/")[0] not in KINDS or k.partition("/")[2] not in ("",) + TRAINING)
    if unknown:
        p.error(f"unknown reward type(s) {', '.join(unknown)}; choose from {', '.join(KINDS[1:])}, "
                f"optionally /{' or /'.join(TRAINING)}")
    logging.disable(logging.INFO)
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="oni-reward-overhead-")
    batch = args.envs_per_worker * 32

    # calibrate: how many frames fit in the budget
    t0 = time.perf_counter()
    probe_frames = batch * (args.warmup + 6)
    probe_fps, _ = run_once("none", probe_frames, args, root)
    probe_wall = time.perf_counter() - t0
    overhead_s = max(probe_wall - probe_frames / probe_fps, 1.0)  # start-up per run
    per_run = max(args.seconds / (args.rounds * len(kinds)) - overhead_s, 2.0)
    frames = max(int(per_run * probe_fps * 0.8) // batch, args.warmup + 4) * batch

    rates = {k: [] for k in kinds}
    model_steps = {k: [] for k in kinds}  # the reward model's steps in each run
    for r in range(args.rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            fps_run, steps_run = run_once(kind, frames, args, root)
            rates[kind].append(fps_run)
            model_steps[kind].append(steps_run)
            print(f"  round {r + 1}/{args.rounds}  {kind:<15} {rates[kind][-1]:8,.0f} frames/s", flush=True)

    fps = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\nreward overhead: {args.workers} worker(s) × {args.envs_per_worker} games, {frames:,} frames "
          f"per run, {args.rounds} rounds, scripted annotator, {os.cpu_count()} CPUs")
    print(f"{'reward':<26}{'frames/s (median)':>18}{'vs none':>10}{'min..max':>22}{'model steps':>13}")
    for kind in kinds:
        lo, hi = min(rates[kind]), max(rates[kind])
        steps = f"{statistics.median(model_steps[kind]):,.0f}" if any(model_steps[kind]) else ""
        print(f"{kind:<26}{fps[kind]:>18,.0f}{fps[kind] / fps['none']:>10.3f}{f'{lo:,.0f}..{hi:,.0f}':>22}{steps:>13}")
    result = {"frames_per_run": frames, "rounds": args.rounds, "workers": args.workers,
              "envs_per_worker": args.envs_per_worker, "cpus": os.cpu_count()}
    if args.rm_time_fraction is not None:
        result["rm_time_fraction"] = args.rm_time_fraction
    for kind in kinds:
        result[f"fps_{kind.replace('/', '_')}"] = round(fps[kind], 1)
    for kind in kinds[1:]:
        result[f"ratio_{kind.replace('/', '_')}"] = round(fps[kind] / fps["none"], 4)
        if any(model_steps[kind]):
            result[f"rm_steps_{kind.replace('/', '_')}"] = statistics.median(model_steps[kind])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
