"""``oni-eval``: play N episodes with a trained policy and report how it does, with error bars.

``oni-eval RUN_DIR_OR_CHECKPOINT`` loads the actor of a checkpoint written by ``oni-train`` (any
``--arch``, any ``--intrinsic-reward``: acting needs only the actor), plays ``--episodes``
games of the run's task (or ``--task``, if its actions are the same) in ``--workers`` processes,
prints a table and, as its last line, one JSON object, and writes ``eval.json`` (the same object
plus one row per episode) into the run folder. ``--record K`` also keeps K episodes as replay
files (``RUN/replays/episode_000.npz``...) that ``oni-replay`` turns into an HTML player or a GIF.

Which episodes count. The N episodes are cut into shards of ``--envs-per-worker`` games; a
worker process plays a shard as one :class:`~torchrl_oni.envs.NLEBatchEnv`, and **each game
slot plays exactly one counted episode** from a seed fixed before play (derived from
``--seed`` and the shard index). Every episode that starts is counted and no episode is chosen
by when it ends, so long episodes weigh as much as short ones (counting "the first N episodes to
finish" would favour quick deaths). Slots whose episode is over keep stepping, uncounted, until
the shard's longest episode ends. The games played depend on ``--seed``, ``--episodes`` and
``--envs-per-worker`` only, not on ``--workers`` (shards go to whichever worker is free); the
default ``--envs-per-worker`` is ``ceil(episodes / workers)`` (at most 32), so pass it to replay
the very same games elsewhere. Actions are sampled from the policy as in training, or
``--greedy`` (the most likely action); sampling is seeded per shard too.

The JSON object (``eval.json`` adds ``per_episode``):

========================  ===============================================================
key                       meaning
========================  ===============================================================
``success_rate``          ``{mean, ci95: [lo, hi], successes, n}``; Wilson score interval
``return`` ... ``scout``  ``{mean, std, ci95, min, max, n}`` for ``return`` (extrinsic),
                          ``length``, ``max_dlvl`` (deepest dungeon level), ``xlvl``
                          (experience level), ``gold``, ``score`` (NetHack's in-game score),
                          ``kills``, ``scout`` (squares seen), ``progression``; ci95 from
                          Student's t
``progression``           BALROG's progression (:mod:`torchrl_oni.progression`): per episode,
                          the share of human games that reached its deepest dungeon level or
                          its highest experience level (the larger) and went on to ascend, in
                          [0, 1]; the table prints it in %
``end_status``            episodes per ending: ``death``, ``timeout``, ``success``
``death_causes``          deaths per NetHack ending (NLE's names: ``died``, ``choking``,
                          ``starving``...)
``messages``              ``sightings`` (non-empty messages seen, every observation of every
                          episode), ``distinct``, ``top`` (``[{message, count, label}]``),
                          and with a caption store: ``labelled_share`` and ``approved_share``
                          (of sightings; approved = label > 0.5) and ``approved_per_episode``
                          (distinct approved captions per episode, as benchmarks/learning_check)
``reward_hacking``        the reward-hacking diagnostics (:mod:`torchrl_oni.reward_hacking`): per
                          paid caption, how often it comes at most ``--death-window`` steps
                          before a death against unpaid captions, its share of the intrinsic
                          return, repeated payments, and ``flagged``: the captions of the ``!!``
                          line; ``paid_by`` says how the payments were recomputed (the run's
                          labels for retrieval and classification), or is None with a ``reason``
``death_causes_check``    hacking that shows in how the agents die
                          (:func:`torchrl_oni.reward_hacking.death_causes_check`): per cause, its
                          share of the episodes, against ``--baseline``'s (an evaluation of the
                          same task, e.g. the extrinsic-only arm: rate ratio, 95 % CI, Fisher p),
                          the paid captions whose episodes end in it more often, and ``flagged``:
                          the causes of its ``!!`` lines
``checkpoint`` ...        where it came from: ``checkpoint``, ``task``, ``trained_task``,
                          ``arch``, ``intrinsic_reward``, ``frames_trained``, ``policy``,
                          ``seed``, ``episodes``, ``workers``, ``envs_per_worker``,
                          ``caption_store``, ``replays``, ``steps``, ``time_s``
========================  ===============================================================

A bad path, a truncated checkpoint, a task whose actions differ from the run's or a bad flag end
with one ``oni-eval: error: ...`` line and exit status 2.

Example:
    >>> import tempfile
    >>> from torchrl_oni.train import TrainConfig, Trainer
    >>> from torchrl_oni.evaluate import evaluate
    >>> run = tempfile.mkdtemp()
    >>> cfg = TrainConfig(frames=128, workers=1, envs_per_worker=2, rollout=32, logdir=run,
    ...                   max_episode_steps=20, progress=False, tensorboard=False)
    >>> _ = Trainer.from_config(cfg).save()  # an untrained policy is enough to evaluate
    >>> result = evaluate(run, episodes=3, workers=1, progress=False)
    >>> result["episodes"], result["length"]["max"] <= 20, sorted(result["end_status"])
    (3, True, ['death', 'success', 'timeout'])
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from ._eval_play import _EMPTY_HASH, EvalError, _action_names, _build_actor, _run_shards, plan_shards
from .atomic import atomic_write
from .cli_errors import OneLineArgumentParser, overwritten_input, report
from .run_folder import CAPTION_STORE_NAME, CONFIG_NAME, EVAL_NAME, METRICS_NAME, REPLAY_DIR
from .reward_hacking.death_causes import death_causes_check, format_death_causes, read_baseline
from .reward_hacking.tally import DEATH_WINDOW, REPORT_NAME as REWARD_HACKING_NAME, HackingTally, format_report
from .stats import mean_ci, wilson_interval
from .worker_start import use_forkserver

__all__ = ["evaluate", "EvalError", "format_table", "main", "EVAL_NAME"]

PROG = "oni-eval"
MAX_GAMES_PER_SHARD = 32
MAX_EPISODES = 1_000_000  # --episodes: a million games is already days of CPU
MAX_WORKERS = 1024
MAX_GAMES_PER_WORKER = 4096  # --envs-per-worker: NetHack games in one process
TOP_MESSAGES = 20
APPROVED = 0.5  # a label above this is "approved" (as benchmarks/learning_check.py counts it)
STAT_KEYS = ("return", "length", "max_dlvl", "xlvl", "gold", "score", "kills", "scout", "progression")


# ---------------------------------------------------------------------- the run
def _run_settings(state: dict) -> dict:
    """The few settings of the trained run that evaluation needs.

    The ONE place that reads the run's configuration (``state["config"]``: the
    :class:`~torchrl_oni.train.TrainConfig` tree as a dict; older checkpoints hold flat names,
    which ``from_dict`` also reads). Settings a checkpoint lacks take TrainConfig's defaults.
    """
    from .train.config import TrainConfig

    raw = state.get("config")
    try:
        cfg = TrainConfig.from_dict(raw if isinstance(raw, dict) else {}, strict=False)
    except (TypeError, ValueError) as err:
        raise EvalError(f"the checkpoint's configuration cannot be read ({err})") from None
    return {
        "task": cfg.env.task,
        "arch": cfg.ppo.arch,
        "value_heads": int(cfg.ppo.value_heads),
        "max_episode_steps": int(cfg.env.max_episode_steps),
        "timeout_as_termination": bool(cfg.env.timeout_as_termination),
        "intrinsic_reward": cfg.reward.intrinsic_reward,
        "count_exponent": float(cfg.reward.count_exponent),
        "reward_message": cfg.reward.reward_message,
        "caption_store": cfg.annotation.caption_store,
    }


def _resolve_checkpoint(path: str) -> tuple:
    """``(checkpoint file, run folder)`` of a run folder or a checkpoint file."""
    from .train.checkpoint import CHECKPOINT_NAME

    p = Path(path)
    if p.is_dir():
        file = p / CHECKPOINT_NAME
        if not file.is_file():
            raise EvalError(f"{p} holds no {CHECKPOINT_NAME} (is it an oni-train run folder?)")
        return file, p
    if p.is_file():
        return p, p.parent
    raise EvalError(f"no run folder or checkpoint at {path}")


def _load_state(file: Path) -> dict:
    from .train.checkpoint import load_checkpoint

    try:
        state = load_checkpoint(str(file))
    except Exception as err:  # truncated, not a torch file, or a pickle of something else
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise EvalError(f"{file} is not a readable checkpoint ({type(err).__name__}: {first})") from None
    if not isinstance(state, dict) or not isinstance(state.get("actor"), dict):
        raise EvalError(f"{file} is not an oni-train checkpoint (no actor weights)")
    return state


def _num_actions(task: str) -> int:
    from .envs.tasks import EXTENDED_ACTIONS, MOTIF_ACTIONS
    from .task_ids import TASKS

    return len(EXTENDED_ACTIONS if TASKS[task]["extended_actions"] else MOTIF_ACTIONS)


# ---------------------------------------------------------------------- evaluation
def _open_store(path: Optional[str]):
    from .store import CaptionStore

    try:
        return CaptionStore.load(path)
    except (FileNotFoundError, ValueError) as err:
        raise EvalError(str(err)) from None


def _find_store(run_dir: Path, settings: dict, caption_store: Optional[str]) -> Optional[str]:
    """The caption store to read labels from: ``caption_store`` if given (``"none"``: none), else
    the run folder's ``captions.pt``, else the run's ``--caption-store`` if that file exists."""
    if caption_store is not None:
        return None if caption_store == "none" else caption_store
    for candidate in (run_dir / CAPTION_STORE_NAME, settings.get("caption_store")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return None


def _labels_of(store, hashes: np.ndarray) -> np.ndarray:
    """float32 labels of ``hashes``, NaN where the store has none."""
    if store is None or len(hashes) == 0:
        return np.full(len(hashes), np.nan, dtype=np.float32)
    labels, found = store.lookup(torch.as_tensor(np.asarray(hashes, dtype=np.int64)))
    return np.where(found.numpy(), labels.numpy(), np.nan).astype(np.float32)


def evaluate(
    path: str,
    episodes: int = 32,
    *,
    task: Optional[str] = None,
    seed: int = 0,
    greedy: bool = False,
    workers: Optional[int] = None,
    envs_per_worker: Optional[int] = None,
    max_episode_steps: Optional[int] = None,
    record: int = 0,
    record_dir: Optional[str] = None,
    caption_store: Optional[str] = None,
    output: Optional[str] = None,
    write: bool = True,
    progress: bool = True,
    death_window: int = DEATH_WINDOW,
    baseline: Optional[str] = None,
) -> dict:
    """Plays ``episodes`` episodes with the policy of a run folder or checkpoint file.

    Args:
        path: an ``oni-train`` run folder or a checkpoint file.
        episodes: episodes to play and count (see the module docstring for which).
        task: the task to play (default: the run's); its actions must be the run's.
        seed: seeds the games and the action sampling.
        greedy: take the most likely action instead of sampling one.
        workers: processes (default: the cores this process may use); 1 plays in this process.
            Workers are spawned, so a script calling this with several must do so under
            ``if __name__ == "__main__":``.
        envs_per_worker: games one worker steps together (default ``ceil(episodes / workers)``, at
            most 32); with ``seed`` it fixes which games are played.
        max_episode_steps: step limit per episode (default: the run's).
        record: keep the first ``record`` episodes as replay files in ``record_dir``
            (default ``<run>/replays``).
        caption_store: labels to judge messages by (default: the run's ``captions.pt``; ``"none"``).
        output: where ``eval.json`` goes (default ``<run>/eval.json``); ``write=False``: nowhere.
        progress: a progress bar over episodes (stderr).
        death_window: the reward-hacking diagnostics' N: a caption comes before a death when the
            episode ends in death at most N steps later.
        baseline: an ``eval.json`` (or a run folder holding one) of the same task, e.g. the
            extrinsic-only arm: each death cause's share of the episodes is compared with the baseline's.

    Returns:
        The ``eval.json`` dict (see the module docstring).

    Raises:
        EvalError: bad input, in one sentence.
    """
    from .envs.batched import NLEBatchEnv
    from .task_ids import resolve_task

    if not 1 <= episodes <= MAX_EPISODES:
        raise EvalError(f"--episodes must be in [1, {MAX_EPISODES:,}], got {episodes}")
    if not 0 <= seed < 2 ** 63:
        raise EvalError(f"--seed must be in [0, 2**63), got {seed}")
    if not 0 <= record <= episodes:
        raise EvalError(f"--record must be between 0 and --episodes ({episodes}), got {record}")
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not 1 <= workers <= MAX_WORKERS:
        raise EvalError(f"--workers must be in [1, {MAX_WORKERS}], got {workers}")
    if envs_per_worker is None:
        envs_per_worker = min(MAX_GAMES_PER_SHARD, -(-episodes // workers))
    if not 1 <= envs_per_worker <= MAX_GAMES_PER_WORKER:
        raise EvalError(f"--envs-per-worker must be in [1, {MAX_GAMES_PER_WORKER}], got {envs_per_worker}")
    if max_episode_steps is not None and not 1 <= max_episode_steps < 2 ** 31:
        raise EvalError(f"--max-episode-steps must be in [1, 2**31), got {max_episode_steps}")
    if not 1 <= death_window < 2 ** 31:
        raise EvalError(f"--death-window must be in [1, 2**31) steps, got {death_window}")

    file, run_dir = _resolve_checkpoint(path)
    base = None
    if baseline is not None:
        try:
            base = read_baseline(baseline)
        except ValueError as err:
            raise EvalError(f"--baseline: {err}") from None
    if write:
        out = Path(output) if output else run_dir / EVAL_NAME
        inputs = [file] + [run_dir / name for name in (CAPTION_STORE_NAME, METRICS_NAME, CONFIG_NAME)]
        if caption_store not in (None, "none"):
            inputs.append(caption_store)
        if base is not None:
            inputs.append(base["source"])
        if overwritten_input(out, inputs) or out.is_dir():
            raise EvalError(f"-o {out} is {'a folder' if out.is_dir() else 'one of the inputs'}; "
                            f"choose another file for eval.json")
    state = _load_state(file)
    settings = _run_settings(state)
    try:
        trained_task = resolve_task(settings["task"])
        play_task = resolve_task(task) if task else trained_task
    except ValueError as err:
        raise EvalError(str(err)) from None
    if _num_actions(play_task) != _num_actions(trained_task):
        raise EvalError(
            f"task {play_task} has {_num_actions(play_task)} actions but the checkpoint's policy was trained on "
            f"{trained_task} ({_num_actions(trained_task)} actions)"
        )
    if base is not None and base["task"] != play_task:
        raise EvalError(f"--baseline: {base['source']} evaluated {base['task'][:80]}, not {play_task}: compare "
                        "evaluations of the same task")
    settings["task"] = play_task
    if max_episode_steps is not None:
        settings["max_episode_steps"] = int(max_episode_steps)
    store_path = _find_store(run_dir, settings, caption_store)
    store = _open_store(store_path) if store_path else None

    probe = NLEBatchEnv(play_task, 1)
    try:
        actor, primer = _build_actor(probe, settings, state["actor"])
        action_names = _action_names(probe.games[0].actions)
    finally:
        probe.close()

    shards = plan_shards(episodes, envs_per_worker, seed, record)
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    with tqdm(total=episodes, unit="episode", disable=not progress, dynamic_ncols=True, file=sys.stderr) as bar:
        results = _run_shards(shards, settings, actor, primer, state["actor"], greedy, workers, bar)
    elapsed = time.perf_counter() - t0

    rows = sorted((row for r in results for row in r["episodes"]), key=lambda r: r["episode"])
    assert len(rows) == episodes, (len(rows), episodes)
    sightings: Counter = Counter()
    texts: Dict[int, str] = {}
    for r in results:
        sightings.update(r["sightings"])
        texts.update(r["texts"])

    result = {
        "checkpoint": str(file),
        "task": play_task,
        "trained_task": trained_task,
        "arch": settings["arch"],
        "intrinsic_reward": settings["intrinsic_reward"],
        "frames_trained": int(state.get("frames", 0)),
        "policy": "greedy" if greedy else "sampling",
        "seed": int(seed),
        "episodes": episodes,
        "workers": int(min(workers, len(shards))),
        "envs_per_worker": int(envs_per_worker),
        "max_episode_steps": settings["max_episode_steps"],
        "success_rate": None,
    }
    successes = sum(r["success"] for r in rows)
    lo, hi = wilson_interval(successes, episodes)
    result["success_rate"] = {"mean": successes / episodes, "ci95": [lo, hi], "successes": successes, "n": episodes}
    for key in STAT_KEYS:
        result[key] = mean_ci([r[key] for r in rows])
    ends = Counter(r["end"] for r in rows)
    result["end_status"] = {k: ends.get(k, 0) for k in ("death", "timeout", "success")}
    result["end_status"].update({k: v for k, v in ends.items() if k not in result["end_status"]})
    result["death_causes"] = dict(Counter(r["death_cause"] for r in rows if r["death_cause"]).most_common())
    result["messages"] = _message_summary(sightings, texts, rows, store)
    result["caption_store"] = store_path
    result["reward_hacking"], paid_sets = _hacking_report(rows, texts, store, settings, death_window)
    result["death_causes_check"] = death_causes_check(
        [r["death_cause"] if r["end"] == "death" else None for r in rows], paid=paid_sets, texts=texts,
        baseline=base, intrinsic_reward=settings["intrinsic_reward"])

    replays = []
    if record:
        replays = _write_replays(results, rows, store, settings, result, action_names,
                                 Path(record_dir) if record_dir else run_dir / REPLAY_DIR)
    result["replays"] = replays
    result["steps"] = int(sum(r["length"] for r in rows))
    result["time_s"] = round(elapsed, 3)
    result["per_episode"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    if write:
        out = Path(output) if output else run_dir / EVAL_NAME
        data = json.dumps(result, indent=1).encode("utf-8")
        atomic_write(out, lambda f: f.write(data))
        result["eval_json"] = str(out)
    return result


def _message_summary(sightings: Counter, texts: Dict[int, str], rows: List[dict], store) -> dict:
    hashes = np.fromiter(sightings.keys(), dtype=np.int64, count=len(sightings))
    counts = np.fromiter(sightings.values(), dtype=np.int64, count=len(sightings))
    labels = _labels_of(store, hashes)
    label_of = dict(zip(hashes.tolist(), labels.tolist()))
    total = int(counts.sum())
    out = {"sightings": total, "distinct": int(len(hashes))}
    top = sightings.most_common(TOP_MESSAGES)
    out["top"] = [{"message": texts[h], "count": int(c),
                   "label": None if math.isnan(label_of[h]) else float(label_of[h])} for h, c in top]
    if store is not None:
        labelled = ~np.isnan(labels)
        approved = labelled & (np.nan_to_num(labels, nan=0.0) > APPROVED)
        out["labelled_share"] = float(counts[labelled].sum() / total) if total else None
        out["approved_share"] = float(counts[approved].sum() / total) if total else None
        approved_set = set(hashes[approved].tolist())
        out["approved_per_episode"] = mean_ci([len(approved_set.intersection(r["_captions"])) for r in rows])
    else:
        out["labelled_share"] = out["approved_share"] = out["approved_per_episode"] = None
    return out


# what oni-eval can recompute of the run's payments: retrieval pays the label itself; a classification
# model was trained on the same labels (an approximation); the others need their reward model
_PAID_BY_LABELS = {"retrieval": "the run's labels x msg_count^-{beta:g} (what retrieval pays)",
                   "classification": "the run's labels x msg_count^-{beta:g} (approximating its classification model)"}


def _hacking_report(rows: List[dict], texts: Dict[int, str], store, settings: dict, window: int) -> tuple:
    """The reward-hacking diagnostics of the played episodes (:mod:`torchrl_oni.reward_hacking`)
    and, per episode, the set of caption hashes it paid (None where unknown).

    What each step paid is recomputed from the run's labels (``R(m) · msg_count^-beta`` of the
    caption ONI pays for, the observation acted on by default); ``{"paid_by": None, "reason": ...}``
    where it cannot be."""
    kind = settings["intrinsic_reward"]
    if kind == "none":
        return {"paid_by": None, "reason": "the run paid no intrinsic reward (extrinsic only)"}, None
    if kind not in _PAID_BY_LABELS:
        return {"paid_by": None, "reason": f"oni-eval cannot recompute a {kind} reward; the training run's "
                                           f"{REWARD_HACKING_NAME} has its diagnostics"}, None
    if store is None:
        return {"paid_by": None, "reason": "no caption store: the run's labels are unknown (--caption-store)"}, None
    beta = settings["count_exponent"]
    acted = settings.get("reward_message", "acted") == "acted"
    tally = HackingTally(window)
    sequences = [r["_sequence"] for r in rows]
    hashes = np.unique(np.concatenate([q[:, 1] for q in sequences])) if sequences else np.zeros(0, np.int64)
    labels = np.nan_to_num(_labels_of(store, hashes), nan=0.0).astype(np.float64)
    paid_sets = []
    for row, seq in zip(rows, sequences):
        length = row["length"]
        obs, h, count = seq[:, 0], seq[:, 1], seq[:, 2]
        # transition t pays for observation t (acted) or t + 1 (next); the last observation is acted on by no step
        step = obs if acted else obs - 1
        keep = (step >= 0) & (step < length)
        step, h, count = step[keep], h[keep], count[keep]
        paid = labels[np.searchsorted(hashes, h)] * np.maximum(count, 1).astype(np.float64) ** -beta
        tally.add_episode(h, paid, step, length, row["end"] == "death")
        paid_sets.append(set(h[paid > 0].tolist()))
    report = tally.report(texts)
    report["paid_by"] = _PAID_BY_LABELS[kind].format(beta=beta)
    return report, paid_sets


def _write_replays(results, rows, store, settings, result, action_names, folder: Path) -> List[str]:
    from .replay import Episode, save_episode

    by_index = {r["episode"]: r for r in rows}
    written = []
    recordings = {i: rec for r in results for i, rec in r["recordings"].items()}
    for index in sorted(recordings):
        arrays = dict(recordings[index])
        hashes = arrays.pop("caption_hash")
        label = _labels_of(store, hashes)
        label[hashes == _EMPTY_HASH] = np.nan  # the empty message is not a caption worth showing
        if settings["intrinsic_reward"] == "retrieval" and store is not None:
            # what ONI-Retrieval pays: the stored label (0 without one) times msg_count ** -beta
            beta = settings["count_exponent"]
            paid = np.nan_to_num(label, nan=0.0) * arrays["msg_count"].astype(np.float64).clip(1) ** -beta
            intrinsic = paid.astype(np.float32)
        else:
            intrinsic = np.full(len(hashes), np.nan, dtype=np.float32)
        row = by_index[index]
        stats = {k: row[k] for k in ("end", "return", "length", "score", "max_dlvl", "xlvl", "gold", "kills")}
        if row["death_cause"]:
            stats["death_cause"] = row["death_cause"]
        meta = {
            "task": result["task"], "checkpoint": result["checkpoint"], "episode": index,
            "seed": result["seed"], "policy": result["policy"], "arch": result["arch"],
            "intrinsic_reward": result["intrinsic_reward"], "count_exponent": settings["count_exponent"],
            "action_names": action_names, "stats": stats,
        }
        episode = Episode(**arrays, label=label, intrinsic_reward=intrinsic, meta=meta)
        written.append(str(save_episode(folder / f"episode_{index:03d}.npz", episode)))
    # replays of an earlier evaluation that this one did not rewrite would pass for its own
    keep = {Path(p).name for p in written}
    for old in folder.glob("episode_*.npz"):
        if re.fullmatch(r"episode_\d+\.npz", old.name) and old.name not in keep:
            old.unlink()
    return written


# ---------------------------------------------------------------------- output
def _fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def format_table(result: dict) -> str:
    """The human-readable report of an :func:`evaluate` result."""
    lines = [
        f"{result['checkpoint']} ({result['arch']}, {result['frames_trained']:,} frames trained) on {result['task']}: "
        f"{result['episodes']} episodes, {result['policy']} actions, seed {result['seed']}",
        "",
        f"{'metric':<16}{'mean':>11}  {'95% CI':<23}{'min':>10}{'max':>10}",
    ]
    sr = result["success_rate"]
    lines.append(f"{'success rate':<16}{sr['mean']:>11.3f}  {'[' + _fmt(sr['ci95'][0], 3) + ', ' + _fmt(sr['ci95'][1], 3) + ']':<23}"
                 f"{sr['successes']:>10}/{sr['n']}")
    names = {"max_dlvl": "max dlvl", "xlvl": "xp level", "scout": "squares seen", "progression": "progression %"}
    for key in STAT_KEYS:
        s = result[key]
        if key == "progression":  # a share in the JSON, in % as BALROG's leaderboard prints it
            s = {k: (None if s[k] is None else [100 * x for x in s[k]] if k == "ci95" else 100 * s[k])
                 for k in ("mean", "ci95", "min", "max")}
        ci = "-" if s["ci95"] is None else f"[{_fmt(s['ci95'][0])}, {_fmt(s['ci95'][1])}]"
        lines.append(f"{names.get(key, key):<16}{_fmt(s['mean']):>11}  {ci:<23}{_fmt(s['min'], 1):>10}{_fmt(s['max'], 1):>10}")
    lines.append("")
    lines.append("endings: " + ", ".join(f"{k} {v}" for k, v in result["end_status"].items()))
    if result["death_causes"]:
        lines.append("deaths: " + ", ".join(f"{k} {v}" for k, v in result["death_causes"].items()))
    m = result["messages"]
    head = f"most frequent messages ({m['sightings']:,} sightings, {m['distinct']:,} distinct"
    if m["approved_share"] is not None:
        head += (f"; the run's annotator labelled {100 * m['labelled_share']:.1f} % and approved "
                 f"{100 * m['approved_share']:.1f} % of sightings, "
                 f"{_fmt(m['approved_per_episode']['mean'])} approved captions per episode")
    lines.append(head + "):")
    lines.append(f"{'count':>8}  {'label':>5}  message")
    for item in m["top"][:10]:
        label = "-" if item["label"] is None else f"{item['label']:.2f}"
        lines.append(f"{item['count']:>8}  {label:>5}  {item['message']}")
    hacking = result.get("reward_hacking")
    if hacking:
        lines.append("")
        if hacking.get("paid_by") is None:
            lines.append(f"reward hacking: not checked: {hacking.get('reason')}")
        else:
            lines += format_report(hacking)
            if hacking["flagged"] and result.get("caption_store"):
                lines.append(f"!! relabel them first: oni-label --store {result['caption_store']}")
    check = result.get("death_causes_check")
    if check:
        lines.append("")
        lines += format_death_causes(check)
    if result.get("replays"):
        lines.append(f"replays: {len(result['replays'])} in {Path(result['replays'][0]).parent} (oni-replay FILE)")
    lines.append(f"{result['steps']:,} steps in {result['time_s']:.1f} s")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog=PROG, description="Play episodes with a trained policy and report success, return, "
                "levels, score, BALROG's progression and messages with 95 % confidence intervals.")
    p.add_argument("path", help="an oni-train run folder or checkpoint file")
    p.add_argument("--episodes", type=int, default=32, help="episodes to play (default: %(default)s)")
    p.add_argument("--task", default=None, help="task to play (default: the run's; same actions required)")
    p.add_argument("--seed", type=int, default=0, help="seeds the games and the action sampling (default: %(default)s)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="take the most likely action")
    mode.add_argument("--sample", dest="greedy", action="store_false", help="sample actions, as in training (default)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: the cores available)")
    p.add_argument("--envs-per-worker", type=int, default=None,
                   help="games a worker plays at once (default: episodes / workers, at most 32)")
    p.add_argument("--max-episode-steps", type=int, default=None, help="step limit per episode (default: the run's)")
    p.add_argument("--record", type=int, default=0, metavar="K", help="keep the first K episodes as replay files")
    p.add_argument("--record-dir", default=None, help="where replays go (default: RUN/replays)")
    p.add_argument("--caption-store", default=None,
                   help="labels to judge messages by (default: the run's captions.pt; 'none' to skip)")
    p.add_argument("--death-window", type=int, default=DEATH_WINDOW, metavar="N",
                   help="reward-hacking diagnostics: a paid caption comes before a death when the episode ends in "
                        "death at most N steps later (default: %(default)s)")
    p.add_argument("--baseline", default=None, metavar="OTHER",
                   help="an eval.json (or a run folder holding one) of the same task, e.g. the extrinsic-only arm: "
                        "flags a death cause far more common here than there")
    p.add_argument("-o", "--output", default=None, help="where eval.json goes (default: RUN/eval.json, written again "
                   "at every evaluation of the run; a file named here is never replaced without --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace the file -o names if it exists")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs ``oni-eval``; returns the exit status (0 ok, 2 bad input)."""
    import logging

    logging.getLogger("torchrl").setLevel(logging.WARNING)  # its INFO lines (storage sizes) go to stdout
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # argparse already printed its one line (or --help)
        return int(stop.code or 0)
    use_forkserver()  # the game processes start as forks of one process that imported torch and NLE once
    if args.output is not None and not args.overwrite and os.path.isfile(args.output):
        # checked before minutes of play; the default RUN/eval.json is the run's latest evaluation and is
        # re-written by design, but a file the user named may be anything they keep
        return report(PROG, f"-o {args.output} already exists: --overwrite replaces it, or choose another file")
    try:
        result = evaluate(
            args.path, args.episodes, task=args.task, seed=args.seed, greedy=args.greedy, workers=args.workers,
            envs_per_worker=args.envs_per_worker, max_episode_steps=args.max_episode_steps, record=args.record,
            record_dir=args.record_dir, caption_store=args.caption_store, output=args.output, progress=args.progress,
            death_window=args.death_window, baseline=args.baseline,
        )
    except EvalError as err:
        return report(PROG, str(err))
    except OSError as err:  # an output folder that cannot be written
        where = f": {err.filename}" if err.filename else ""
        return report(PROG, (err.strerror or str(err)) + where)
    print(format_table(result))
    print(json.dumps({k: v for k, v in result.items() if k != "per_episode"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
