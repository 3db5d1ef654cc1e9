"""The trainer hook that produces ``("next", "intrinsic_reward")`` for ``--intrinsic-reward``.

One :class:`IntrinsicRewardHook` owns the reward pipeline of a run, all of it in the trainer
process (the collector's env workers only play); the labelling side (caption store, annotator or
LLM server, annotation worker, label budgets, the labelling page, their numbers and alarms) is
the :class:`~torchrl_oni.train.labelling.Labelling` it holds. The hook is assembled from parts
built elsewhere (:func:`~torchrl_oni.train.build.build_intrinsic_hook`, from the configuration)
and runs at the trainer's stages (:mod:`torchrl_oni.train.hooks`):

* on each update's batch (``on_batch``; the workers' batches gathered for it): the labelling's
  turn (screens, new captions to the annotator in the background), the reward type's own step
  (ranking pairs), then the :class:`~torchrl_oni.transforms.IntrinsicRewardTransform`;
* after each PPO iteration (``after_update``): reward-model training for types that have a
  trainer, on the trainer's own :class:`~torchrl_oni.rewards.training.RewardModelSchedule`
  (ONI's rule within a wall-time budget), then its held-out evaluation: inline, or with
  ``--rm-training background`` (the default on a GPU learner) as a round of a
  :class:`~torchrl_oni.train.background_rounds.BackgroundRounds` thread that the next update never
  waits for (checkpoints pause it between rounds);
* ``metrics()``: label counts and balance, annotation health, reward-model accuracy, the mean
  intrinsic reward and the fraction of steps rewarded; the most rewarded messages of the last
  window go to ``<logdir>/top_messages.txt`` (the CSV holds numbers only; rewritten every
  ``TOP_MESSAGES_EVERY_S`` seconds and at the end);
* the reward-hacking diagnostics (:mod:`torchrl_oni.reward_hacking`): every update batch's
  captions, payments and deaths are tallied per episode (episodes told apart by the collector's
  trajectory ids; 1.4-1.7 ms per 2,048-frame batch, 0.65 % of a 2-core run's wall time); at the
  end of the run ``final_warnings``
  writes ``<logdir>/reward_hacking.json`` and names, in a ``!!`` line of the summary, the paid
  captions that come before deaths far above chance (``hacking/*`` in the last metrics row).

Reward models (all optional):

* ``--rm-ensemble N``, ``--rm-surf-tau``: the reward type builds an ensemble (and SURF);
* ``--rm-rune-beta B`` (the reward type's own batch step, ``RewardParts.after_reward``, see
  :mod:`~torchrl_oni.train.reward_types._rune`): RUNE's exploration bonus ``B_t · std_m(prediction_m(caption))``, with
  the same per-episode count decay as the intrinsic reward, is **added to**
  ``("next", "intrinsic_reward")`` before the trainer mixes rewards
  (:class:`~torchrl_oni.transforms.CombineRewards`), so PPO optimises
  ``ext · clip(r_env) + int · (R(m) · count^-β + bonus)`` and, with ``--value-heads 2``, the
  bonus is part of the intrinsic stream. It is logged apart (``intrinsic/rune_bonus``,
  ``intrinsic/rune_beta``; ``intrinsic/mean`` and ``top_messages.txt`` stay the reward alone)
  and ``B_t = B (1 − --rm-rune-decay)^t`` shrinks after every PPO iteration.

Reward types come from the registry (:mod:`torchrl_oni.train.reward_types`): each declares
whether it needs labels or pairs from an annotator, its own settings and how it is built; the
hook only assembles what the declaration asks for.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Dict, List, Optional

import numpy as np
import torch
from tensordict import TensorDictBase

from ..atomic import atomic_write
from ..captions import (CAPTION_HASH_KEY, INTRINSIC_REWARD_KEY, MESSAGE_KEY, MESSAGE_LEN, RUN_COUNT_KEY,
                        decode_message)
from ..rewards.scaling import RunMessageCounts
from ..reward_hacking.tally import REPORT_NAME as REWARD_HACKING_NAME, EpisodeAssembler, HackingTally
from ..run_folder import TOP_MESSAGES_NAME
from .background_rounds import BackgroundRounds
from .hooks import TrainHook

__all__ = ["IntrinsicRewardHook"]

log = logging.getLogger("torchrl_oni.train")

# A learned reward (classification, ranking) whose model took fewer steps than this, or still
# scores at chance on its held-out captions, pays noise: ONI's char-CNN needs ~100 Adam steps to
# leave chance, and on a CPU learner under --rm-time-fraction a short run may give it 11.
MIN_REWARD_MODEL_STEPS = 100
CHANCE_BALANCED_ACCURACY = 0.55
# top_messages.txt is for a person watching the run: rewritten (atomically, two fsyncs) at most
# this often and at the run's end, not after every update (3-5 ms an update on the 2-core VM)
TOP_MESSAGES_EVERY_S = 10.0
# An intrinsic reward that has paid under LOW_PAID_SHARE of the run's steps once PAID_MIN_LABELS
# captions are labelled, and whose agent does not meet more approved captions per episode than at
# the start (RISING), does nothing a person would call ONI: said like a judge that approves nothing
LOW_PAID_SHARE = 0.005
PAID_MIN_LABELS = 300
RISING = 1.2


class IntrinsicRewardHook(TrainHook):
    """The trainer hook of one intrinsic reward type (see the module docstring), assembled from
    parts already built: :func:`~torchrl_oni.train.build.build_intrinsic_hook` builds them from
    the configuration and hands them over; nothing here reads a configuration.

    Args:
        spec: the reward type's registry entry (:class:`~torchrl_oni.train.reward_types.RewardType`).
        labelling: the run's :class:`~torchrl_oni.train.labelling.Labelling`, open and started;
            the hook closes it.
        parts: what the reward type built (:class:`~torchrl_oni.train.reward_types.RewardParts`).
        run_dir: the run folder (``top_messages.txt``, ``reward_hacking.json``).
        message: which observation's message pays (``--reward-message``: ``acted`` or ``next``).
        count_exponent: beta of the count decay ``R(m) · count^-beta`` (``--count-exponent``).
        count_scope: what the count counts (``--count-scope``: ``episode`` or ``run``).
        rm_background: reward-model rounds run in a thread of their own instead of between
            updates (:attr:`~torchrl_oni.train.config.Derived.rm_background`).
    """

    name = "intrinsic"
    stages = ("batch", "post_update", "metrics", "alert", "bar", "summary", "final_warnings", "state", "close")

    def __init__(self, spec, labelling, parts, *, run_dir: str, message: str = "acted", count_exponent: float = 3.0,
                 count_scope: str = "episode", rm_background: bool = False):
        from ..transforms import IntrinsicRewardTransform

        self.spec = spec
        self.kind = spec.name
        self.run_dir = run_dir
        self.labelling = labelling
        self.parts = parts
        self.reward = parts.reward
        self.rm_trainer = parts.trainer
        self.after_reward = parts.after_reward  # the reward type's own batch step (RUNE's bonus), or None
        self.heldout: Dict[str, float] = {}
        self.rm_last: Dict[str, float] = {}
        self._window = _RewardWindow()
        self._clock = time.monotonic
        self._top_written_at = -float("inf")  # the first metrics row writes top_messages.txt
        self.hacking = _HackingWatch()
        self._paid_said = False
        self._closed = False
        # a type without a reward function writes ("next", "intrinsic_reward") in its own on_batch (ELLM)
        self.transform = None if self.reward is None else IntrinsicRewardTransform(
            self.reward, message=message, beta=count_exponent, normalize=parts.normalize, threshold=parts.threshold)
        # --count-scope run: the decay reads the run's sightings (written into the batch) for msg_count
        self.run_counts = None
        if self.transform is not None and count_scope == "run":
            self.run_counts = RunMessageCounts()
            self.transform.set_keys(msg_count=RUN_COUNT_KEY)
        self.rm_rounds: Optional[BackgroundRounds] = None  # the reward model's thread (--rm-training background)
        if self.rm_trainer is not None and rm_background:
            # the next update never waits for the reward model's steps: they overlap it and the
            # wait for batches
            self.rm_rounds = BackgroundRounds(self._reward_model_round, name="reward-model training")

    def env_transforms(self) -> list:
        """Transforms every env worker applies (observations the policy needs at acting time)."""
        return list(self.parts.env_transforms)

    # ------------------------------------------------------------------ TrainHook API
    def on_batch(self, batch: TensorDictBase, trainer=None) -> TensorDictBase:
        batch = self.labelling.on_batch(batch, trainer)
        if self.parts.on_batch is not None:
            out = self.parts.on_batch(batch)
            batch = batch if out is None else out
        if self.transform is not None:
            if self.run_counts is not None:
                self._write_run_counts(batch)
            batch = self.transform(batch)
            self._window.add(batch, self.transform)
        self.hacking.add(batch, self.transform)  # the reward alone, before RUNE's bonus joins it
        if self.after_reward is not None:
            # the type's own step (RUNE's bonus joins the intrinsic reward before the trainer mixes the rewards)
            batch = self.after_reward(batch)
        return batch

    def _write_run_counts(self, batch: TensorDictBase) -> None:
        """Writes :data:`RUN_COUNT_KEY` beside the paying message: its sightings in the run so far,
        counted in time order (a batch is ``[games, time]``: all games' step t before step t + 1)."""
        source = batch if self.transform.message == "acted" else batch.get("next")
        hashes = source.get(self.transform.hash_key)
        time_major = hashes.transpose(0, 1) if batch.batch_dims >= 2 else hashes
        counts = self.run_counts.count(time_major.contiguous())
        source.set(RUN_COUNT_KEY, (counts.transpose(0, 1) if batch.batch_dims >= 2 else counts).to(hashes.device))

    def after_update(self, trainer=None) -> None:
        if self.after_reward is not None:
            self.after_reward.after_update()
        if self.rm_trainer is None:
            return
        if self.rm_rounds is not None:
            self.rm_rounds.poke()
        else:
            self._reward_model_round()

    def _reward_model_round(self) -> None:
        """The steps the schedule says are due, then the held-out evaluation if any ran (on the
        trainer's thread, or on the reward model's own with --rm-training background)."""
        result = self.rm_trainer.after_iteration()
        if result.get("steps"):
            self.rm_last = result
            if hasattr(self.rm_trainer, "evaluate") and self.spec.labels:
                self.heldout = self.rm_trainer.evaluate(refresh=False)

    def metrics(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        self.labelling.metrics(out)
        if self.after_reward is not None:
            out.update(self.after_reward.metrics())
        if self.rm_trainer is not None:
            out["reward_model/steps"] = self.rm_trainer.total_steps
            out["reward_model/steps_owed"] = self.rm_trainer.schedule.owed
            if self.rm_rounds is not None:  # updates whose round was merged into a later one
                out["reward_model/rounds_merged"] = self.rm_rounds.coalesced
            for key in ("loss", "train_accuracy", "accuracy", "pseudo_labelled"):
                if key in self.rm_last and np.isfinite(self.rm_last[key]):
                    out[f"reward_model/{key}"] = float(self.rm_last[key])
            for key in ("heldout_accuracy", "heldout_balanced_accuracy"):
                if key in self.heldout and np.isfinite(self.heldout[key]):
                    out[f"reward_model/{key}"] = float(self.heldout[key])
        self.labelling.judge_metrics(out)
        if self.parts.metrics is not None:
            out.update(self.parts.metrics())
        if self.transform is not None:
            out.update(self._window.metrics())
            now = self._clock()
            if self._closed or now - self._top_written_at >= TOP_MESSAGES_EVERY_S:
                self._window.write_top(os.path.join(self.run_dir, TOP_MESSAGES_NAME), self.kind)
                self._top_written_at = now
            self._window.reset()
        if self._closed:  # the run's last row: the diagnostics over the whole run
            out.update(self.hacking.metrics())
        return out

    # ------------------------------------------------------------------ saying it loudly
    def alert(self, metrics: Dict[str, float]) -> Optional[str]:
        """The warning lines of this update (labelling's health, the judge, coverage, a reward that
        pays almost nothing), joined, or None. The trainer prints them above its progress bar."""
        lines = self.labelling.alerts(metrics)
        paid = self._paid_problem(metrics)
        if paid and not self._paid_said:
            self._paid_said = True
            lines.append(paid)
        return "\n".join(lines) if lines else None

    def bar_fields(self, metrics: Dict[str, float]) -> List[str]:
        """The progress bar's words on labelling (coverages, queue, rate, server state)."""
        return self.labelling.bar_fields(metrics)

    def _paid_problem(self, metrics: Dict[str, float]) -> Optional[str]:
        """A reward that pays under LOW_PAID_SHARE of the steps while the agent does not find more
        of what it pays (see the constants), once enough captions are labelled; else None."""
        share = self._window.run_share()
        if share is None or share >= LOW_PAID_SHARE or not self.spec.labels:
            return None
        if metrics.get("labels/labelled", 0) < PAID_MIN_LABELS:
            return None
        trend = self.hacking.tally.approved_per_episode()
        if trend is not None and trend[1] >= RISING * max(trend[0], 1e-9):
            return None  # rare payments, but the agent finds more of them: ONI at work
        approved = int(round(metrics.get("labels/positive_fraction", 0.0) * metrics.get("labels/labelled", 0)))
        seen = "" if trend is None else (f"; approved captions per episode {trend[0]:.2f} at the start, "
                                         f"{trend[1]:.2f} now")
        return (f"the intrinsic reward paid only {share:.2%} of the steps so far ({approved:,} of "
                f"{int(metrics.get('labels/labelled', 0)):,} labelled captions approved){seen}: ONI's signal is too "
                f"rare to steer the agent; check top_messages.txt, the judge (--check-judge) or --llm-prompt")

    def summary_lines(self, metrics: Dict[str, float]) -> List[str]:
        """Plain lines for the run's summary: ONI's signal (approved captions per episode at the
        start against now, the share of steps paid) and the labelling's health."""
        lines = []
        trend = self.hacking.tally.approved_per_episode()
        if trend is not None:
            lines.append(f"approved captions per episode: {trend[0]:.2f} in the first {trend[2]} episodes, "
                         f"{trend[1]:.2f} in the last {trend[2]}")
        return lines + self.labelling.summary_lines(metrics)

    def final_warnings(self, metrics: Dict[str, float]) -> List[str]:
        """Lines the run's summary must show when ONI did (almost) nothing: labels that never
        came, or a learned reward whose model never left chance."""
        paid = self._paid_problem(metrics)
        return (self.labelling.final_warnings(metrics) + ([paid] if paid else [])
                + self._reward_model_warnings(metrics)
                + self.hacking.final_warnings(self.run_dir, self.labelling.store_path))

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

    # ------------------------------------------------------------------ checkpoints
    def _stateful(self) -> Dict[str, object]:
        objects = dict(self.parts.stateful or {})
        if hasattr(self.reward, "state_dict"):
            objects["reward"] = self.reward
        if self.rm_trainer is not None:
            objects["rm_trainer"] = self.rm_trainer
            objects["rm_schedule"] = self.rm_trainer.schedule
        if self.labelling.claim is not None:
            objects["claim"] = self.labelling.claim  # the label budget spent
        if self.after_reward is not None:
            objects[self.after_reward.name] = self.after_reward  # RUNE: the bonus's decay
        objects["hacking"] = self.hacking.tally  # the diagnostics' counts go on after --resume
        if self.run_counts is not None:
            objects["run_counts"] = self.run_counts  # --count-scope run: the decay goes on after --resume
        return objects

    def state_dict(self) -> dict:
        """Called at each checkpoint: also writes the caption store beside it."""
        # a reward model mid-step is not a state to save; the trainers' state_dict() copies their
        # tensors, so the thread's next steps after the pause leave the checkpoint alone
        with self._rounds_paused():
            state = {"kind": self.kind, "store_path": self.labelling.save_store()}
            if self.transform is not None:
                state["transform"] = self.transform.state_dict()
            for name, obj in self._stateful().items():
                state[name] = obj.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if not state or state.get("kind") != self.kind:
            log.warning("checkpoint has no %s intrinsic-reward state; starting it fresh", self.kind)
            return
        with self._rounds_paused():
            if self.transform is not None and "transform" in state:
                self.transform.load_state_dict(state["transform"])
            for name, obj in self._stateful().items():
                if name in state:
                    obj.load_state_dict(state[name])

    def _rounds_paused(self):
        return self.rm_rounds.paused() if self.rm_rounds is not None else contextlib.nullcontext()

    def close(self, save: bool = True) -> None:
        """Stops the reward model's thread, the reward type's own workers and the labelling
        (page, annotation worker, embedded server); saves the store unless ``save=False``.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.rm_rounds is not None:
                try:
                    self.rm_rounds.close()  # the round under way ends first: the store is saved after it
                except RuntimeError as err:  # the last round failed: say so, still save what was labelled
                    log.error("%s", err)
            if self.parts.close is not None:
                self.parts.close()  # ELLM's goal requests, before the server they go to stops
        finally:
            self.labelling.close(save=save)


class _HackingWatch:
    """Feeds collected batches to the reward-hacking diagnostics (a :class:`HackingTally`).

    Reads, per step: the caption the reward paid for (the root's ``caption_hash`` for
    ``--reward-message acted``, the next one's otherwise, and for types that write the reward
    themselves: ELLM), ``("next", "intrinsic_reward")``, ``("next", "done")``,
    ``("next", "episode", "end_status")`` (1: death) and ``("collector", "traj_ids")`` when the
    collector writes them. The texts of paid captions are kept for the report. A batch it cannot
    read turns it off with one log line: diagnostics never stop training.
    """

    def __init__(self):
        self.tally = HackingTally()
        self.feed = EpisodeAssembler(self.tally)
        self.enabled = True
        self.report: Optional[dict] = None

    def add(self, batch: TensorDictBase, transform) -> None:
        if not self.enabled:
            return
        try:
            self._add(batch, transform)
        except Exception as err:  # noqa: BLE001 - a diagnostic must never stop a run
            self.enabled = False
            log.warning("reward-hacking diagnostics off for this run: %s: %s", type(err).__name__, err)

    def _add(self, batch: TensorDictBase, transform) -> None:
        if transform is not None:
            source = batch if transform.message == "acted" else batch.get("next")
            hash_key, message_key, out_key = transform.hash_key, transform.message_key, transform.out_key
        else:
            source, hash_key, message_key, out_key = batch.get("next"), CAPTION_HASH_KEY, MESSAGE_KEY, INTRINSIC_REWARD_KEY
        nxt = batch.get("next")
        paid_t = nxt.get(out_key, None)
        status = nxt.get(("episode", "end_status"), None)
        if paid_t is None or status is None:
            return  # nothing paid yet, or an env without episode statistics
        shape = batch.shape
        T = shape[-1] if len(shape) else 1
        hashes = source.get(hash_key).reshape(-1, T).numpy()
        paid = paid_t.reshape(-1, T).double().numpy()
        done = nxt.get("done").reshape(-1, T).numpy()
        died = status.reshape(-1, T).numpy() == 1
        traj = batch.get(("collector", "traj_ids"), None)
        traj = None if traj is None or traj.numel() != hashes.size else traj.reshape(-1, T).numpy()
        self.feed.add(hashes, paid, done, died, traj)
        texts = self.tally.texts
        paying = np.flatnonzero(paid.reshape(-1) > 0)
        if len(paying):
            flat = hashes.reshape(-1)[paying]
            new, first = np.unique(flat, return_index=True)
            keep = [k for k, h in enumerate(new.tolist()) if h not in texts]
            if keep:
                messages = source.get(message_key).reshape(-1, MESSAGE_LEN)
                for k in keep:
                    texts[int(new[k])] = decode_message(messages[int(paying[first[k]])])

    def metrics(self) -> Dict[str, float]:
        report = self._report()
        if report is None:
            return {}
        out = {}
        trend = self.tally.approved_per_episode()
        if trend is not None:
            out = {"intrinsic/approved_per_episode_first": trend[0], "intrinsic/approved_per_episode_last": trend[1]}
        return {**out, "hacking/episodes": float(report["episodes"]), "hacking/deaths": float(report["deaths"]),
                "hacking/paid_captions": float(report["paid_captions"]),
                "hacking/flagged_captions": float(len(report["flagged"]))}

    def _report(self) -> Optional[dict]:
        if self.report is None and self.tally.episodes:
            self.report = self.tally.report()
        return self.report

    def final_warnings(self, run_dir: str, store_path: Optional[str]) -> List[str]:
        """Writes ``<run_dir>/reward_hacking.json``; the summary's ``!!`` lines."""
        report = self._report()
        if report is None:
            return []
        import json

        path = os.path.join(run_dir, REWARD_HACKING_NAME)
        data = json.dumps(report, indent=1).encode("utf-8")
        try:
            atomic_write(path, lambda f: f.write(data))
        except OSError as err:
            log.warning("cannot write %s: %s", path, err)
        hint = f" (oni-label --store {store_path} shows them first; details: {path})" if store_path else f" ({path})"
        return [line + hint for line in report["warnings"]]


class _RewardWindow:
    """Intrinsic reward statistics since the last ``metrics()`` call, and who earned them over
    the last ``batches`` collected batches (so top_messages.txt is never empty by accident)."""

    def __init__(self, top: int = 25, batches: int = 20):
        import collections

        self.top = top
        self.recent = collections.deque(maxlen=batches)  # per batch: {hash: [paid, steps, R, bytes]}
        self.run_steps = 0  # over the whole run (this process), never reset
        self.run_rewarded = 0
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
        self.run_steps += value.numel()
        self.run_rewarded += int(paid.sum())
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

    def run_share(self) -> Optional[float]:
        """Share of the run's steps (since this process started) paid a non-zero reward."""
        return self.run_rewarded / self.run_steps if self.run_steps else None

    def metrics(self) -> Dict[str, float]:
        if not self.steps:
            return {}
        return {"intrinsic/mean": self.total / self.steps, "intrinsic/rewarded_fraction": self.rewarded / self.steps,
                "intrinsic/rewarded_fraction_run": self.run_rewarded / max(self.run_steps, 1)}

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
