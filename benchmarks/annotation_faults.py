"""Caption coverage over time when the LLM server is slow, dead, or one of a pool is down.

Scenarios (``--scenarios``, default all three):

* ``hog`` — README's main command conditions: ``oni-train``'s trainer (its collector, 2 workers ×
  32 games × 32 steps, and the PPO learner) runs in this process; each collected batch goes
  through ``LLMAnnotationTransform``, labelled by the embedded CPU LLM started as ``oni-train``
  starts it (one thread, short yes/no prompt with logprobs), while ``--hog-procs`` busy
  processes take the cores. ``--llm-url`` measures another server instead (e.g. vLLM on CPU).
* ``outage`` — the captions the trainer collected (recorded from ``hog``, or from a trainer run
  without LLM when ``hog`` is not run) are replayed at the pace they were collected, labelled
  by a fake OpenAI server (:class:`torchrl_oni.testing.FakeLLMServer`:
  ``--fake-ms-per-prompt`` of work per prompt, one request at a time) that goes down for
  ``--outage-s`` seconds (default 120) from ``--outage-at``. ``outage_recovery_s``: seconds from
  the restart until every caption seen before it is labelled.
* ``pool`` — the same replay, labelled by a pool of two fake servers; run once with both up
  and once with one killed at ``--kill-at``. ``pool_one_down_ratio``: labels/s after the kill
  time, one server down / both up (near 1 while one server keeps up with new captions).

Every scenario prints a table of coverage over time (every ``--sample-s`` seconds):
``seen_cov`` (share of all steps so far whose caption is labelled now), ``window_cov`` (share
of the steps of the last 32 batches that were labelled when collected), labels, captions
waiting, given up, requests refused by the breaker, timeouts, connection errors; then the
worker's health line. The last line of stdout is one JSON object.

Usage::

    python benchmarks/annotation_faults.py --seconds 300                 # the real measurement
    python benchmarks/annotation_faults.py --seconds 20 --outage-s 5 --workers 1 --envs 4  # smoke
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from tensordict import TensorDict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from torchrl_oni.annotation import LLMAnnotationTransform  # noqa: E402
from torchrl_oni.annotators.openai import OpenAIAnnotator  # noqa: E402
from torchrl_oni.captions import CAPTION_HASH_KEY, MESSAGE_KEY, MESSAGE_LEN  # noqa: E402
from torchrl_oni.store import CaptionStore  # noqa: E402
from torchrl_oni.train.hooks import TrainHook  # noqa: E402

COLUMNS = ("t_s", "seen_cov", "window_cov", "labelled", "waiting", "given_up", "labels_per_s",
           "unsent", "timeouts", "conn_err")


def _burn(stop) -> None:  # pragma: no cover - runs in a child process
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 31 + 7) % 1_000_003


class CpuHogs:
    """``n`` processes spinning on a core each, for the length of a ``with`` block."""

    def __init__(self, n: int) -> None:
        self.n = n
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._procs = [ctx.Process(target=_burn, args=(self._stop,), daemon=True) for _ in range(n)]

    def __enter__(self) -> "CpuHogs":
        for p in self._procs:
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.terminate()


class CaptionFeed:
    """The captions of collected batches with their collection times, to replay them.

    Only hashes per batch are kept, and one 256-byte row per distinct caption.
    """

    def __init__(self) -> None:
        self.times: List[float] = []
        self.hashes: List[np.ndarray] = []
        self.rows: Dict[int, np.ndarray] = {}
        self._t0: Optional[float] = None

    def record(self, batch) -> None:
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        msgs = batch.get(MESSAGE_KEY).reshape(-1, MESSAGE_LEN).numpy()
        hashes = batch.get(CAPTION_HASH_KEY).reshape(-1).numpy().astype(np.int64)
        uniq, first = np.unique(hashes, return_index=True)
        for h, i in zip(uniq.tolist(), first.tolist()):
            if h not in self.rows:
                self.rows[h] = msgs[i].copy()
        self.times.append(now - self._t0)
        self.hashes.append(hashes.copy())

    def __len__(self) -> int:
        return len(self.times)

    def replay(self, seconds: float, on_batch, on_tick=None) -> None:
        """Calls ``on_batch(td, t)`` for each batch at its recorded time offset (looping), for
        ``seconds``; ``on_tick(t)`` is called between batches."""
        if not self.times:
            raise RuntimeError("no captions recorded")
        period = self.times[-1] + (self.times[-1] / max(len(self.times) - 1, 1) or 1.0)
        t0 = time.monotonic()
        i = 0
        while True:
            lap, k = divmod(i, len(self.times))
            due = lap * period + self.times[k]
            while True:
                now = time.monotonic() - t0
                if now >= seconds:
                    return
                if on_tick is not None:
                    on_tick(now)
                if now >= due:
                    break
                time.sleep(min(0.05, due - now))
            hashes = self.hashes[k]
            msgs = np.stack([self.rows[h] for h in hashes.tolist()])
            td = TensorDict({MESSAGE_KEY: torch.from_numpy(msgs), CAPTION_HASH_KEY: torch.from_numpy(hashes)},
                            batch_size=[len(hashes)])
            on_batch(td, time.monotonic() - t0)
            i += 1


class CoverageProbe:
    """Samples the store's and the transform's coverage every ``every_s`` seconds."""

    def __init__(self, store: CaptionStore, annotate: LLMAnnotationTransform, every_s: float) -> None:
        self.store, self.annotate, self.every_s = store, annotate, every_s
        self.rows: List[Dict[str, float]] = []
        self._next = 0.0

    def maybe_sample(self, t: float, force: bool = False) -> None:
        if not force and t < self._next:
            return
        self._next = t + self.every_s
        m = self.annotate.metrics()
        self.rows.append({
            "t_s": round(t, 1), "seen_cov": round(m["seen_coverage"], 4), "window_cov": round(m["coverage"], 4),
            "labelled": int(m["labelled"]), "waiting": int(m["unseen"] + m["pending"]),
            "given_up": int(m["given_up"]), "labels_per_s": round(m["labels_per_s"], 2),
            "unsent": int(m["requests_unsent"]), "timeouts": int(m["timeouts"]),
            "conn_err": int(m["connection_errors"]),
        })

    def labelled_at(self, t: float) -> int:
        before = [r["labelled"] for r in self.rows if r["t_s"] <= t]
        return before[-1] if before else 0


def print_table(title: str, rows: Sequence[Dict[str, float]], health: str) -> None:
    print(f"\n== {title}")
    print(" ".join(f"{c:>12}" for c in COLUMNS))
    for r in rows:
        print(" ".join(f"{r[c]:>12}" for c in COLUMNS))
    print(f"health: {health}")


def make_client(url, model: str, args, **extra) -> OpenAIAnnotator:
    """The client ``oni-train`` builds for the embedded server (short prompt, logprobs)."""
    opts = dict(prompt="short", use_logprobs=True, ranking="scores", batch_size=args.llm_batch_size,
                max_concurrency=args.llm_concurrency, timeout_s=args.llm_timeout)
    opts.update(extra)
    return OpenAIAnnotator(url, model, **opts)


def make_transform(store: CaptionStore, client) -> LLMAnnotationTransform:
    return LLMAnnotationTransform(store, client, batch_size=client.batch_size, pairs=False,
                                  close_annotator=True, poll_interval_s=0.5)


class _TrainerHook(TrainHook):
    """Annotates, records and samples each collected batch; stops the trainer after ``seconds``."""

    name = "annotation_faults"
    stages = ("batch", "post_update")

    def __init__(self, seconds: float, annotate=None, feed: Optional[CaptionFeed] = None,
                 probe: Optional[CoverageProbe] = None) -> None:
        self.seconds, self.annotate, self.feed, self.probe = seconds, annotate, feed, probe
        self.t0: Optional[float] = None

    def on_batch(self, batch, trainer):
        if self.t0 is None:
            self.t0 = time.monotonic()
        if self.annotate is not None:
            batch = self.annotate(batch)
        if self.feed is not None:
            self.feed.record(batch)
        if self.probe is not None:
            self.probe.maybe_sample(time.monotonic() - self.t0)
        return batch

    def after_update(self, trainer):
        if time.monotonic() - self.t0 > self.seconds:
            trainer.total_frames = trainer.frames


def run_trainer(args, hook: _TrainerHook) -> None:
    from torchrl_oni.train import TrainConfig, Trainer
    from torchrl_oni.train.config import MAX_FRAMES

    # frames: the most the config accepts; the hook stops the trainer after ``seconds``
    cfg = TrainConfig(frames=MAX_FRAMES, workers=args.workers, envs_per_worker=args.envs, rollout=args.rollout,
                      logdir=tempfile.mkdtemp(prefix="oni-faults-"), progress=False, tensorboard=False,
                      checkpoint_every=MAX_FRAMES, seed=args.seed)
    Trainer.from_config(cfg, hooks=[hook]).train()


# ---------------------------------------------------------------------------------- scenarios
def scenario_hog(args, feed: CaptionFeed) -> dict:
    server = None
    if args.llm_url:
        from torchrl_oni.annotators.endpoints import resolve_model

        url, model = args.llm_url, resolve_model(args.llm_url, args.llm_model, api_key=args.llm_api_key)
    else:
        from torchrl_oni.serve import DEFAULT_MODEL, start_embedded_server

        server = start_embedded_server(model=args.llm_model or DEFAULT_MODEL, threads=1)
        url, model = server.url, server.model
    store = CaptionStore()
    annotate = make_transform(store, make_client(url, model, args, api_key=args.llm_api_key))
    probe = CoverageProbe(store, annotate, args.sample_s)
    hook = _TrainerHook(args.seconds, annotate, feed, probe)
    try:
        with CpuHogs(args.hog_procs):
            run_trainer(args, hook)
        elapsed = time.monotonic() - hook.t0
        probe.maybe_sample(elapsed, force=True)
        health, metrics = annotate.health(), annotate.metrics()
    finally:
        annotate.close(timeout=1.0)
        if server is not None:
            server.stop()
    print_table(f"hog: {args.hog_procs} busy processes beside the trainer, LLM {model} at {url}",
                probe.rows, health)
    return {"hog_seen_coverage": metrics["seen_coverage"], "hog_labels": int(metrics["labelled"]),
            "hog_labels_per_s": round(metrics["labels_total"] / max(elapsed, 1e-9), 3),
            "hog_given_up": int(metrics["given_up"]), "hog_timeouts": int(metrics["timeouts"]),
            "hog_frames": int(sum(len(h) for h in feed.hashes)), "hog_health": health,
            "hog_series": [[r["t_s"], r["seen_cov"]] for r in probe.rows]}


def _fake_server(args):
    from torchrl_oni.testing import FakeLLMServer

    return FakeLLMServer(serial=True, latency_s=args.fake_ms_per_request / 1000,
                         per_prompt_s=args.fake_ms_per_prompt / 1000)


def scenario_outage(args, feed: CaptionFeed) -> dict:
    store = CaptionStore()
    server = _fake_server(args).start()
    annotate = make_transform(store, make_client(server.url, "fake-model", args))
    probe = CoverageProbe(store, annotate, args.sample_s)
    outage_at = args.outage_at if args.outage_at is not None else args.seconds / 4
    back_at = outage_at + args.outage_s
    state = {"down": False, "back": False, "seen_before_restart": None, "recovered_at": None,
             "coverage_before": None}
    seen: List[np.ndarray] = []

    def on_batch(td, t):
        annotate(td)
        seen.append(np.unique(td.get(CAPTION_HASH_KEY).numpy()))

    def on_tick(t):
        probe.maybe_sample(t)
        if not state["down"] and t >= outage_at:
            state["down"] = True
            state["coverage_before"] = store.stats()["seen_coverage"]
            server.stop()
        elif state["down"] and not state["back"] and t >= back_at:
            state["back"] = True
            state["back_t"] = t
            state["seen_before_restart"] = np.unique(np.concatenate(seen)) if seen else np.empty(0, np.int64)
            server.start()
        elif state["back"] and state["recovered_at"] is None:
            _, found = store.lookup(state["seen_before_restart"])
            if bool(found.all()):
                state["recovered_at"] = t

    try:
        feed.replay(args.seconds, on_batch, on_tick)
        probe.maybe_sample(args.seconds, force=True)
        health, metrics = annotate.health(), annotate.metrics()
        lost = 0
        if state["seen_before_restart"] is not None:
            lost = int((~store.lookup(state["seen_before_restart"])[1]).sum())
    finally:
        annotate.close(timeout=1.0)
        server.stop()
    during = [r["seen_cov"] for r in probe.rows if outage_at <= r["t_s"] <= back_at]
    print_table(f"outage: fake server ({args.fake_ms_per_prompt:g} ms/prompt, serial) down from "
                f"{outage_at:g} s for {args.outage_s:g} s", probe.rows, health)
    recovery = None
    if state["recovered_at"] is not None:
        recovery = round(state["recovered_at"] - state["back_t"], 2)
    return {"outage_s": args.outage_s,
            "outage_coverage_before": state["coverage_before"],
            "outage_coverage_min": min(during) if during else None,
            "outage_coverage_end": metrics["seen_coverage"],
            "outage_given_up": int(metrics["given_up"]),
            "outage_unlabelled_seen_before_restart": lost,
            "outage_recovery_s": recovery,
            "outage_requests_unsent": int(metrics["requests_unsent"]),
            "outage_series": [[r["t_s"], r["seen_cov"]] for r in probe.rows]}


def _pool_run(args, feed: CaptionFeed, kill_at: Optional[float]) -> dict:
    store = CaptionStore()
    servers = [_fake_server(args).start(), _fake_server(args).start()]
    annotate = make_transform(store, make_client([s.url for s in servers], "fake-model", args))
    probe = CoverageProbe(store, annotate, args.sample_s)
    killed = {"done": False}
    cut = kill_at if kill_at is not None else args.kill_at

    def on_tick(t):
        probe.maybe_sample(t)
        if not killed["done"] and t >= cut:
            killed["done"] = True
            probe.maybe_sample(t, force=True)
            if kill_at is not None:
                servers[1].stop()

    try:
        feed.replay(args.seconds, lambda td, t: annotate(td), on_tick)
        probe.maybe_sample(args.seconds, force=True)
        health, metrics = annotate.health(), annotate.metrics()
    finally:
        annotate.close(timeout=1.0)
        for s in servers:
            s.stop()
    after = probe.labelled_at(args.seconds) - probe.labelled_at(cut)
    return {"rows": probe.rows, "health": health, "metrics": metrics,
            "labels_per_s_after": after / max(args.seconds - cut, 1e-9)}


def scenario_pool(args, feed: CaptionFeed) -> dict:
    both = _pool_run(args, feed, kill_at=None)
    print_table("pool: two fake servers, both up", both["rows"], both["health"])
    one = _pool_run(args, feed, kill_at=args.kill_at)
    print_table(f"pool: two fake servers, one killed at {args.kill_at:g} s", one["rows"], one["health"])
    ratio = one["labels_per_s_after"] / both["labels_per_s_after"] if both["labels_per_s_after"] else None
    return {"pool_both_labels_per_s": round(both["labels_per_s_after"], 3),
            "pool_one_down_labels_per_s": round(one["labels_per_s_after"], 3),
            "pool_one_down_ratio": None if ratio is None else round(ratio, 3),
            "pool_both_coverage_end": both["metrics"]["seen_coverage"],
            "pool_one_down_coverage_end": one["metrics"]["seen_coverage"],
            "pool_given_up": int(one["metrics"]["given_up"])}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torchrl_oni.train import TrainConfig

    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="hog,outage,pool", help="comma-separated: hog, outage, pool")
    parser.add_argument("--seconds", type=float, default=300.0, help="length of each run")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between table rows")
    parser.add_argument("--workers", type=int, default=defaults.env.workers, help="env worker processes")
    parser.add_argument("--envs", type=int, default=defaults.env.envs_per_worker, help="games per worker")
    parser.add_argument("--rollout", type=int, default=defaults.env.rollout, help="steps per game per batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hog-procs", type=int, default=os.cpu_count() or 2,
                        help="busy processes beside the trainer in 'hog'")
    parser.add_argument("--llm-url", default=None, help="'hog': this server instead of the embedded LLM")
    parser.add_argument("--llm-model", default=None, help="served model (default: the only one listed), or "
                                                          "the packaged model of the embedded server")
    parser.add_argument("--llm-api-key", default=None, help="API key for --llm-url (default: OPENAI_API_KEY)")
    parser.add_argument("--llm-batch-size", type=int, default=100, help="most prompts per request")
    parser.add_argument("--llm-concurrency", type=int, default=4, help="most requests in flight per server")
    parser.add_argument("--llm-timeout", type=float, default=None, help="fixed request time limit (default: adaptive)")
    parser.add_argument("--outage-s", type=float, default=120.0, help="'outage': how long the server is down")
    parser.add_argument("--outage-at", type=float, default=None, help="'outage': when it goes down "
                                                                      "(default: a quarter of --seconds)")
    parser.add_argument("--kill-at", type=float, default=None, help="'pool': when one server is killed "
                                                                    "(default: a quarter of --seconds)")
    parser.add_argument("--fake-ms-per-prompt", type=float, default=20.0,
                        help="fake servers' work per prompt (one request at a time)")
    parser.add_argument("--fake-ms-per-request", type=float, default=20.0, help="fake servers' work per request")
    args = parser.parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(scenarios) - {"hog", "outage", "pool"}
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    if args.kill_at is None:
        args.kill_at = args.seconds / 4
    torch.set_num_threads(1)

    result: Dict[str, object] = {"seconds": args.seconds, "workers": args.workers, "envs": args.envs}
    feed = CaptionFeed()
    if "hog" in scenarios:
        result.update(scenario_hog(args, feed))
    elif scenarios:
        run_trainer(args, _TrainerHook(args.seconds, feed=feed))  # record real captions, no LLM
    result["recorded_frames"] = int(sum(len(h) for h in feed.hashes))
    result["recorded_captions"] = len(feed.rows)
    if "outage" in scenarios:
        result.update(scenario_outage(args, feed))
    if "pool" in scenarios:
        result.update(scenario_pool(args, feed))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
