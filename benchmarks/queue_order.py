"""Which captions should the judge label first? The caption store's claim orders, in simulated time.

A deterministic simulation (no model, no environment, no wall clock): the real
:class:`~torchrl_oni.store.CaptionStore` is fed a stream of caption sightings (``add``) and
emptied by a judge of fixed throughput (``claim`` a batch, ``set_labels`` it ``batch / rate``
seconds later, then claim the next: one request at a time, as the embedded CPU server answers
them). Only the order in which ``claim`` hands out unseen captions changes from policy to policy;
the stream is the same for all.

**The stream** is a real run's: each sighting is a caption of the labels file (default the shipped
``staircase-lvl3`` file: 6,876 captions and their sightings in two 3M-frame runs), drawn with
probability proportional to its ``seen``, at ``--fps`` frames/s and one sighting every
``--steps-per-sighting`` frames (a Poisson number per ``--tick``). Calibration: README's main
command (``oni-train --intrinsic-reward retrieval``, 300k frames) beside a CPU hog saw 634, 946,
1,791 and 2,842 distinct captions after 14, 27, 71 and 155 s at 1,940 frames/s (BENCHMARKS.md,
"Faults"); one sighting every 2 frames gives 677, 1,003, 1,738 and 2,618 at that frame rate, and
at 2,900 frames/s over 150 s new distinct captions arrive at 20.6/s on average (32/s in the
first minute; printed), the ~21/s measured. Arrivals slow down as the run goes on (a real run's
do too; here the file's pool also runs out), so a longer ``--seconds`` under-states the backlog.
``--late-approved``: each approved caption (label 1 in the file) first appears at a random time
in the first half of the run, then at the rate that keeps its expected sightings: progress the
agent learns during the run rather than progress it always makes.

**The judge**: ``--rates`` labels/s (default 6, the embedded Qwen 0.5B beside training, and 12
and 24), ``--batch`` captions a claim (the annotation worker's request; default 32).

**The policies** (``--policies``): the store's claim orders ``most_seen`` (most sightings; ties
oldest first), ``oldest`` (first seen first) and ``seen_rate`` (most sightings per caption first
seen since, with a prior of :data:`~torchrl_oni.store.captions.SEEN_RATE_PRIOR` captions:
``oni-train``'s default); and, for comparison only, ``seen_rate_N`` (another prior),
``newest`` (last seen first), ``mixed`` (every 4th caption handed out the newest unseen one, the
others the most seen; ``mixed_1/N``: every N-th) and ``mixed_oldest`` (every 4th the oldest).

**Per policy**: ``steps``, the share of sightings whose caption was labelled at that moment (the
steps ONI-Retrieval pays for or not), over the run and over its last tenth (``steps end``);
``approved steps``, the same over the sightings of approved captions (the intrinsic reward
actually paid, against a judge answering at once); ``captions``, distinct captions seen and
labelled at the end; for **rare** captions (seen at most ``--rare`` = 10 times in the run) and
the approved ones among them: the share ever labelled, the share labelled within ``--soon`` =
30 s of their first sighting, and the median and 90th percentile time from first sighting to
label of those labelled (null where none was). A table, then one JSON line.

**What it showed** (2026-11-28, 150 s, seed 0): ``seen_rate`` keeps the steps within 0.3 points
of ``most_seen`` at 6, 12 and 24 labels/s and cuts rare captions' median wait from 86 to 44 s at
6 labels/s (7 % labelled within 30 s instead of 0.1 %) and from 48 to 4 s at 12. It pays 0.9-1.5
points fewer approved steps when nothing changes over the run (1.5-1.6 at 6 labels/s with seeds
1 and 2; 0.7-2.0 over 300 s), and 2.8-7.5 more with ``--late-approved`` (0.5-5.7 over 300 s).
When the judge nearly keeps up (24 labels/s) its slowest rare labels come later (p90 75 s instead
of 30: a caption not seen again sinks as it ages). ``mixed`` is dominated by it (6 labels/s:
steps -0.6, approved steps -4.6, median wait 77 s).

Usage::

    python benchmarks/queue_order.py                    # 150 s at 2,900 frames/s; judges of 6, 12, 24 labels/s
    python benchmarks/queue_order.py --seconds 300 --late-approved --policies most_seen seen_rate mixed
"""
from __future__ import annotations

import json
import os
import sys
from typing import Callable, Dict, List, Optional

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torchrl_oni.annotators.base import Provenance  # noqa: E402
from torchrl_oni.captions import CAPTION_HASH_KEY, MESSAGE_KEY  # noqa: E402
from torchrl_oni.cli_errors import OneLineArgumentParser, report  # noqa: E402
from torchrl_oni.store import CaptionStore  # noqa: E402
from torchrl_oni.store.captions import CLAIM_ORDERS, _most_seen_first, _seen_rate_first  # noqa: E402
from torchrl_oni.store.labels_file import read_labels  # noqa: E402

PROG = "queue_order.py"
LABELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "labels",
                      "staircase-lvl3_qwen2.5-coder-0.5b.jsonl.gz")
POLICIES = ("most_seen", "oldest", "seen_rate", "newest", "mixed", "mixed_oldest", "seen_rate_250", "seen_rate_2000")
JUDGE = Provenance("simulated", "queue_order")


# ------------------------------------------------------------------------------------ the policies
def mixed_first(cand: np.ndarray, seen: np.ndarray, k: int, handed: int, every: int = 4,
                newest: bool = True) -> np.ndarray:
    """A benchmark-only order: counting every caption handed out (``handed`` before this call),
    each ``every``-th is the newest candidate left (``newest=False``: the oldest); the others are
    the most seen of the rest. ``every=1``: newest first."""
    k = min(max(int(k), 0), len(cand))
    fresh = np.arange(handed, handed + k) % every == every - 1
    m = int(fresh.sum())
    if newest:
        ends, rest = cand[len(cand) - m:][::-1], slice(None, len(cand) - m)
    else:
        ends, rest = cand[:m], slice(m, None)
    out = np.empty(k, dtype=cand.dtype)
    out[fresh] = ends
    out[~fresh] = _most_seen_first(cand[rest], seen[rest], k - m)
    return out


def _ranking(policy: str) -> Optional[Callable[..., np.ndarray]]:
    """How a policy that is not one of the store's claim orders ranks the claimable slots:
    ``(cand ascending, times_seen, k, store size, captions handed out so far) -> the k handed
    out, in order``; None for the store's own (:data:`~torchrl_oni.store.CLAIM_ORDERS`)."""
    if policy in CLAIM_ORDERS:
        return None
    number = policy.rsplit("_", 1)[-1].replace("1/", "", 1)
    every, newest = {"newest": (1, True), "mixed": (4, True), "mixed_oldest": (4, False)}.get(policy, (0, True))
    if policy.startswith("mixed_1/") and number.isdigit():
        every = int(number)
    if every >= 1:
        return lambda cand, seen, k, size, handed: mixed_first(cand, seen, k, handed, every, newest)
    if policy.startswith("seen_rate_") and number.isdigit():
        return lambda cand, seen, k, size, handed: _seen_rate_first(cand, seen, size, k, prior=int(number))
    raise ValueError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)}, mixed_1/N, seen_rate_N)")


class _PolicyStore(CaptionStore):
    """The real store, its claim order replaced by a benchmark-only ranking."""

    def __init__(self, rank, **kwargs):
        super().__init__(**kwargs)
        self._rank = rank
        self._handed = 0

    def _claim_first(self, cand: np.ndarray, k: int) -> np.ndarray:
        out = self._rank(cand, self._captions.cols["times_seen"][cand], k, self._captions.size, self._handed)
        self._handed += len(out)
        return out


def make_store(policy: str, capacity: int) -> CaptionStore:
    rank = _ranking(policy)
    if rank is None:
        return CaptionStore(capacity=capacity, claim_order=policy)
    return _PolicyStore(rank, capacity=capacity)


# ------------------------------------------------------------------------------------ the stream
def load_pool(path: str) -> Dict[str, np.ndarray]:
    """The labels file's captions: ``messages``, ``hashes``, ``seen`` (sightings), ``approved``."""
    state = read_labels(path).state_dict()["captions"]
    return {"messages": state[MESSAGE_KEY].numpy(), "hashes": state[CAPTION_HASH_KEY].numpy(),
            "seen": state["times_seen"].numpy().astype(np.float64), "approved": state["label"].numpy() >= 0.5}


def make_stream(pool: Dict[str, np.ndarray], seconds: float, fps: float, steps_per_sighting: float,
                tick: float, seed: int, late_approved: bool = False) -> List[tuple]:
    """Per tick: ``(caption indices, their sighting counts)``; the same for every policy.

    With ``late_approved``, each approved caption is first possible at a uniform random time in
    the first half of the run, and seen from then on at the rate that keeps its expected
    sightings (progress the agent learns during the run, rather than progress it always makes).
    """
    rng = np.random.default_rng(seed)
    weight = pool["seen"].copy()
    onset = np.zeros(len(weight))
    if late_approved:
        late = pool["approved"]
        onset[late] = rng.uniform(0.0, seconds / 2, int(late.sum()))
        weight[late] *= seconds / (seconds - onset[late])
    per_weight = fps * tick / steps_per_sighting / pool["seen"].sum()  # sightings per tick per unit weight
    out = []
    for step in range(int(round(seconds / tick))):
        w = np.where(onset <= step * tick, weight, 0.0)
        counts = rng.multinomial(rng.poisson(per_weight * w.sum()), w / w.sum())
        idx = np.flatnonzero(counts)
        out.append((idx, counts[idx]))
    return out


# ------------------------------------------------------------------------------------ the run
def simulate(policy: str, pool: Dict[str, np.ndarray], stream: List[tuple], rate: float, batch: int,
             tick: float) -> Dict[str, np.ndarray]:
    """Feeds ``stream`` to a store claimed in ``policy``'s order by a judge of ``rate`` labels/s.

    Each tick: the judge's answers due by its end are written (a free judge claims its next batch
    at once, the time it answered), then the tick's sightings are looked up (labelled at that
    moment?) and added; an idle judge claims after them. Returns per caption ``first_seen``,
    ``labelled_at`` (s, NaN: never) and ``times`` (sightings), and per tick the ``covered``
    sightings, ``approved_covered`` and ``approved`` sightings.
    """
    n = len(pool["hashes"])
    store = make_store(policy, capacity=n)
    index = {h: i for i, h in enumerate(pool["hashes"].tolist())}
    first_seen = np.full(n, np.nan)
    labelled_at = np.full(n, np.nan)
    times = np.zeros(n, dtype=np.int64)
    covered, approved_covered, approved_seen = [], [], []
    asked = None  # the request the judge is answering: (time it answers, hashes)

    def claim(now: float):
        hashes, _ = store.claim(batch)
        return (now + len(hashes) / rate, hashes) if len(hashes) else None

    for step, (idx, counts) in enumerate(stream):
        now = (step + 1) * tick
        while asked is not None and asked[0] <= now:
            done, hashes = asked
            store.set_labels(hashes, 0.0, JUDGE)  # the label's value does not steer the queue
            labelled_at[[index[h] for h in hashes.tolist()]] = done
            asked = claim(done)  # the next request goes out as this one is answered
        sightings = np.repeat(idx, counts)
        found = store.lookup(pool["hashes"][sightings])[1].numpy()
        approved = pool["approved"][sightings]
        covered.append(int(found.sum()))
        approved_seen.append(int(approved.sum()))
        approved_covered.append(int((found & approved).sum()))
        store.add(pool["messages"][sightings], pool["hashes"][sightings])
        fresh = idx[np.isnan(first_seen[idx])]
        first_seen[fresh] = now
        times[idx] += counts
        if asked is None:
            asked = claim(now)
    return {"first_seen": first_seen, "labelled_at": labelled_at, "times": times,
            "covered": np.array(covered), "approved_covered": np.array(approved_covered),
            "approved_seen": np.array(approved_seen)}


def _wait_figures(wait: np.ndarray, soon: float, prefix: str) -> dict:
    """Share labelled, share labelled within ``soon`` s, median / p90 wait of those labelled."""
    done = wait[~np.isnan(wait)]
    n = len(wait)
    return {
        f"{prefix}": n,
        f"{prefix}_labelled": round(len(done) / n, 4) if n else None,
        f"{prefix}_soon": round(int((done <= soon).sum()) / n, 4) if n else None,
        f"{prefix}_median_s": round(float(np.median(done)), 1) if len(done) else None,
        f"{prefix}_p90_s": round(float(np.percentile(done, 90)), 1) if len(done) else None,
    }


def summarise(run: Dict[str, np.ndarray], pool: Dict[str, np.ndarray], stream: List[tuple], *, rare: int,
              soon: float) -> dict:
    sightings = np.array([int(c.sum()) for _, c in stream])
    end = slice(len(stream) - max(len(stream) // 10, 1), None)
    seen = run["times"] > 0
    wait = run["labelled_at"] - run["first_seen"]
    is_rare = seen & (run["times"] <= rare)
    share = lambda part, whole: round(float(part) / float(whole), 4) if whole else None  # noqa: E731
    out = {
        "steps": share(run["covered"].sum(), sightings.sum()),
        "steps_end": share(run["covered"][end].sum(), sightings[end].sum()),
        "approved_steps": share(run["approved_covered"].sum(), run["approved_seen"].sum()),
        "captions_seen": int(seen.sum()),
        "captions": share((~np.isnan(run["labelled_at"]) & seen).sum(), seen.sum()),
    }
    out.update(_wait_figures(wait[is_rare], soon, "rare"))
    out.update(_wait_figures(wait[is_rare & pool["approved"]], soon, "approved_rare"))
    return out


# ------------------------------------------------------------------------------------ the report
def _cell(value, percent: bool = False) -> str:
    if value is None:
        return "—"
    return f"{100 * value:.1f}" if percent else f"{value:g}"


def main(argv=None) -> int:
    parser = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--labels", default=LABELS, help="labels file whose captions and sightings make the stream")
    parser.add_argument("--seconds", type=float, default=150.0, help="simulated run length (README's run: ~150 s)")
    parser.add_argument("--fps", type=float, default=2900.0, help="frames per second of the simulated trainer")
    parser.add_argument("--steps-per-sighting", type=float, default=2.0,
                        help="frames per caption sighting (2: README's run's distinct-caption curve)")
    parser.add_argument("--rates", type=float, nargs="+", default=[6.0, 12.0, 24.0], help="judge labels/s")
    parser.add_argument("--batch", type=int, default=32, help="captions per claim (one request)")
    parser.add_argument("--tick", type=float, default=0.5, help="simulated seconds per step of the simulation")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), help="claim orders to compare")
    parser.add_argument("--rare", type=int, default=10, help="a rare caption is seen at most this often in the run")
    parser.add_argument("--soon", type=float, default=30.0, help="seconds after its first sighting a label is 'soon'")
    parser.add_argument("--late-approved", action="store_true",
                        help="approved captions first appear at a random time in the first half of the run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.rates) <= 0 or args.batch < 1 or args.tick <= 0 or args.seconds < args.tick or args.fps <= 0 \
            or args.steps_per_sighting <= 0:
        return report(PROG, "--rates, --batch, --tick, --fps, --steps-per-sighting must be positive and "
                            "--seconds at least one --tick")
    try:
        for policy in args.policies:
            _ranking(policy)
        pool = load_pool(args.labels)
    except (ValueError, FileNotFoundError) as err:
        return report(PROG, str(err))
    stream = make_stream(pool, args.seconds, args.fps, args.steps_per_sighting, args.tick, args.seed,
                         args.late_approved)
    first = np.zeros(len(pool["hashes"]), dtype=bool)
    arrivals = []
    for idx, _ in stream:
        arrivals.append(int((~first[idx]).sum()))
        first[idx] = True
    new_per_s = sum(arrivals) / args.seconds
    results = {}
    for rate in args.rates:
        for policy in args.policies:
            run = simulate(policy, pool, stream, rate, args.batch, args.tick)
            results[f"{rate:g}/{policy}"] = summarise(run, pool, stream, rare=args.rare, soon=args.soon)

    print(f"Claim orders, simulated: {args.seconds:g} s at {args.fps:g} frames/s, a sighting every "
          f"{args.steps_per_sighting:g} frames; {sum(arrivals):,} distinct captions ({new_per_s:.1f}/s; "
          f"{sum(arrivals[:int(60 / args.tick)]) / min(60.0, args.seconds):.1f}/s in the first minute), "
          f"judge batches of {args.batch}" + ("; approved captions appear late" if args.late_approved else ""))
    print("steps/approved steps: % labelled when seen; rare: seen <= "
          f"{args.rare} times; soon: labelled within {args.soon:g} s of the first sighting; waits: of those labelled")
    head = ["labels/s", "policy", "steps", "steps end", "approved steps", "captions", "rare", "rare labelled",
            "rare soon", "median s", "p90 s", "approved rare", "labelled", "soon", "median s", "p90 s"]
    rows = []
    for key, r in results.items():
        rate, policy = key.split("/", 1)
        rows.append([rate, policy, _cell(r["steps"], True), _cell(r["steps_end"], True),
                     _cell(r["approved_steps"], True), _cell(r["captions"], True), str(r["rare"]),
                     _cell(r["rare_labelled"], True), _cell(r["rare_soon"], True), _cell(r["rare_median_s"]),
                     _cell(r["rare_p90_s"]), str(r["approved_rare"]), _cell(r["approved_rare_labelled"], True),
                     _cell(r["approved_rare_soon"], True), _cell(r["approved_rare_median_s"]),
                     _cell(r["approved_rare_p90_s"])])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    print(json.dumps({
        "benchmark": "queue_order", "labels": os.path.basename(args.labels), "seconds": args.seconds,
        "fps": args.fps, "steps_per_sighting": args.steps_per_sighting, "batch": args.batch, "seed": args.seed,
        "late_approved": args.late_approved,
        "rare_at_most": args.rare, "soon_s": args.soon, "captions_seen": sum(arrivals),
        "new_captions_per_s": round(new_per_s, 2), "results": results,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
