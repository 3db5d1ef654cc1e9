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
* after each PPO iteration (``after_update``): reward-model training for types that have a
  trainer, on the trainer's own :class:`~torchrl_oni.rewards.training.RewardModelSchedule`
  (ONI's rule within a wall-time budget);
* ``metrics()``: label counts and balance, annotation health, reward-model accuracy, the mean
  intrinsic reward and the fraction of steps rewarded; the most rewarded messages of the last
  window go to ``<logdir>/top_messages.txt`` (the CSV holds numbers only).

Label-efficient annotation (all optional, see :mod:`torchrl_oni.queries`):

* ``--label-budget N [--label-schedule S]`` and ``--query-selection R``: the annotation worker
  claims captions through a :class:`~torchrl_oni.queries.SelectiveClaim` (the budget, in labels
  per million frames, is read at the trainer's frame count; ``disagree``/``entropy`` rank the
  most-seen unlabelled captions by the reward model's members). Ranking applies both to the
  pairs it queues (:class:`~torchrl_oni.rewards.ranking.PairQueue`);
* ``--rm-ensemble N``, ``--rm-surf-tau``: the reward type builds an ensemble (and SURF);
* ``--rm-rune-beta B``: RUNE's exploration bonus ``B_t · std_m(prediction_m(caption))``, with
  the same per-episode count decay as the intrinsic reward, is **added to**
  ``("next", "intrinsic_reward")`` before the trainer mixes rewards
  (:class:`~torchrl_oni.transforms.CombineRewards`), so PPO optimises
  ``ext · clip(r_env) + int · (R(m) · count^-β + bonus)`` and, with ``--value-heads 2``, the
  bonus is part of the intrinsic stream. It is logged apart (``intrinsic/rune_bonus``,
  ``intrinsic/rune_beta``; ``intrinsic/mean`` and ``top_messages.txt`` stay the reward alone)
  and ``B_t = B (1 − --rm-rune-decay)^t`` shrinks after every PPO iteration.

Human feedback (``--human-feedback``): the labelling page of :mod:`torchrl_oni.feedback` runs in
a thread of its own on the run's live caption store from the start to the end of the run. People's
labels are kept over the LLM's (:data:`~torchrl_oni.store.HUMAN` precedence) and reach the reward
from the next batch: retrieval reads the store, reward models train on its labels. The page
never blocks training; its numbers are logged as ``human/*``. With it, the env workers also
return the terminal (``NLEBatchEnv(screens=True)``): the screen of each caption new to the store
is kept (:class:`~torchrl_oni.feedback.screens.ScreenSnapshots`, saved as
``<store>.screens.pt`` beside the store, where ``oni-label`` finds it) and dropped from the batch
before PPO.

Reward types come from the registry (:mod:`torchrl_oni.train.reward_types`): each declares
whether it needs labels or pairs from an annotator, its own settings and how it is built; the
hook only assembles what the declaration asks for.

A caption store reused from another run keeps that run's labels: use a fresh ``--caption-store``
when changing ``--goal`` or the annotator.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from tensordict import TensorDictBase

from ..atomic import atomic_write
from ..captions import INTRINSIC_REWARD_KEY, MESSAGE_LEN, caption_hash, decode_message
from ..run_folder import CAPTION_STORE_NAME, TOP_MESSAGES_NAME
from .config import TrainConfig, resolve_device

__all__ = ["build_intrinsic_hooks", "IntrinsicRewardHook", "TOP_MESSAGES_NAME", "CAPTION_STORE_NAME"]

log = logging.getLogger("torchrl_oni.train")

# Warn while fewer than LOW_COVERAGE of the steps have a labelled caption, after the first
# COVERAGE_GRACE_S (the LLM needs a moment), at most every ALERT_EVERY_S; the final summary
# warns below FINAL_COVERAGE_WARNING.
LOW_COVERAGE = 0.05
# While the run goes on: a judge that has approved at least JUDGE_POSITIVE_ALARM of at least
# JUDGE_MIN_LABELS captions pays most steps (ONI's LLM approved ~10-20 %; a mis-prompted one 93 %)
JUDGE_POSITIVE_ALARM = 0.5
JUDGE_MIN_LABELS = 200
EMPTY_CAPTION_HASH = caption_hash(b"")
COVERAGE_GRACE_S = 60.0
ALERT_EVERY_S = 60.0
FINAL_COVERAGE_WARNING = 0.5
# A learned reward (classification, ranking) whose model took fewer steps than this, or still
# scores at chance on its held-out captions, pays noise: ONI's char-CNN needs ~100 Adam steps to
# leave chance, and on a CPU learner under --rm-time-fraction a short run may give it 11.
MIN_REWARD_MODEL_STEPS = 100
CHANCE_BALANCED_ACCURACY = 0.55


def _ask_then_close(annotator, ask):
    """Runs ``await ask()`` on a fresh event loop and closes the annotator's HTTP sessions after
    (the annotation worker opens its own on its loop)."""

    async def run():
        try:
            return await ask()
        finally:
            await annotator.aclose()

    return asyncio.run(run())


def _check_llm(annotator) -> None:
    """Asks the server for its models; raises ``AnnotatorUnavailable`` with one line."""
    _ask_then_close(annotator, annotator.check)


def start_llm(cfg: TrainConfig):
    """``(LLMEndpoint, server_handle or None)``: the OpenAI-compatible servers of ``--llm-url``
    (the model defaults to the only one they list) or the embedded CPU server, started here in a
    process of its own (see :func:`~torchrl_oni.serve.start_embedded_process`)."""
    from ..annotators import resolve_model
    from .reward_types import LLMEndpoint

    ann = cfg.annotation
    if ann.llm_url:
        urls = tuple(ann.llm_url)
        model = resolve_model(list(urls), ann.llm_model, api_key=ann.llm_api_key)
        return LLMEndpoint(urls, model, ann.llm_api_key), None
    from ..serve import DEFAULT_MODEL, start_embedded_process, start_embedded_server

    name, threads = ann.llm_model or DEFAULT_MODEL, ann.embedded_threads or 1
    if ann.embedded_server == "process":
        log.info("starting the embedded LLM %s (a minute or two the first time) ...", name)
        server = start_embedded_process(name, threads=threads)
    else:
        server = start_embedded_server(model=name, threads=threads)
    return LLMEndpoint((server.url,), server.model), server


def make_annotator(cfg: TrainConfig):
    """``(annotator, server_handle or None)`` for ``cfg.annotation``, checked to answer.

    Rules (``--annotator scripted``), a simulated noisy teacher (``teacher``), or an LLM
    (:func:`start_llm`: a pool of ``--llm-url`` servers or the embedded CPU server).
    """
    from ..annotators import OpenAIAnnotator, ScriptedAnnotator

    ann = cfg.annotation
    if ann.annotator == "scripted":
        return ScriptedAnnotator(goal=ann.goal), None
    if ann.annotator == "teacher":
        import math

        from ..annotators import SimulatedTeacher

        beta = math.inf if ann.teacher_beta is None else ann.teacher_beta
        return SimulatedTeacher(ann.goal, beta=beta, epsilon=ann.teacher_epsilon, seed=cfg.seed), None
    endpoint, server = start_llm(cfg)
    # the embedded server gets ONI's short yes/no prompt scored by logprobs; a URL gets the tagged prompt
    prompt = ann.llm_prompt if ann.llm_prompt != "auto" else ("short" if server is not None else "tagged")
    small = prompt == "short"
    try:
        annotator = OpenAIAnnotator(
            list(endpoint.urls), endpoint.model, goal=ann.goal, prompt=prompt, use_logprobs=small,
            ranking="scores" if small else "direct", batch_size=ann.llm_batch_size,
            max_concurrency=ann.llm_concurrency, timeout_s=ann.llm_timeout, api_key=ann.llm_api_key,
        )
        _check_llm(annotator)
    except BaseException:
        if server is not None:
            server.stop()
        raise
    return annotator, server


def check_judge(annotator, goal: str):
    """Runs the calibration probe (:mod:`torchrl_oni.annotators.probe`) on ``annotator``: the
    :class:`~torchrl_oni.annotators.probe.JudgeReport`, or ``None`` when the probe could not be
    asked (a server fault: the annotation worker's own retries deal with those)."""
    from ..annotators.probe import probe_judge

    try:
        return _ask_then_close(annotator, lambda: probe_judge(annotator, goal))
    except Exception as err:  # noqa: BLE001 — the probe must never stop a run
        log.warning("judge probe not run: %s", str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None


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
        from ..rewards.training import RewardModelSchedule
        from .reward_types import RewardContext, reward_types
        from ..transforms import IntrinsicRewardTransform

        cfg = cfg.resolved()
        if cfg.reward.intrinsic_reward == "none":
            raise ValueError("IntrinsicRewardHook needs an --intrinsic-reward other than 'none'")
        self.cfg = cfg
        self.kind = cfg.reward.intrinsic_reward
        self.spec = reward_types()[self.kind]
        self.run_dir = cfg.log.logdir
        self.store = None
        self.store_path: Optional[str] = None
        self.server = None
        self.annotation = None
        self.parts = None
        self.claim = None
        self.rune = None
        self.feedback = None
        self.snapshots = None
        self._frames = 0
        self.heldout: Dict[str, float] = {}
        self.rm_last: Dict[str, float] = {}
        self._window = _RewardWindow()
        self._rune_sum, self._rune_steps = 0.0, 0
        self._closed = False
        self._started = self._last_alert = time.monotonic()
        self._final_health: Optional[str] = None
        self.judge = None  # the calibration probe's report (LLM judges of captions)
        self._judge_said = False
        annotator = None
        try:
            device = resolve_device(cfg.device)  # reward models sit with the learner, never on env workers
            llm = None
            if self.spec.needs_annotator:
                annotator, self.server = make_annotator(cfg)  # first: a dead server fails fast
                if self.spec.labels and cfg.annotation.annotator == "llm":
                    self.judge = check_judge(annotator, cfg.annotation.goal)  # before its first real label
                    if self.judge is not None:
                        problem = self.judge.problem()
                        (log.warning if problem else log.info)("%s%s", self.judge.summary(),
                                                               f"\n!! {problem}" if problem else "")
                self._open_store()
            elif self.spec.llm and cfg.annotation.annotator == "llm":
                llm, self.server = start_llm(cfg)
            rm = cfg.reward_model
            fraction = rm.time_fraction
            if fraction is None:
                fraction = 0.1 if device.type == "cpu" else 0.0
            schedule = RewardModelSchedule(rm.steps_per_labels, rm.switch_at, rm.steps_per_iteration,
                                           time_fraction=fraction)
            settings = getattr(cfg.reward, self.kind.replace("-", "_"), None) if self.spec.settings else None
            self.parts = self.spec.build(RewardContext(cfg=cfg, settings=settings, store=self.store, device=device,
                                                       schedule=schedule, annotator=annotator, llm=llm,
                                                       wake_annotator=self._wake_annotator))
            self.reward = self.parts.reward
            self.rm_trainer = self.parts.trainer
            if self.spec.needs_annotator:
                from ..annotation import LLMAnnotationTransform

                self.claim = self._make_claim()
                self.annotation = LLMAnnotationTransform(
                    self.store, annotator, batch_size=cfg.annotation.llm_batch_size,
                    max_concurrency=cfg.annotation.llm_concurrency, captions=self.spec.labels,
                    pairs=self.spec.pairs, close_annotator=True, poll_interval_s=0.5, claim=self.claim,
                )
            if rm.rune_beta > 0:
                from ..transforms import rune_transform

                self.rune = rune_transform(self.reward, rm.rune_beta, rm.rune_decay, message=cfg.reward.reward_message,
                                           count_beta=cfg.reward.count_exponent)
            if cfg.feedback.human_feedback:
                self._start_feedback()
        except BaseException:
            self.close(save=False)  # a run that never started must not write a store
            raise
        # a type without a reward function writes ("next", "intrinsic_reward") in its own on_batch (ELLM)
        self.transform = None if self.reward is None else IntrinsicRewardTransform(
            self.reward, message=cfg.reward.reward_message, beta=cfg.reward.count_exponent,
            normalize=self.parts.normalize, threshold=self.parts.threshold)

    def env_transforms(self) -> list:
        """Transforms every env worker applies (observations the policy needs at acting time)."""
        return list(self.parts.env_transforms) if self.parts is not None else []

    # ------------------------------------------------------------------ label efficiency, people
    def _wake_annotator(self) -> None:
        if self.annotation is not None:
            self.annotation.worker.wake()

    def _member_probabilities(self):
        """``uint8[N,256] -> float[N, M]``: the caption reward model's members' P(helpful), or None."""
        reward = self.reward
        if hasattr(reward, "member_probabilities"):  # ClassifierEnsemble
            return reward.member_probabilities
        if hasattr(reward, "helpful_probability"):  # one ClassificationReward: a one-member "ensemble"
            return lambda messages: reward.helpful_probability(messages)[:, None]
        return None

    def _make_claim(self):
        """A :class:`~torchrl_oni.queries.SelectiveClaim` when a budget or a rule other than the
        store's own most-seen order is asked for single captions; else None (``store.claim``)."""
        from ..queries import LabelBudget, SelectiveClaim

        ann = self.cfg.annotation
        if not self.spec.labels or (ann.label_budget is None and ann.query_selection == "frequency"):
            return None
        budget = None
        if ann.label_budget is not None:
            budget = LabelBudget(ann.label_budget, ann.label_schedule, total_frames=self.cfg.frames)
        member_probs = self._member_probabilities() if ann.query_selection in ("disagree", "entropy") else None
        if ann.query_selection in ("disagree", "entropy") and member_probs is None:
            raise ValueError(f"--query-selection {ann.query_selection} needs a reward model of captions "
                             f"(--intrinsic-reward classification), not {self.kind!r}")
        # a few requests' worth of candidates: each is scored by every member on every claim
        pool = max(4 * ann.llm_batch_size, 64)
        return SelectiveClaim(self.store, ann.query_selection, budget=budget, member_probs=member_probs,
                              pool_size=pool, seed=self.cfg.seed)

    def _start_feedback(self) -> None:
        """The labelling page on the live store, and the screens shown beside its captions."""
        from ..feedback import ScreenSnapshots, serve_feedback
        from ..feedback.cli import default_screens_path

        fb = self.cfg.feedback
        path = default_screens_path(Path(self.store_path))
        self.snapshots = ScreenSnapshots()
        if path.is_file():
            try:
                self.snapshots = ScreenSnapshots.load(path)
            except ValueError as err:  # screens are a convenience: never a reason not to train
                log.warning("starting without the saved screens: %s", err)
        scorer = pair_scorer = None
        if getattr(self.reward, "members", None) is not None and len(self.reward.members) > 1:
            # an ensemble: show people first what its members disagree on most
            scorer = getattr(self.reward, "member_probabilities", None)
            pair_scorer = getattr(self.reward, "pair_probabilities", None)
        # prints the address once (with its access token off loopback)
        self.feedback = serve_feedback(self.store, fb.feedback_host, fb.feedback_port, snapshots=self.snapshots,
                                       scorer=scorer, pair_scorer=pair_scorer)

    def _offer_screens(self, batch: TensorDictBase) -> TensorDictBase:
        """Keeps the screens of captions new to the store; drops the screens from the batch."""
        from ..envs.batched import SCREEN_KEYS

        chars = batch.get("tty_chars", None)
        if chars is None:
            return batch
        if self.snapshots is not None:
            hashes = batch.get("caption_hash").reshape(-1)
            unique, first = np.unique(hashes.numpy(), return_index=True)
            new = self.store.slots(unique).numpy() < 0  # before the annotation transform adds them
            if new.any():
                rows = torch.from_numpy(first[new])
                self.snapshots.offer(unique[new], chars.reshape(-1, *chars.shape[-2:])[rows],
                                     batch.get("tty_colors").reshape(-1, *chars.shape[-2:])[rows])
        # 7.7 kB a step that PPO must not carry through its minibatches
        return batch.exclude(*SCREEN_KEYS, *(("next", k) for k in SCREEN_KEYS))

    # ------------------------------------------------------------------ store
    def _open_store(self) -> None:
        from ..store import CaptionStore

        self.store_path = self.cfg.annotation.caption_store or os.path.join(self.run_dir, CAPTION_STORE_NAME)
        if os.path.exists(self.store_path):
            self.store = CaptionStore.load(self.store_path)
            log.info("caption store: %d captions (%d labelled) from %s", len(self.store),
                     self.store.stats()["labelled"], self.store_path)
        else:
            self.store = CaptionStore()

    def save_store(self) -> Optional[str]:
        """Writes the caption store (labels, pairs) to ``--caption-store``, and the screens kept for
        the labelling page beside it; returns the store's path."""
        if self.store is None or self.store_path is None:
            return None
        self.store.save(self.store_path)
        if self.snapshots is not None and len(self.snapshots):
            from ..feedback.cli import default_screens_path

            try:
                self.snapshots.save(default_screens_path(Path(self.store_path)))
            except OSError as err:  # the store is what matters; screens are a convenience
                log.warning("cannot save the screens beside %s: %s", self.store_path, err)
        return self.store_path

    # ------------------------------------------------------------------ TrainHook API
    def on_batch(self, batch: TensorDictBase, trainer=None) -> TensorDictBase:
        self._frames = int(trainer.frames) if trainer is not None else self._frames + batch.numel()
        if self.claim is not None:
            self.claim.set_frames(self._frames)
        batch = self._offer_screens(batch)
        if self.annotation is not None:
            batch = self.annotation(batch)
        if self.parts.on_batch is not None:
            out = self.parts.on_batch(batch)
            batch = batch if out is None else out
        if self.transform is not None:
            batch = self.transform(batch)
            self._window.add(batch, self.transform)
        if self.rune is not None:
            # RUNE's bonus joins the intrinsic reward before the trainer mixes the rewards
            batch = self.rune(batch)
            bonus = batch.get(("next", self.rune.out_key))
            key = ("next", INTRINSIC_REWARD_KEY)
            batch.set(key, batch.get(key) + bonus)
            self._rune_sum += float(bonus.sum())
            self._rune_steps += bonus.numel()
        return batch

    def after_update(self, trainer=None) -> None:
        if self.rune is not None:
            self.rune.reward.step()
        if self.rm_trainer is None:
            return
        result = self.rm_trainer.after_iteration()
        if result.get("steps"):
            self.rm_last = result
            if hasattr(self.rm_trainer, "evaluate") and self.spec.labels:
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
            out["labels/skipped"] = s["skipped"]
            if self.spec.pairs:
                out["labels/pairs"] = s["pairs"]
                out["labels/pairs_labelled"] = s["pairs_labelled"]
                out["labels/pairs_skipped"] = s["pairs_skipped"]
        if self.annotation is not None:
            a = self.annotation.metrics()
            for key in ("labels_per_s", "labels_total", "preferences_total", "pending", "queue_depth",
                        "coverage", "parse_failures", "skipped", "claim_errors", "server_errors", "latency_s",
                        "requests_sent", "requests_unsent", "timeouts", "connection_errors",
                        "caption_server_failures", "requeued_total", "given_up", "timeout_s", "request_batch",
                        "servers_up"):
                if key in a:
                    out[f"annotation/{key}"] = float(a[key])
        if self.claim is not None:
            for key, value in self.claim.metrics().items():
                out[f"annotation/{key}"] = float(value)
        if self.feedback is not None:
            self._feedback_metrics(out)
        if self.rune is not None:
            out["intrinsic/rune_beta"] = self.rune.reward.beta
            if self._rune_steps:
                out["intrinsic/rune_bonus"] = self._rune_sum / self._rune_steps
            self._rune_sum, self._rune_steps = 0.0, 0
        if self.rm_trainer is not None:
            out["reward_model/steps"] = self.rm_trainer.total_steps
            out["reward_model/steps_owed"] = self.rm_trainer.schedule.owed
            for key in ("loss", "train_accuracy", "accuracy", "pseudo_labelled"):
                if key in self.rm_last and np.isfinite(self.rm_last[key]):
                    out[f"reward_model/{key}"] = float(self.rm_last[key])
            for key in ("heldout_accuracy", "heldout_balanced_accuracy"):
                if key in self.heldout and np.isfinite(self.heldout[key]):
                    out[f"reward_model/{key}"] = float(self.heldout[key])
        if self.judge is not None:
            out.update(self.judge.metrics())
        if self.parts.metrics is not None:
            out.update(self.parts.metrics())
        if self.transform is not None:
            out.update(self._window.metrics())
            self._window.write_top(os.path.join(self.run_dir, TOP_MESSAGES_NAME), self.kind)
            self._window.reset()
        return out

    def _feedback_metrics(self, out: Dict[str, float]) -> None:
        from ..store import HUMAN

        page = self.feedback.metrics()
        out["human/labels"] = page["human_labels"]  # this run's answers
        out["human/compared"] = page["human_compared"]
        if np.isfinite(page["human_agreement"]):  # agreement with the LLM's label, once compared
            out["human/agreement"] = page["human_agreement"]
        held = self.store.count_by(HUMAN)  # every person's label in the store, earlier runs included
        out["human/captions_in_store"] = held["captions"]
        out["human/pairs_in_store"] = held["pairs"]
        out["human/page_up"] = float(self.feedback.running)

    # ------------------------------------------------------------------ saying it loudly
    def alert(self, metrics: Dict[str, float]) -> Optional[str]:
        """A warning line, at most once a minute, while label coverage stays near zero after
        the first minute (with the cause), else None. The trainer prints it above its progress bar."""
        if self.annotation is None:
            return None
        now = time.monotonic()
        judge = self._judge_problem(metrics)
        if judge and (not self._judge_said or now - self._last_alert >= ALERT_EVERY_S):
            self._judge_said, self._last_alert = True, now
            return judge
        coverage = self._coverage(metrics)
        if now - self._started < COVERAGE_GRACE_S or coverage >= LOW_COVERAGE or now - self._last_alert < ALERT_EVERY_S:
            return None
        self._last_alert = now
        what = "of steps have a labelled caption" if self.spec.labels else "of queued pairs are labelled"
        return (f"intrinsic reward: only {coverage:.1%} {what} after {now - self._started:.0f} s; "
                f"annotation: {self.annotation.health()}")

    def _judge_problem(self, metrics: Dict[str, float]) -> Optional[str]:
        """The probe's verdict, or the positive rate of this run's labels when it pays most steps."""
        if self.judge is not None and self.judge.problem():
            return f"judge probe: {self.judge.problem()}"
        if not self.spec.labels or self.store is None:
            return None
        from ..annotators.probe import ADVICE

        labelled, positive = metrics.get("labels/labelled", 0), metrics.get("labels/positive_fraction", 0.0)
        if labelled >= JUDGE_MIN_LABELS and positive >= JUDGE_POSITIVE_ALARM:
            return (f"the judge approved {positive:.0%} of the {int(labelled):,} captions it labelled: the intrinsic "
                    f"reward pays most steps, a survival bonus instead of ONI; {ADVICE}")
        label, found = self.store.lookup(np.array([EMPTY_CAPTION_HASH], dtype=np.int64))
        if bool(found[0]) and float(label[0]) > 0.5:  # the commonest caption of all: it would pay most steps
            return (f"the judge labelled the empty message (no message on screen) as progress, so most steps are "
                    f"paid; {ADVICE}")
        return None

    def _coverage(self, metrics: Dict[str, float]) -> float:
        """Share of steps whose caption is labelled (pairs-only types: share of pairs labelled)."""
        if self.spec.labels:
            return metrics.get("labels/seen_coverage", 0.0)
        pairs = metrics.get("labels/pairs", 0)
        return metrics.get("labels/pairs_labelled", 0) / pairs if pairs else 0.0

    def final_warnings(self, metrics: Dict[str, float]) -> List[str]:
        """Lines the run's summary must show when ONI did (almost) nothing: labels that never
        came, or a learned reward whose model never left chance."""
        lines = self._reward_model_warnings(metrics)
        if self.annotation is None:
            return lines
        judge = self._judge_problem(metrics)
        if judge:
            lines = [judge] + lines
        coverage = self._coverage(metrics)
        if coverage >= FINAL_COVERAGE_WARNING:
            return lines
        if self.spec.labels:
            done, total, unit = metrics.get("labels/labelled", 0), metrics.get("labels/captions", 0), "captions"
        else:
            done, total, unit = metrics.get("labels/pairs_labelled", 0), metrics.get("labels/pairs", 0), "pairs"
        budget = self.cfg.annotation.label_budget
        if budget is not None:  # few labels is what was asked for: say so, not "barely ran"
            return [f"label budget: {int(done):,} of {int(total):,} {unit} labelled ({coverage:.1%}) under "
                    f"--label-budget {budget:g} per million frames"] + lines
        health = self._final_health or self.annotation.health(window_s=float("inf"))
        return [f"ONI barely ran: {int(done):,} of {int(total):,} {unit} labelled ({coverage:.1%}), so the "
                f"intrinsic reward was mostly 0. Annotation: {health}"] + lines

    def _reward_model_warnings(self, metrics: Dict[str, float]) -> List[str]:
        if self.rm_trainer is None or "reward_model/steps" not in metrics:
            return []
        steps = int(metrics["reward_model/steps"])
        balanced = metrics.get("reward_model/heldout_balanced_accuracy", float("nan"))
        if steps >= MIN_REWARD_MODEL_STEPS and not balanced <= CHANCE_BALANCED_ACCURACY:
            return []
        held = f"held-out balanced accuracy {balanced:.2f}"
        if steps < MIN_REWARD_MODEL_STEPS:
            what = f"trained only {steps:,} steps" + ("" if np.isnan(balanced) else f", {held}")
        else:  # enough steps, still at chance (a NaN accuracy returned above)
            what = f"trained {steps:,} steps and is still at chance ({held})"
        return [f"the {self.kind} reward model {what}: its reward is close to noise. Give it time "
                "(--rm-time-fraction 0.5 or 0, a longer run) or a GPU learner (--device cuda)"]

    def _stateful(self) -> Dict[str, object]:
        objects = dict(self.parts.stateful or {})
        if hasattr(self.reward, "state_dict"):
            objects["reward"] = self.reward
        if self.rm_trainer is not None:
            objects["rm_trainer"] = self.rm_trainer
            objects["rm_schedule"] = self.rm_trainer.schedule
        if self.claim is not None:
            objects["claim"] = self.claim  # the label budget spent
        if self.rune is not None:
            objects["rune"] = self.rune.reward  # the bonus's decay
        return objects

    def state_dict(self) -> dict:
        """Called at each checkpoint: also writes the caption store beside it."""
        state = {"kind": self.kind, "store_path": self.save_store()}
        if self.transform is not None:
            state["transform"] = self.transform.state_dict()
        for name, obj in self._stateful().items():
            state[name] = obj.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if not state or state.get("kind") != self.kind:
            log.warning("checkpoint has no %s intrinsic-reward state; starting it fresh", self.kind)
            return
        if self.transform is not None and "transform" in state:
            self.transform.load_state_dict(state["transform"])
        for name, obj in self._stateful().items():
            if name in state:
                obj.load_state_dict(state[name])

    def close(self, save: bool = True) -> None:
        """Stops the annotation worker and the embedded server; saves the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.feedback is not None:
                self.feedback.stop()  # first: answers given until now land in the saved store
            if self.parts is not None and self.parts.close is not None:
                self.parts.close()
            if self.annotation is not None:
                self._final_health = self.annotation.health(window_s=float("inf"))
                self.annotation.close()
            if save:
                self.save_store()
        finally:
            if self.server is not None:
                self.server.stop()
                self.server = None


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
        text = ("\n".join(lines) + "\n").encode("utf-8")
        try:
            atomic_write(path, lambda f: f.write(text))
        except OSError as err:  # logging must never stop training
            log.warning("cannot write %s: %s", path, err)


def build_intrinsic_hooks(cfg: TrainConfig) -> List:
    """Hooks for ``cfg.reward.intrinsic_reward``; ``none`` needs none.

    Example:
        >>> from torchrl_oni.train import TrainConfig
        >>> build_intrinsic_hooks(TrainConfig())
        []
    """
    if cfg.reward.intrinsic_reward == "none":
        return []
    return [IntrinsicRewardHook(cfg)]
