"""README's main command beside a CPU hog, under several judge settings: frames/s against labels.

On a CPU-only machine the embedded judge and the trainer share the cores; this measures the trade
the judge settings make. Each configuration runs README's main command (``oni-train
--intrinsic-reward retrieval``, 300k frames, the embedded judge in its own process) plus its own
flags, while ``--hog-procs`` processes spin on a core each (the busy machine a user has), in
alternating rounds, and reads the run's last metrics row:

==========================  ==================================================================
column                      meaning
==========================  ==================================================================
frames/s                    the run's frames over its training time
steps labelled              share of the steps whose caption was labelled by the end
captions labelled           distinct captions labelled by the end, of those seen
labels/s                    labels over the training time
judge CPU                   the judge process's share of the run's CPU time
==========================  ==================================================================

The first configuration is the baseline; ``--baseline-code DIR`` runs it from another checkout
(``PYTHONPATH=DIR``: today's code), so ratios are same-run comparisons.

Usage::

    python benchmarks/judge_share.py --configs "today=" "int8=--embedded-dtype int8" \\
        --baseline-code /work/grid --rounds 1

The last line of stdout is one JSON object.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

README_COMMAND = ["--intrinsic-reward", "retrieval"]


def last_row(run: Path) -> Dict[str, float]:
    """The last metrics row of a run folder (floats; empty cells left out)."""
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: float(v) for k, v in rows[-1].items() if v not in ("", None)}


def run_once(flags: Sequence[str], frames: str, code: Optional[str], hogs: int, log: Path) -> dict:
    """One ``oni-train`` run beside ``hogs`` busy processes; its figures."""
    sys.path.insert(0, str(Path(__file__).parent))
    from annotation_faults import CpuHogs  # imports torch: not before the flags are checked

    env = dict(os.environ)
    if code:
        env["PYTHONPATH"] = code + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory(prefix="judge-share-") as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "torchrl_oni.train", *README_COMMAND, "--frames", frames,
               "--no-progress", "--logdir", str(run), *flags]
        start = time.perf_counter()
        with CpuHogs(hogs), open(log, "w") as out:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                  cwd=code or os.getcwd())
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}; see {log}")
        m = last_row(run)
    seen, labelled = m.get("labels/seen_captions", 0.0), m.get("labels/seen_labelled", 0.0)
    return {"fps": m["frames"] / m["time_s"], "steps_labelled": m.get("labels/seen_coverage", 0.0),
            "captions_labelled": int(labelled), "captions_seen": int(seen),
            "captions_share": labelled / seen if seen else 0.0,
            "labels_per_s": m.get("labels/labelled", 0.0) / m["time_s"],
            "judge_cpu_share": m.get("annotation/judge_cpu_share"), "wall_s": wall}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["default="],
                        help="NAME=FLAGS: oni-train flags added to README's command; the first is the baseline")
    parser.add_argument("--baseline-code", default=None,
                        help="run the first configuration from this checkout (today's code)")
    parser.add_argument("--frames", default="300k", help="frames per run (README's default: 300k)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of all configurations")
    parser.add_argument("--hog-procs", type=int, default=1, help="busy processes beside each run")
    parser.add_argument("--logs", default=None, help="folder for the runs' output (default: a temporary one)")
    args = parser.parse_args(argv)
    configs = {}
    for item in args.configs:
        name, sep, flags = item.partition("=")
        if not sep or not name:
            print(f"error: --configs takes NAME=FLAGS, got {item!r}", file=sys.stderr)
            return 2
        configs[name] = shlex.split(flags)
    if args.baseline_code and not (Path(args.baseline_code) / "torchrl_oni").is_dir():
        print(f"error: --baseline-code {args.baseline_code}: no torchrl_oni package there", file=sys.stderr)
        return 2
    logs = Path(args.logs or tempfile.mkdtemp(prefix="judge-share-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    results: Dict[str, List[dict]] = {name: [] for name in configs}
    baseline = next(iter(configs))
    for rnd in range(args.rounds):
        for name, flags in configs.items():
            code = args.baseline_code if name == baseline else None
            res = run_once(flags, args.frames, code, args.hog_procs, logs / f"{name}_{rnd}.log")
            results[name].append(res)
            print(f"[round {rnd + 1}] {name}: {res['fps']:,.0f} frames/s, {res['steps_labelled']:.1%} of steps "
                  f"and {res['captions_labelled']:,} of {res['captions_seen']:,} captions labelled", flush=True)

    def med(name, key):
        values = [r[key] for r in results[name] if r[key] is not None]
        return statistics.median(values) if values else None

    print(f"\nREADME's main command, {args.frames} frames, beside {args.hog_procs} busy process(es), "
          f"{args.rounds} round(s); medians")
    print(f"{'config':<12} {'frames/s':>9} {'vs base':>8} {'steps labelled':>15} {'captions labelled':>22} "
          f"{'labels/s':>9} {'judge CPU':>10}  flags")
    summary = {}
    for name, flags in configs.items():
        row = {k: med(name, k) for k in ("fps", "steps_labelled", "captions_share", "captions_labelled",
                                         "captions_seen", "labels_per_s", "judge_cpu_share")}
        row["fps_vs_baseline"] = row["fps"] / med(baseline, "fps")
        summary[name] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        share = "-" if row["judge_cpu_share"] is None else f"{row['judge_cpu_share']:.0%}"
        print(f"{name:<12} {row['fps']:>9,.0f} {row['fps_vs_baseline']:>8.2f} {row['steps_labelled']:>15.1%} "
              f"{row['captions_share']:>8.1%} ({row['captions_labelled']:,.0f}/{row['captions_seen']:,.0f})"
              f" {row['labels_per_s']:>9.1f} {share:>10}  {shlex.join(flags) or '(README)'}")
    print(json.dumps({"benchmark": "judge_share", "frames": args.frames, "hog_procs": args.hog_procs,
                      "rounds": args.rounds, "baseline": baseline, "baseline_code": args.baseline_code,
                      "configs": {n: shlex.join(f) for n, f in configs.items()}, "results": summary,
                      "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
