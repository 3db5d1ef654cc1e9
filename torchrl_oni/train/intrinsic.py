"""Builds the trainer hooks that produce ``("next", "intrinsic_reward")`` for ``--intrinsic-reward``.

One :class:`IntrinsicRewardHook` owns the whole intrinsic side of a run, all of it in the
trainer process (the collector's env workers only play):

* a :class:`~torchrl_oni.store.CaptionStore`, loaded from ``--caption-store`` (default
  ``<logdir>/captions.pt``) when the file exists and saved at every checkpoint and at exit, so
  a label is never paid for twice, across restarts included;
* an annotator: ``--annotator scripted`` (rules, no LLM), ``--llm-url URL`` (any
  OpenAI-compatible server, checked once at start) or, with no URL, the embedded CPU server
  (:func:`~torchrl_oni.serve.start_embedded_server`), stopped at exit;
* on each collected batch (``on_batch``): the :class:`~torchrl_oni.transforms.LLMAnnotationTransform`
  (new captions go to the annotator in the background), ranking pairs for ``ranking``, then the
  :class:`~torchrl_oni.transforms.IntrinsicRewardTransform`;
* after each PPO iteration (``after_update``): reward-model training for ``classification`` and
  ``ranking`` on ONI's schedule (``--rm-steps-per-labels`` steps whenever new labels arrived
  until ``--rm-switch-at`` items, then ``--rm-steps-per-iteration`` per iteration);
* ``metrics()``: label counts and balance, annotation health, reward-model accuracy, the mean
  intrinsic reward and the fraction of steps rewarded; the most rewarded messages of the last
  window go to ``<logdir>/top_messages.txt`` (the CSV holds numbers only).

Reward sources: ``retrieval`` (:class:`~torchrl_oni.rewards.RetrievalReward`), ``classification``
(:class:`~torchrl_oni.rewards.ClassificationReward`), ``ranking``
(:class:`~torchrl_oni.rewards.RankingReward`, normalised and thresholded unless
``--ranking-raw``), ``motif`` (:class:`~torchrl_oni.rewards.MotifReward`, frozen, from
``--reward-model``), ``bow`` (:class:`~torchrl_oni.rewards.BoWReward`, no LLM).

A caption store reused from another run keeps that run's labels: use a fresh ``--caption-store``
when changing ``--goal`` or the annotator.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Dict, List, Optional

import numpy as np
import torch
from tensordict import TensorDictBase

from ..captions import CAPTION_HASH_KEY, MESSAGE_KEY, MESSAGE_LEN, decode_message
from .config import TrainConfig

__all__ = ["build_intrinsic_hooks", "IntrinsicRewardHook", "TOP_MESSAGES_NAME", "CAPTION_STORE_NAME"]

log = logging.getLogger("torchrl_oni.train")

TOP_MESSAGES_NAME = "top_messages.txt"
CAPTION_STORE_NAME = "captions.pt"
_NEEDS_LABELS = ("retrieval", "classification", "ranking")

# Goal sentences for the bag-of-words reward: content words only (BoW has no notion of "not").
_BOW_GOALS = {
    "combat": "Kill monsters, fight and defeat enemies, gain experience levels.",
    "gold": "Find gold, pick up gold pieces, collect coins and treasure.",
    "stairs": "Find the staircase down, descend the stairs to deeper dungeon levels.",
}


class _PairsOnlyStore:
    """The store as the ranking annotation worker sees it: pairs to compare, no single captions.

    ONI-Ranking needs preferences only; without this the worker would label every caption first.
    """

    def __init__(self, store):
        self._store = store

    def claim(self, max_items: int):
        return torch.zeros(0, dtype=torch.int64), []

    def __getattr__(self, name):
        return getattr(self._store, name)

    def __repr__(self) -> str:
        return f"PairsOnly({self._store!r})"


def _check_llm(annotator) -> None:
    """Asks the server for its models; raises ``AnnotatorUnavailable`` with one line."""

    async def check():
        try:
            await annotator.check()
        finally:
            await annotator.aclose()

    asyncio.run(check())


def _make_annotator(cfg: TrainConfig):
    """``(annotator, server_handle or None)`` for the configured source."""
    from ..annotators import OpenAIAnnotator, ScriptedAnnotator

    if cfg.annotator == "scripted":
        return ScriptedAnnotator(goal=cfg.goal), None
    server = None
    if cfg.llm_url:
        if not cfg.llm_model:
            raise ValueError("--llm-url needs --llm-model (the name the server lists at /v1/models)")
        url, model = cfg.llm_url, cfg.llm_model
        prompt = "tagged" if cfg.llm_prompt == "auto" else cfg.llm_prompt
    else:
        from ..serve import DEFAULT_MODEL, start_embedded_server

        # One thread: the model answers in the background and must not take the learner's cores.
        server = start_embedded_server(model=cfg.llm_model or DEFAULT_MODEL, threads=1)
        url, model = server.url, server.model
        prompt = "short" if cfg.llm_prompt == "auto" else cfg.llm_prompt
    small = prompt == "short"
    try:
        annotator = OpenAIAnnotator(
            url, model, goal=cfg.goal, prompt=prompt, use_logprobs=small,
            ranking="scores" if small else "direct", batch_size=cfg.llm_batch_size,
            max_concurrency=cfg.llm_concurrency,
        )
        _check_llm(annotator)
    except BaseException:
        if server is not None:
            server.stop()
        raise
    return annotator, server


def _make_bow(cfg: TrainConfig):
    from ..rewards.bow import DEFAULT_GOAL, BoWReward, HashedWordVectors, MiniLMTokenVectors

    goal = DEFAULT_GOAL if cfg.goal == "default" else _BOW_GOALS[cfg.goal]
    if cfg.bow_vectors == "hashed":
        vectors = HashedWordVectors()
    else:
        try:
            vectors = MiniLMTokenVectors()
        except (ImportError, OSError, RuntimeError, ValueError) as err:
            if cfg.bow_vectors == "minilm":
                raise ValueError(f"--bow-vectors minilm: {err}") from None
            log.warning("BoW: MiniLM vectors unavailable (%s); using hashed word vectors", err)
            vectors = HashedWordVectors()
    return BoWReward(goal, vectors=vectors, threshold=cfg.bow_threshold)


class IntrinsicRewardHook:
    """The trainer hook of one intrinsic reward type (see the module docstring).

    Args:
        cfg: the run's :class:`TrainConfig` (``intrinsic_reward`` other than ``none``).

    Raises:
        ValueError / RuntimeError: one-line reasons (dead LLM server, unknown model, missing
            reward-model checkpoint...), which ``oni-train`` prints and exits 2 on.
    """

    name = "intrinsic"

    def __init__(self, cfg: TrainConfig):
        from ..rewards.classification import RewardModelSchedule
        from ..transforms import IntrinsicRewardTransform

        if cfg.intrinsic_reward == "none":
            raise ValueError("IntrinsicRewardHook needs an --intrinsic-reward other than 'none'")
        self.cfg = cfg
        self.kind = cfg.intrinsic_reward
        self.run_dir = cfg.logdir
        self.store = None
        self.store_path: Optional[str] = None
        self.server = None
        self.annotation = None
        self.rm_trainer = None
        self.sampler = None
        self.heldout: Dict[str, float] = {}
        self.rm_last: Dict[str, float] = {}
        self._labelled_seen = -1
        self._window = _RewardWindow()
        self._closed = False
        try:
            if self.kind in _NEEDS_LABELS:
                annotator, self.server = _make_annotator(cfg)  # first: a dead server fails fast
                self._open_store()
                from ..annotation import LLMAnnotationTransform

                worker_store = _PairsOnlyStore(self.store) if self.kind == "ranking" else self.store
                self.annotation = LLMAnnotationTransform(
                    worker_store, annotator, batch_size=cfg.llm_batch_size,
                    max_concurrency=cfg.llm_concurrency, pairs=self.kind == "ranking",
                    close_annotator=True, poll_interval_s=0.5,
                )
            schedule = RewardModelSchedule(cfg.rm_steps_per_labels, cfg.rm_switch_at, cfg.rm_steps_per_iteration)
            from .ppo import resolve_device

            device = resolve_device(cfg.device)  # reward models sit with the learner, never on env workers
            fraction = cfg.rm_time_fraction
            if fraction is None:
                fraction = 0.1 if device.type == "cpu" else 0.0
            self.rm_budget = _StepBudget(fraction, max_owed=4 * max(cfg.rm_steps_per_labels, 1))
            if self.kind == "retrieval":
                from ..rewards import RetrievalReward

                reward = RetrievalReward(self.store)
            elif self.kind == "classification":
                from ..rewards import ClassificationReward, ClassifierTrainer

                reward = ClassificationReward(threshold=cfg.classification_threshold, device=device)
                self.rm_trainer = ClassifierTrainer(reward, self.store, lr=cfg.rm_lr,
                                                    batch_size=cfg.rm_batch_size, schedule=schedule,
                                                    seed=cfg.seed)
            elif self.kind == "ranking":
                from ..rewards import RankingReward, RankingTrainer, UniqueCaptionPairSampler

                # raw scores here; the transform normalises (frequency-weighted running stats over
                # every step, as ONI) and thresholds them after de-duplicating the batch
                reward = RankingReward(normalize=False, device=device)
                self.rm_trainer = RankingTrainer(reward, self.store, lr=cfg.rm_lr,
                                                 batch_size=cfg.rm_batch_size, schedule=schedule)
                self.sampler = UniqueCaptionPairSampler(seed=cfg.seed)
            elif self.kind == "motif":
                from ..rewards.motif import MotifReward

                reward = MotifReward(cfg.reward_model, quantile=cfg.motif_quantile)
            elif self.kind == "bow":
                reward = _make_bow(cfg)
            else:  # validate() keeps this unreachable
                raise ValueError(f"unknown --intrinsic-reward {self.kind!r}")
        except BaseException:
            self.close(save=False)  # a run that never started must not write a store
            raise
        self.reward = reward
        normalize = self.kind == "ranking" and not cfg.ranking_raw
        self.transform = IntrinsicRewardTransform(reward, message=cfg.reward_message, beta=cfg.count_exponent,
                                                  normalize=normalize,
                                                  threshold=cfg.ranking_threshold if normalize else None)

    # ------------------------------------------------------------------ store
    def _open_store(self) -> None:
        from ..store import CaptionStore

        self.store_path = self.cfg.caption_store or os.path.join(self.run_dir, CAPTION_STORE_NAME)
        if os.path.exists(self.store_path):
            self.store = CaptionStore.load(self.store_path)
            log.info("caption store: %d captions (%d labelled) from %s", len(self.store),
                     self.store.stats()["labelled"], self.store_path)
        else:
            self.store = CaptionStore()

    def save_store(self) -> Optional[str]:
        """Writes the caption store (labels, pairs) to ``--caption-store``; returns the path."""
        if self.store is None or self.store_path is None:
            return None
        self.store.save(self.store_path)
        return self.store_path

    # ------------------------------------------------------------------ TrainHook API
    def on_batch(self, batch: TensorDictBase, trainer=None) -> TensorDictBase:
        if self.annotation is not None:
            batch = self.annotation(batch)
        if self.sampler is not None:
            self._queue_pairs(batch)
        batch = self.transform(batch)
        self._window.add(batch, self.transform)
        return batch

    def _queue_pairs(self, batch: TensorDictBase) -> None:
        messages = batch.get(MESSAGE_KEY)
        hashes = batch.get(CAPTION_HASH_KEY)
        self.sampler.observe(messages.reshape(-1, MESSAGE_LEN), hashes.reshape(-1))
        stats = self.store.stats()
        backlog = stats["pairs"] - stats["pairs_labelled"]
        # ONI queued 10 pairs per minibatch while fewer than 2 × batch size were waiting.
        if backlog < 2 * self.cfg.llm_batch_size:
            _, _, h1, h2 = self.sampler.sample_pairs(self.cfg.ranking_pairs)
            if len(h1):
                self.store.add_pairs(h1, h2)
                self.annotation.worker.wake()

    def after_update(self, trainer=None) -> None:
        if self.rm_trainer is None:
            return
        stats = self.store.stats()
        size = stats["pairs_labelled"] if self.kind == "ranking" else stats["labelled"]
        new_labels = size > self._labelled_seen
        self._labelled_seen = size
        schedule = self.rm_trainer.schedule
        owed = schedule.steps(size, new_labels=new_labels, iteration_done=False)
        owed += schedule.steps(size, new_labels=False, iteration_done=True)
        n = self.rm_budget.steps_now(owed)
        if n <= 0:
            return
        start = time.perf_counter()
        result = self.rm_trainer.train_steps(n)
        self.rm_budget.spent(result.get("steps", 0), time.perf_counter() - start)
        if result.get("steps"):
            self.rm_last = result
            if self.kind == "classification":
                self.heldout = self.rm_trainer.evaluate(refresh=False)

    def metrics(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        if self.store is not None:
            s = self.store.stats()
            out["labels/captions"] = s["size"]
            out["labels/labelled"] = s["labelled"]
            out["labels/failed"] = s["failed"]
            out["labels/positive_fraction"] = s["positives"] / s["labelled"] if s["labelled"] else 0.0
            out["labels/seen_coverage"] = s["seen_coverage"]
            if self.kind == "ranking":
                out["labels/pairs"] = s["pairs"]
                out["labels/pairs_labelled"] = s["pairs_labelled"]
        if self.annotation is not None:
            a = self.annotation.metrics()
            for key in ("labels_per_s", "labels_total", "preferences_total", "pending", "queue_depth",
                        "coverage", "parse_failures", "server_errors", "latency_s"):
                if key in a:
                    out[f"annotation/{key}"] = float(a[key])
        if self.rm_trainer is not None:
            out["reward_model/steps"] = self.rm_trainer.total_steps
            out["reward_model/steps_owed"] = self.rm_budget.owed
            for key in ("loss", "train_accuracy", "accuracy"):
                if key in self.rm_last and np.isfinite(self.rm_last[key]):
                    out[f"reward_model/{key}"] = float(self.rm_last[key])
            for key in ("heldout_accuracy", "heldout_balanced_accuracy"):
                if key in self.heldout and np.isfinite(self.heldout[key]):
                    out[f"reward_model/{key}"] = float(self.heldout[key])
        out.update(self._window.metrics())
        self._window.write_top(os.path.join(self.run_dir, TOP_MESSAGES_NAME), self.kind)
        self._window.reset()
        return out

    def state_dict(self) -> dict:
        """Called at each checkpoint: also writes the caption store beside it."""
        state = {"kind": self.kind, "transform": self.transform.state_dict(), "store_path": self.save_store()}
        if hasattr(self.reward, "state_dict"):
            state["reward"] = self.reward.state_dict()
        if self.rm_trainer is not None:
            state["rm_trainer"] = self.rm_trainer.state_dict()
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if not state or state.get("kind") != self.kind:
            log.warning("checkpoint has no %s intrinsic-reward state; starting it fresh", self.kind)
            return
        self.transform.load_state_dict(state["transform"])
        if "reward" in state and hasattr(self.reward, "load_state_dict"):
            self.reward.load_state_dict(state["reward"])
        if "rm_trainer" in state and self.rm_trainer is not None:
            self.rm_trainer.load_state_dict(state["rm_trainer"])
        if "sampler" in state and self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])

    def close(self, save: bool = True) -> None:
        """Stops the annotation worker and the embedded server; saves the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.annotation is not None:
                self.annotation.close()
            if save:
                self.save_store()
        finally:
            if self.server is not None:
                self.server.stop()
                self.server = None


class _StepBudget:
    """Spreads the reward-model steps the schedule asks for so that training takes at most
    ``fraction`` of the wall time (0: run every step at once, ONI's behaviour).

    Credit accrues as ``fraction ×`` the wall time between calls (minus the training itself);
    steps run while the credit covers their measured cost. Owed steps are capped at
    ``max_owed``: on a slow CPU the schedule's demand can exceed any budget, and old debt is
    worth less than fresh labels.
    """

    def __init__(self, fraction: float, max_owed: int):
        self.fraction = float(fraction)
        self.max_owed = int(max_owed)
        self.owed = 0
        self.credit = 0.0
        self.step_cost: Optional[float] = None
        self._last = time.perf_counter()
        self._spent_since = 0.0

    def steps_now(self, new_steps: int) -> int:
        now = time.perf_counter()
        self.owed = min(self.owed + int(new_steps), self.max_owed) if self.fraction > 0 else int(new_steps)
        if self.fraction <= 0:
            n, self.owed = self.owed, 0
            return n
        self.credit += self.fraction * max(now - self._last - self._spent_since, 0.0)
        self._last, self._spent_since = now, 0.0
        if not self.owed:
            return 0
        if self.step_cost is None:
            return 1  # measure one step first
        n = min(self.owed, int(self.credit // self.step_cost))
        return n

    def spent(self, steps: int, seconds: float) -> None:
        self._spent_since += seconds
        if steps:
            cost = seconds / steps
            self.step_cost = cost if self.step_cost is None else 0.8 * self.step_cost + 0.2 * cost
        if self.fraction > 0:
            self.owed = max(self.owed - steps, 0)
            self.credit = max(self.credit - seconds, -10 * (self.step_cost or 0.0))


class _RewardWindow:
    """Intrinsic reward statistics since the last ``metrics()`` call, and who earned them over
    the last ``batches`` collected batches (so top_messages.txt is never empty by accident)."""

    def __init__(self, top: int = 25, batches: int = 20):
        import collections

        self.top = top
        self.recent = collections.deque(maxlen=batches)  # per batch: {hash: [paid, steps, R, bytes]}
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.total = 0.0
        self.rewarded = 0

    def add(self, batch: TensorDictBase, transform) -> None:
        value = batch.get(("next", transform.out_key)).reshape(-1)
        source = batch if transform.message == "acted" else batch.get("next")
        hashes = source.get(transform.hash_key).reshape(-1)
        raw = transform.last_raw
        self.steps += value.numel()
        self.total += float(value.sum())
        paid = value != 0
        self.rewarded += int(paid.sum())
        by_hash: Dict[int, list] = {}
        self.recent.append(by_hash)
        if not bool(paid.any()):
            return
        unique, inverse = torch.unique(hashes[paid], return_inverse=True)
        sums = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, inverse, value[paid].double())
        counts = torch.bincount(inverse, minlength=len(unique))
        rows = torch.nonzero(paid).squeeze(1)
        first = torch.full((len(unique),), len(rows), dtype=torch.int64).scatter_reduce_(
            0, inverse, torch.arange(len(rows)), reduce="amin")
        messages = source.get(transform.message_key).reshape(-1, MESSAGE_LEN)
        for k, h in enumerate(unique.tolist()):
            row = int(rows[first[k]])
            r = float(raw[row]) if raw is not None else float("nan")
            by_hash[h] = [float(sums[k]), int(counts[k]), r, messages[row].numpy().tobytes()]

    def merged(self) -> Dict[int, list]:
        out: Dict[int, list] = {}
        for by_hash in self.recent:
            for h, (paid, steps, raw, msg) in by_hash.items():
                entry = out.setdefault(h, [0.0, 0, raw, msg])
                entry[0] += paid
                entry[1] += steps
                entry[2] = raw  # the latest R(m): rewards change as models train
        return out

    def metrics(self) -> Dict[str, float]:
        if not self.steps:
            return {}
        return {"intrinsic/mean": self.total / self.steps, "intrinsic/rewarded_fraction": self.rewarded / self.steps}

    def write_top(self, path: str, kind: str) -> None:
        merged = self.merged()
        ranked = sorted(merged.values(), key=lambda e: -e[0])[: self.top]
        steps = sum(e[1] for e in merged.values())
        lines = [f"# top rewarded messages of the last {len(self.recent)} batches ({kind}; {steps} rewarded "
                 f"steps, {len(merged)} distinct messages; {time.strftime('%Y-%m-%d %H:%M:%S')})",
                 "# paid_total\tsteps\tR(m)\tmessage"]
        for paid, steps, raw, msg in ranked:
            text = decode_message(np.frombuffer(msg, dtype=np.uint8)) or "<empty>"
            lines.append(f"{paid:.4f}\t{steps}\t{raw:.4f}\t{text}")
        tmp = path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
            os.replace(tmp, path)
        except OSError as err:  # logging must never stop training
            log.warning("cannot write %s: %s", path, err)


def build_intrinsic_hooks(cfg: TrainConfig) -> List:
    """Hooks for ``cfg.intrinsic_reward``; ``none`` needs none.

    Example:
        >>> from torchrl_oni.train import TrainConfig
        >>> build_intrinsic_hooks(TrainConfig())
        []
    """
    if cfg.intrinsic_reward == "none":
        return []
    return [IntrinsicRewardHook(cfg)]
