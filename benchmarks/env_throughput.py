"""Env throughput on one core: raw NLE loops vs the batched TorchRL env vs TorchRL's own wrappers.

Every configuration steps random actions in this one process (``torch.set_num_threads(1)``);
configurations are measured in interleaved rounds and the median round is reported, so machine
noise hits them alike. ``ParallelEnv`` uses two processes and is reported for reference only.

Rows:
  raw NLE (default keys)   gymnasium ``NetHackScore-v0`` with NLE's default observation keys —
                           the "raw NLE gymnasium loop" a user writes; the ratio's baseline
  raw NLE (our 3 keys)     the same loop asking only for the keys our env reads (glyphs, blstats, message)
  raw NLE, K games         the default-keys loop over K games round-robin in one process
  task loop, 1 game        our ONI task (ExtendedActions step logic) in a plain Python loop
  task loop, K games       K of those games stepped round-robin in plain Python: NetHack's own
                           cost with K games per process (each game has its own globals and
                           heap, and K of them share one core's caches)
  NLEBatchEnv(K)           the batched TorchRL env with every key, ``step_and_maybe_reset``
                           (a TorchRL user's path: a TensorDict every step)
  NLEBatchEnv(K), in place the env workers' path (``NLERolloutCollector``): the games write each
                           step into ``[K, T]`` rollout buffers, the next root and the resets
                           too, no TensorDict per step (random actions: the collector without
                           its policy)
  ..., NetHack's step skipped  the same with each game's step a no-op: what TorchRL and the
                           observation packaging cost alone, with warm caches
  GymEnv (1 game)          TorchRL ``GymWrapper`` + copying wrapper + ``MessageCounter``

Each K of ``--envs`` is measured in its own group (its games close before the next K's open),
with the one-game loops measured again beside it; the JSON reports the K with the best ratio and
every K under ``per_envs``. ``ceiling`` is the K-game task loop over the raw loop: what the batched
env would reach if TorchRL and the observation packaging cost nothing.

Usage: ``python benchmarks/env_throughput.py --seconds 60 [--envs 8 16 32] [--parallel]``
The last line of output is one JSON object: raw_fps, batched_fps, ratio (= batched / raw, per core), ...
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch


def _round_robin(games, n_actions, step_ended):
    """Random actions to each game in turn; ``step_ended(game, action)`` steps one, says if it ended."""
    rng = np.random.default_rng(0)
    rows = max(1, 256 // len(games))

    def run(seconds):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for row in rng.integers(0, n_actions, size=(rows, len(games))).tolist():
                for game, a in zip(games, row):
                    n += 1
                    if step_ended(game, a):
                        game.reset()
        return n / (time.perf_counter() - t0)

    def close():
        for game in games:
            game.close()

    return run, close


def _raw_gym_loop(keys=None, games=1):
    import gymnasium as gym
    import nle  # noqa: F401  (registers NetHack*-v0)

    kwargs = {} if keys is None else {"observation_keys": keys}
    envs = [gym.make("NetHackScore-v0", **kwargs) for _ in range(games)]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    return _round_robin(envs, envs[0].action_space.n, lambda env, a: any(env.step(a)[2:4]))


def _task_loop(k):
    from torchrl_oni.envs import make_task

    games = [make_task("score") for _ in range(k)]
    for i, g in enumerate(games):
        g.reset(seed=i)
    return _round_robin(games, games[0].action_space.n, lambda g, a: any(g.step_core(a)[1:3]))


def _torchrl_loop(env):
    td = env.reset()
    batch = max(1, env.batch_size.numel())
    spec = env.action_spec
    # random actions drawn in chunks, as the raw loops draw theirs (a policy would write them)
    chunk = 64

    def run(seconds):
        nonlocal td
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            actions = torch.randint(0, int(spec.space.n), (chunk, *spec.shape), dtype=spec.dtype)
            for action in actions.unbind(0):
                td.set("action", action)
                _, td = env.step_and_maybe_reset(td)
                n += batch
        return n / (time.perf_counter() - t0)

    return run, env.close


def _in_place_loop(env, rollout=32):
    """The env workers' hot loop without the policy: what ``NLERolloutCollector`` does per step
    (``_step_into`` the rollout's next-observation, carry it to the next root, ``_reset_into`` the
    games that ended), into ``[K, T]`` buffers allocated once."""
    td = env.reset()
    K = env.batch_size[0]
    fields = env.rollout_fields()
    root = {name: np.zeros((K, rollout + 1) + tuple(td.get(key).shape[1:]), td.get(key).numpy().dtype)
            for name, key in fields.items()}
    nxt = {name: np.zeros((K, rollout) + arr.shape[2:], arr.dtype) for name, arr in root.items()}
    nxt["reward"] = np.zeros((K, rollout, 1), np.float32)
    for name, key in fields.items():
        root[name][:, 0] = td.get(key).numpy()
    roots = [{name: arr[:, t] for name, arr in root.items()} for t in range(rollout + 1)]
    nexts = [{name: arr[:, t] for name, arr in nxt.items()} for t in range(rollout)]
    game_blstats = env._live["state"]["game_blstats"].copy()
    rng = np.random.default_rng(0)

    def run(seconds):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            actions = rng.integers(0, env.num_actions, size=(rollout, K)).tolist()
            for t in range(rollout):
                out, then = nexts[t], roots[t + 1]
                ended = env._step_into(actions[t], out, game_blstats)
                for name in fields:
                    np.copyto(then[name], out[name])
                if ended:
                    env._reset_into(ended, then, game_blstats)
                n += K
            for name in fields:  # the last root starts the next rollout
                np.copyto(roots[0][name], roots[rollout][name])
        return n / (time.perf_counter() - t0)

    return run, env.close


def _packaging_only(k):
    """The batched env with every game's step replaced by a no-op: TorchRL + packaging alone."""
    from torchrl_oni.envs import NLEBatchEnv

    env = NLEBatchEnv("score", num_envs=k, seed=0)
    for game in env.games:
        game.step_core = lambda action: (0.0, False, False, 0, False)
    return env


def _interleaved(configs, seconds, rounds):
    """Median frames/s of each configuration, measured in interleaved rounds."""
    per = seconds / (rounds * len(configs))
    results = {name: [] for name in configs}
    for run, _ in configs.values():  # warm-up
        run(min(0.3, per))
    for _ in range(rounds):
        for name, (run, _) in configs.items():
            results[name].append(run(per))
    return {name: statistics.median(v) for name, v in results.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="total measuring time (default 60)")
    p.add_argument("--envs", type=int, nargs="+", default=[8, 16, 32],
                   help="games per batched env; several values are measured one after the other (default 8 16 32)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--parallel", action="store_true", help="also time ParallelEnv(2) of GymEnv (slow start)")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.rounds < 1 or min(args.envs) < 1:
        p.error("--seconds, --rounds and --envs must be positive")
    torch.set_num_threads(1)

    from torchrl_oni.envs import NLEBatchEnv
    from torchrl_oni.envs.gym_wrapper import make_gym_env

    # the one-game loops stay open and are measured again beside every K, so each ratio
    # compares figures taken in the same minutes
    baselines = {
        "raw NLE (default keys)": _raw_gym_loop(),
        "raw NLE (our 3 keys)": _raw_gym_loop(("glyphs", "blstats", "message")),
        "task loop, 1 game": _task_loop(1),
        "GymEnv (1 game)": _torchrl_loop(make_gym_env("score", seed=0)),
    }
    groups = {}
    slot = args.seconds / len(args.envs)
    for k in args.envs:
        group = {
            f"raw NLE (default keys), {k} games round-robin": _raw_gym_loop(games=k),
            f"task loop, {k} games": _task_loop(k),
            f"NLEBatchEnv({k})": _torchrl_loop(NLEBatchEnv("score", num_envs=k, seed=0)),
            f"NLEBatchEnv({k}), in place": _in_place_loop(NLEBatchEnv("score", num_envs=k, seed=0)),
        }
        groups[k] = _interleaved({**baselines, **group}, slot * 0.95, args.rounds)
        for _, close in group.values():  # a group's games leave before the next group's arrive
            close()
        # measured alone afterwards: more live games in the process would slow the groups' games
        run, close = _torchrl_loop(_packaging_only(k))
        run(0.2)
        groups[k][f"NLEBatchEnv({k}), NetHack's step skipped"] = run(slot * 0.05)
        close()
    for _, close in baselines.values():
        close()

    per_k = {}
    for k, med in groups.items():
        raw = med["raw NLE (default keys)"]
        batched = med[f"NLEBatchEnv({k})"]
        per_k[k] = {
            "raw_fps": round(raw),
            "batched_fps": round(batched),
            "ratio": round(batched / raw, 3),
            "task_loop_k_fps": round(med[f"task loop, {k} games"]),
            "ratio_vs_k_game_loop": round(batched / med[f"task loop, {k} games"], 3),
            "in_place_fps": round(med[f"NLEBatchEnv({k}), in place"]),
            "in_place_vs_k_game_loop": round(med[f"NLEBatchEnv({k}), in place"] / med[f"task loop, {k} games"], 3),
            "ceiling": round(med[f"task loop, {k} games"] / raw, 3),
            "raw_k_fps": round(med[f"raw NLE (default keys), {k} games round-robin"]),
            "ratio_vs_raw_k": round(batched / med[f"raw NLE (default keys), {k} games round-robin"], 3),
            # one step_and_maybe_reset without NetHack, warm caches (µs per batch of K)
            "packaging_us": round(1e6 * k / med[f"NLEBatchEnv({k}), NetHack's step skipped"], 1),
        }
        print(f"\n{k} games per process: env throughput, random actions, 1 torch thread, "
              f"median of {args.rounds} interleaved rounds")
        print(f"{'configuration':<50} {'frames/s':>10} {'vs raw':>8}")
        for name, fps in med.items():
            print(f"{name:<50} {fps:>10,.0f} {fps / raw:>8.2f}")
    if args.parallel:
        from torchrl.envs import ParallelEnv

        t0 = time.perf_counter()
        penv = ParallelEnv(2, make_gym_env, mp_start_method="spawn")
        run, close = _torchrl_loop(penv)
        startup = time.perf_counter() - t0
        print(f"ParallelEnv(2) of GymEnv [2 procs, start {startup:.0f} s]: {run(slot):,.0f} frames/s")
        close()

    best = max(per_k, key=lambda k: per_k[k]["ratio"])
    print(f"\n{'K':>4} {'batched':>9} {'ratio':>7} {'ceiling':>8} {'vs K-game loop':>15} {'in place':>9} "
          f"{'in place vs K-game loop':>24} {'packaging µs/batch':>19}")
    for k, r in per_k.items():
        print(f"{k:>4} {r['batched_fps']:>9,} {r['ratio']:>7.3f} {r['ceiling']:>8.3f} "
              f"{r['ratio_vs_k_game_loop']:>15.3f} {r['in_place_fps']:>9,} {r['in_place_vs_k_game_loop']:>24.3f} "
              f"{r['packaging_us']:>19.1f}")
    print("ratio = NLEBatchEnv(K) / raw NLE loop (1 game, default keys); ceiling = the same K games "
          "stepped in plain Python, no TorchRL, / raw; packaging = one step_and_maybe_reset with "
          "NetHack's step skipped (warm caches)")
    all_raw = [med["raw NLE (default keys)"] for med in groups.values()]
    out = {
        "raw_fps": round(statistics.median(all_raw)),
        "batched_fps": per_k[best]["batched_fps"],
        "ratio": per_k[best]["ratio"],
        "envs": best,
        "ceiling": per_k[best]["ceiling"],
        "ratio_vs_k_game_loop": per_k[best]["ratio_vs_k_game_loop"],
        # the workers' path, at every K: the goal is >= 0.85 of the K-game loop at K = 16 and 32
        "in_place_vs_k_game_loop": {k: r["in_place_vs_k_game_loop"] for k, r in per_k.items()},
        "raw_same_keys_fps": round(statistics.median(m["raw NLE (our 3 keys)"] for m in groups.values())),
        "task_loop_fps": round(statistics.median(m["task loop, 1 game"] for m in groups.values())),
        "gymenv_fps": round(statistics.median(m["GymEnv (1 game)"] for m in groups.values())),
        "per_envs": per_k,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
