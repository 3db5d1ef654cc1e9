"""Captions/s and accuracy of the embedded OpenAI-compatible server, by yes/no logprob scoring.

For each batch size (prompts per ``/v1/completions`` request) the benchmark sends requests for a
share of ``--seconds`` and counts scored captions. The scripted server (keyword rules, no model)
is measured in the same run as the baseline: its captions/s is the cost of HTTP + JSON + the
client alone, so ``model / scripted`` is the share of time the model itself takes.
Accuracy (threshold 0.5 on P(yes)/(P(yes)+P(no))) and AUC are measured on a built-in set of 40
hand-labelled NetHack messages (20 progress, 20 not).

The second part, :func:`collector_overhead`, measures the collector's frames/s with
``LLMAnnotationTransform`` on vs off in the same run (``ratio`` = on/off).

Usage::

    python benchmarks/annotation_throughput.py --seconds 60 --model smollm2 --threads 2
    python benchmarks/annotation_throughput.py --llm-url http://gpu-node:8000/v1   # any server (vLLM)
    python benchmarks/annotation_throughput.py --model qwen --layout padded --compare-layout tree \
        --throughput-captions real_captions --max-tokens 2      # two paths, one run

With ``--llm-url`` the model rows measure that server (``--llm-model``: default the only model it
lists; ``--llm-api-key``: default ``OPENAI_API_KEY``) instead of starting the embedded one, and
``--laptop`` measures the collector with that server.

The last line of stdout is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import resource
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import aiohttp

from torchrl_oni.stats import auc

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


_HEADERS: Dict[str, str] = {}  # the API key's header, when there is one (set by main)


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), headers=_HEADERS)


# Tokens asked per caption: the score reads the first one; the annotator asks 2 (the label, then
# the end of the answer), which ``--max-tokens 2`` measures.
MAX_TOKENS = {"n": 1}


async def _score(session, url: str, model: str, messages: Sequence[str],
                 max_tokens: Optional[int] = None) -> List[Optional[float]]:
    body = {"model": model, "prompt": [short_prompt(m) for m in messages],
            "max_tokens": MAX_TOKENS["n"] if max_tokens is None else max_tokens,
            "logprobs": 5, "temperature": 0}
    async with session.post(url + "/completions", json=body) as resp:
        out = await resp.json()
    if resp.status != 200:
        raise RuntimeError(f"server answered {resp.status}: {out}")
    choices = sorted(out["choices"], key=lambda c: c["index"])
    return [p_yes((c["logprobs"]["top_logprobs"] or [{}])[0]) for c in choices]


async def _throughput(url: str, model: str, batch: int, seconds: float,
                      messages: Optional[Sequence[str]] = None) -> Tuple[float, int]:
    """Captions/s with one request of ``batch`` prompts in flight at a time, cycling through
    ``messages`` (default: the hand-labelled ones)."""
    messages = list(messages) if messages else [m for m, _ in LABELLED]
    done, i = 0, 0
    async with _session() as session:
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
    async with _session() as session:
        return accuracy_of(await _score(session, url, model, [m for m, _ in LABELLED]))


def accuracy_of(scores: Sequence[Optional[float]]) -> Dict[str, float]:
    """Accuracy (threshold 0.5), AUC and more of P(yes) scores of the LABELLED messages, in order."""
    labels = [y for _, y in LABELLED]
    filled = [0.5 if s is None else s for s in scores]
    acc = sum((s > 0.5) == y for s, y in zip(filled, labels)) / len(labels)
    return {"accuracy": acc, "auc": auc(filled, labels),
            "unscored": sum(s is None for s in scores), "predicted_positive_rate":
            sum(s > 0.5 for s in filled) / len(filled)}


def _collector_phases(url: str, model: str, seconds: float, rounds: int = 6) -> Tuple[float, float, dict]:
    """Collector frames/s with annotation off and on, in alternating phases of one collector."""
    import torch
    from torchrl.collectors import MultiAsyncCollector

    from torchrl_oni.annotation import LLMAnnotationTransform
    from torchrl_oni.annotators.openai import OpenAIAnnotator
    from torchrl_oni.store import CaptionStore
    from torchrl_oni.train.config import TrainConfig
    from torchrl_oni.train.env_factory import make_env_factory

    torch.set_num_threads(1)
    cfg = TrainConfig(workers=2, envs_per_worker=32, rollout=32)
    collector = MultiAsyncCollector([make_env_factory(cfg, w) for w in range(cfg.env.workers)], None,
                                    frames_per_batch=cfg.frames_per_batch, total_frames=-1,
                                    device="cpu", storing_device="cpu", num_sub_threads=1)
    store = CaptionStore(capacity=65536)
    annotator = OpenAIAnnotator(url, model, batch_size=100, prompt="short", use_logprobs=True,
                                api_key=_HEADERS.get("Authorization", "")[len("Bearer "):] or None)
    annotate = LLMAnnotationTransform(store, annotator, close_annotator=True)
    fps = {"off": [], "on": []}
    phase = seconds / (2 * rounds)
    it = iter(collector)
    next(it)  # start-up
    try:
        for _ in range(rounds):
            for mode in ("off", "on"):
                frames, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < phase:
                    batch = next(it)
                    if mode == "on":
                        batch = annotate(batch)
                    frames += batch.numel()
                fps[mode].append(frames / (time.perf_counter() - t0))
        metrics = annotate.metrics()
    finally:
        annotate.close()
        collector.shutdown()
    off = sorted(fps["off"])[len(fps["off"]) // 2]
    on = sorted(fps["on"])[len(fps["on"]) // 2]
    # the ratio is the median of per-round ratios: neighbouring phases share the machine's mood
    ratios = sorted(b / a for a, b in zip(fps["off"], fps["on"]))
    metrics["ratio_median"] = ratios[len(ratios) // 2]
    return off, on, metrics


def collector_overhead(args) -> Optional[dict]:
    """Collector frames/s with ``LLMAnnotationTransform`` on vs off, in the same run.

    Two workers × 32 games feed a ``MultiAsyncCollector``; the trainer applies the transform to
    each batch (its place: the collector deep-copies postprocs). Phases alternate off/on on one
    collector so start-up and machine noise hit both. The annotator is the real aiohttp client
    against the scripted server — the LLM's own compute is elsewhere, as with a GPU node — so the
    ratio is the client-side cost. ``--laptop`` also measures the embedded model serving on the
    same two cores, which is what a laptop user sees.
    """
    if args.collector_seconds <= 0:
        return None
    from torchrl_oni.serve.embedded import start_embedded_server

    out = {}
    with start_embedded_server(backend="scripted", port=0) as srv:
        off, on, m = _collector_phases(srv.url, srv.model, args.collector_seconds)
    out.update({"collector_fps_off": round(off), "collector_fps_on": round(on), "ratio": round(m["ratio_median"], 3),
                "collector_labels": int(m.get("labels_total", 0)), "collector_coverage": round(m.get("coverage", 0.0), 3)})
    if args.laptop and args.llm_url:
        off, on, m = _collector_phases(args.llm_url, args.llm_model, args.collector_seconds)
        out.update({"laptop_fps_off": round(off), "laptop_fps_on": round(on), "laptop_ratio": round(m["ratio_median"], 3),
                    "laptop_coverage": round(m.get("coverage", 0.0), 3)})
    elif args.laptop:
        with start_embedded_server(args.model, port=0, threads=1, dtype=args.dtype) as srv:
            off, on, m = _collector_phases(srv.url, srv.model, args.collector_seconds)
        out.update({"laptop_fps_off": round(off), "laptop_fps_on": round(on), "laptop_ratio": round(m["ratio_median"], 3),
                    "laptop_coverage": round(m.get("coverage", 0.0), 3)})
    return out


SHIPPED_LABELS = Path(__file__).parent / "labels" / "staircase-lvl3_qwen2.5-coder-0.5b.jsonl.gz"


def _shipped_captions() -> List[str]:
    """The shipped labels file's captions, in its order (its first line is the header)."""
    import gzip

    with gzip.open(SHIPPED_LABELS, "rt") as f:
        rows = [json.loads(line) for line in f][1:]
    return [r["caption"] for r in rows]


def real_captions(n: int, seed: int = 0) -> List[str]:
    """``n`` captions drawn at random from the shipped labels file (the captions agents meet)."""
    if n <= 0 or not SHIPPED_LABELS.is_file():
        return []
    captions = _shipped_captions()
    return random.Random(seed).sample(captions, min(n, len(captions)))


async def _alternating_stream(servers: dict, batch: int, seconds: float, rounds: int, captions: Sequence[str],
                              max_tokens: Dict[str, int]) -> Tuple[Dict[str, list], int, Dict[str, float]]:
    """Each request of ``batch`` new captions goes to every server in turn (who goes first
    alternates), so a machine's drift falls on both alike; stops after ``seconds`` or when the
    captions run out. Returns the captions/s of each ``rounds``-th of the time per server, the
    captions scored (by each) and each server's captions/s over the whole stream."""
    roles = list(servers)
    spent = {role: [0.0] * rounds for role in roles}
    done = {role: [0] * rounds for role in roles}
    at = 0
    async with _session() as session:
        for srv in servers.values():
            await _score(session, srv.url, srv.model, [LABELLED[0][0]])  # warm-up (prefix cache, threads)
        start = time.perf_counter()
        while at < len(captions):
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
            part = min(int(elapsed / seconds * rounds), rounds - 1)
            chunk = list(captions[at:at + batch])
            for role in (roles if (at // batch) % 2 == 0 else roles[::-1]):
                t0 = time.perf_counter()
                await _score(session, servers[role].url, servers[role].model, chunk, max_tokens[role])
                spent[role][part] += time.perf_counter() - t0
                done[role][part] += len(chunk)
            at += len(chunk)
    rates = {role: [round(n / s, 2) if s else 0.0 for n, s in zip(done[role], spent[role])] for role in roles}
    total = {role: sum(done[role]) / max(sum(spent[role]), 1e-9) for role in roles}
    return rates, at, total


def agreement_sets(real: int) -> Dict[str, List[str]]:
    """The captions two judges are compared on: the 40 hand-labelled messages, the 13 of the judge
    probe and ``real`` drawn from the shipped labels file (a set left empty is left out)."""
    from torchrl_oni.annotators.probe import NOT_PROGRESS, PROGRESS

    sets = {"hand_labelled": [m for m, _ in LABELLED],
            "judge_probe": list(dict.fromkeys([*NOT_PROGRESS, *PROGRESS["default"]])),
            "real_captions": real_captions(real)}
    return {name: msgs for name, msgs in sets.items() if msgs}


def same_labels(first: Sequence[Optional[float]], second: Sequence[Optional[float]]) -> Tuple[int, float]:
    """How many captions two lists of P(yes) give the same label (threshold 0.5; a missing score
    agrees with nothing), and the largest score change between them."""
    pairs = [(a, b) for a, b in zip(first, second) if a is not None and b is not None]
    same = sum((a >= 0.5) == (b >= 0.5) for a, b in pairs)
    return same, max((abs(a - b) for a, b in pairs), default=0)


def stream_captions(exclude: Sequence[str], seed: int = 2) -> List[str]:
    """The shipped labels file's captions less ``exclude``, shuffled: a stream of captions a judge
    has not seen (each is scored once, as in training, where the store asks about a caption once)."""
    skip = set(exclude)
    out = [c for c in _shipped_captions() if c not in skip]
    random.Random(seed).shuffle(out)
    return out


def compare_paths(args) -> int:
    """The reference path (``--dtype``, ``--layout``, ``--node-cache-mb``) against the candidate
    (``--compare-dtype``, ``--compare-layout``, ``--compare-node-cache-mb``) in one run: speed,
    agreement, AUC, and the agreement of the reference with itself when only the batches' make-up
    changes (its rounding floor)."""
    from torchrl_oni.serve.embedded import start_embedded_server

    sets = agreement_sets(args.real_captions)  # --real-captions 0: two sets
    compare_mb = args.node_cache_mb if args.compare_node_cache_mb is None else args.compare_node_cache_mb
    paths = {"reference": (args.dtype, args.layout, args.node_cache_mb),
             "candidate": (args.compare_dtype or args.dtype, args.compare_layout or args.layout, compare_mb)}
    stream = args.throughput_captions == "stream"
    if stream:
        if not SHIPPED_LABELS.is_file():
            raise ValueError(f"no captions to stream: {SHIPPED_LABELS} is missing")
        throughput_set = stream_captions(exclude=[m for msgs in sets.values() for m in msgs])
    elif args.throughput_captions not in sets:
        raise ValueError(f"no real captions to score: {SHIPPED_LABELS} is missing")
    else:
        throughput_set = sets[args.throughput_captions]
    servers, result = {}, {"model": None, "threads": args.threads, "batch": args.compare_batch,
                           "max_tokens": MAX_TOKENS["n"], "throughput_captions": args.throughput_captions}
    try:
        for role, (dtype, layout, cache_mb) in paths.items():
            t0 = time.perf_counter()
            servers[role] = start_embedded_server(args.model, port=0, threads=args.threads, dtype=dtype,
                                                  layout=layout, node_cache_mb=cache_mb)
            engine = servers[role].server.engine
            result[f"{role}_engine"] = type(engine).__name__
            result[f"{role}_dtype"] = getattr(getattr(engine, "loaded", None), "dtype", dtype)
            result[f"{role}_layout"] = getattr(engine, "layout", "-")
            node = getattr(engine, "node_cache", None)
            result[f"{role}_node_cache_tokens"] = node.capacity if node is not None else 0
            result[f"{role}_startup_s"] = round(time.perf_counter() - t0, 1)
            result["model"] = servers[role].model

        def score_sets(srv, order_seed=None):
            async def score_all(url=srv.url, model=srv.model):
                async with _session() as session:
                    out = {}
                    for name, msgs in sets.items():
                        order = list(range(len(msgs)))
                        if order_seed is not None:  # the same captions in other batches
                            random.Random(order_seed).shuffle(order)
                        got = [None] * len(msgs)
                        for start in range(0, len(order), args.compare_batch):
                            part = order[start:start + args.compare_batch]
                            for i, score in zip(part, await _score(session, url, model, [msgs[i] for i in part])):
                                got[i] = score
                        out[name] = got
                    return out
            return asyncio.run(score_all())

        scores = {role: score_sets(srv) for role, srv in servers.items()}
        reshuffled = score_sets(servers["reference"], order_seed=1)
        for role in paths:
            result[f"{role}_auc"] = round(accuracy_of(scores[role]["hand_labelled"])["auc"], 4)
        agree_all, total, floor_all = 0, 0, 0
        for name in sets:
            n = len(sets[name])
            same, change = same_labels(scores["reference"][name], scores["candidate"][name])
            itself, _ = same_labels(scores["reference"][name], reshuffled[name])
            result[f"agreement_{name}"] = round(same / max(n, 1), 4)
            result[f"reference_self_agreement_{name}"] = round(itself / max(n, 1), 4)
            result[f"n_{name}"] = n
            result[f"max_score_change_{name}"] = round(change, 4)
            if name != "real_captions":
                agree_all, total, floor_all = agree_all + same, total + n, floor_all + itself
        result["agreement_vs_reference"] = round(agree_all / max(total, 1), 4)
        result["reference_self_agreement"] = round(floor_all / max(total, 1), 4)
        tokens_before = {role: getattr(srv.server.engine, "tokens_run", None) for role, srv in servers.items()}
        if stream:
            asked = {"reference": MAX_TOKENS["n"], "candidate": args.compare_max_tokens or MAX_TOKENS["n"]}
            result["candidate_max_tokens"] = asked["candidate"]
            rates, scored, total = asyncio.run(_alternating_stream(servers, args.compare_batch, args.seconds,
                                                                   args.rounds, throughput_set, asked))
            result["stream_captions_scored"] = scored
            if scored >= len(throughput_set):
                print(f"warning: the stream of {len(throughput_set)} captions ran out; use fewer --seconds",
                      file=sys.stderr)
        else:
            rates = {role: [] for role in paths}
            for _ in range(args.rounds):
                for role, srv in servers.items():
                    rate, _ = asyncio.run(_throughput(srv.url, srv.model, args.compare_batch,
                                                      args.seconds / (2 * args.rounds), throughput_set))
                    rates[role].append(round(rate, 2))
            total = {role: sorted(r)[len(r) // 2] for role, r in rates.items()}  # the median round
        for role, srv in servers.items():
            result[f"{role}_captions_per_s"] = rates[role]
            node = getattr(srv.server.engine, "node_cache", None)
            if node is not None:
                result[f"{role}_node_cache_hits"] = node.hits
            if stream and tokens_before[role] is not None:
                result[f"{role}_tokens_per_caption"] = round((srv.server.engine.tokens_run - tokens_before[role])
                                                             / max(scored, 1), 2)
        result["speedup_vs_reference"] = round(total["candidate"] / total["reference"], 3)
        result["auc_change"] = round(result["candidate_auc"] - result["reference_auc"], 4)
    finally:
        for srv in servers.values():
            srv.stop()
    print(f"{result['model']}, {args.threads} threads, {args.compare_batch} prompts per request "
          f"({args.throughput_captions.replace('_', ' ')}, {MAX_TOKENS['n']} tokens asked), "
          f"{args.rounds} alternating rounds")
    print(f"{'path':<11} {'engine':<20} {'dtype':<9} {'layout':<7} {'node cache':>10} "
          f"{'captions/s (rounds)':<28} {'AUC':>6}")
    for role in paths:
        print(f"{role:<11} {result[role + '_engine']:<20} {result[role + '_dtype']:<9} {result[role + '_layout']:<7} "
              f"{result[role + '_node_cache_tokens']:>10} "
              f"{', '.join(map(str, result[role + '_captions_per_s'])):<28} {result[role + '_auc']:>6.3f}")
    if stream:
        print(f"a stream of {result['stream_captions_scored']} new captions, each request to both paths in turn; "
              "tokens run per caption: " + ", ".join(f"{role} {result.get(role + '_tokens_per_caption', '-')}"
                                                    for role in paths))
    print(f"speedup ({'whole stream' if stream else 'medians'}) {result['speedup_vs_reference']:.2f}x; same label on "
          + ", ".join(f"{result['agreement_' + n]:.1%} of {result['n_' + n]} {n.replace('_', ' ')}" for n in sets))
    print("the reference against itself, the same captions in other batches: "
          + ", ".join(f"{result['reference_self_agreement_' + n]:.1%}" for n in sets))
    print(json.dumps(result))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="total time budget")
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="packaged model (e.g. smollm2, qwen)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the model")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32", "int8"))
    parser.add_argument("--compare-dtype", default=None, choices=("int8", "bfloat16", "float32"),
                        help="instead of the rows below: serve the model in --dtype (the reference) "
                             "and in this dtype in the same run, alternate --rounds throughput "
                             "rounds at --compare-batch prompts, and compare their labels")
    parser.add_argument("--layout", default="tree", choices=("tree", "padded"),
                        help="how the float path runs a batch after its shared prefix (the engine's)")
    parser.add_argument("--compare-layout", default=None, choices=("tree", "padded"),
                        help="like --compare-dtype, for the layout (the two may be combined)")
    parser.add_argument("--node-cache-mb", type=float, default=None,
                        help="the embedded engine's cache of tokens computed before (default: oni-serve's; 0: off)")
    parser.add_argument("--compare-node-cache-mb", type=float, default=None,
                        help="like --compare-dtype, for --node-cache-mb")
    parser.add_argument("--throughput-captions", default="hand_labelled",
                        choices=("hand_labelled", "real_captions", "stream"),
                        help="with a comparison: the captions the throughput rounds score")
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens asked per caption")
    parser.add_argument("--compare-max-tokens", type=int, default=None,
                        help="with --throughput-captions stream: the candidate's tokens asked (default --max-tokens)")
    parser.add_argument("--rounds", type=int, default=3, help="with --compare-dtype: rounds per path")
    parser.add_argument("--compare-batch", type=int, default=32,
                        help="with --compare-dtype: prompts per request")
    parser.add_argument("--real-captions", type=int, default=300,
                        help="with --compare-dtype: captions drawn from the shipped labels file "
                             "for the agreement (0: none)")
    parser.add_argument("--batches", default="1,8,32,100", help="prompts per request")
    parser.add_argument("--no-accuracy", action="store_true")
    parser.add_argument("--collector-seconds", type=float, default=None,
                        help="time for the collector on/off part (default: a third of --seconds; 0 skips)")
    parser.add_argument("--laptop", action="store_true",
                        help="also measure the collector with the embedded model on the same cores "
                             "(with --llm-url: with that server)")
    parser.add_argument("--llm-url", default=None,
                        help="measure this OpenAI-compatible server (e.g. vLLM) instead of the embedded model")
    parser.add_argument("--llm-model", default=None,
                        help="served model name with --llm-url (default: the only one it lists)")
    parser.add_argument("--llm-api-key", default=None,
                        help="API key for --llm-url (default: the OPENAI_API_KEY environment variable)")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        print(f"error: --max-tokens must be at least 1, not {args.max_tokens}", file=sys.stderr)
        return 2
    MAX_TOKENS["n"] = args.max_tokens
    if args.compare_max_tokens is not None and (args.compare_max_tokens < 1 or args.throughput_captions != "stream"):
        print(f"error: --compare-max-tokens {args.compare_max_tokens} needs --throughput-captions stream and a value "
              "of at least 1", file=sys.stderr)
        return 2
    if args.throughput_captions == "real_captions" and args.real_captions <= 0:
        print("error: --throughput-captions real_captions needs --real-captions of at least 1", file=sys.stderr)
        return 2
    if args.llm_url:
        from torchrl_oni.annotators.endpoints import AnnotatorUnavailable, _auth_headers, normalize_base_url, resolve_model

        try:
            args.llm_url = normalize_base_url(args.llm_url)
            args.llm_model = resolve_model(args.llm_url, args.llm_model, api_key=args.llm_api_key)
        except (AnnotatorUnavailable, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        _HEADERS.update(_auth_headers(args.llm_api_key))

    from torchrl_oni.serve.embedded import start_embedded_server
    from torchrl_oni.serve.models import ModelNotInstalledError

    if args.compare_dtype or args.compare_layout or args.compare_node_cache_mb is not None:
        try:
            return compare_paths(args)
        except (ValueError, ModelNotInstalledError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if args.collector_seconds is None:
        args.collector_seconds = args.seconds / 3
        args.seconds -= args.collector_seconds
    batches = [int(b) for b in args.batches.split(",")]
    # Scripted baseline gets a tenth of the time: it only measures HTTP + client cost.
    base_share = args.seconds * 0.1 / len(batches)
    model_share = args.seconds * 0.9 / len(batches)

    baseline = {}
    with start_embedded_server(backend="scripted", port=0) as srv:
        for b in batches:
            baseline[b], _ = asyncio.run(_throughput(srv.url, srv.model, b, base_share))

    rates = {}
    if args.llm_url:
        result = {"model": args.llm_model, "server": args.llm_url}
        if not args.no_accuracy:
            result.update({k: round(v, 3) for k, v in asyncio.run(_accuracy(args.llm_url, args.llm_model)).items()})
        for b in batches:
            rates[b], _ = asyncio.run(_throughput(args.llm_url, args.llm_model, b, model_share))
    else:
        t0 = time.perf_counter()
        try:
            srv = start_embedded_server(args.model, port=0, threads=args.threads, dtype=args.dtype,
                                        layout=args.layout, node_cache_mb=args.node_cache_mb)
        except (ValueError, ModelNotInstalledError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        startup_s = time.perf_counter() - t0
        loaded = srv.server.engine.loaded
        result = {"model": loaded.spec.name, "dtype": loaded.dtype, "threads": args.threads,
                  "load_s": round(loaded.load_seconds, 2), "startup_s": round(startup_s, 2),
                  "from_cache": loaded.from_cache}
        with srv:
            if not args.no_accuracy:
                result.update({k: round(v, 3) for k, v in asyncio.run(_accuracy(srv.url, srv.model)).items()})
            for b in batches:
                rates[b], _ = asyncio.run(_throughput(srv.url, srv.model, b, model_share))
            cache = getattr(srv.server.engine, "prefix_cache", None)  # int8: CTranslate2's own
            if cache is not None:
                result["prefix_cache_hits"] = cache.hits
    result["rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    result["captions_per_s"] = {str(b): round(r, 2) for b, r in rates.items()}
    result["scripted_captions_per_s"] = {str(b): round(r, 1) for b, r in baseline.items()}
    result["model_time_share"] = {str(b): round(1 - rates[b] / baseline[b], 4) for b in batches}
    extra = collector_overhead(args)
    if extra:
        result.update(extra)

    if args.llm_url:
        print(f"model {result['model']} served at {args.llm_url}; peak RSS of this client {result['rss_mb']} MB")
    else:
        print(f"model {result['model']} ({result['dtype']}, {args.threads} threads): load "
              f"{result['load_s']} s (from cache: {result['from_cache']}), peak RSS {result['rss_mb']} MB")
    if "accuracy" in result:
        print(f"accuracy {result['accuracy']:.3f}  AUC {result['auc']:.3f}  on {len(LABELLED)} "
              f"labelled messages (predicted positive {result['predicted_positive_rate']:.2f})")
    print(f"{'batch':>6} {'captions/s':>11} {'scripted/s':>11} {'model share':>12}")
    for b in batches:
        print(f"{b:>6} {rates[b]:>11.2f} {baseline[b]:>11.1f} {result['model_time_share'][str(b)]:>12.1%}")
    if "ratio" in result:
        print(f"collector, 2 workers x 32 games: {result['collector_fps_off']:,} frames/s without annotation, "
              f"{result['collector_fps_on']:,} with (ratio {result['ratio']:.3f}; scripted server, client cost)")
    if "laptop_ratio" in result:
        print(f"  embedded model on the same cores: {result['laptop_fps_off']:,} -> {result['laptop_fps_on']:,} "
              f"frames/s (ratio {result['laptop_ratio']:.3f})")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
