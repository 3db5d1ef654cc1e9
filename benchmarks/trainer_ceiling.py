"""The trainer process alone: the most frames/s it can take in when env workers are never late.

The real :class:`~torchrl_oni.train.Trainer` (episode statistics, the intrinsic-reward hooks,
gathering workers' batches, reward mixing, the PPO update, weight broadcast, logging) is fed by a
stand-in collector that hands over copies of one real rollout (``[K, T]`` of the batched env,
captions included) as fast as the trainer asks — what ``MultiAsyncCollector`` hands over, minus
the waiting. On a GPU node this is the ceiling that end-to-end frames/s cannot pass, whatever
the number of env workers; the gap between it and ``train_throughput.py`` is the workers' side.

Baseline in the same run: with ``--baseline-code DIR`` the same measurement by the package in DIR
(e.g. ``git worktree add DIR HEAD``), interleaved rounds.

Usage: ``python benchmarks/trainer_ceiling.py --seconds 20 [--device cuda] [--arch light oni]
[--frames-per-update 1024 16384] [--intrinsic-reward retrieval] [--baseline-code DIR --rounds 3]``
Last line: one JSON object, ``results`` with frames/s and stage shares per configuration, and
``ratio`` (this code over the baseline, first configuration) with ``--baseline-code``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# this folder is the script's: the time limit and the steady-state cut of the end-to-end benchmark
from train_throughput import steady_state, timed_trainer


class _StandInCollector:
    """Hands over ``total_frames`` worth of copies of ``batch`` (the collector's contract:
    iterate, ``update_policy_weights_``, ``shutdown``)."""

    last_worker = None
    procs = None

    def __init__(self, batch, total_frames: int):
        self.batch = batch
        self.batches = -(-total_frames // batch.numel())

    def __iter__(self):
        for _ in range(self.batches):
            yield self.batch.clone()  # MultiAsyncCollector clones its shared buffer likewise

    def update_policy_weights_(self, *args, **kwargs):
        pass

    def shutdown(self):
        pass


def run(seconds: float, arch: str, device: str, frames_per_update: int, intrinsic_reward: str, games: int,
        rollout: int) -> dict:
    import torch
    from torchrl_oni.train import TrainConfig, Trainer
    from torchrl_oni.train.learner import rollout_batch
    from torchrl_oni.train.run_log import read_metrics

    _, _, batch = rollout_batch(arch, games, rollout)
    try:  # what the workers hand over: their acting copy stores no trunk outputs (train/policy.py)
        from torchrl_oni.train.policy import TRUNK_KEYS

        batch = batch.exclude(*TRUNK_KEYS)
    except ImportError:  # code from before TRUNK_KEYS (--baseline-code)
        pass
    logdir = tempfile.mkdtemp(prefix="oni-ceiling-")
    extra = {"frames_per_update": frames_per_update} if frames_per_update != games * rollout else {}
    if intrinsic_reward != "none":
        extra.update(intrinsic_reward=intrinsic_reward, annotator="scripted")
    cfg = TrainConfig(frames=10**9, workers=1, envs_per_worker=games, rollout=rollout, arch=arch, device=device,
                      logdir=logdir, progress=False, tensorboard=False, checkpoint_every=10**9,
                      minibatch_size=frames_per_update, **extra)

    class StandInTrainer(Trainer):  # code from before the env workers were the run's own part (--baseline-code)
        def _make_collector(self, total_frames: int):
            self.collector = _StandInCollector(batch, total_frames)
            return self.collector

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))  # what the trainer keeps beside its workers
    trainer = timed_trainer(cfg, seconds, StandInTrainer)
    workers = getattr(trainer, "workers", None)
    if workers is not None:
        def stand_in(actor, device, primer_spec, total_frames, seed_offset):
            workers.collector = _StandInCollector(batch, total_frames)
            return workers.collector

        workers._make_collector = stand_in
    trainer.train()
    fps, last, stages = steady_state(read_metrics(logdir))
    return {"arch": arch, "frames_per_update": frames_per_update, "intrinsic_reward": intrinsic_reward,
            "fps": round(fps), "updates": int(last["iteration"]), "stages": stages}


def _run_elsewhere(code_dir: str, args, arch: str, fpu: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one-run", "--seconds", str(args.seconds), "--arch", arch,
           "--device", args.device, "--frames-per-update", str(fpu), "--intrinsic-reward", args.intrinsic_reward,
           "--games", str(args.games), "--rollout", str(args.rollout)]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(code_dir) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=code_dir)
    if out.returncode != 0:
        raise SystemExit(f"trainer_ceiling: error: the run with --baseline-code {code_dir} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="per configuration (default 20)")
    p.add_argument("--device", default="auto", help="learner device: cpu, cuda or auto")
    p.add_argument("--arch", nargs="+", default=["light"], help="policy networks: light, oni")
    p.add_argument("--frames-per-update", nargs="+", type=int, default=[1024])
    p.add_argument("--intrinsic-reward", default="retrieval", help="reward type, labelled by the rules (default retrieval)")
    p.add_argument("--games", type=int, default=32, help="games per worker batch (default 32)")
    p.add_argument("--rollout", type=int, default=32)
    p.add_argument("--baseline-code", metavar="DIR", default=None)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one_run:
        print(json.dumps(run(args.seconds, args.arch[0], args.device, args.frames_per_update[0],
                             args.intrinsic_reward, args.games, args.rollout)))
        return 0
    if args.baseline_code and not os.path.isdir(os.path.join(args.baseline_code, "torchrl_oni")):
        p.error(f"--baseline-code {args.baseline_code}: no torchrl_oni package there")
    rows = []
    for arch in args.arch:
        for fpu in args.frames_per_update:
            mine, theirs = [], []
            for _ in range(args.rounds if args.baseline_code else 1):
                mine.append(run(args.seconds, arch, args.device, fpu, args.intrinsic_reward, args.games, args.rollout))
                if args.baseline_code:
                    theirs.append(_run_elsewhere(args.baseline_code, args, arch, fpu))
            row = sorted(mine, key=lambda r: r["fps"])[len(mine) // 2]
            if theirs:
                row["baseline_fps"] = statistics.median(r["fps"] for r in theirs)
                row["rounds_fps"] = [r["fps"] for r in mine]
                row["rounds_baseline_fps"] = [r["fps"] for r in theirs]
                row["ratio"] = round(row["fps"] / max(row["baseline_fps"], 1e-9), 3)
            rows.append(row)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    print(f"\nThe trainer process alone (stand-in collector), learner on {device}, {os.cpu_count()} cores, "
          f"intrinsic reward {args.intrinsic_reward}, batches of {args.games} x {args.rollout}")
    print(f"{'arch':<6} {'frames/upd':>10} {'frames/s':>10} {'baseline':>10} {'ratio':>6}  stages")
    for r in rows:
        top = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["stages"].items(), key=lambda kv: -kv[1])[:6])
        print(f"{r['arch']:<6} {r['frames_per_update']:>10,} {r['fps']:>10,} {r.get('baseline_fps', ''):>10} "
              f"{r.get('ratio', ''):>6}  {top}")
    out = {"device": device, "results": rows}
    if args.baseline_code:
        out["ratio"] = rows[0]["ratio"]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
