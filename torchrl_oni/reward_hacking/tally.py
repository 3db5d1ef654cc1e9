"""The trainer's tally: :class:`HackingTally` counts, per caption, what the diagnostics need, one
finished episode at a time, and makes the report; :class:`EpisodeAssembler` cuts collected batches
into those episodes; :func:`format_report` prints a report as ``oni-eval`` shows it.

``oni-train`` tallies every collected batch (:mod:`torchrl_oni.train.intrinsic`), ``oni-eval`` the
episodes it played (:mod:`torchrl_oni.evaluate`). What is counted and what the report holds:
:mod:`torchrl_oni.reward_hacking`.
"""
from __future__ import annotations

import collections
import math
from typing import Deque, Dict, Hashable, List, Mapping, Optional, Tuple

import numpy as np

from ..captions import hash_bytes
from ..run_folder import REWARD_HACKING_NAME
from ..stats import rate_ratio_ci

__all__ = ["HackingTally", "EpisodeAssembler", "format_report", "DEATH_WINDOW", "MIN_RATIO", "MIN_DEATH_SHARE",
           "MIN_DEATHS", "REPORT_NAME"]

REPORT_NAME = REWARD_HACKING_NAME  # the training run's report, in its run folder (oni-label reads it)
DEATH_WINDOW = 20
"""N: a step comes before a death when the episode ended in death at most N steps later."""
MIN_RATIO = 3.0
"""Flag: the lower end of the 95 % interval of the rate ratio (paid caption / baseline) is at least this."""
MIN_DEATH_SHARE = 0.1
"""Flag: the caption came before at least this share of the deaths..."""
MIN_DEATHS = 3
"""...and at least this many deaths."""
MIN_BASELINE = 100
"""Unpaid captions seen fewer times than this: the baseline is all steps instead."""
RESET_EPISODE_SHARE = 0.5
RESET_EARLY = 0.25
REPEAT_SHARE = 0.5
REPEAT_PAYMENTS = 3.0
LOOP_WARNING_SHARE = 0.25
"""Episode loops that together earn at least this share of the intrinsic return get a ``!!`` line."""
TOP = 10
# episodes at the start and at the end of a run whose approved captions the summary compares; a
# run that ends fewer than twice as many (many games, long episodes) compares its two halves,
# each of at least MIN_APPROVED_WINDOW episodes
APPROVED_WINDOW = 100
MIN_APPROVED_WINDOW = 50
EMPTY_HASH = hash_bytes(b"")

# per caption, one row of HackingTally._data
_SEEN, _BEFORE, _DEATHS, _PAID, _PAYMENTS, _EPISODES, _EPISODES_PAID, _FIRST_AT, _REPEAT, _MAX = range(10)
_FIELDS = 10


class HackingTally:
    """Counts, per caption, what the diagnostics need, one finished episode at a time.

    Args:
        window: N of "comes before a death within N steps" (default :data:`DEATH_WINDOW`).

    Attributes:
        texts (dict): caption hash -> text, filled by the caller (reports name captions by it).

    Cost: one :func:`numpy.unique` and a few vectorised updates per episode (tens of
    microseconds for an episode of a few hundred captions); memory: 80 bytes per distinct caption.
    """

    def __init__(self, window: int = DEATH_WINDOW):
        if not 1 <= int(window) < 2 ** 31:
            raise ValueError(f"the death window must be a positive number of steps, got {window}")
        self.window = int(window)
        self.texts: Dict[int, str] = {}
        # distinct paid captions of the first and of the latest APPROVED_WINDOW episodes: the
        # learning check's measure (an agent that learns meets more approved captions per episode)
        self.approved_first: List[int] = []
        self.approved_last: Deque[int] = collections.deque(maxlen=APPROVED_WINDOW)
        self.episodes = 0
        self.deaths = 0
        self.steps = 0
        self.window_steps = 0  # steps that came before a death (chance rate's numerator)
        self.paid_total = 0.0
        self._index: Dict[int, int] = {}
        self._hashes: List[int] = []
        self._data = np.zeros((64, _FIELDS), dtype=np.float64)

    # ------------------------------------------------------------------ counting
    def _rows(self, hashes: np.ndarray) -> np.ndarray:
        index = self._index
        rows = np.fromiter((index.get(h, -1) for h in hashes.tolist()), dtype=np.int64, count=len(hashes))
        new = np.flatnonzero(rows < 0)
        if len(new):
            start = len(self._hashes)
            for k, pos in enumerate(new.tolist()):
                h = int(hashes[pos])
                index[h] = start + k
                self._hashes.append(h)
            rows[new] = np.arange(start, start + len(new))
            if len(self._hashes) > len(self._data):
                grown = np.zeros((max(2 * len(self._data), len(self._hashes)), _FIELDS), dtype=np.float64)
                grown[: len(self._data)] = self._data
                self._data = grown
        return rows

    def add_episode(self, hashes, paid, steps, length: int, died: bool) -> None:
        """Counts one finished episode (see the module docstring for the arguments)."""
        hashes = np.asarray(hashes, dtype=np.int64).reshape(-1)
        paid = np.asarray(paid, dtype=np.float64).reshape(-1)
        steps = np.asarray(steps, dtype=np.int64).reshape(-1)
        if not len(hashes) == len(paid) == len(steps):
            raise ValueError(f"hashes, paid and steps differ in length ({len(hashes)}, {len(paid)}, {len(steps)})")
        length, died = int(length), bool(died)
        self.episodes += 1
        self.steps += length
        if died:
            self.deaths += 1
            self.window_steps += min(self.window, length)
        self.paid_total += float(paid.sum())
        approved = int(len(np.unique(hashes[paid > 0]))) if len(hashes) else 0
        if len(self.approved_first) < APPROVED_WINDOW:
            self.approved_first.append(approved)
        self.approved_last.append(approved)
        if not len(hashes):
            return
        uniq, inverse = np.unique(hashes, return_inverse=True)
        k = len(uniq)
        rows = self._rows(uniq)
        data = self._data
        data[rows, _SEEN] += np.bincount(inverse, minlength=k)
        data[rows, _EPISODES] += 1
        if died:
            ahead = length - steps  # steps from this one to the death (1: the last step)
            near = ((ahead >= 1) & (ahead <= self.window)).astype(np.float64)
            before = np.bincount(inverse, weights=near, minlength=k)
            data[rows, _BEFORE] += before
            data[rows, _DEATHS] += before > 0
        is_paid = paid > 0
        if is_paid.any():
            paying = np.flatnonzero(is_paid)
            sums = np.bincount(inverse, weights=paid, minlength=k)
            counts = np.bincount(inverse[paying], minlength=k)
            data[rows, _PAID] += sums
            data[rows, _PAYMENTS] += counts
            who, first = np.unique(inverse[paying], return_index=True)  # steps increase: the first payment
            first_step = steps[paying[first]]
            prow = rows[who]
            data[prow, _EPISODES_PAID] += 1
            data[prow, _FIRST_AT] += first_step / max(length, 1)
            data[prow, _REPEAT] += sums[who] - paid[paying[first]]
            data[prow, _MAX] = np.maximum(data[prow, _MAX], counts[who])
        elif paid.any():  # negative payments only: counted in the return, never "paid"
            data[rows, _PAID] += np.bincount(inverse, weights=paid, minlength=k)

    # ------------------------------------------------------------------ the report
    def report(self, texts: Optional[Mapping[int, str]] = None, *, top: int = TOP, min_ratio: float = MIN_RATIO,
               min_death_share: float = MIN_DEATH_SHARE, min_deaths: int = MIN_DEATHS) -> dict:
        """The diagnostics (see the module docstring); ``texts`` adds to :attr:`texts`."""
        names = dict(self.texts)
        if texts:
            names.update(texts)
        n = len(self._hashes)
        data = self._data[:n]
        hashes = np.asarray(self._hashes, dtype=np.int64)
        paid_mask = data[:, _PAID] > 0
        unpaid = ~paid_mask
        base_seen, base_before = float(data[unpaid, _SEEN].sum()), float(data[unpaid, _BEFORE].sum())
        if base_seen >= MIN_BASELINE:
            baseline = {"of": "unpaid captions", "sightings": int(base_seen), "before_death": int(base_before)}
        else:
            baseline = {"of": "all steps", "sightings": int(self.steps), "before_death": int(self.window_steps)}
        baseline["rate"] = baseline["before_death"] / baseline["sightings"] if baseline["sightings"] else None
        total = self.paid_total
        needed = max(int(min_deaths), math.ceil(min_death_share * self.deaths))
        rule = {"min_ratio": float(min_ratio), "min_death_share": float(min_death_share),
                "min_deaths": int(min_deaths), "deaths_needed": needed,
                "reset_loop": {"episode_share": RESET_EPISODE_SHARE, "first_paid_at": RESET_EARLY},
                "episode_loop": {"repeat_share": REPEAT_SHARE, "payments_per_episode": REPEAT_PAYMENTS}}

        rows: Dict[int, dict] = {}

        def row(i: int) -> dict:
            if i in rows:
                return rows[i]
            d = data[i]
            h = int(hashes[i])
            seen, before = int(d[_SEEN]), int(d[_BEFORE])
            ratio, lo, hi = rate_ratio_ci(before, seen, baseline["before_death"], baseline["sightings"])
            paying = d[_EPISODES_PAID]
            rows[i] = out = {
                "hash": str(h),
                "message": names.get(h),
                "return_share": _num(d[_PAID] / total) if total > 0 else None,
                "paid": float(d[_PAID]),
                "payments": int(d[_PAYMENTS]),
                "sightings": seen,
                "before_death": before,
                "rate": before / seen if seen else None,
                "ratio": _num(ratio),
                "ratio_ci95": [_num(lo), _num(hi)],
                "deaths_preceded": int(d[_DEATHS]),
                "death_share": int(d[_DEATHS]) / self.deaths if self.deaths else None,
                "episode_share": float(paying / self.episodes) if self.episodes else None,
                "first_paid_at": float(d[_FIRST_AT] / paying) if paying else None,
                "payments_per_episode": float(d[_PAYMENTS] / paying) if paying else None,
                "max_payments": int(d[_MAX]),
                "repeat_share": float(d[_REPEAT] / d[_PAID]) if d[_PAID] > 0 else None,
            }
            return out

        paid_rows = np.flatnonzero(paid_mask)
        by_return = paid_rows[np.argsort(-data[paid_rows, _PAID], kind="stable")]
        flagged = []
        reset_loops, episode_loops = [], []
        for i in by_return.tolist():
            d = data[i]
            if d[_DEATHS] >= needed and d[_BEFORE] > 0:
                r = row(i)
                if r["ratio_ci95"][0] is not None and r["ratio_ci95"][0] >= min_ratio:
                    flagged.append(r)
            paying = d[_EPISODES_PAID]
            if paying and self.episodes:
                if paying / self.episodes >= RESET_EPISODE_SHARE and d[_FIRST_AT] / paying <= RESET_EARLY:
                    reset_loops.append(row(i))
                if d[_REPEAT] / d[_PAID] > REPEAT_SHARE and d[_PAYMENTS] / paying >= REPEAT_PAYMENTS:
                    episode_loops.append(row(i))
        flagged.sort(key=lambda r: (-r["deaths_preceded"], -(r["ratio"] or 0.0)))
        out = {
            "window": self.window,
            "episodes": self.episodes,
            "deaths": self.deaths,
            "steps": self.steps,
            "intrinsic_return": float(total),
            "paid_captions": int(paid_mask.sum()),
            "captions": n,
            "baseline": baseline,
            "chance_rate": self.window_steps / self.steps if self.steps else None,
            "top": [row(i) for i in by_return[: max(int(top), 0)].tolist()],
            "flagged": flagged,
            "loops": {"reset": reset_loops[:top], "episode": episode_loops[:top]},
            "rule": rule,
        }
        out["warnings"] = _warnings(out)
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Plain numbers and lists (fits a ``weights_only`` checkpoint)."""
        n = len(self._hashes)
        return {"window": self.window, "episodes": self.episodes, "deaths": self.deaths, "steps": self.steps,
                "window_steps": self.window_steps, "paid_total": self.paid_total, "hashes": list(self._hashes),
                "data": self._data[:n].tolist(),
                "texts": {str(h): t for h, t in self.texts.items()},
                "approved_first": list(self.approved_first), "approved_last": list(self.approved_last)}

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict` (the counts of the episodes before a checkpoint)."""
        self.window = int(state["window"])
        for key in ("episodes", "deaths", "steps", "window_steps"):
            setattr(self, key, int(state[key]))
        self.paid_total = float(state["paid_total"])
        self._hashes = [int(h) for h in state["hashes"]]
        self._index = {h: i for i, h in enumerate(self._hashes)}
        data = np.asarray(state["data"], dtype=np.float64).reshape(-1, _FIELDS)
        self._data = np.zeros((max(64, len(data)), _FIELDS), dtype=np.float64)
        self._data[: len(data)] = data
        self.texts = {int(h): str(t) for h, t in state.get("texts", {}).items()}
        self.approved_first = [int(n) for n in state.get("approved_first", [])][:APPROVED_WINDOW]
        self.approved_last = collections.deque((int(n) for n in state.get("approved_last", [])),
                                               maxlen=APPROVED_WINDOW)

    def approved_per_episode(self) -> Optional[Tuple[float, float, int]]:
        """``(first, latest, window)``: distinct paid captions per episode over the run's first and
        its latest ``window`` episodes, ``window`` being :data:`APPROVED_WINDOW`, or half the
        episodes of a run that has ended fewer than twice that many (the two never overlap); None
        while that half is under :data:`MIN_APPROVED_WINDOW`.

        Example:
            >>> tally = HackingTally()
            >>> for k in range(2 * APPROVED_WINDOW):
            ...     tally.add_episode([1, 2, 3], [0.0, 1.0 if k >= APPROVED_WINDOW else 0.0, 0.5], [1, 2, 3], 3, False)
            >>> tally.approved_per_episode()
            (1.0, 2.0, 100)
            >>> short = HackingTally()
            >>> for k in range(130):  # a short run: its first 65 episodes against its last 65
            ...     short.add_episode([1, 2, 3], [0.0, 1.0 if k >= 65 else 0.0, 0.5], [1, 2, 3], 3, False)
            >>> short.approved_per_episode()
            (1.0, 2.0, 65)
        """
        window = min(APPROVED_WINDOW, self.episodes // 2, len(self.approved_first), len(self.approved_last))
        if window < MIN_APPROVED_WINDOW:
            return None
        latest = list(self.approved_last)[-window:]
        return float(np.mean(self.approved_first[:window])), float(np.mean(latest)), window


def _num(x) -> Optional[float]:
    x = float(x)
    return x if math.isfinite(x) else None


def _quote(r: dict) -> str:
    text = r["message"] if r["message"] is not None else f"caption {r['hash']}"
    return '"' + (text if len(text) <= 60 else text[:57] + "...") + '"'


def _times(x) -> str:
    return "-" if x is None else (f"{x:.1f}" if x < 100 else f"{x:,.0f}")


def _warnings(report: dict) -> List[str]:
    """The ``!!`` lines (without the ``!!``) of a report."""
    lines = []
    flagged = report["flagged"]
    if flagged:
        named = "; ".join(
            f"{_quote(r)} (before {r['deaths_preceded']} of {report['deaths']} deaths, "
            f"{_times(r['ratio'])}x the rate of {report['baseline']['of']}, 95 % CI "
            f"{_times(r['ratio_ci95'][0])}-{_times(r['ratio_ci95'][1])}x)" for r in flagged[:3])
        more = f" and {len(flagged) - 3} more" if len(flagged) > 3 else ""
        lines.append(f"paid captions come before deaths far above chance: {named}{more}, within "
                     f"{report['window']} steps. The intrinsic reward may be paying the agent to die: relabel "
                     "them (oni-label puts them first)")
    loops = report["loops"]["episode"]
    share = sum(r["return_share"] or 0.0 for r in loops)
    if loops and share >= LOOP_WARNING_SHARE:
        named = ", ".join(f"{_quote(r)} ({r['payments_per_episode']:.0f} payments per episode)" for r in loops[:3])
        lines.append(f"{100 * share:.0f} % of the intrinsic return is paid again and again within episodes: {named}. "
                     "Check the count decay (--count-exponent) and relabel them")
    return lines


def format_report(report: dict, top: int = 5) -> List[str]:
    """The report as table lines (``oni-eval`` prints them; the ``!!`` lines last)."""
    lines = []
    base = report["baseline"]
    rate = "-" if base["rate"] is None else f"{100 * base['rate']:.1f} %"
    lines.append(f"reward hacking: {report['paid_captions']:,} paid captions, intrinsic return "
                 f"{report['intrinsic_return']:,.2f} over {report['episodes']:,} episodes, {report['deaths']:,} deaths; "
                 f"before a death = within {report['window']} steps ({rate} of the {base['sightings']:,} "
                 f"sightings of {base['of']}):")
    if report.get("paid_by"):
        lines.append(f"  paid = {report['paid_by']}")
    lines.append(f"  {'share':>6}  {'payments':>8}  {'before death':>12}  {'x base [95% CI]':<19}  {'deaths':>6}  "
                 f"{'episodes':>8}  message")
    shown = report["top"][:top]
    shown += [r for r in report["flagged"] if r not in shown]
    flagged = {r["hash"] for r in report["flagged"]}
    for r in shown:
        share = "-" if r["return_share"] is None else f"{100 * r['return_share']:.1f}%"
        rate = "-" if r["rate"] is None else f"{100 * r['rate']:.1f}%"
        ci = f"{_times(r['ratio'])} [{_times(r['ratio_ci95'][0])}, {_times(r['ratio_ci95'][1])}]"
        episodes = "-" if r["episode_share"] is None else f"{100 * r['episode_share']:.0f}%"
        mark = "!! " if r["hash"] in flagged else ""
        lines.append(f"  {share:>6}  {r['payments']:>8,}  {rate:>12}  {ci:<19}  {r['deaths_preceded']:>6}  "
                     f"{episodes:>8}  {mark}{_quote(r)}")
    for kind, what in (("reset", "paid again after every reset"), ("episode", "paid again and again within episodes")):
        loops = report["loops"][kind]
        if loops:
            lines.append(f"  {what}: " + ", ".join(
                f"{_quote(r)} (in {100 * r['episode_share']:.0f} % of episodes, "
                f"{r['payments_per_episode']:.1f} payments each)" for r in loops[:3]))
    if not report["flagged"]:
        lines.append(f"  no paid caption comes before deaths far above chance (rule: 95 % CI of the ratio above "
                     f"{report['rule']['min_ratio']:g}x, before {report['rule']['deaths_needed']}+ deaths)")
    lines += [f"!! {line}" for line in report["warnings"]]
    return lines


# ---------------------------------------------------------------------- collected batches
class EpisodeAssembler:
    """Cuts collected batches ``[R, T]`` (time last) into finished episodes for a :class:`HackingTally`.

    Episodes cross batches: a row's steps are kept, per trajectory, until its episode ends.
    Trajectories are told apart by the collector's trajectory ids (``("collector", "traj_ids")``;
    unique across the workers of TorchRL's multi-process collectors, whose consecutive batches
    come from different workers); without them, row ``r`` of a batch continues row ``r`` of the
    previous one. Only steps with a non-empty caption are kept (a few bytes each); trajectories
    not seen for ``stale_batches`` batches (a restarted worker's) are dropped.

    Example:
        >>> import numpy as np
        >>> tally = HackingTally(window=2)
        >>> feed = EpisodeAssembler(tally)
        >>> hashes = np.array([[5, 6, 7, 8]]); paid = np.array([[0.0, 1.0, 0.0, 0.0]])
        >>> feed.add(hashes, paid, done=np.array([[False, False, False, False]]), died=np.zeros((1, 4), bool))
        0
        >>> feed.add(hashes, paid, done=np.array([[False, True, False, False]]), died=np.array([[False, True, False, False]]))
        1
        >>> tally.episodes, tally.steps, tally.deaths, feed.open_episodes
        (1, 6, 1, 1)
    """

    def __init__(self, tally: HackingTally, stale_batches: int = 1000, empty_hash: int = EMPTY_HASH):
        self.tally = tally
        self.stale_batches = int(stale_batches)
        self.empty_hash = int(empty_hash)
        self._open: Dict[Hashable, list] = {}  # key -> [hash chunks, paid chunks, step chunks, steps, last batch]
        self._batches = 0

    @property
    def open_episodes(self) -> int:
        return len(self._open)

    def add(self, hashes, paid, done, died, traj_ids=None) -> int:
        """Adds one batch (numpy ``[R, T]`` arrays; ``died``: the step ended its episode in a death);
        returns the episodes it finished."""
        hashes = np.asarray(hashes, dtype=np.int64)
        T = hashes.shape[-1]
        hashes = hashes.reshape(-1, T)
        paid = np.asarray(paid, dtype=np.float64).reshape(hashes.shape)
        done = np.asarray(done, dtype=bool).reshape(hashes.shape)
        died = np.asarray(died, dtype=bool).reshape(hashes.shape)
        traj = None if traj_ids is None else np.asarray(traj_ids, dtype=np.int64).reshape(hashes.shape)
        self._batches += 1
        R, T = hashes.shape
        # segments: runs of a row's steps with one trajectory and no episode end inside; found for
        # the whole batch at once (the Python loop below goes over segments and calls no numpy per
        # row: 5.9 ms for 512 rows x 32 steps, a GPU node's update, where a loop per row took 11.3)
        starts = np.zeros((R, T), dtype=bool)
        starts[:, 0] = True
        starts[:, 1:] = done[:, :-1]
        if traj is not None:
            starts[:, 1:] |= traj[:, 1:] != traj[:, :-1]
        seg_start = np.flatnonzero(starts.reshape(-1))
        seg_end = np.append(seg_start[1:], R * T)
        last = seg_end - 1
        seg_done = done.reshape(-1)[last].tolist()
        seg_died = died.reshape(-1)[last].tolist()
        seg_len = (seg_end - seg_start).tolist()
        keys = (traj.reshape(-1)[seg_start].tolist() if traj is not None
                else [("row", r) for r in (seg_start // T).tolist()])
        kept = np.flatnonzero(hashes.reshape(-1) != self.empty_hash)  # steps with a caption
        seg_of = np.searchsorted(seg_start, kept, side="right") - 1
        cut = np.searchsorted(seg_of, np.arange(1, len(seg_start)))
        h_parts = np.split(hashes.reshape(-1)[kept], cut)
        p_parts = np.split(paid.reshape(-1)[kept], cut)
        s_parts = np.split(kept - seg_start[seg_of], cut)  # the step within the segment
        finished = 0
        open_, batch = self._open, self._batches
        for k, key in enumerate(keys):
            entry = open_.get(key)
            if entry is None:
                entry = open_[key] = [[], [], [], 0, 0]
            if len(h_parts[k]):
                entry[0].append(h_parts[k])
                entry[1].append(p_parts[k])
                entry[2].append(entry[3] + s_parts[k])
            entry[3] += seg_len[k]
            entry[4] = batch
            if seg_done[k]:
                del open_[key]
                cat = (lambda chunks, dtype: np.concatenate(chunks) if chunks else np.zeros(0, dtype))
                self.tally.add_episode(cat(entry[0], np.int64), cat(entry[1], np.float64),
                                       cat(entry[2], np.int64), entry[3], seg_died[k])
                finished += 1
        if self._batches % 100 == 0:
            old = [k for k, e in self._open.items() if self._batches - e[4] > self.stale_batches]
            for k in old:
                del self._open[k]
        return finished
