"""The labelling side of an intrinsic-reward run: who labels captions, where labels are kept,
which captions are bought, and the page people label on.

One :class:`Labelling` per run, built by :func:`~torchrl_oni.train.build.build_run` from the
``annotation`` and ``feedback`` sections and held by
:class:`~torchrl_oni.train.intrinsic.IntrinsicRewardHook` (the reward pipeline), all of it in the
trainer process:

* a :class:`~torchrl_oni.store.CaptionStore`, loaded from ``--caption-store`` (default
  ``<logdir>/captions.pt``) when the file exists and saved at every checkpoint and at exit, so
  a label is never paid for twice, across restarts included; it hands unseen captions to the
  annotator in the order ``--claim-order`` says (default ``seen_rate``);
* an annotator: ``--annotator scripted`` (rules, no LLM), ``--llm-url URL`` (any
  OpenAI-compatible server, checked once at start) or, with no URL, the embedded CPU server
  (:func:`~torchrl_oni.serve.start_embedded_server`), stopped at exit; an LLM judge of single
  captions is first asked the calibration probe (:func:`check_judge`);
* on each update's batch: the :class:`~torchrl_oni.annotation.LLMAnnotationTransform` (new
  captions go to the annotator in the background);
* its numbers (``labels/*``, ``annotation/*``, ``human/*``, the judge probe's) and its alarms:
  label coverage near zero, a judge that approves most captions.

Label-efficient annotation (all optional, see :mod:`torchrl_oni.queries`):
``--label-budget N [--label-schedule S]`` and ``--query-selection R``: the annotation worker
claims captions through a :class:`~torchrl_oni.queries.SelectiveClaim` (the budget, in labels
per million frames, is read at the trainer's frame count; ``disagree``/``entropy`` rank the
unlabelled captions the store hands out first by the reward model's members). Ranking applies both to the
pairs it queues (:class:`~torchrl_oni.rewards.ranking.PairQueue`).

Human feedback (``--human-feedback``): the labelling page of :mod:`torchrl_oni.feedback` runs in
a thread of its own on the run's live caption store from the start to the end of the run. People's
labels are kept over the LLM's (:data:`~torchrl_oni.store.HUMAN` precedence) and reach the reward
from the next batch: retrieval reads the store, reward models train on its labels. The page
never blocks training; its numbers are logged as ``human/*``. With it, the env workers also
return the terminal (``NLEBatchEnv(screens=True)``): the screen of each caption new to the store
is kept (:class:`~torchrl_oni.feedback.screens.ScreenSnapshots`, saved as
``<store>.screens.pt`` beside the store, where ``oni-label`` finds it) and dropped from the batch
before PPO.

A caption store reused from another run keeps that run's labels: use a fresh ``--caption-store``
when changing ``--goal`` or the annotator.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from tensordict import TensorDictBase

from ..captions import caption_hash
from .annotator_types import _ask_then_close, get_annotator, start_llm
from .labelling_health import LabellingHealth

__all__ = ["Labelling", "make_annotator", "check_judge"]

log = logging.getLogger("torchrl_oni.train")

# Warn while fewer than LOW_COVERAGE of the steps have a labelled caption, COVERAGE_GRACE_S
# after training started (the first update: the server answered by then, so its start-up is not
# counted), at most every ALERT_EVERY_S; the final summary warns below FINAL_COVERAGE_WARNING.
LOW_COVERAGE = 0.05
# While the run goes on: a judge that has approved at least JUDGE_POSITIVE_ALARM of at least
# JUDGE_MIN_LABELS captions pays most steps (ONI's LLM approved ~10-20 %; a mis-prompted one 93 %);
# one that approved at most JUDGE_NEGATIVE_ALARM of them pays almost nothing (a short-prompted
# 0.5B model approved 1 of 48): either way the reward is not ONI's
JUDGE_POSITIVE_ALARM = 0.5
JUDGE_NEGATIVE_ALARM = 0.02
JUDGE_MIN_LABELS = 200
EMPTY_CAPTION_HASH = caption_hash(b"")
COVERAGE_GRACE_S = 60.0
ALERT_EVERY_S = 60.0
JUDGE_CPU_EVERY_S = 10.0  # how often the judge's CPU share is read from /proc (milliseconds a reading)
FINAL_COVERAGE_WARNING = 0.5


def make_annotator(ann, *, seed: int = 0):
    """``(annotator, server_handle or None)`` for the ``annotation`` section ``ann``, checked to
    answer; ``seed``: the run's (a simulated teacher's noise).

    Built by the ``--annotator`` entry of the registry (:mod:`torchrl_oni.train.annotator_types`):
    rules (``scripted``), a simulated noisy teacher (``teacher``), or an LLM (``llm``:
    :func:`start_llm`, a pool of ``--llm-url`` servers or the embedded CPU server).
    """
    return get_annotator(ann.annotator).build(ann, seed=seed)


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


class Labelling:
    """The labelling service of one intrinsic reward type (see the module docstring).

    Started in two steps around the reward's construction: :meth:`open` (annotator or LLM
    endpoint, judge probe, caption store) before it, :meth:`start` (label claims, the annotation
    worker, the labelling page) after, since budgets by disagreement and the page's order read
    the reward model; :meth:`close` stops it all.

    Args:
        ann: the ``annotation`` section (:class:`~torchrl_oni.train.config.AnnotationConfig`).
        feedback: the ``feedback`` section (the labelling page).
        spec: the reward type's registry entry (:class:`~torchrl_oni.train.reward_types.RewardType`).
        store_path: where the caption store is loaded from and saved (``--caption-store``, or the
            run folder's ``captions.pt``).
        seed: the run's seed (a simulated teacher's noise, the query rules' draws).
        total_frames: the run's frames (a label budget's schedule).
    """

    def __init__(self, ann, feedback, spec, *, store_path: str, seed: int = 0, total_frames: int):
        self.ann_cfg = ann
        self.feedback_cfg = feedback
        self.spec = spec
        self.kind = spec.name
        self.seed = seed
        self.total_frames = total_frames
        # an annotator that answers (not ``store``): labels are expected to keep coming
        self.watched = get_annotator(ann.annotator).answers
        self.store = None
        self._store_file = store_path
        self.store_path: Optional[str] = None  # set once the store is open (types labelled by an annotator)
        self.server = None
        self.annotator = None  # handed to the reward type and to the annotation worker
        self.llm = None  # an LLMEndpoint for types that ask an LLM themselves (ELLM)
        self.annotation = None
        self.claim = None
        self.feedback = None
        self.snapshots = None
        self.frames = 0
        self.started: Optional[float] = None  # the first update: see COVERAGE_GRACE_S
        self.last_alert = float("-inf")
        self.health = LabellingHealth()
        self.final_health: Optional[str] = None
        self.judge = None  # the calibration probe's report (LLM judges of captions)
        self.judge_said = False
        self.judge_cpu = None  # the embedded judge process's share of the run's CPU time

    # ------------------------------------------------------------------ starting
    def open(self) -> None:
        """The annotator (first: a dead server fails fast), the judge probe and the caption
        store; or the LLM endpoint of a type that sends requests of its own."""
        ann = self.ann_cfg
        entry = get_annotator(ann.annotator)
        if self.spec.needs_annotator:
            self.annotator, self.server = make_annotator(ann, seed=self.seed)
            if self.spec.labels and entry.judged:
                self.judge = check_judge(self.annotator, ann.goal)  # before its first real label
                if self.judge is not None:
                    problem = self.judge.problem()
                    (log.warning if problem else log.info)("%s%s", self.judge.summary(),
                                                           f"\n!! {problem}" if problem else "")
            self._open_store()
        elif self.spec.llm and entry.llm:
            self.llm, self.server = start_llm(ann)
        process = getattr(self.server, "process", None)  # the embedded judge in a process of its own
        if process is not None:
            from .cpu_share import CpuShare

            self.judge_cpu = CpuShare(os.getpid(), process.pid, every_s=JUDGE_CPU_EVERY_S)

    def start(self, reward) -> None:
        """Label claims (budget, query rule), the background annotation worker and the labelling
        page for people (``--human-feedback``), once ``reward`` is built."""
        self._start_worker(reward)
        if self.feedback_cfg.human_feedback:
            self._start_feedback(reward)

    def _start_worker(self, reward) -> None:
        if not self.spec.needs_annotator:
            return
        from ..annotation import LLMAnnotationTransform

        ann = self.ann_cfg
        self.claim = self._make_claim(reward)
        self.annotation = LLMAnnotationTransform(
            self.store, self.annotator, batch_size=ann.llm_batch_size,
            max_concurrency=ann.llm_concurrency, captions=self.spec.labels,
            pairs=self.spec.pairs, close_annotator=True, poll_interval_s=0.5, claim=self.claim,
        )

    def wake(self) -> None:
        """Called after work was queued (pairs) so the annotation worker picks it up."""
        if self.annotation is not None:
            self.annotation.worker.wake()

    @staticmethod
    def _member_probabilities(reward):
        """``uint8[N,256] -> float[N, M]``: the caption reward model's members' P(helpful), or None."""
        if hasattr(reward, "member_probabilities"):  # ClassifierEnsemble
            return reward.member_probabilities
        if hasattr(reward, "helpful_probability"):  # one ClassificationReward: a one-member "ensemble"
            return lambda messages: reward.helpful_probability(messages)[:, None]
        return None

    def _make_claim(self, reward):
        """A :class:`~torchrl_oni.queries.SelectiveClaim` when a budget or a rule other than the
        store's own order (``--claim-order``) is asked for single captions; else None (``store.claim``)."""
        from ..queries import LabelBudget, SelectiveClaim

        ann = self.ann_cfg
        if not self.spec.labels or (ann.label_budget is None and ann.query_selection == "frequency"):
            return None
        budget = None
        if ann.label_budget is not None:
            budget = LabelBudget(ann.label_budget, ann.label_schedule, total_frames=self.total_frames)
        member_probs = self._member_probabilities(reward) if ann.query_selection in ("disagree", "entropy") else None
        if ann.query_selection in ("disagree", "entropy") and member_probs is None:
            raise ValueError(f"--query-selection {ann.query_selection} needs a reward model of captions "
                             f"(--intrinsic-reward classification), not {self.kind!r}")
        # a few requests' worth of candidates: each is scored by every member on every claim
        pool = max(4 * ann.llm_batch_size, 64)
        return SelectiveClaim(self.store, ann.query_selection, budget=budget, member_probs=member_probs,
                              pool_size=pool, seed=self.seed)

    def _start_feedback(self, reward) -> None:
        """The labelling page on the live store, and the screens shown beside its captions."""
        from ..feedback import serve_feedback

        fb = self.feedback_cfg
        if self.snapshots is None:
            self.snapshots = self._load_screens()
        scorer = pair_scorer = None
        if getattr(reward, "members", None) is not None and len(reward.members) > 1:
            # an ensemble: show people first what its members disagree on most
            scorer = getattr(reward, "member_probabilities", None)
            pair_scorer = getattr(reward, "pair_probabilities", None)
        # prints the address once (with its access token off loopback)
        self.feedback = serve_feedback(self.store, fb.feedback_host, fb.feedback_port, snapshots=self.snapshots,
                                       scorer=scorer, pair_scorer=pair_scorer)

    # ------------------------------------------------------------------ each batch
    def on_batch(self, batch: TensorDictBase, trainer=None) -> TensorDictBase:
        """The frame count for budgets, screens for the page, new captions to the annotator."""
        self.frames = int(trainer.frames) if trainer is not None else self.frames + batch.numel()
        if self.claim is not None:
            self.claim.set_frames(self.frames)
        batch = self._offer_screens(batch)
        if self.annotation is not None:
            batch = self.annotation(batch)
        return batch

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

        self.store_path = self._store_file
        order = self.ann_cfg.claim_order  # the run's setting, over the one a reused store was saved with
        if os.path.exists(self.store_path):
            self.store = CaptionStore.load(self.store_path, claim_order=order)
            log.info("caption store: %d captions (%d labelled) from %s", len(self.store),
                     self.store.stats()["labelled"], self.store_path)
        else:
            self.store = CaptionStore(claim_order=order)
        for source in self.ann_cfg.labels_from:
            self._import_labels(source)
        if self.feedback_cfg.human_feedback:
            self.snapshots = self._load_screens()  # before any work: a damaged file ends the run here

    def _import_labels(self, source: str) -> None:
        """Copies the caption labels of ``--labels-from`` store ``source`` into the run's store
        (at every start: on ``--resume`` the run's store has them already and keeps its own).

        Raises:
            ValueError: ``source`` is missing, unreadable or holds no labels (one sentence).
        """
        from ..store.labels_file import is_labels_file, load_labels

        if os.path.abspath(source) == os.path.abspath(self.store_path):
            raise ValueError(f"--labels-from {source} is this run's own caption store")
        try:
            other = load_labels(source)  # a caption store, or a labels file (.jsonl[.gz])
        except FileNotFoundError:
            kind = "labels file" if is_labels_file(source) else "caption store"
            raise ValueError(f"--labels-from: no {kind} at {source}") from None
        except ValueError as err:  # damaged or foreign: the loader says which in one sentence
            raise ValueError(f"--labels-from: {err}") from None
        counts = self.store.import_labels(other)
        if counts["imported"] + counts["kept"] == 0:
            raise ValueError(f"--labels-from {source}: it holds no labelled caption")
        log.info("labels from %s: %d captions imported (%d approved), %d already labelled here kept "
                 "(%d of them labelled otherwise there)", source, counts["imported"], counts["positive"],
                 counts["kept"], counts["disagreeing"])

    def _load_screens(self):
        """The screens saved beside the caption store (``<store>.screens.pt``), or an empty table.

        Raises:
            ValueError: the file is damaged or not a screens file (one sentence, as ``oni-label``
                says it): the run would overwrite it at its first checkpoint.
        """
        from ..feedback import ScreenSnapshots
        from ..feedback.cli import default_screens_path

        path = default_screens_path(Path(self.store_path))
        if not path.is_file():
            return ScreenSnapshots()
        try:
            return ScreenSnapshots.load(path)
        except ValueError as err:
            raise ValueError(f"{err}; --human-feedback would replace it at the first checkpoint: move it away to "
                             f"start without the saved screens") from None

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

    # ------------------------------------------------------------------ numbers
    def metrics(self, out: Dict[str, float]) -> None:
        """Adds ``labels/*``, ``annotation/*`` and ``human/*`` to ``out``."""
        if self.store is not None:
            s = self.store.stats()
            out["labels/captions"] = s["size"]
            out["labels/labelled"] = s["labelled"]
            out["labels/failed"] = s["failed"]
            out["labels/positive_fraction"] = s["positives"] / s["labelled"] if s["labelled"] else 0.0
            out["labels/seen_coverage"] = s["seen_coverage"]
            out["labels/seen_captions"] = s["seen_captions"]  # differs from labels/captions with --labels-from
            out["labels/seen_labelled"] = s["seen_labelled"]
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
        if self.annotation is not None and self.watched:
            out.update(self.health.metrics())
        if self.claim is not None:
            for key, value in self.claim.metrics().items():
                out[f"annotation/{key}"] = float(value)
        if self.feedback is not None:
            self._feedback_metrics(out)
        share = self.judge_cpu.sample() if self.judge_cpu is not None else None
        if share is not None:
            out["annotation/judge_cpu_share"] = share

    def judge_metrics(self, out: Dict[str, float]) -> None:
        """Adds the judge probe's numbers to ``out`` (when it was asked)."""
        if self.judge is not None:
            out.update(self.judge.metrics())

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
    def alerts(self, metrics: Dict[str, float]) -> List[str]:
        """The warning lines to print above the progress bar now (often none): the labelling's
        health (servers down, labels stopped, servers back: :class:`LabellingHealth`), a judge
        whose labels are not ONI's, label coverage near zero. Called once an update."""
        if self.annotation is None:
            return []
        now = time.monotonic()
        if self.started is None:
            self.started = now
        lines: List[str] = []
        if self.watched:
            labels = metrics.get("annotation/labels_total", 0) + metrics.get("annotation/preferences_total", 0)
            lines += self.health.update(int(labels), int(metrics.get("annotation/queue_depth", 0)),
                                        self.annotation.servers(), cause=self.annotation.health)
        judge = self.judge_problem(metrics)
        if judge and (not self.judge_said or now - self.last_alert >= ALERT_EVERY_S):
            self.judge_said, self.last_alert = True, now
            return lines + [judge]
        coverage = self.coverage(metrics)
        if now - self.started < COVERAGE_GRACE_S or coverage >= LOW_COVERAGE or now - self.last_alert < ALERT_EVERY_S:
            return lines
        if lines:  # the health line said why already
            return lines
        self.last_alert = now
        what = "of steps have a labelled caption" if self.spec.labels else "of queued pairs are labelled"
        return [f"intrinsic reward: only {coverage:.1%} {what} {now - self.started:.0f} s into training; "
                f"annotation: {self.annotation.health()}"]

    def bar_fields(self, metrics: Dict[str, float]) -> List[str]:
        """The progress bar's words on labelling: both coverages, the queue, the rate, the server."""
        fields = []
        if "labels/seen_coverage" in metrics:
            seen = metrics.get("labels/seen_captions", 0)
            captions = metrics.get("labels/seen_labelled", 0) / seen if seen else 0.0
            fields.append(f"labelled={metrics['labels/seen_coverage']:.0%} steps {captions:.0%} captions")
        if "annotation/queue_depth" in metrics:
            fields.append(f"queue={metrics['annotation/queue_depth']:,.0f}")
        if "annotation/labels_per_s" in metrics:
            fields.append(f"labels/s={metrics['annotation/labels_per_s']:.1f}")
        if self.annotation is not None and self.watched and self.health.started is not None:
            fields.append(f"llm={self.health.state()}")
        return fields

    def judge_problem(self, metrics: Dict[str, float]) -> Optional[str]:
        """The probe's verdict, or the positive rate of this run's labels when it pays most steps
        or almost none."""
        if self.judge is not None and self.judge.problem():
            return f"judge probe: {self.judge.problem()}"
        if not self.spec.labels or self.store is None:
            return None
        from ..annotators.probe import ADVICE

        labelled, positive = metrics.get("labels/labelled", 0), metrics.get("labels/positive_fraction", 0.0)
        if labelled >= JUDGE_MIN_LABELS and positive >= JUDGE_POSITIVE_ALARM:
            return (f"the judge approved {positive:.0%} of the {int(labelled):,} captions it labelled: the intrinsic "
                    f"reward pays most steps, a survival bonus instead of ONI; {ADVICE}")
        if (labelled >= JUDGE_MIN_LABELS and "labels/positive_fraction" in metrics and positive <= JUDGE_NEGATIVE_ALARM
                and self.watched):
            approved = int(round(positive * labelled))
            return (f"the judge approved only {approved:,} of the {int(labelled):,} captions it labelled "
                    f"({positive:.1%}; ONI's judge approved 10-20 %): the intrinsic reward pays almost nothing and "
                    f"ONI does nothing; {ADVICE}")
        label, found = self.store.lookup(np.array([EMPTY_CAPTION_HASH], dtype=np.int64))
        if bool(found[0]) and float(label[0]) > 0.5:  # the commonest caption of all: it would pay most steps
            return (f"the judge labelled the empty message (no message on screen) as progress, so most steps are "
                    f"paid; {ADVICE}")
        return None

    def coverage(self, metrics: Dict[str, float]) -> float:
        """Share of steps whose caption is labelled (pairs-only types: share of pairs labelled)."""
        if self.spec.labels:
            return metrics.get("labels/seen_coverage", 0.0)
        pairs = metrics.get("labels/pairs", 0)
        return metrics.get("labels/pairs_labelled", 0) / pairs if pairs else 0.0

    def _counts(self, metrics: Dict[str, float]):
        """``(labelled, seen, unit)`` of what this run saw: captions (of those it met; --labels-from
        also brings captions it never met) or pairs."""
        if self.spec.labels:
            done = metrics.get("labels/seen_labelled", metrics.get("labels/labelled", 0))
            return int(done), int(metrics.get("labels/seen_captions", metrics.get("labels/captions", 0))), "captions"
        return int(metrics.get("labels/pairs_labelled", 0)), int(metrics.get("labels/pairs", 0)), "pairs"

    def summary_lines(self, metrics: Dict[str, float]) -> List[str]:
        """Plain lines for the run's summary: how long labelling was stopped, what never got a label."""
        if self.annotation is None or not self.watched or self.health.started is None:
            return []
        done, seen, unit = self._counts(metrics)
        lines = self.health.summary_lines(max(seen - done, 0), seen, unit)[0]
        share = metrics.get("annotation/judge_cpu_share")
        if share is not None:
            ann = self.ann_cfg
            lines.append(f"the embedded judge ({ann.embedded_dtype}, {ann.embedded_threads or 1} thread"
                         f"{'s' if (ann.embedded_threads or 1) > 1 else ''}) used {share:.0%} of this run's CPU time")
        return lines

    def final_warnings(self, metrics: Dict[str, float]) -> List[str]:
        """Lines the run's summary must show when labels never came or stopped for long, or the
        judge pays most steps or almost none; the reward's own lines go after these."""
        if self.annotation is None:
            return []
        lines: List[str] = []
        judge = self.judge_problem(metrics)
        if judge:
            lines = [judge]
        done, total, unit = self._counts(metrics)
        if self.watched and self.health.started is not None:
            lines = self.health.summary_lines(max(total - done, 0), total, unit)[1] + lines
        coverage = self.coverage(metrics)
        if coverage >= FINAL_COVERAGE_WARNING:
            return lines
        budget = self.ann_cfg.label_budget
        if budget is not None:  # few labels is what was asked for: say so, not "barely ran"
            return [f"label budget: {done:,} of {total:,} {unit} labelled ({coverage:.1%}) under "
                    f"--label-budget {budget:g} per million frames"] + lines
        health = self.final_health or self.annotation.health(window_s=float("inf"))
        return [f"ONI barely ran: {done:,} of {total:,} {unit} labelled ({coverage:.1%}), so the "
                f"intrinsic reward was mostly 0. Annotation: {health}"] + lines

    # ------------------------------------------------------------------ stopping
    def close(self, save: bool = True) -> None:
        """Stops the labelling page (first: answers given until now land in the saved store), the
        annotation worker (its health over the whole run is kept for the summary), saves the
        store (``save=False``: a run that never started writes none) and stops the embedded LLM
        server this run started, whatever failed before."""
        try:
            if self.feedback is not None:
                self.feedback.stop()
            if self.annotation is not None:
                self.final_health = self.annotation.health(window_s=float("inf"))
                self.annotation.close()
            if save:
                self.save_store()
        finally:
            if self.server is not None:
                self.server.stop()
                self.server = None
