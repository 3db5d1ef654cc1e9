"""End-to-end PPO throughput: frames/s of ``oni-train``'s loop and where the time goes.

Runs the real trainer (``MultiAsyncCollector`` over batched-env workers, GAE, ClipPPOLoss,
weight sync, CSV logging) for a bounded time per configuration and reports steady-state
frames/s (the first 25 % of each run, process start-up included, is discarded) and the
fraction of the trainer's time spent waiting for collected data.

Baseline in the same run: the same trainer with ONE game per worker, i.e. a straightforward
TorchRL PPO where every TensorDict carries a single NetHack game. With ``--baseline-code DIR``
the baseline is instead the same configuration run by the package in DIR (e.g. ``git worktree
add DIR HEAD~1``), in interleaved rounds: the regression guard for learner changes.

Also reported: the learner's time per stage (``torchrl_oni.train.timing``; host times on CUDA)
and the share outside the loss's forward/backward, and the GPU's utilisation sampled once a
second (``nvidia-smi``) when the learner is on CUDA.

Usage: ``python benchmarks/train_throughput.py --seconds 120 [--workers 2] [--envs 32]
[--frames-per-update 16384] [--acting server] [--task staircase-lvl3] [--baseline-code DIR --rounds 3]``;
what a reward type costs: ``--intrinsic-reward retrieval --baseline-code . --baseline-intrinsic-reward none``;
what games in groups give the served workers: ``--acting server --acting-splits 2 --baseline-code .
--baseline-acting-splits 1``.
Last line: one JSON object with ``fps``, ``collect_fraction``, ``baseline_fps``, ``ratio``,
``stages`` and ``gpu_util``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time


class _GPUUtilisation:
    """Samples the GPU's utilisation (%) once a second with ``nvidia-smi`` while it runs."""

    def __init__(self, device: str):
        self.samples = []
        self._stop = threading.Event()
        index = device.split(":")[1] if ":" in device else "0"
        self._cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", index]
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(1.0):
            try:
                out = subprocess.run(self._cmd, capture_output=True, text=True, timeout=5).stdout.strip()
                self.samples.append(float(out.splitlines()[0]))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                return  # no nvidia-smi: utilisation unknown

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)

    def mean(self):
        # the first samples are start-up; the same cut as the frames/s
        steady = self.samples[len(self.samples) // 4:]
        return round(statistics.fmean(steady), 1) if steady else None




def timed_trainer(cfg, seconds: float, trainer_cls=None):
    """The trainer of ``cfg`` (``trainer_cls``, default ``Trainer``) with the run's intrinsic-reward
    hook (none without one), then a time limit: it stops the trainer ``seconds`` after its first
    update (whose compilation, with ``--compile``, can take longer than the window) by lowering
    its frame budget to what it has done."""
    from torchrl_oni.train import Trainer, TrainHook

    class TimeLimit(TrainHook):
        name = "time_limit"
        stages = ("post_update",)

        def __init__(self):
            self.t0 = None

        def after_update(self, trainer):
            if self.t0 is None:
                self.t0 = time.perf_counter()
            elif time.perf_counter() - self.t0 > seconds:
                if hasattr(trainer, "total_frames"):
                    trainer.total_frames = trainer.frames
                else:  # code from before the trainer held its budget (--baseline-code)
                    trainer.cfg.frames = trainer.frames

    trainer_cls = trainer_cls or Trainer
    if hasattr(trainer_cls, "from_config"):
        return trainer_cls.from_config(cfg, hooks=[TimeLimit()])
    # code from before Trainer.from_config (--baseline-code): its hooks built by hand
    from torchrl_oni.train.intrinsic import build_intrinsic_hooks

    return trainer_cls(cfg, hooks=build_intrinsic_hooks(cfg) + [TimeLimit()])


def steady_state(rows: list) -> tuple:
    """``(frames/s, last row, learner stage shares)`` of a run's metrics rows, its first quarter
    (start-up) left out."""
    cut = rows[len(rows) // 4] if len(rows) >= 4 else rows[0]
    last = rows[-1]
    fps = (last["frames"] - cut["frames"]) / max(last["time_s"] - cut["time_s"], 1e-9)
    stages = {k[len("learner/"):-len("_share")]: round(v, 4) for k, v in last.items()
              if k.startswith("learner/") and k.endswith("_share") and k != "learner/outside_loss_share"}
    return fps, last, stages


def run(seconds: float, workers: int, envs: int, rollout: int, arch: str = "light", device: str = "auto",
        frames_per_update=None, acting: str = "workers", minibatch_size=None, intrinsic_reward: str = "none",
        prefetch_batches=None, compile=None, task=None, acting_splits=None) -> dict:
    import torch
    from torchrl_oni.train import TrainConfig
    try:
        from torchrl_oni.train.run_log import read_metrics
    except ImportError:  # code from before the module's rename (--baseline-code)
        from torchrl_oni.train.logging import read_metrics

    logdir = tempfile.mkdtemp(prefix="oni-bench-")
    extra = {}
    if frames_per_update:  # settings this version of the trainer may not have (--baseline-code)
        extra["frames_per_update"] = frames_per_update
    if acting != "workers":
        extra["acting"] = acting
    if prefetch_batches is not None:
        extra["prefetch_batches"] = prefetch_batches
    if acting_splits is not None:
        extra["acting_splits"] = acting_splits
    if compile:
        extra["compile"] = compile
    if task:
        extra["task"] = task
    if intrinsic_reward != "none":  # labels from the rules, in the trainer: the LLM's compute lives elsewhere
        extra.update(intrinsic_reward=intrinsic_reward, annotator="scripted")
    cfg = TrainConfig(frames=10**9, workers=workers, envs_per_worker=envs, rollout=rollout, arch=arch, device=device,
                      logdir=logdir, progress=False, tensorboard=False, checkpoint_every=10**9,
                      minibatch_size=minibatch_size or max(envs * rollout, 256), **extra)
    trainer = timed_trainer(cfg, seconds)
    t0 = time.perf_counter()
    learner_device = str(trainer.device)
    util = _GPUUtilisation(learner_device) if torch.device(learner_device).type == "cuda" else None
    if util is not None:
        with util:
            summary = trainer.train()
    else:
        summary = trainer.train()
    wall = time.perf_counter() - t0
    steady, last, stages = steady_state(read_metrics(logdir))
    record = trainer.run.cfg if hasattr(trainer, "run") else trainer.cfg  # the latter: --baseline-code
    return {
        "fps": steady,
        "fps_incl_startup": summary["frames"] / wall,
        "collect_fraction": last["collect_fraction"],
        "frames": summary["frames"],
        "iterations": last["iteration"],
        "stages": stages,
        "outside_loss_share": last.get("learner/outside_loss_share"),
        "gpu_util": util.mean() if util is not None else None,
        "acting": {k: v for k, v in last.items() if k.startswith("acting/")},
        "prefetch_batches": getattr(record.distributed, "prefetch_batches", None),  # as resolved
        "compile": getattr(record.ppo, "compile", None),
        "acting_splits": getattr(record, "acting_splits", 1),
        "envs_per_worker": getattr(getattr(record, "env", record), "envs_per_worker", None),  # as resolved
    }


def _run_elsewhere(code_dir: str, args, seconds: float) -> dict:
    """The same measurement by the package in ``code_dir`` (a subprocess with it first on the path)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one-run", "--seconds", str(seconds), "--workers",
           str(args.workers), "--envs", str(args.baseline_envs or args.envs), "--rollout", str(args.rollout),
           "--arch", args.arch,
           "--device", args.device, "--intrinsic-reward", args.baseline_intrinsic_reward or args.intrinsic_reward,
           "--acting", args.acting]
    for flag, value in (("--frames-per-update", args.frames_per_update), ("--minibatch-size", args.minibatch_size),
                        ("--prefetch-batches", args.baseline_prefetch_batches),
                        ("--acting-splits", args.baseline_acting_splits),
                        ("--compile", args.baseline_compile), ("--task", args.task)):
        if value is not None:  # only what was asked: the baseline's code may not know the setting
            cmd += [flag, str(value)]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(code_dir) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=code_dir)
    if out.returncode != 0:
        raise SystemExit(f"train_throughput: error: the run with --baseline-code {code_dir} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    from torchrl_oni.cli_errors import OneLineArgumentParser  # as old as config_tree: any --baseline-code has it
    from torchrl_oni.config_tree import parse_count

    p = OneLineArgumentParser(prog="train_throughput.py", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="total time budget (default 120)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs", type=int, default=32, help="games per worker (default 32)")
    p.add_argument("--rollout", type=int, default=32)
    p.add_argument("--arch", default="light", help="policy network: light, oni (GRU), oni-lstm")
    p.add_argument("--device", default="auto", help="learner device (auto: cuda when there is one)")
    p.add_argument("--frames-per-update", type=parse_count, default=None,
                   help="frames gathered per PPO update (default: one worker's batch)")
    p.add_argument("--minibatch-size", type=parse_count, default=None,
                   help="steps per PPO minibatch (default: one worker's batch, at least 256)")
    p.add_argument("--acting", default="workers", choices=("workers", "server"),
                   help="where the policy acts: env workers' CPUs or one inference server on the learner's device")
    p.add_argument("--acting-splits", type=int, default=None, metavar="N",
                   help="with --acting server: groups of each worker's games that take turns (default: the trainer's)")
    p.add_argument("--baseline-envs", type=int, default=None, metavar="K",
                   help="with --baseline-code: the baseline's games per worker (default: --envs), e.g. the "
                        "default of the code before when this code's differs")
    p.add_argument("--baseline-acting-splits", type=int, default=None, metavar="N",
                   help="with --baseline-code: the baseline's --acting-splits (default: its own default)")
    p.add_argument("--intrinsic-reward", default="none",
                   help="an intrinsic reward type (retrieval, classification, ...), labelled by the rules annotator "
                        "in the trainer (default none)")
    p.add_argument("--baseline-intrinsic-reward", default=None, metavar="TYPE",
                   help="with --baseline-code: the baseline's --intrinsic-reward (default: the same); with "
                        "--baseline-code . it measures what a reward type costs, in interleaved rounds")
    p.add_argument("--task", default=None, help="the task (default: the trainer's, score)")
    p.add_argument("--prefetch-batches", type=int, default=None,
                   help="batches the trainer takes from the workers while it learns (default: the trainer's, one "
                        "update's worth; 0: only when it asks)")
    p.add_argument("--baseline-prefetch-batches", type=int, default=None, metavar="N",
                   help="with --baseline-code: the baseline's --prefetch-batches (default: its own default)")
    p.add_argument("--compile", default=None, metavar="MODE",
                   help="the trainer's --compile (default: its own default, off); the first updates compile, and "
                        "the steady state leaves the run's first quarter out")
    p.add_argument("--baseline-compile", default=None, metavar="MODE",
                   help="with --baseline-code: the baseline's --compile (default: its own default)")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--baseline-code", metavar="DIR", default=None,
                   help="baseline: the same configuration run by the package in DIR (interleaved rounds)")
    p.add_argument("--rounds", type=int, default=1, help="with --baseline-code: rounds of (this, baseline)")
    p.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)  # a --baseline-code subprocess
    args = p.parse_args(argv)
    settings = dict(frames_per_update=args.frames_per_update, acting=args.acting, minibatch_size=args.minibatch_size,
                    intrinsic_reward=args.intrinsic_reward, prefetch_batches=args.prefetch_batches,
                    compile=args.compile, task=args.task, acting_splits=args.acting_splits)
    if args.one_run:
        print(json.dumps(run(args.seconds, args.workers, args.envs, args.rollout, args.arch, args.device, **settings)))
        return 0
    base = None
    orphans = [flag for flag, given in (("--baseline-intrinsic-reward", args.baseline_intrinsic_reward is not None),
                                        ("--baseline-envs", args.baseline_envs is not None),
                                        ("--baseline-prefetch-batches", args.baseline_prefetch_batches is not None),
                                        ("--baseline-compile", args.baseline_compile is not None),
                                        ("--baseline-acting-splits", args.baseline_acting_splits is not None),
                                        ("--rounds", args.rounds != 1)) if given]
    if orphans and not args.baseline_code:  # said, not ignored: the run would measure something else
        p.error(f"{orphans[0]} describes the --baseline-code run: give --baseline-code DIR (. for this code)")
    if args.baseline_code:
        if not os.path.isdir(os.path.join(args.baseline_code, "torchrl_oni")):
            p.error(f"--baseline-code {args.baseline_code}: no torchrl_oni package there")
        if args.baseline_envs is not None and args.baseline_envs < 1:
            p.error(f"--baseline-envs must be >= 1, got {args.baseline_envs}")
        share = args.seconds / (2 * args.rounds)
        mine, theirs = [], []
        for _ in range(args.rounds):
            mine.append(run(share, args.workers, args.envs, args.rollout, args.arch, args.device, **settings))
            theirs.append(_run_elsewhere(args.baseline_code, args, share))
        main_run = sorted(mine, key=lambda r: r["fps"])[len(mine) // 2]  # the median round
        base = sorted(theirs, key=lambda r: r["fps"])[len(theirs) // 2]
        rows = [(f"this code: {args.workers} workers x {args.envs} games", main_run),
                (f"--baseline-code {os.path.basename(os.path.abspath(args.baseline_code))}"
                 + (f": {args.workers} x {args.baseline_envs}" if args.baseline_envs else ""), base)]
    else:
        share = args.seconds if args.no_baseline else args.seconds * 0.65
        main_run = run(share, args.workers, args.envs, args.rollout, args.arch, args.device, **settings)
        rows = [(f"batched: {args.workers} workers x {args.envs} games", main_run)]
        if not args.no_baseline:
            base = run(args.seconds - share, args.workers, 1, args.rollout, args.arch, args.device)
            rows.append((f"baseline: {args.workers} workers x 1 game", base))
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    print(f"\nPPO end to end, {args.arch} policy, {os.cpu_count()} cores, learner on {device}, rollout {args.rollout}, "
          f"acting on {args.acting}, {args.frames_per_update or args.envs * args.rollout} frames per update, "
          f"intrinsic reward {args.intrinsic_reward}"
          + (f" (baseline: {args.baseline_intrinsic_reward})" if args.baseline_intrinsic_reward else "")
          + (f", task {args.task}" if args.task else ""))
    print(f"{'configuration':<40} {'frames/s':>10} {'incl. start':>12} {'waiting for data':>17} {'GPU busy':>9}")
    for name, r in rows:
        util = "" if r.get("gpu_util") is None else f"{r['gpu_util']:.0f} %"
        print(f"{name:<40} {r['fps']:>10,.0f} {r['fps_incl_startup']:>12,.0f} {r['collect_fraction']:>17.0%} {util:>9}")
    if main_run["stages"]:
        print("learner's time per stage (this code): " + ", ".join(
            f"{k} {v:.0%}" for k, v in sorted(main_run["stages"].items(), key=lambda kv: -kv[1]) if v >= 0.005)
            + f"; outside the loss's forward/backward {main_run['outside_loss_share']:.0%}")
    out = {
        "fps": round(main_run["fps"]),
        "collect_fraction": round(main_run["collect_fraction"], 3),
        "learn_fraction": round(1 - main_run["collect_fraction"], 3),
        "workers": args.workers,
        "envs_per_worker": main_run["envs_per_worker"],
        "baseline_envs_per_worker": base.get("envs_per_worker") if base else None,
        "arch": args.arch,
        "acting": args.acting,
        "intrinsic_reward": args.intrinsic_reward,
        "baseline_intrinsic_reward": args.baseline_intrinsic_reward,
        "task": args.task,
        "frames_per_update": args.frames_per_update or args.envs * args.rollout,
        "prefetch_batches": main_run.get("prefetch_batches"),
        "compile": main_run.get("compile"),
        "acting_splits": main_run.get("acting_splits"),
        "fps_per_core": round(main_run["fps"] / (os.cpu_count() or 1)),
        "outside_loss_share": main_run["outside_loss_share"] and round(main_run["outside_loss_share"], 3),
        "stages": main_run["stages"],
        "gpu_util": main_run["gpu_util"],
    }
    if args.baseline_code:
        out["rounds_fps"] = [round(r["fps"]) for r in mine]
        out["rounds_baseline_fps"] = [round(r["fps"]) for r in theirs]
    if base:
        out["baseline_fps"] = round(base["fps"])
        out["baseline_stages"] = base.get("stages")
        out["ratio"] = round(main_run["fps"] / max(base["fps"], 1e-9), 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
