"""The PPO learner alone: frames/s of updates on batches of the real shapes, and where the time goes.

No env workers: one real rollout of the batched env (K games × T steps, episode ends included)
is tiled into batches of ``--frames-per-update`` frames, and the learner
(:class:`torchrl_oni.train.learner.PPOLearner`) updates on them for ``--seconds`` per
configuration. Two passes per configuration: frames/s without synchronisation (as the trainer
runs), then the per-stage breakdown with the device synchronised at each stage's end.

Baseline in the same run: the same learner with TorchRL's GAE evaluating the critic on every
observation and every next observation (``fast_values=False``, the trainer's path before).

``--compile MODE...`` adds, per configuration, the same learner through ``torch.compile``
(``--compile``'s modes); its warm-up (the compilation) is timed apart, as ``warmup_s``.

Usage: ``python benchmarks/learner_throughput.py --seconds 10 [--device cuda] [--arch light oni]
[--frames-per-update 1024 16384] [--compile default reduce-overhead]``
Last line: one JSON object, ``results`` with frames/s, ms per update and stage shares per
configuration, ``ratio`` (frames/s over the baseline's, first configuration) and, with
``--compile``, ``compile_ratios`` (each compiled row's frames/s over its eager row's).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def measure(arch: str, device: torch.device, frames: int, seconds: float, minibatch: int, rollout: int,
            fast_values: bool = True, threads: int = 0, compile: str = "off") -> dict:
    from torchrl_oni.train.config import PPOConfig
    from torchrl_oni.train.learner import PPOLearner, rollout_batch
    from torchrl_oni.train.archs import RECURRENT_ARCHS
    from torchrl_oni.train.timing import UPDATE_STAGES, StageClock

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    games = max(1, frames // rollout)
    actor, critic, base = rollout_batch(arch, min(games, 32), rollout)
    reps = -(-games // base.shape[0])
    batch = torch.cat([base] * reps, 0)[:games]  # the real rollout tiled to the update's size
    actor.to(device)
    critic.to(device)
    recurrent = arch in RECURRENT_ARCHS
    ppo = PPOConfig(minibatch_size=minibatch, ppo_epochs=1, compile=compile)
    learner = PPOLearner(actor, critic, ppo, device, recurrent=recurrent, fast_values=fast_values)

    def run(seconds: float, clock: StageClock) -> tuple:
        learner.clock = clock
        n, t0 = 0, time.perf_counter()
        while True:
            learner.update(batch.clone())  # the trainer hands over a CPU batch each time
            n += 1
            if time.perf_counter() - t0 >= seconds and n >= 2:
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return n, time.perf_counter() - t0

    t0 = time.perf_counter()
    run(min(1.0, seconds / 5), StageClock())  # warm-up: allocator, kernels, first Adam step, compilation
    warmup = time.perf_counter() - t0
    n, wall = run(seconds, StageClock())
    clock = StageClock(synchronize=device)
    run(max(seconds / 2, 0.5), clock)
    shares = clock.shares(UPDATE_STAGES)
    return {
        "arch": arch,
        "device": str(device),
        "frames_per_update": batch.numel(),
        "minibatch_size": minibatch,
        "fast_values": fast_values,
        "compile": compile,
        "warmup_s": warmup,
        "fps": batch.numel() * n / wall,
        "ms_per_update": 1e3 * wall / n,
        "updates": n,
        "outside_loss_share": clock.outside_loss_share(),
        "shares": {k: round(v, 4) for k, v in shares.items()},
    }


def main(argv=None) -> int:
    from torchrl_oni.train.config import COMPILE_MODES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=10.0, help="timed updates per configuration (default 10)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 or auto (cuda when there is one)")
    p.add_argument("--arch", nargs="+", default=["light"], help="policy networks: light, oni, oni-lstm")
    p.add_argument("--frames-per-update", nargs="+", type=int, default=[1024],
                   help="frames per update (default 1024: 32 games × 32 steps)")
    p.add_argument("--minibatch-size", type=int, default=None,
                   help="steps per minibatch (default: the whole update on CUDA, 1024 on CPU)")
    p.add_argument("--rollout", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    p.add_argument("--no-baseline", action="store_true", help="skip TorchRL's critic-on-both-sides GAE baseline")
    p.add_argument("--compile", nargs="+", default=[], metavar="MODE",
                   choices=[m for m in COMPILE_MODES if m != "off"],
                   help="also measure each configuration through torch.compile in these modes")
    args = p.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"learner_throughput: error: --device {args.device}: CUDA is not available here", file=sys.stderr)
        return 2
    rows = []
    for arch in args.arch:
        for frames in args.frames_per_update:
            mb = args.minibatch_size or (frames if device.type == "cuda" else min(frames, 1024))
            rows.append(measure(arch, device, frames, args.seconds, mb, args.rollout, threads=args.threads))
            for mode in args.compile:
                rows.append(measure(arch, device, frames, args.seconds, mb, args.rollout, threads=args.threads,
                                    compile=mode))
            if not args.no_baseline and frames == args.frames_per_update[0]:
                rows.append(measure(arch, device, frames, args.seconds, mb, args.rollout, fast_values=False,
                                    threads=args.threads))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"\nPPO learner alone ({name}, {os.cpu_count()} cores), 1 epoch per update")
    stages = [s for s in ("transfer", "gae", "minibatch", "forward", "backward", "optimizer", "stats")
              if any(s in r["shares"] for r in rows)]
    head = (f"{'arch':<6} {'frames/upd':>10} {'GAE path':<10} {'compile':<16} {'frames/s':>10} {'ms/upd':>8} "
            f"{'warm-up s':>9} {'outside':>8} ")
    print(head + " ".join(f"{s:>9}" for s in stages))
    for r in rows:
        path = "fast" if r["fast_values"] else "torchrl"
        print(f"{r['arch']:<6} {r['frames_per_update']:>10,} {path:<10} {r['compile']:<16} {r['fps']:>10,.0f} "
              f"{r['ms_per_update']:>8.1f} {r['warmup_s']:>9.1f} {r['outside_loss_share']:>8.0%} "
              + " ".join(f"{r['shares'].get(s, 0):>9.0%}" for s in stages))
    out = {"device": name, "results": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                                       for r in rows]}
    base = [r for r in rows if not r["fast_values"]]
    if base:
        first = rows[0]
        out["ratio"] = round(first["fps"] / base[0]["fps"], 3)
    eager = {(r["arch"], r["frames_per_update"]): r for r in rows if r["fast_values"] and r["compile"] == "off"}
    compiled = [r for r in rows if r["compile"] != "off"]
    if compiled:
        out["compile_ratios"] = {f"{r['arch']} {r['frames_per_update']} {r['compile']}": round(
            r["fps"] / eager[(r["arch"], r["frames_per_update"])]["fps"], 3) for r in compiled}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
