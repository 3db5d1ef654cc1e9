"""The grid's numbers: what each run's eval.json and metrics.csv hold, their mean and 95 % CI over
seeds, every setting paired with the baseline by seed and by game, and the evaluations by frames
trained (a frame ladder).

For whoever reads or changes the statistics; plain data in, plain data out (the JSON line's
``rows``, ``paired``, ``by_frames`` and ``runs``), no printing but a warning line.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from sparse_grid.grid import EARLIER_EVAL_PATTERN, NONE, GridError, Run, _read_json, say

# eval.json statistics in the evaluation table: (key in the JSON rows, eval.json path, header)
EVAL_METRICS = (
    ("success", ("success_rate", "mean"), "success"),
    ("return", ("return", "mean"), "return"),
    ("max_dlvl", ("max_dlvl", "mean"), "max dlvl"),
    ("xlvl", ("xlvl", "mean"), "xp level"),
    ("progression", ("progression", "mean"), "progress %"),
    ("score", ("score", "mean"), "score"),
    ("approved_per_episode", ("messages", "approved_per_episode", "mean"), "approved/ep"),
)


# the eval.json fields that fix which games oni-eval plays (its module docstring): runs equal in all
# of them played episode k from the same game seed, so their episodes pair one to one
EVAL_GAMES = ("task", "seed", "episodes", "workers", "envs_per_worker", "max_episode_steps")


def _dig(data, path):
    for key in path:
        if not isinstance(data, dict) or data.get(key) is None:
            return None
        data = data[key]
    return data


def curve_value(rows: List[Dict[str, float]], metric: str, target: float) -> Optional[float]:
    """``metric`` in the logged row nearest to ``target`` frames, if one lies within one logging interval.

    Example:
        >>> rows = [{"frames": 512.0 * i, "episode/success": i / 10} for i in range(1, 9)]
        >>> curve_value(rows, "episode/success", 2048), curve_value(rows, "episode/success", 2100)
        (0.4, 0.4)
        >>> curve_value(rows, "episode/success", 8192) is None  # the run stopped at 4,096 frames
        True
    """
    have = [(r["frames"], r[metric]) for r in rows
            if "frames" in r and metric in r and math.isfinite(r[metric])]
    if not have:
        return None
    frames = sorted(r["frames"] for r in rows if "frames" in r)
    gaps = [b - a for a, b in zip(frames, frames[1:])]
    tolerance = max(gaps) if gaps else frames[0]
    x, value = min(have, key=lambda p: (abs(p[0] - target), p[0]))
    return float(value) if abs(x - target) <= tolerance else None


def collect_run(run: Run, args) -> dict:
    """One run's numbers: eval.json statistics, curve values at the budgets, frames, wall times."""
    from torchrl_oni.evaluate import EVAL_NAME
    from torchrl_oni.train.run_log import METRICS_NAME, MetricsFileError, read_metrics

    out = {"task": run.task, "setting": run.setting, "reward": run.reward, "annotator": run.annotator,
           "seed": run.seed, "logdir": str(run.logdir), "status": run.status, "frames": run.frames,
           "train_time_s": None, "eval_time_s": None, "eval": {}, "curve": {}}
    result = _read_json(run.logdir / EVAL_NAME) if run.status == "done" else None
    if result is not None:
        out.update(eval_summary(result))
    out["earlier_evals"] = earlier_evals(run.logdir)
    metrics = run.logdir / METRICS_NAME
    if metrics.exists():
        try:
            rows = read_metrics(str(metrics))
        except (MetricsFileError, OSError) as err:
            say(f"{run.name}: cannot read metrics.csv ({err})")
            rows = []
        times = [r["time_s"] for r in rows if "time_s" in r]
        out["train_time_s"] = times[-1] if times else None
        out["curve"] = {metric: {budget_key(b): curve_value(rows, metric, b * args.frames) for b in args.budgets}
                        for metric in args.curve_metrics}
    return out


def eval_summary(result: dict) -> dict:
    """What the grid reads from one eval.json (:func:`collect_run`'s evaluation fields)."""
    episodes = sorted(result.get("per_episode") or [], key=lambda e: e.get("episode", 0))
    stats = {key: _dig(result, path) for key, path, _ in EVAL_METRICS}
    if stats["progression"] is None:
        stats["progression"] = _progression_of_episodes(episodes)
    return {
        "eval": stats,
        "eval_time_s": result.get("time_s"),
        "caption_store": result.get("caption_store"),
        # "0110…": episode k's success, k in oni-eval's order; two runs with equal eval_games played the same games
        "episode_success": "".join("1" if e.get("success") else "0" for e in episodes),
        "eval_games": {key: result.get(key) for key in EVAL_GAMES},
        # the diagnostics of oni-eval: how episodes ended, and its `!!` lines (reward hacking, death causes)
        "death_causes": dict(result.get("death_causes") or {}),
        "episodes": _dig(result, ("success_rate", "n")),
        "flags": [*(_dig(result, ("reward_hacking", "warnings")) or []),
                  *(_dig(result, ("death_causes_check", "warnings")) or [])],
    }


def _progression_of_episodes(episodes: List[dict]) -> Optional[float]:
    """BALROG's mean progression from the episodes' ``max_dlvl`` and ``xlvl``, for an eval.json
    written before oni-eval scored it (a frame ladder's earlier rungs); None without them.

    Those episodes know only their last experience level, not their highest: the two differ only
    after a level drain, so the mean may come out a little lower than oni-eval's own.

    Example:
        >>> round(100 * _progression_of_episodes([{"max_dlvl": 5, "xlvl": 1}, {"max_dlvl": 1, "xlvl": 1}]), 3)
        1.324
        >>> _progression_of_episodes([]) is None
        True
    """
    from torchrl_oni.progression import progression

    values = [progression(e["max_dlvl"], e["xlvl"]) for e in episodes
              if e.get("max_dlvl") is not None and e.get("xlvl") is not None]
    return sum(values) / len(values) if values and len(values) == len(episodes) else None


def earlier_evals(logdir: Path) -> List[dict]:
    """The run's kept evaluations of smaller budgets (``eval_<frames>.json``), fewest frames first:
    ``{"frames", "eval"}`` each, ``eval`` as :func:`collect_run` reads it."""
    kept = []
    for path in logdir.glob("eval_*.json"):
        match = EARLIER_EVAL_PATTERN.fullmatch(path.name)
        result = _read_json(path) if match else None
        if result is None:
            continue
        kept.append({"frames": int(result.get("frames_trained", match.group(1))),
                     "eval": eval_summary(result)["eval"]})
    return sorted(kept, key=lambda e: e["frames"])


def budget_key(fraction: float) -> str:
    return f"{fraction:g}"


def _pooled(counts) -> Dict[str, int]:
    """The sum of ``{cause: count}`` dicts, largest first."""
    total: Dict[str, int] = {}
    for c in counts:
        for cause, n in c.items():
            total[cause] = total.get(cause, 0) + int(n)
    return dict(sorted(total.items(), key=lambda kv: (-kv[1], kv[0])))


def aggregate(per_run: List[dict], args) -> List[dict]:
    """Per task × setting: mean and 95 % CI over the seeds whose run is done (:func:`mean_ci`)."""
    from torchrl_oni.stats import mean_ci

    groups: Dict[tuple, List[dict]] = {}
    for r in per_run:
        groups.setdefault((r["task"], r["setting"]), []).append(r)
    rows = []
    for (task, setting), members in groups.items():
        done = [r for r in members if r["status"] == "done"]

        def stat(values):
            return mean_ci([v for v in values if v is not None])

        row = {"task": task, "setting": setting, "reward": members[0]["reward"], "annotator": members[0]["annotator"],
               "seeds": [r["seed"] for r in done], "runs": len(members),
               "eval": {key: stat(r["eval"].get(key) for r in done) for key, _, _ in EVAL_METRICS},
               "curve": {m: {budget_key(b): stat(r["curve"].get(m, {}).get(budget_key(b)) for r in done)
                             for b in args.budgets} for m in args.curve_metrics},
               "frames": stat(r["frames"] for r in done),
               "train_time_s": stat(r["train_time_s"] for r in done),
               "eval_time_s": stat(r["eval_time_s"] for r in done),
               # pooled over the seeds: episodes, deaths by cause, runs with an `!!` line of oni-eval
               "episodes": sum(r.get("episodes") or 0 for r in done),
               "death_causes": _pooled(r.get("death_causes") or {} for r in done),
               "flagged_runs": sum(bool(r.get("flags")) for r in done)}
        rows.append(row)
    return rows


# what a seed summary gives for a pair whose run folders are gone (:func:`read_seed_summaries`)
SUMMARY_KEYS = ("task", "setting", "baseline", "seed", "frames", "success", "episodes", "source")
EPISODE_KEYS = ("both", "only_setting", "only_baseline", "neither")


def read_seed_summaries(path) -> List[dict]:
    """The seed summaries in the JSON file ``path`` (a list of objects with :data:`SUMMARY_KEYS`):
    a pair of runs (setting and baseline, one seed) known only by its figures, e.g. from
    BENCHMARKS.md once its run folders are lost. ``success`` is ``[setting's, baseline's]``
    success rate; ``episodes`` the games paired by game (:data:`EPISODE_KEYS` counts), or None
    where they are not known. Raises :class:`GridError` naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise GridError(f"--seed-summaries {path}: {err}") from None
    if not isinstance(data, list):
        raise GridError(f"--seed-summaries {path}: expected a JSON list of seed summaries")
    for i, entry in enumerate(data):
        missing = [k for k in SUMMARY_KEYS if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise GridError(f"--seed-summaries {path}: entry {i} lacks {', '.join(missing)}")
        episodes = entry["episodes"]
        if len(entry["success"]) != 2 or (episodes is not None and sorted(episodes) != sorted(EPISODE_KEYS)):
            raise GridError(f"--seed-summaries {path}: entry {i}: success is [setting, baseline] and episodes "
                            f"has {', '.join(EPISODE_KEYS)} (or is null)")
    return data


def paired(per_run: List[dict], baseline: str = NONE, summaries: Sequence[dict] = ()) -> List[dict]:
    """Per task, every setting against ``baseline`` on the seeds both have done: each seed is a pair
    (the two runs share the training seed and, when their ``eval_games`` agree, the evaluation games).

    ``success``: :func:`torchrl_oni.stats.paired_difference` of the seeds' success rates (the mean
    difference, its Student-t 95 % CI, whether that excludes 0, the exact sign-flip p, seeds won).
    ``episodes``: the episodes paired by game over those seeds — counts of both/only one/neither
    succeeding and the exact McNemar p — or None, with ``episodes_unpaired`` saying why, when some
    pair did not play the same games.

    ``summaries`` (:func:`read_seed_summaries`) add the seeds a row's runs do not have, where the
    summary's frames are the runs' budget (:func:`budget_of`): their success rates join the seeds',
    their games the pooled counts; ``summary_seeds`` and ``summary_sources`` name them.
    """
    from torchrl_oni.stats import mcnemar_exact, paired_difference

    done = {(r["task"], r["setting"], r["seed"]): r for r in per_run
            if r["status"] == "done" and r["eval"].get("success") is not None}
    rows = []
    for task in dict.fromkeys(r["task"] for r in per_run):
        settings = [s for s in dict.fromkeys(r["setting"] for r in per_run if r["task"] == task) if s != baseline]
        for setting in settings:
            seeds = sorted(seed for (t, s_, seed) in done if t == task and s_ == setting
                           and (task, baseline, seed) in done)
            if not seeds:
                continue
            pairs = [(done[(task, setting, k)], done[(task, baseline, k)]) for k in seeds]
            budgets = {budget_of(r["frames"]) for pair in pairs for r in pair if r.get("frames")}
            extra = [x for x in summaries if (x["task"], x["setting"], x["baseline"]) == (task, setting, baseline)
                     and x["seed"] not in seeds and budgets == {budget_of(x["frames"])}]
            mine = [a["eval"]["success"] for a, _ in pairs] + [x["success"][0] for x in extra]
            base = [b["eval"]["success"] for _, b in pairs] + [x["success"][1] for x in extra]
            row = {"task": task, "setting": setting, "baseline": baseline, "seeds": seeds + [x["seed"] for x in extra],
                   "success": paired_difference(mine, base), "episodes": None}
            if extra:
                row["summary_seeds"] = [x["seed"] for x in extra]
                row["summary_sources"] = [x["source"] for x in extra]
            mismatched = [k for k, (a, b) in zip(seeds, pairs)
                          if a.get("eval_games") != b.get("eval_games") or not a.get("episode_success")
                          or len(a["episode_success"]) != len(b.get("episode_success") or "")]
            unknown = [x["seed"] for x in extra if x["episodes"] is None]
            unpaired = []
            if mismatched:
                unpaired.append(f"seed(s) {', '.join(map(str, mismatched))}: the two runs were not evaluated on "
                                f"the same games (eval.json differs in {'/'.join(EVAL_GAMES)} or has no per_episode)")
            if unknown:
                unpaired.append(f"seed(s) {', '.join(map(str, unknown))}: the summary has no games paired by game")
            if unpaired:
                row["episodes_unpaired"] = "; ".join(unpaired)
            else:
                counts = dict.fromkeys(EPISODE_KEYS, 0)
                for a, b in pairs:
                    for x, y in zip(a["episode_success"], b["episode_success"]):
                        counts[{("1", "1"): "both", ("1", "0"): "only_setting", ("0", "1"): "only_baseline",
                                ("0", "0"): "neither"}[(x, y)]] += 1
                for x in extra:
                    for key in EPISODE_KEYS:
                        counts[key] += int(x["episodes"][key])
                counts["pairs"] = sum(counts.values())
                counts["p"] = mcnemar_exact(counts["only_setting"], counts["only_baseline"])
                row["episodes"] = counts
            rows.append(row)
    return rows


def budget_of(frames: int) -> int:
    """``frames`` to 3 significant digits: the runs of one ``--frames`` stop a batch or so past it.

    Example:
        >>> budget_of(10_000_384), budget_of(3_000_320), budget_of(2048)
        (10000000, 3000000, 2050)
    """
    return int(float(f"{int(frames):.3g}"))


# what the by-frames table follows: the task's success, the deepest level reached, which moves
# long before success does on staircase-lvl3 (reach dungeon level 3), and BALROG's progression, the
# number other NetHack agents are compared by
FRAMES_METRICS = (("success", "success", 3), ("max_dlvl", "max dlvl", 2), ("progression", "progress %", 2))


def by_frames(per_run: List[dict], baseline: str = NONE) -> List[dict]:
    """Success, depth and progression at every budget the grid was run to, from the current and the
    kept earlier evaluations (:func:`earlier_evals`); [] when no run has an earlier one.

    One row per task × budget × setting, with for each of :data:`FRAMES_METRICS` the
    :func:`mean_ci` over the seeds evaluated at that budget (``eval``) and the
    :func:`paired_difference` with ``baseline`` on the seeds both were evaluated at that budget
    (``vs_baseline``; None for the baseline itself or without a common seed).
    """
    from torchrl_oni.stats import mean_ci, paired_difference

    if not any(r.get("earlier_evals") for r in per_run):
        return []
    points: Dict[tuple, Dict[str, Dict[int, dict]]] = {}  # (task, budget) -> setting -> seed -> eval
    for r in per_run:
        evals = list(r.get("earlier_evals") or [])
        if r["status"] == "done" and r["frames"]:
            evals.append({"frames": r["frames"], "eval": r["eval"]})
        for e in evals:
            if e["eval"].get("success") is not None:
                budget = (r["task"], budget_of(e["frames"]))
                points.setdefault(budget, {}).setdefault(r["setting"], {})[r["seed"]] = e["eval"]
    tasks = list(dict.fromkeys(r["task"] for r in per_run))
    settings = list(dict.fromkeys(r["setting"] for r in per_run))
    rows = []
    for (task, budget) in sorted(points, key=lambda k: (tasks.index(k[0]), k[1])):
        group = points[(task, budget)]
        base = group.get(baseline, {})
        for setting in (s for s in settings if s in group):
            mine = group[setting]
            common = [k for k in sorted(mine) if k in base] if setting != baseline else []
            row = {"task": task, "frames": budget, "setting": setting, "seeds": sorted(mine), "baseline": baseline,
                   "eval": {}, "vs_baseline": {}}
            for key, _, _ in FRAMES_METRICS:
                row["eval"][key] = mean_ci([mine[k][key] for k in sorted(mine) if mine[k].get(key) is not None])
                pairs = [(mine[k][key], base[k][key]) for k in common
                         if mine[k].get(key) is not None and base[k].get(key) is not None]
                row["vs_baseline"][key] = paired_difference(*zip(*pairs)) if pairs else None
            rows.append(row)
    return rows
