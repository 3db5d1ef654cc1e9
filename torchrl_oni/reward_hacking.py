"""Reward-hacking diagnostics: paid captions that come just before deaths, who earns the
intrinsic return, and payments that repeat.

An intrinsic reward written by an LLM can be hacked: on ``staircase`` the agents learned to eat
until they choked (rules labels: 118 of 171 deaths), which a person found by reading death
causes. This module finds it from what every run has: per episode, the captions the agent acted
on, the intrinsic reward each of those steps paid, and how the episode ended. ``oni-eval``
(:mod:`torchrl_oni.evaluate`) and ``oni-train``'s final summary
(:mod:`torchrl_oni.train.intrinsic`) report it; ``oni-label`` puts the flagged captions first
(:func:`read_flagged`).

Input, one :meth:`HackingTally.add_episode` call per finished episode (non-empty captions only;
:class:`EpisodeAssembler` cuts collected ``[R, T]`` batches into these):

===========  ===========  ==================================================================
argument     dtype/shape  meaning
===========  ===========  ==================================================================
``hashes``   int64[n]     caption hash of each step with a non-empty message (the caption the
                          reward is paid for: by default the observation acted on)
``paid``     float[n]     the intrinsic reward that step paid (0: unpaid)
``steps``    int[n]       the step's index in the episode, ``0 .. length - 1``, increasing
``length``   int          steps in the episode
``died``     bool         the episode ended in the agent's death (not a time-out or success)
===========  ===========  ==================================================================

What :meth:`HackingTally.report` returns (JSON-ready; caption hashes are strings, as on the
labelling page: an int64 does not fit a JavaScript number):

=====================  ==========================================================================
key                    meaning
=====================  ==========================================================================
``window``             N: a step *comes before a death* when its episode ended in death at most
                       N steps later (``length - step <= N``)
``episodes``,          episodes, deaths, steps counted; ``intrinsic_return``: the sum of all
``deaths``, ``steps``  payments; ``paid_captions`` / ``captions``: distinct captions paid / seen
``baseline``           ``{of, sightings, before_death, rate}``: how often the sightings of
                       *unpaid* captions come before a death (all steps when unpaid captions were
                       seen fewer than :data:`MIN_BASELINE` times); ``chance_rate``: the share
                       of all steps that come before a death
``top``                the paid captions with the largest share of the intrinsic return (rows)
``flagged``            the paid captions that come before deaths far above chance (the verdict,
                       strongest first): the ``!!`` line names them
``loops``              ``reset``: paid again after every reset (in at least half of the
                       episodes, first paid in the first quarter of each on average);
                       ``episode``: paid many times within one episode (over half of its return
                       from repeats, 3+ payments per paying episode)
``rule``               the thresholds used; ``warnings``: the lines a user must see
=====================  ==========================================================================

A row: ``hash``, ``message``, ``return_share`` (of the intrinsic return), ``paid``, ``payments``
(steps that paid), ``sightings``, ``before_death`` (sightings that came before a death),
``rate`` (``before_death / sightings``), ``ratio`` and ``ratio_ci95`` (``rate`` over the
baseline's, Katz's 95 % interval: :func:`torchrl_oni.stats.rate_ratio_ci`), ``deaths_preceded``
and ``death_share`` (deaths it came before, of all deaths), ``episode_share`` (episodes that paid
it), ``first_paid_at`` (mean position of its first payment, as a fraction of the episode),
``payments_per_episode`` (in episodes that paid it), ``max_payments`` (in one episode),
``repeat_share`` (of its return, paid after its first payment in an episode).

**The verdict.** A paid caption is flagged when the lower end of its ratio's 95 % interval is at
least :data:`MIN_RATIO` (3) and it came before at least :data:`MIN_DEATH_SHARE` (a tenth) of the
deaths, and at least :data:`MIN_DEATHS` of them. Why these: danger itself is not hacking. A
reward for kills pays "You kill the jackal!" in the fights where agents also die, so any paid
caption of a dangerous activity comes before deaths somewhat more often than average; but the
unpaid captions of the same fights ("The jackal bites!") do too, which is why the baseline is the
unpaid captions and the bar three times their rate with 95 % confidence rather than any excess.
And a caption that came before one death in a hundred cannot be what kills the agents, hence the
tenth of the deaths. The sightings of one caption within one episode are not independent (ten
sightings before one death count ten), so the interval is narrower than it should be for
captions that repeat; counting distinct deaths guards against one episode's repeats.

**How the agents die** (:func:`death_causes_check`, ``eval.json``'s ``death_causes_check``). A
reward can teach a deadly habit through captions paid long before the death, which the window
rule cannot see (staircase, rules labels: choking after paid meals, the captions just before it
unpaid). With ``oni-eval --baseline OTHER`` (an evaluation of the same task, e.g. the
extrinsic-only arm) each death cause's share of the episodes is compared with the baseline's
(Katz rate ratio, one-sided Fisher p) and a cause at least :data:`MIN_CAUSE_RATIO` times the
baseline's with 95 % confidence is flagged; without one, a cause the agent brings on itself
(:data:`SELF_INFLICTED`) that ends more than half of the episodes is. Under each cause, the paid
captions whose episodes end in it more often than the episodes that did not pay them; ``oni-label``
puts those of a flagged cause first.

Example (a paid caption that comes right before every death; another paid at every step):
    >>> import numpy as np
    >>> from torchrl_oni.reward_hacking import HackingTally
    >>> tally = HackingTally(window=20)
    >>> EAT, WALK = 1, 2
    >>> for _ in range(10):
    ...     steps = np.arange(0, 100, 5)                 # a non-empty message every 5th step
    ...     hashes = np.full(len(steps), WALK); hashes[-1] = EAT
    ...     paid = np.where(hashes == EAT, 1.0, 0.0); paid[0] = 0.5   # WALK paid once per episode
    ...     tally.add_episode(hashes, paid, steps, length=100, died=True)
    >>> report = tally.report({EAT: "You finish eating the food ration.", WALK: "You see here a rock."})
    >>> [row["message"] for row in report["flagged"]]
    ['You finish eating the food ration.']
    >>> report["flagged"][0]["deaths_preceded"], report["deaths"]
    (10, 10)
    >>> print(report["warnings"][0][:73])
    paid captions come before deaths far above chance: "You finish eating the
"""
from __future__ import annotations

import collections
import json
import math
from pathlib import Path
from typing import Deque, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .captions import encode_message, hash_bytes, message_bytes
from .run_folder import REWARD_HACKING_NAME
from .stats import fisher_greater, rate_ratio_ci

__all__ = ["HackingTally", "EpisodeAssembler", "format_report", "read_flagged", "DEATH_WINDOW", "MIN_RATIO",
           "MIN_DEATH_SHARE", "MIN_DEATHS", "REPORT_NAME", "death_causes_check", "format_death_causes", "read_baseline",
           "SELF_INFLICTED", "MIN_CAUSE_RATIO"]

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
# episodes at the start and at the end of a run whose approved captions the summary compares
APPROVED_WINDOW = 100
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

    def approved_per_episode(self) -> Optional[Tuple[float, float]]:
        """``(first, latest)``: distinct paid captions per episode over the run's first and its
        latest :data:`APPROVED_WINDOW` episodes; None until there are twice that many episodes
        (before, the two windows overlap).

        Example:
            >>> tally = HackingTally()
            >>> for k in range(2 * APPROVED_WINDOW):
            ...     tally.add_episode([1, 2, 3], [0.0, 1.0 if k >= APPROVED_WINDOW else 0.0, 0.5], [1, 2, 3], 3, False)
            >>> tally.approved_per_episode()
            (1.0, 2.0)
        """
        if self.episodes < 2 * APPROVED_WINDOW or not self.approved_first:
            return None
        return float(np.mean(self.approved_first)), float(np.mean(self.approved_last))


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


# ---------------------------------------------------------------------- reading reports back
def read_flagged(path) -> List[Tuple[int, str]]:
    """``[(caption hash, why)]`` to put first on the labelling page, from a JSON file: an
    ``eval.json`` of ``oni-eval`` or a ``reward_hacking.json`` of ``oni-train`` (their flagged
    captions, strongest first), or a JSON list of captions (texts) chosen by hand.

    Raises:
        ValueError: a file that is none of these, in one sentence.
        OSError: a file that cannot be read.

    Example:
        >>> import json, tempfile
        >>> path = tempfile.mktemp(suffix=".json")
        >>> _ = open(path, "w").write(json.dumps(["You choke over your food."]))
        >>> [why.startswith("listed in ") for _, why in read_flagged(path)]
        [True]
    """
    path = Path(path)
    raw = path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError(f"{path} is not a JSON file (an oni-eval eval.json, a reward_hacking.json or a list of "
                         "captions)") from None
    if isinstance(data, list):
        if not all(isinstance(x, str) for x in data):
            raise ValueError(f"{path}: a list of captions must hold strings only")
        return [(hash_bytes(message_bytes(encode_message(x))), f"listed in {path.name}") for x in data]
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an oni-eval eval.json, a "
                         "reward_hacking.json or a list of captions")
    report = data.get("reward_hacking", data)
    check = data.get("death_causes_check")
    causes = _cause_flagged(path, check) if check is not None else []
    if not isinstance(report, dict) or "flagged" not in report:
        if isinstance(check, dict):
            return causes
        raise ValueError(f"{path} holds no reward-hacking diagnostics (an eval.json of an older oni-eval, or "
                         "of a run that paid no intrinsic reward?)")
    rows = report["flagged"]
    window = report.get("window")
    deaths = report.get("deaths")
    base = report.get("baseline")
    base = base.get("of") if isinstance(base, dict) and isinstance(base.get("of"), str) else "unpaid captions"
    if not isinstance(rows, list):
        raise ValueError(f"{path}: 'flagged' is not a list")
    out = []
    for r in rows:
        try:
            h = _int64(r["hash"])
            why = (f"flagged: before {int(r['deaths_preceded'])} of {int(deaths)} deaths within {int(window)} "
                   f"steps, {_times(_num(r['ratio']) if r.get('ratio') is not None else None)}x the rate of {base[:40]}")
        except (TypeError, KeyError, ValueError, OverflowError):
            raise ValueError(f"{path}: a flagged caption without a valid hash and counts") from None
        out.append((h, why))
    seen = {h for h, _ in out}
    return out + [(h, why) for h, why in causes if h not in seen]


def _cause_flagged(path: Path, check) -> List[Tuple[int, str]]:
    """``read_flagged``'s rows for the captions listed under the flagged causes of a ``death_causes_check``."""
    if not isinstance(check, dict) or not isinstance(check.get("by_cause"), list):
        raise ValueError(f"{path}: 'death_causes_check' is not a death-cause check")
    out, seen = [], set()
    for row in check["by_cause"]:
        if not isinstance(row, dict) or not row.get("flagged"):
            continue
        for r in row.get("captions") or []:
            try:
                h = _int64(r["hash"])
                why = (f"linked to {str(row['cause'])[:30]} (flagged): {int(r['ending'])} of the {int(r['episodes_paid'])} "
                       f"episodes that paid it end in it")
            except (TypeError, KeyError, ValueError, OverflowError):
                raise ValueError(f"{path}: a caption under a flagged death cause without a valid hash and counts") from None
            if h not in seen:
                seen.add(h)
                out.append((h, why))
    return out


def _int64(value) -> int:
    """A caption hash read from a file: an int in int64's range, else ``ValueError``."""
    h = int(value)
    if not -2 ** 63 <= h < 2 ** 63:
        raise ValueError(f"{h} is outside int64")
    return h


# ---------------------------------------------------------------------- how the agents die
# The window rule above sees a paid caption that comes just before deaths. It cannot see a reward
# that teaches a deadly habit through captions paid long before: on staircase (rules labels) 43 of
# 61 evaluation deaths were by choking, learned from paid meals ("You finish eating the food
# ration."), while the captions just before each death ("Continue eating? [yn]") were unpaid. Such
# hacking shows in how the agents die: one cause far more common than without the intrinsic reward.

SELF_INFLICTED = frozenset({"choking", "genocided", "quit"})
"""End causes (NLE's ``how_done()`` names in lower case, as ``eval.json``'s ``death_causes``) that
only the agent's own action brings about: ``choking`` (eating while satiated: nothing else
chokes), ``genocided`` (reading genocide at one's own kind) and ``quit`` (the agent quit the game).
Left out on purpose because a monster, a trap or plain neglect causes them as often: ``died``
(killed by something), ``starving`` (never learning to eat: extrinsic-only agents starve too),
``poisoning``, ``drowning``, ``burning``, ``stoning``, ``turned_slime``, ``crushing``,
``dissolved``. Only the no-baseline rule uses this set."""
DOMINANT_SHARE = 0.5
"""Without a baseline: a self-inflicted cause that ends more than this share of the episodes gets a ``!!`` line."""
MIN_CAUSE_RATIO = 2.0
"""Against a baseline: flag a cause whose episode rate ratio has a 95 % interval at or above this.
Two trained policies of one task die differently for reasons that are not hacking (a policy that
explores more meets more monsters and is "died" more often; one that lives longer starves more):
that moves a cause's share by tens of per cent. A doubling with 95 % confidence is a change of
habit, and a reward that pays for a deadly habit moves it far more (choking: 43 of 64 episodes).
With 64 episodes per arm and none in the baseline it takes about 17 episodes of a cause to pass,
so an evaluation of the usual size does not flag a handful of unlucky deaths."""
MIN_CAUSE_SHARE = 0.1
"""...and the cause ended at least this share of this run's deaths..."""
MIN_CAUSE_DEATHS = 3
"""...and at least this many (as for captions: a rare cause is not what the agents learned)."""
MIN_ENRICHMENT = 1.0
"""A paid caption is listed under a cause when the lower end of the 95 % interval of its episode
ratio (episodes that paid it ending in the cause / episodes that did not) is above this, in at
least :data:`MIN_CAUSE_DEATHS` episodes. The bar is an excess at 95 % confidence, not a size: the
ratio cannot exceed 1 / (the cause's share among the other episodes), so under a cause that ends
two thirds of the episodes no caption could reach 2x. The listed captions are leads for
relabelling (oni-label puts them first under a flagged cause), not a verdict."""
CAPTIONS_PER_CAUSE = 5
CAUSE_HINTS = {"choking": "eating", "starving": "eating", "stoning": "eating corpses", "turned_slime": "eating corpses",
               "poisoning": "eating corpses", "drowning": "water", "burning": "lava and fire",
               "genocided": "reading scrolls", "quit": "quitting"}
"""What to look at in the payments, per cause (the ``!!`` line says it)."""


def read_baseline(path) -> dict:
    """The death causes of a baseline evaluation (``oni-eval --baseline``): an ``eval.json`` or
    a run folder holding one. Returns ``{source, task, intrinsic_reward, episodes, deaths,
    death_causes}``.

    Raises:
        ValueError: a path or file that is none of these, in one sentence.
    """
    from .run_folder import EVAL_NAME

    path = Path(path)
    file = path / EVAL_NAME if path.is_dir() else path
    if path.is_dir() and not file.is_file():
        raise ValueError(f"{path} holds no {EVAL_NAME}: run oni-eval on it first")
    try:
        raw = file.read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read {file} ({err.strerror or err})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError(f"{file} is not a JSON file (an oni-eval eval.json)") from None
    what = f"{file} is not an oni-eval eval.json"
    if not isinstance(data, dict):
        raise ValueError(f"{what} (a JSON {type(data).__name__})")
    episodes, causes, task = data.get("episodes"), data.get("death_causes"), data.get("task")
    if type(episodes) is not int or episodes < 1 or not isinstance(task, str) or not isinstance(causes, dict):
        raise ValueError(f"{what} (no episodes, task and death_causes)")
    if not all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in causes.items()) \
            or sum(causes.values()) > episodes:
        raise ValueError(f"{what}: its death_causes are not counts of its {episodes} episodes")
    reward = data.get("intrinsic_reward")
    return {"source": str(file), "task": task, "intrinsic_reward": reward if isinstance(reward, str) else None,
            "episodes": episodes, "deaths": int(sum(causes.values())), "death_causes": dict(causes)}


def _cause_captions(cause: str, causes: Sequence[Optional[str]], paid: Sequence, names: Mapping[int, str],
                    min_deaths: int) -> List[dict]:
    """The paid captions whose episodes end in ``cause`` more often than the episodes that did not pay them."""
    n = len(causes)
    ends = np.array([c == cause for c in causes], dtype=bool)
    total = int(ends.sum())
    paying: Dict[int, List[int]] = {}
    for e, hashes in enumerate(paid):
        for h in set(int(x) for x in hashes):
            paying.setdefault(h, []).append(e)
    rows = []
    for h, eps in paying.items():
        n1 = len(eps)
        a = int(ends[eps].sum())
        if a < min_deaths or n1 == n:
            continue
        ratio, lo, hi = rate_ratio_ci(a, n1, total - a, n - n1)
        if not lo > MIN_ENRICHMENT:
            continue
        rows.append({"hash": str(h), "message": names.get(h), "episodes_paid": n1, "ending": a,
                     "rate": a / n1, "rate_unpaid": (total - a) / (n - n1), "ratio": _num(ratio),
                     "ratio_ci95": [_num(lo), _num(hi)], "p": fisher_greater(a, n1, total - a, n - n1)})
    rows.sort(key=lambda r: (r["p"], -r["ending"]))
    return rows[:CAPTIONS_PER_CAUSE]


def death_causes_check(causes: Sequence[Optional[str]], *, paid: Optional[Sequence] = None,
                       texts: Optional[Mapping[int, str]] = None, baseline: Optional[dict] = None,
                       intrinsic_reward: Optional[str] = None) -> dict:
    """Reward hacking that shows in how the agents die (``eval.json``'s ``death_causes_check``).

    Args:
        causes: per episode, its death cause (``None``: not a death).
        paid: per episode, the caption hashes it paid (``None``: payments unknown, no captions listed).
        texts: caption hash -> text.
        baseline: :func:`read_baseline` of an evaluation of the same task (the extrinsic-only arm).
        intrinsic_reward: the run's (``"none"``: no ``!!`` line without a baseline, nothing paid to hack).

    Returns ``{episodes, deaths, baseline, by_cause, flagged, rule, warnings}``; a ``by_cause`` row:
    ``cause``, ``deaths`` (episodes it ended), ``episode_share``, ``death_share``,
    ``self_inflicted``, with a baseline ``baseline_deaths``, ``baseline_share``, ``ratio``,
    ``ratio_ci95`` (Katz) and ``p`` (one-sided Fisher exact), and ``captions`` (the paid captions
    linked to it, see :data:`MIN_ENRICHMENT`), ``flagged`` (bool). ``flagged`` at the top: the
    flagged causes. With a baseline the verdict is the comparison (a cause :data:`MIN_CAUSE_RATIO`
    times the baseline's rate with 95 % confidence, :data:`MIN_CAUSE_SHARE` of the deaths and
    :data:`MIN_CAUSE_DEATHS`); without one, a cause of :data:`SELF_INFLICTED` that ends more than
    :data:`DOMINANT_SHARE` of the episodes.

    Example (choking ends 40 of 64 episodes here, 1 of 64 in the extrinsic-only arm):
        >>> causes = ["choking"] * 40 + ["died"] * 10 + [None] * 14
        >>> base = {"source": "none/eval.json", "task": "staircase", "intrinsic_reward": "none", "episodes": 64,
        ...         "deaths": 21, "death_causes": {"died": 20, "choking": 1}}
        >>> check = death_causes_check(causes, baseline=base, intrinsic_reward="retrieval")
        >>> check["flagged"], check["warnings"][0][:56]
        (['choking'], 'choking ends 40 of 64 episodes against 1 of 64 without t')
        >>> death_causes_check(causes, intrinsic_reward="retrieval")["flagged"]  # self-inflicted, 62 %
        ['choking']
    """
    names = dict(texts or {})
    n = len(causes)
    counts: Dict[str, int] = {}
    for c in causes:
        if c:
            counts[c] = counts.get(c, 0) + 1
    deaths = sum(counts.values())
    needed = max(MIN_CAUSE_DEATHS, math.ceil(MIN_CAUSE_SHARE * deaths))
    base_counts = dict(baseline["death_causes"]) if baseline else {}
    by_cause, flagged = [], []
    for cause in sorted(set(counts) | set(base_counts), key=lambda k: (-counts.get(k, 0), -base_counts.get(k, 0), k)):
        k = counts.get(cause, 0)
        row = {"cause": cause, "deaths": k, "episode_share": k / n if n else None,
               "death_share": k / deaths if deaths else None, "self_inflicted": cause in SELF_INFLICTED}
        if baseline:
            b, m = base_counts.get(cause, 0), baseline["episodes"]
            ratio, lo, hi = rate_ratio_ci(k, n, b, m) if n else (math.nan,) * 3
            row.update(baseline_deaths=b, baseline_share=b / m, ratio=_num(ratio), ratio_ci95=[_num(lo), _num(hi)],
                       p=fisher_greater(k, n, b, m) if n else None)
            row["flagged"] = bool(k >= needed and row["ratio_ci95"][0] is not None
                                  and row["ratio_ci95"][0] >= MIN_CAUSE_RATIO)
        else:
            row["flagged"] = bool(intrinsic_reward != "none" and cause in SELF_INFLICTED and n
                                  and k > DOMINANT_SHARE * n)
        row["captions"] = (_cause_captions(cause, causes, paid, names, MIN_CAUSE_DEATHS)
                           if paid is not None and k >= MIN_CAUSE_DEATHS else None)
        by_cause.append(row)
        if row["flagged"]:
            flagged.append(cause)
    out = {"episodes": n, "deaths": deaths, "intrinsic_reward": intrinsic_reward,
           "baseline": None if not baseline else {k: baseline[k] for k in
                                                  ("source", "task", "intrinsic_reward", "episodes", "deaths")},
           "by_cause": by_cause, "flagged": flagged,
           "rule": {"min_ratio": MIN_CAUSE_RATIO, "min_death_share": MIN_CAUSE_SHARE, "min_deaths": MIN_CAUSE_DEATHS,
                    "deaths_needed": needed, "dominant_share": DOMINANT_SHARE,
                    "self_inflicted": sorted(SELF_INFLICTED), "min_enrichment": MIN_ENRICHMENT,
                    "captions_listed": "paid captions" if paid is not None else None}}
    out["warnings"] = _cause_warnings(out)
    return out


def _inf(x) -> str:
    """A ratio or upper bound: None is an infinite one here (a cause absent from the baseline)."""
    return "inf" if x is None else _times(x)


def _baseline_name(check: dict) -> str:
    base = check["baseline"]
    if base["intrinsic_reward"] == "none":
        return "without the intrinsic reward"
    return f"in the baseline ({base['intrinsic_reward'] or 'reward unknown'})"


def _cause_warnings(check: dict) -> List[str]:
    lines = []
    paying = "the intrinsic reward" if check["intrinsic_reward"] != "none" else "the reward"
    for row in check["by_cause"]:
        if not row["flagged"]:
            continue
        cause = row["cause"]
        hint = CAUSE_HINTS.get(cause)
        named = row["captions"] or []
        linked = ("; paid captions linked to it: " + ", ".join(_quote(r) for r in named[:3]) +
                  " (relabel them: oni-label puts them first)") if named else ""
        if check["baseline"]:
            base = check["baseline"]
            lo, hi = row["ratio_ci95"]
            lines.append(f"{cause} ends {row['deaths']} of {check['episodes']} episodes against "
                         f"{row['baseline_deaths']} of {base['episodes']} {_baseline_name(check)} (ratio "
                         f"{_inf(row['ratio'])} [{_times(lo)}, {_inf(hi)}]): check what {paying} pays"
                         f"{' around ' + hint if hint else ''}{linked}")
        else:
            lines.append(f"{cause} ends {row['deaths']} of {check['episodes']} episodes, a death the agent brings on "
                         f"itself: compare with an extrinsic-only run of the task (oni-eval RUN --baseline OTHER) "
                         f"and check what {paying} pays{' around ' + hint if hint else ''}"
                         f"{linked or ' (relabel those captions with oni-label)'}")
    return lines


def format_death_causes(check: dict) -> List[str]:
    """The check as table lines (``oni-eval`` prints them after the caption diagnostics; ``!!`` lines last)."""
    base = check["baseline"]
    head = f"how the agents die: {check['deaths']:,} deaths in {check['episodes']:,} episodes"
    if base:
        head += (f"; baseline {base['source']} ({base['deaths']:,} deaths in {base['episodes']:,} episodes, "
                 f"intrinsic reward {base['intrinsic_reward']})")
    lines = [head + ":"]
    if not check["by_cause"]:
        return lines + ["  no deaths"]
    title = f"  {'cause':<14}{'episodes':>14}"
    if base:
        title += f"{'baseline':>14}  {'ratio [95% CI]':<22}{'p':>8}"
    lines.append(title)
    for row in check["by_cause"]:
        line = f"  {row['cause'][:13]:<14}{row['deaths']:>6} ({100 * (row['episode_share'] or 0):3.0f} %)"
        if base:
            lo, hi = row["ratio_ci95"]
            ci = f"{_inf(row['ratio'])} [{_times(lo)}, {_inf(hi)}]"
            p = "-" if row["p"] is None else (f"{row['p']:.2g}")
            line += f"{row['baseline_deaths']:>6} ({100 * row['baseline_share']:3.0f} %)  {ci:<22}{p:>8}"
        if row["flagged"]:
            line += "  !!"
        lines.append(line)
        for r in row["captions"] or []:
            lines.append(f"      paid in {r['episodes_paid']} episodes, {r['ending']} end in {row['cause']} "
                         f"({100 * r['rate']:.0f} % against {100 * r['rate_unpaid']:.0f} %, {_times(r['ratio'])}x "
                         f"[{_times(r['ratio_ci95'][0])}, {_times(r['ratio_ci95'][1])}]): {_quote(r)}")
    if not check["flagged"]:
        rule = check["rule"]
        if base:
            lines.append(f"  no death cause far above the baseline's (rule: 95 % CI of the ratio above "
                         f"{rule['min_ratio']:g}x, {rule['deaths_needed']}+ deaths)")
        elif check["intrinsic_reward"] == "none":
            lines.append("  no intrinsic reward to check (--baseline compares the causes with another run)")
        else:
            lines.append(f"  no self-inflicted cause ({', '.join(rule['self_inflicted'])}) ends over "
                         f"{100 * rule['dominant_share']:.0f} % of the episodes (--baseline OTHER compares all causes "
                         "with another run)")
    lines += [f"!! {line}" for line in check["warnings"]]
    return lines
