"""``oni-eval``'s games: the run's actor, and shards of games played to their end, in this process
or in spawned worker processes (:func:`_run_shards`).

A shard (:class:`Shard`, cut by :func:`plan_shards`) is ``--envs-per-worker`` game slots played as
one :class:`~torchrl_oni.envs.NLEBatchEnv`, each slot one counted episode from a seed fixed before
play; which episodes count and why: :mod:`torchrl_oni.evaluate`. Each finished episode becomes a
row (:func:`_episode_row`: its stats, ending, death cause, captions), and the episodes to record
keep their tty screens (``_Recorder``) for ``oni-replay``. :class:`EvalError` is ``oni-eval``'s
one-line error (:mod:`torchrl_oni.evaluate` raises it too), defined here where the checkpoint's
actor may not fit the task.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, List

import numpy as np
import torch
from nle import nethack

from .captions import decode_message, hash_bytes
from .progression import progression
from .spawn_check import check_main_guard
from .worker_start import worker_context

TTY_KEYS = ("tty_chars", "tty_colors", "tty_cursor")
END_NAMES = {-1: "timeout", 0: "running", 1: "death", 2: "success"}
_EMPTY_HASH = hash_bytes(b"")


class EvalError(ValueError):
    """Bad ``oni-eval`` input: a path, a checkpoint, a task or a flag (one line, exit 2)."""


# ---------------------------------------------------------------------- the run's actor
def _action_names(actions) -> List[str]:
    return [f"{type(a).__name__}.{a.name}" for a in actions]


def _build_actor(env, settings: dict, actor_state: dict):
    """The run's actor on ``env``'s specs, with the checkpoint's weights (as train/ppo.py builds it)."""
    from .train.policy import make_actor_critic, recurrent_primer

    actor, _ = make_actor_critic(env, arch=settings["arch"], value_heads=settings["value_heads"])
    try:
        actor.load_state_dict(actor_state)
    except (RuntimeError, KeyError) as err:
        first = str(err).strip().splitlines()[0]
        raise EvalError(f"the checkpoint's actor does not fit a {settings['arch']!r} policy on this task ({first})") from None
    actor.eval()
    primer = recurrent_primer(actor)
    return actor, (primer.primers if primer is not None else None)


# ---------------------------------------------------------------------- shards
@dataclass(frozen=True)
class Shard:
    """``games`` game slots played together; slot i plays episode ``first_episode + i``."""

    index: int
    games: int
    first_episode: int
    seed: int
    record: tuple  # slots whose episode is recorded


def plan_shards(episodes: int, games_per_shard: int, seed: int, record: int = 0) -> List[Shard]:
    """Cuts ``episodes`` into shards of at most ``games_per_shard`` slots; records episodes ``0..record-1``.

    Example:
        >>> [(s.games, s.first_episode, s.record) for s in plan_shards(5, 2, seed=0, record=3)]
        [(2, 0, (0, 1)), (2, 2, (0,)), (1, 4, ())]
    """
    shards = []
    for index, first in enumerate(range(0, episodes, games_per_shard)):
        games = min(games_per_shard, episodes - first)
        # a seed per shard from (seed, shard), far from the small seeds training derives
        shard_seed = int(np.random.SeedSequence(int(seed), spawn_key=(index,)).generate_state(1)[0] % 2**31)
        recorded = tuple(i for i in range(games) if first + i < record)
        shards.append(Shard(index, games, first, shard_seed, recorded))
    return shards


class _Recorder:
    """Frames of one game slot's episode: the tty screen, message, count, action, reward."""

    def __init__(self, buffers: dict):
        self.buffers = buffers  # the game's live NLE arrays (NetHack rewrites them every step)
        self.frames: Dict[str, list] = {k: [] for k in (*TTY_KEYS, "message", "msg_count", "caption_hash", "action", "reward")}

    def add(self, message, count: int, caption_hash: int, reward: float) -> None:
        for key in TTY_KEYS:
            self.frames[key].append(np.array(self.buffers[key], dtype=np.uint8))
        self.frames["message"].append(np.asarray(message, dtype=np.uint8).copy())
        self.frames["msg_count"].append(count)
        self.frames["caption_hash"].append(caption_hash)
        self.frames["reward"].append(reward)
        self.frames["action"].append(-1)

    def arrays(self) -> dict:
        f = self.frames
        return {
            "tty_chars": np.stack(f["tty_chars"]),
            "tty_colors": np.stack(f["tty_colors"]) & np.uint8(15),
            "tty_cursor": np.stack(f["tty_cursor"]),
            "message": np.stack(f["message"]),
            "msg_count": np.asarray(f["msg_count"], dtype=np.int32),
            "caption_hash": np.asarray(f["caption_hash"], dtype=np.int64),
            "action": np.asarray(f["action"], dtype=np.int16),
            "reward": np.asarray(f["reward"], dtype=np.float32),
        }


def _play_shard(shard: Shard, settings: dict, actor, primer_spec, greedy: bool,
                on_episode: Callable[[], None]) -> dict:
    """Plays one shard until each slot's episode is over; returns its episodes and recordings."""
    from torchrl.envs import TransformedEnv
    from torchrl.envs.utils import ExplorationType, set_exploration_type

    from .train.env_factory import EnvFactory  # the env exactly as training builds it (primers included)

    task_kwargs = {"max_episode_steps": settings["max_episode_steps"],
                   "timeout_as_termination": settings["timeout_as_termination"]}
    if shard.record:
        # the tty screens are kept only where an episode is recorded (NetHack fills every
        # requested buffer on every step)
        from .envs.tasks import OBSERVATION_KEYS

        task_kwargs["observation_keys"] = tuple(OBSERVATION_KEYS) + TTY_KEYS
    env = EnvFactory(settings["task"], shard.games, shard.seed, task_kwargs, primer_spec)()
    games = (env.base_env if isinstance(env, TransformedEnv) else env).games
    K = shard.games
    torch.manual_seed(shard.seed)
    mode = ExplorationType.DETERMINISTIC if greedy else ExplorationType.RANDOM

    active = np.ones(K, dtype=bool)
    last_score = np.zeros(K, dtype=np.int64)
    max_depth = np.zeros(K, dtype=np.int64)
    # progression counts the highest experience level shown, as BALROG does; the episode's xlvl is
    # its last, lower after a level drain
    max_xp = np.zeros(K, dtype=np.int64)
    captions = [set() for _ in range(K)]
    tails: List[list] = [[] for _ in range(K)]  # the last few non-empty messages of each episode
    # (observation index, caption hash, msg_count) of each non-empty message, for the diagnostics
    sequences: List[list] = [[] for _ in range(K)]
    seen_obs = [0] * K  # observations of the slot's episode so far
    sightings: Counter = Counter()
    texts: Dict[int, str] = {}
    recorders = {i: _Recorder(games[i].nethack._obs_buffers) for i in shard.record}
    episodes: List[dict] = []

    def observe(obs, rows, rewards=None):
        """Counts what the active slots ``rows`` see in ``obs`` (root or next entries)."""
        blstats = obs.get("blstats").numpy()
        hashes = obs.get("caption_hash").numpy()
        counts = obs.get("msg_count").numpy()
        messages = obs.get("message")
        for i in rows:
            if blstats[i].any():  # NetHack zeroes blstats once the game is over
                last_score[i] = blstats[i, nethack.NLE_BL_SCORE]
                max_depth[i] = max(max_depth[i], blstats[i, nethack.NLE_BL_DEPTH])
                max_xp[i] = max(max_xp[i], blstats[i, nethack.NLE_BL_XP])
            h = int(hashes[i])
            if h != _EMPTY_HASH:
                sequences[i].append((seen_obs[i], h, int(counts[i])))
                sightings[h] += 1
                captions[i].add(h)
                if h not in texts:
                    texts[h] = decode_message(messages[i])
                tail = tails[i]
                tail.append(h)
                if len(tail) > 3:
                    del tail[0]
            seen_obs[i] += 1
            if i in recorders:
                reward = 0.0 if rewards is None else float(rewards[i])
                recorders[i].add(messages[i].numpy(), int(counts[i]), h, reward)

    try:
        td = env.reset()
        observe(td, range(K))
        with torch.no_grad(), set_exploration_type(mode):
            while active.any():
                td = actor(td)
                actions = td.get("action").reshape(K).numpy()
                for i, rec in recorders.items():
                    if active[i]:
                        rec.frames["action"][-1] = int(actions[i])
                td = env.step(td)
                nxt = td.get("next")
                rows = np.flatnonzero(active)
                observe(nxt, rows, nxt.get("reward").reshape(K).numpy())
                done = nxt.get("done").reshape(K).numpy()
                for i in np.flatnonzero(done & active):
                    episodes.append(_episode_row(shard.first_episode + int(i), nxt.get("episode")[int(i)],
                                                 games[i], last_score[i], max_depth[i], captions[i],
                                                 [texts[h] for h in tails[i]], sequences[i], max_xp[i]))
                    active[i] = False
                    on_episode()
                td = env.maybe_reset(env.step_mdp(td))
    finally:
        env.close()
    return {
        "episodes": episodes,
        "sightings": dict(sightings),
        "texts": texts,
        "recordings": {shard.first_episode + i: rec.arrays() for i, rec in recorders.items()},
        "action_names": _action_names(games[0].actions) if games else [],
    }


def _episode_row(index, episode, game, score, max_depth, captions, tail, sequence=(), max_xp=0) -> dict:
    stats = {k: episode.get(k).item() for k in ("return", "length", "dlvl", "xlvl", "gold", "scout", "kills",
                                                 "end_status", "success")}
    end = END_NAMES.get(int(stats.pop("end_status")), "unknown")
    cause = None
    if end == "death":
        how = game.nethack.how_done()  # read before the slot is reset
        cause = getattr(how, "name", str(how)).lower()
    max_dlvl = int(max(max_depth, stats["dlvl"]))
    return {
        "episode": index,
        "return": float(stats["return"]),
        "length": int(stats["length"]),
        "max_dlvl": max_dlvl,
        "xlvl": int(stats["xlvl"]),
        "gold": int(stats["gold"]),
        "score": int(score),
        "kills": int(stats["kills"]),
        "scout": int(stats["scout"]),
        "progression": progression(max_dlvl, max(int(max_xp), int(stats["xlvl"]))),
        "success": bool(stats["success"]),
        "end": end,
        "death_cause": cause,
        "last_messages": tail,
        "_captions": sorted(captions),
        # observation index, caption hash and msg_count of every non-empty message (the diagnostics')
        "_sequence": np.array(sequence, dtype=np.int64).reshape(-1, 3),
    }


# ---------------------------------------------------------------------- worker processes
_WORKER: dict = {}


def _init_worker(payload: dict, queue) -> None:
    torch.set_num_threads(1)  # one core per worker; OpenMP threads beside the others cost more
    _WORKER.update(payload)
    _WORKER["queue"] = queue


def _worker_shard(shard: Shard) -> dict:
    settings = _WORKER["settings"]
    if "actor" not in _WORKER:
        from .envs.batched import NLEBatchEnv

        probe = NLEBatchEnv(settings["task"], 1)
        try:
            _WORKER["actor"], _WORKER["primer"] = _build_actor(probe, settings, _WORKER["actor_state"])
        finally:
            probe.close()
    queue = _WORKER["queue"]
    return _play_shard(shard, settings, _WORKER["actor"], _WORKER["primer"], _WORKER["greedy"],
                       lambda: queue.put(1))


def _run_shards(shards, settings, actor, primer, actor_state, greedy, workers, bar) -> List[dict]:
    if workers <= 1 or len(shards) == 1:
        threads = torch.get_num_threads()
        try:
            with torch.random.fork_rng(devices=[]):  # the shards seed torch; the caller's stream is left alone
                return [_play_shard(s, settings, actor, primer, greedy, lambda: bar.update(1)) for s in shards]
        finally:
            torch.set_num_threads(threads)  # the env factory sets one thread, as in a worker
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool
    from queue import Empty

    ctx = worker_context()  # spawn or the fork server, never fork
    check_main_guard(ctx.get_start_method())  # an unguarded script would be re-run by every worker the pool starts
    queue = ctx.Queue()
    payload = {"settings": settings, "actor_state": actor_state, "greedy": greedy}
    results: Dict[int, dict] = {}

    def drain():
        while True:
            try:
                bar.update(queue.get_nowait())
            except Empty:
                return

    with ProcessPoolExecutor(max_workers=min(workers, len(shards)), mp_context=ctx,
                             initializer=_init_worker, initargs=(payload, queue)) as pool:
        futures = {pool.submit(_worker_shard, s): s.index for s in shards}
        pending = set(futures)
        try:
            while pending:
                finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                drain()
                for f in finished:
                    results[futures[f]] = f.result()
        except BrokenProcessPool as err:
            raise RuntimeError(
                f"an evaluation worker process died ({err}); from a script, call evaluate() under "
                "`if __name__ == '__main__':` (workers are spawned and import the main module)"
            ) from err
        except BaseException:
            for f in pending:
                f.cancel()
            raise
    drain()
    return [results[s.index] for s in shards]
