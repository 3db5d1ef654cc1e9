"""Captions/s and accuracy of the embedded OpenAI-compatible server, by yes/no logprob scoring.

For each batch size (prompts per ``/v1/completions`` request) the benchmark sends requests for a
share of ``--seconds`` and counts scored captions. The scripted server (keyword rules, no model)
is measured in the same run as the baseline: its captions/s is the cost of HTTP + JSON + the
client alone, so ``model / scripted`` is the share of time the model itself takes.
Accuracy (threshold 0.5 on P(yes)/(P(yes)+P(no))) and AUC are measured on a built-in set of 40
hand-labelled NetHack messages (20 progress, 20 not).

The second part, the collector's frames/s with annotation on vs off, is left to
:func:`collector_overhead` (to be written with the training loop).

Usage::

    python benchmarks/annotation_throughput.py --seconds 60 --model smollm2 --threads 2

The last line of stdout is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import aiohttp

# (message, shows progress?) — our own labels for the default goal (score: kill, gold, descend).
LABELLED: Tuple[Tuple[str, bool], ...] = (
    ("You kill the newt!", True),
    ("You kill the jackal!", True),
    ("You destroy the kobold zombie!", True),
    ("Welcome to experience level 2.", True),
    ("Welcome to experience level 5.", True),
    ("You see here 23 gold pieces.", True),
    ("$ - 41 gold pieces.", True),
    ("There is a staircase down here.", True),
    ("You climb down the stairs.", True),
    ("You find a hidden passage.", True),
    ("You find a hidden door.", True),
    ("You feel much better.", True),
    ("You feel strong!", True),
    ("You hear someone counting money.", True),
    ("You kill the grid bug!", True),
    ("You finish eating the food ration.", True),
    ("You kill the sewer rat!", True),
    ("g - a blessed +2 long sword.", True),
    ("You feel more confident in your weapon skills.", True),
    ("You see here a wand.", True),
    ("It's a wall.", False),
    ("It's solid stone.", False),
    ("Never mind.", False),
    ("That door is closed.", False),
    ("You miss the jackal.", False),
    ("The jackal bites!", False),
    ("The newt bites!", False),
    ("You are beginning to feel hungry.", False),
    ("You can't move diagonally out of an intact doorway.", False),
    ("Unknown command ' '.", False),
    ("What do you want to eat? [abc or ?*]", False),
    ("You die...", False),
    ("The door is locked.", False),
    ("You are beginning to feel weak.", False),
    ("You hear the splashing of a naiad.", False),
    ("There is a doorway here.", False),
    ("You stop. Your kitten is in the way.", False),
    ("The kitten misses the newt.", False),
    ("This door is locked.", False),
    ("You faint from lack of food.", False),
)


def short_prompt(message: str) -> str:
    """The one-token question; prompts.py's wording when available, else our own few-shot."""
    try:
        from torchrl_oni.annotators.prompts import render_text, short_messages

        return render_text(short_messages(message), style="plain")
    except ImportError:  # pragma: no cover - the annotators package is written separately
        return ("Does this NetHack message show progress? Answer yes or no.\n"
                "Message: You kill the jackal!\nProgress: yes\n"
                "Message: It's a wall.\nProgress: no\n"
                f"Message: {message}\nProgress:")


def p_yes(top: Dict[str, float]) -> Optional[float]:
    """P(yes) / (P(yes) + P(no)) from one position's top logprobs; ``None`` if neither is there."""
    yes = sum(math.exp(v) for t, v in top.items() if t.strip().lower() == "yes")
    no = sum(math.exp(v) for t, v in top.items() if t.strip().lower() == "no")
    return yes / (yes + no) if yes + no > 0 else None


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / max(1, len(pos) * len(neg))


async def _score(session, url: str, model: str, messages: Sequence[str]) -> List[Optional[float]]:
    body = {"model": model, "prompt": [short_prompt(m) for m in messages], "max_tokens": 1,
            "logprobs": 5, "temperature": 0}
    async with session.post(url + "/completions", json=body) as resp:
        out = await resp.json()
    if resp.status != 200:
        raise RuntimeError(f"server answered {resp.status}: {out}")
    choices = sorted(out["choices"], key=lambda c: c["index"])
    return [p_yes((c["logprobs"]["top_logprobs"] or [{}])[0]) for c in choices]


async def _throughput(url: str, model: str, batch: int, seconds: float) -> Tuple[float, int]:
    """Captions/s with one request of ``batch`` prompts in flight at a time."""
    messages = [m for m, _ in LABELLED]
    done, i = 0, 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await _score(session, url, model, messages[:1])  # warm-up (prefix cache, threads)
        start = time.perf_counter()
        while True:
            chunk = [messages[(i + k) % len(messages)] for k in range(batch)]
            i += batch
            await _score(session, url, model, chunk)
            done += batch
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return done / elapsed, done


async def _accuracy(url: str, model: str) -> Dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        scores = await _score(session, url, model, [m for m, _ in LABELLED])
    labels = [y for _, y in LABELLED]
    filled = [0.5 if s is None else s for s in scores]
    acc = sum((s > 0.5) == y for s, y in zip(filled, labels)) / len(labels)
    return {"accuracy": acc, "auc": auc(filled, labels),
            "unscored": sum(s is None for s in scores), "predicted_positive_rate":
            sum(s > 0.5 for s in filled) / len(filled)}


def collector_overhead(args) -> Optional[dict]:
    """TODO(lead): frames/s of the collector with annotation on vs off (ratio in the same run).

    To be added with the training loop: run the collector for a share of ``args.seconds`` with
    the annotation transform off, then on against (a) the scripted server (client-side cost, as
    on a GPU node) and (b) the embedded model on the same cores (what a laptop user sees).
    Return a dict merged into the JSON line, or ``None`` to skip.
    """
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="total time budget")
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="packaged model (e.g. smollm2, qwen)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the model")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--batches", default="1,8,32,100", help="prompts per request")
    parser.add_argument("--no-accuracy", action="store_true")
    args = parser.parse_args(argv)

    from torchrl_oni.serve.embedded import start_embedded_server
    from torchrl_oni.serve.models import ModelNotInstalledError

    batches = [int(b) for b in args.batches.split(",")]
    # Scripted baseline gets a tenth of the time: it only measures HTTP + client cost.
    base_share = args.seconds * 0.1 / len(batches)
    model_share = args.seconds * 0.9 / len(batches)

    baseline = {}
    with start_embedded_server(backend="scripted", port=0) as srv:
        for b in batches:
            baseline[b], _ = asyncio.run(_throughput(srv.url, srv.model, b, base_share))

    t0 = time.perf_counter()
    try:
        srv = start_embedded_server(args.model, port=0, threads=args.threads, dtype=args.dtype)
    except (ValueError, ModelNotInstalledError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    startup_s = time.perf_counter() - t0
    loaded = srv.server.engine.loaded
    result = {"model": loaded.spec.name, "dtype": loaded.dtype, "threads": args.threads,
              "load_s": round(loaded.load_seconds, 2), "startup_s": round(startup_s, 2),
              "from_cache": loaded.from_cache}
    rates = {}
    with srv:
        if not args.no_accuracy:
            result.update({k: round(v, 3) for k, v in asyncio.run(_accuracy(srv.url, srv.model)).items()})
        for b in batches:
            rates[b], _ = asyncio.run(_throughput(srv.url, srv.model, b, model_share))
        cache = srv.server.engine.prefix_cache
        result["prefix_cache_hits"] = cache.hits
    result["rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    result["captions_per_s"] = {str(b): round(r, 2) for b, r in rates.items()}
    result["scripted_captions_per_s"] = {str(b): round(r, 1) for b, r in baseline.items()}
    result["model_time_share"] = {str(b): round(1 - rates[b] / baseline[b], 4) for b in batches}
    extra = collector_overhead(args)
    if extra:
        result.update(extra)

    print(f"model {result['model']} ({result['dtype']}, {args.threads} threads): load "
          f"{result['load_s']} s (from cache: {result['from_cache']}), peak RSS {result['rss_mb']} MB")
    if "accuracy" in result:
        print(f"accuracy {result['accuracy']:.3f}  AUC {result['auc']:.3f}  on {len(LABELLED)} "
              f"labelled messages (predicted positive {result['predicted_positive_rate']:.2f})")
    print(f"{'batch':>6} {'captions/s':>11} {'scripted/s':>11} {'model share':>12}")
    for b in batches:
        print(f"{b:>6} {rates[b]:>11.2f} {baseline[b]:>11.1f} {result['model_time_share'][str(b)]:>12.1%}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
