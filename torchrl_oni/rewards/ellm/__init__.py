"""ELLM (Du et al., 2023): reward the agent for doing what a language model suggested, built the ONI way.

For each state the agent acts in, a language model suggests a few goals ("kill the jackal",
"descend the stairs"); a transition pays when its caption (the message the action produced)
is close, in a sentence encoder's space, to one of the goals suggested for the state it was
taken in. Here, as in ONI, nothing waits for the model: goals are requested in the background
for new states, cached by state, and a state whose goals have not arrived yet pays 0.

Pieces (all in the trainer process, except :class:`GoalEmbeddingTransform`, which goal-conditioned
runs put in the env workers):

* :class:`~torchrl_oni.envs.state_captions.StateCaptioner`: observation → state caption and its
  blake2b-64 hash (computed once per distinct state key);
* :class:`GoalTable`: state hash → goals (ids into a goal vocabulary), with a request queue
  under :class:`~torchrl_oni.store.CaptionStore`'s rule (unseen → pending → done; a server
  fault sends a state back after a short wait and never gives it up, unparsable answers give it
  up after ``max_attempts``), saved atomically;
* :class:`GoalWorker`: a :class:`~torchrl_oni.background.BackgroundLoop` (the caption
  annotation worker's thread and asyncio loop) that claims new states, awaits
  ``suggester.suggest(captions)`` (:mod:`torchrl_oni.annotators.goals`) with bounded concurrency,
  writes goals or failures back, and pre-computes the goals' embeddings;
* :class:`ELLMReward`: the trainer hook (``on_batch``, ``metrics``, ``state_dict``,
  ``load_state_dict``, ``close``); :func:`build_ellm_reward` builds it from plain settings.

Keys (batch ``[*B, T]``, time last, e.g. ``[K, T]`` from a collector):

========================================  ===============  ======================================
key                                       dtype / shape    meaning
========================================  ===============  ======================================
``message``, ``blstats``, ``crop``,       read             the state the action was taken in
``caption_hash`` (root)
``("next", "message")``, ``caption_hash``,  read           the transition's caption
``msg_count``
``("next", "done")``                      read             episode ends (when no trajectory ids)
``("collector", "traj_ids")``             read, optional   episode identity across batches
``state_hash``                            int64[*B, T]     written: hash of the state caption
``("next", "intrinsic_reward")``          float32[*B,T,1]  written: the ELLM reward
``goal_embedding`` and                    float32[*B,T,D]  the mean unit embedding of the state's
``("next", "goal_embedding")``                             goals, renormalised; zeros when none.
                                                           Written at acting time by
                                                           :class:`GoalEmbeddingTransform` (env
                                                           workers, from a
                                                           :class:`SharedGoalEmbeddings` the hook
                                                           fills), else by the hook with
                                                           ``goal_conditioned``
========================================  ===============  ======================================

**Goal conditioning** must happen at acting time: PPO's old log-probabilities come from the
collector's policy, so a goal input added to the batch afterwards would change the policy the
ratio compares against. The trainer creates one :class:`SharedGoalEmbeddings` before the
collector starts, gives it to :class:`ELLMReward` (``shared=``, which publishes each state's
goal embedding once its goals arrive) and to every env worker's :class:`GoalEmbeddingTransform`
(which writes ``goal_embedding`` into each observation, zeros until published). ``D`` is 384
for both encoders.

The reward (ELLM's rule): with ``c`` the unit embedding of the transition caption and
``g_1..g_M`` those of the state's goals, ``r = max {cos(c, g_j) : cos(c, g_j) > threshold and
g_j not yet paid in this episode}`` (0 if the set is empty); the goal that pays is marked paid
until the episode ends (``once_per_episode``). Optionally ``r · msg_count^-beta`` (Motif's decay;
``beta=0`` by default, the once-per-goal rule already stops repeats). Goals are identified by
their text, so "kill the newt" suggested in two states is one goal.

**Transition captions.** ELLM captioned a transition with the action's name ("chop tree"). Here
the caption is NetHack's message, split into sentences (NLE joins a step's messages: "You swap
places with your kitten. You kill the newt!"), each matched on its own (the best sentence counts;
this also keeps the encoder's cache small: sentences repeat far more than their combinations),
with one rewrite (:func:`transition_sentences`): an item entering the inventory is announced as
``"f - a food ration."``, which we read as ``"You pick up a food ration."`` (MiniLM: cos to
"pick up the food ration" 0.69 → 0.90).

**Threshold.** ELLM's 0.99 was tuned for its own encoder and action-name captions. Ours is fitted
on :data:`CALIBRATION_PAIRS`, 40 hand-made ``(message, goal, should match?)`` examples, 19
positive, with many near misses ("The newt bites!" vs "kill the newt", "There is a staircase down
here." vs "descend the stairs"): :func:`calibrate_threshold` takes the middle of the interval of
thresholds with the best accuracy.

======================  ==========  ==========================================================
encoder                 threshold   accuracy on CALIBRATION_PAIRS
======================  ==========  ==========================================================
MiniLM (all-MiniLM-L6)  0.81        0.825 (33/40): precision 1.0 (12 true, 0 false matches),
                                    recall 12/19; the closest miss is "There is a staircase
                                    down here." / "descend the stairs" at 0.805
hashed (384-d)          0.51        0.85 (34/40), 16 true and 3 false matches ("You see here
                                    a newt corpse." / "eat the newt corpse" at 0.67, "The newt
                                    bites!" / "kill the newt" at 0.56): lexical, so it works
                                    for goals that reuse the message's words, and only for those
======================  ==========  ==========================================================

**Episodes.** The once-per-goal rule needs per-episode state across batches. Episodes are
identified by the collector's ``("collector", "traj_ids")`` (TorchRL collectors write them; with
``MultiAsyncCollector`` they are unique across workers, which matters because consecutive batches
come from different workers). Without them, row ``k`` of the batch is assumed to continue row
``k`` of the previous batch (``env.rollout`` calls, one single-process collector) and ``("next",
"done")`` starts a new episode. The paid-goal sets are not checkpointed: a resumed run starts
new games.

**Cost** of :meth:`ELLMReward.on_batch` (state captions included; 2-core VM shared with other
jobs, random agent on NetHack Score, batches of 32 games × 32 steps, scripted goals, main-thread
CPU time; :meth:`ELLMReward.metrics` reports the wall time as ``ellm/ms_per_1k_steps``):

==================  ==========================  ==========================================
encoder             first 10k steps             after 20k–60k steps
==================  ==========================  ==========================================
hashed              9 ms per 1k steps           8–11 ms per 1k steps
MiniLM (CPU)        207 ms per 1k steps         52–67 ms per 1k steps (wall 80–95 ms)
==================  ==========================  ==========================================

With MiniLM the cost is embedding sentences never seen before (each once per run; 10–15 new
ones per 1k steps after 50k random steps), so it falls as the run goes on. MiniLM takes 2.9 ms
per new sentence on one idle CPU core (batches of 64), 1.2 ms with 4 threads, 0.08 ms on an
H100 (``device="cuda"``, the learner's GPU; same embeddings within 2e-7). Goal requests cost the
trainer nothing but a wake-up of the worker thread.

Example:
    >>> import torch
    >>> from torchrl_oni.envs import NLEBatchEnv
    >>> from torchrl_oni.rewards.ellm import build_ellm_reward
    >>> env = NLEBatchEnv("score", num_envs=2, seed=0)
    >>> batch = env.rollout(8, break_when_any_done=False)
    >>> env.close()
    >>> ellm = build_ellm_reward(annotator_kind="scripted", encoder="hashed")
    >>> out = ellm.on_batch(batch)          # returns at once; goals arrive in the background
    >>> out["next", "intrinsic_reward"].shape, out["state_hash"].dtype
    (torch.Size([2, 8, 1]), torch.int64)
    >>> ellm.wait_idle(timeout=10)
    True
    >>> ellm.metrics()["ellm/states_with_goals"] > 0
    True
    >>> ellm.close()
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.envs.transforms import Transform

from torchrl_oni.annotators.base import Provenance
from torchrl_oni.atomic import atomic_write
from torchrl_oni.background import BackgroundLoop
from torchrl_oni.captions import (
    CAPTION_HASH_KEY,
    GOAL_EMBEDDING_KEY,
    INTRINSIC_REWARD_KEY,
    MESSAGE_KEY,
    MESSAGE_LEN,
    MSG_COUNT_KEY,
    decode_message,
)
from torchrl_oni.store import FAILED, LABELLED, PENDING, UNSEEN, WorkQueue
from torchrl_oni.rewards.ellm.matching import (  # noqa: F401
    CALIBRATION_PAIRS,
    DEFAULT_THRESHOLDS,
    calibrate_threshold,
    pay_once_per_episode,
    sentence_goal_similarity,
    transition_caption,
    transition_sentences,
)
from torchrl_oni.rewards.ellm.table import DONE, GoalTable  # noqa: F401
from torchrl_oni.rewards.ellm.worker import GoalWorker  # noqa: F401
from torchrl_oni.rewards.ellm.conditioning import GoalEmbeddingTransform, SharedGoalEmbeddings  # noqa: F401

__all__ = [
    "GoalTable",
    "GoalWorker",
    "ELLMReward",
    "build_ellm_reward",
    "pay_once_per_episode",
    "transition_caption",
    "transition_sentences",
    "sentence_goal_similarity",
    "calibrate_threshold",
    "CALIBRATION_PAIRS",
    "DEFAULT_THRESHOLDS",
    "GOAL_EMBEDDING_KEY",
    "TRAJ_IDS_KEY",
    "SharedGoalEmbeddings",
    "GoalEmbeddingTransform",
]

log = logging.getLogger(__name__)

STATE_HASH_KEY = "state_hash"
TRAJ_IDS_KEY = ("collector", "traj_ids")

# ---------------------------------------------------------------------------------- the hook
class ELLMReward:
    """The ELLM intrinsic reward as a trainer hook (see the module docstring).

    Args:
        table: the :class:`GoalTable` (shared with the worker).
        suggester: a :class:`~torchrl_oni.annotators.goals.GoalSuggester` (scripted or HTTP).
        encoder: a sentence encoder (:mod:`torchrl_oni.rewards.encoder`).

    Keyword Args:
        threshold: cosine above which a goal counts as achieved; ``None``: the encoder's
            :data:`DEFAULT_THRESHOLDS` entry.
        message: ``"next"`` (default, ELLM: the message the action produced) or ``"acted"``
            (the message of the state acted on, ONI's default for its other rewards).
        once_per_episode: pay each goal at most once per episode (ELLM). False: every matching
            step pays its best cosine.
        beta: count decay ``msg_count^-beta`` of the paying message (0: none).
        captioner: the :class:`~torchrl_oni.envs.state_captions.StateCaptioner`.
        goal_conditioned: write ``goal_embedding`` (root and ``"next"``) when the batch lacks it.
        shared: a :class:`SharedGoalEmbeddings` to publish the states' goal embeddings to, for the
            env workers' :class:`GoalEmbeddingTransform` (goal conditioning at acting time).
        table_path: where :meth:`state_dict` saves the table (``None``: not saved).
        batch_size, max_concurrency, poll_interval_s: for the :class:`GoalWorker`.
        autostart: start the worker on the first batch.
        close_suggester: close the suggester when the worker stops.
    """

    def __init__(self, table: GoalTable, suggester, encoder, *, threshold: Optional[float] = None,
                 message: str = "next", once_per_episode: bool = True, beta: float = 0.0,
                 captioner=None, goal_conditioned: bool = False, shared: Optional["SharedGoalEmbeddings"] = None,
                 table_path: Optional[Union[str, os.PathLike]] = None, batch_size: int = 32,
                 max_concurrency: int = 4, poll_interval_s: float = 1.0, autostart: bool = True,
                 close_suggester: bool = True):
        from torchrl_oni.envs.state_captions import StateCaptioner

        if message not in ("next", "acted"):
            raise ValueError(f"message must be 'next' or 'acted', got {message!r}")
        if beta < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        self.table = table
        self.suggester = suggester
        self.encoder = encoder
        self.threshold = float(DEFAULT_THRESHOLDS.get(encoder.name, 0.8) if threshold is None else threshold)
        self.message = message
        self.once_per_episode = bool(once_per_episode)
        self.beta = float(beta)
        self.captioner = captioner if captioner is not None else StateCaptioner()
        self.goal_conditioned = bool(goal_conditioned)
        self.shared = shared
        self._published: Set[int] = set()
        if shared is not None and shared.dim != encoder.dim:
            raise ValueError(f"the shared goal table holds {shared.dim}-d vectors, the encoder makes {encoder.dim}-d")
        self.table_path = None if table_path is None else str(table_path)
        self.autostart = bool(autostart)
        self.worker = GoalWorker(table, suggester, batch_size=batch_size, max_concurrency=max_concurrency,
                                 poll_interval_s=poll_interval_s, encoder=encoder,
                                 close_suggester=close_suggester)
        self._goal_vectors = torch.zeros(0, encoder.dim)
        self._paid: "collections.OrderedDict[int, Set[int]]" = collections.OrderedDict()
        self._row_episode: Optional[np.ndarray] = None  # per-row episode counters without traj ids
        self._max_episodes = 100_000
        self._closed = False
        self.paid_goal_counts: collections.Counter = collections.Counter()
        self._transition_cache: Dict[int, List[str]] = {}
        self._reset_window()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "ELLMReward":
        if self._closed:
            raise RuntimeError("this ELLMReward is closed")
        self.worker.start()
        return self

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Blocks until every queued state has its goals or failed (tests, end of a run)."""
        return self.worker.wait_idle(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stops the worker (pending states go back to unseen) and saves the table. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.worker.stop(timeout)
        if self.table_path is not None:
            self.table.save(self.table_path)

    def __enter__(self) -> "ELLMReward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ embeddings
    def goal_vectors(self) -> torch.Tensor:
        """Unit embeddings of the table's goal vocabulary, ``float32[V, D]`` (grown on demand)."""
        texts = self.table.goal_texts
        have = self._goal_vectors.shape[0]
        if len(texts) > have:
            fresh = self.encoder.encode(list(texts[have:]))
            self._goal_vectors = torch.cat([self._goal_vectors, fresh])
        return self._goal_vectors

    def state_goal_embedding(self, goal_ids: torch.Tensor) -> torch.Tensor:
        """``[..., M]`` goal ids → ``float32[..., D]``: renormalised mean of the goals' vectors."""
        vectors = self.goal_vectors()
        valid = goal_ids >= 0
        if vectors.shape[0] == 0:
            return torch.zeros(*goal_ids.shape[:-1], self.encoder.dim)
        gathered = vectors[goal_ids.clamp(min=0)] * valid.unsqueeze(-1)
        mean = gathered.sum(-2)
        return torch.nn.functional.normalize(mean, dim=-1)  # all-zero rows stay zero

    def _transition_sentences(self, hashes: torch.Tensor, messages: torch.Tensor, rows: torch.Tensor
                              ) -> List[List[str]]:
        """Caption sentences of distinct message hashes, decoded once per message per run."""
        cache = self._transition_cache
        out: List[Optional[List[str]]] = [cache.get(h) for h in hashes.tolist()]
        missing = [i for i, text in enumerate(out) if text is None]
        if missing:
            raw = messages[rows[missing]].cpu().numpy()
            for i, row in zip(missing, raw):
                out[i] = cache[int(hashes[i])] = transition_sentences(decode_message(row))
            while len(cache) > 200_000:
                cache.pop(next(iter(cache)))
        return out  # type: ignore[return-value]

    def _publish(self, hashes: torch.Tensor, goal_ids: torch.Tensor) -> None:
        """Writes the goal embeddings of this batch's states that have goals to the shared table."""
        has = (goal_ids >= 0).any(1)
        if not bool(has.any()):
            return
        unique, first, _ = _unique_first(hashes[has])
        keep = [i for i, h in enumerate(unique.tolist()) if h not in self._published]
        if not keep:
            return
        rows = torch.nonzero(has).squeeze(1)[first[keep]]
        self.shared.put(unique[keep], self.state_goal_embedding(goal_ids[rows]))
        self._published.update(unique[keep].tolist())

    # ------------------------------------------------------------------ episodes
    def _episode_keys(self, batch: TensorDictBase, k: int, t: int) -> torch.Tensor:
        traj = batch.get(TRAJ_IDS_KEY, None)
        if traj is not None and traj.numel() == k * t:
            return traj.reshape(-1).long().cpu()
        done = batch.get(("next", "done"), None)
        done = torch.zeros(k, t, dtype=torch.bool) if done is None else done.reshape(k, t).cpu()
        if self._row_episode is None or len(self._row_episode) != k:
            self._row_episode = np.zeros(k, np.int64)
        local = torch.cumsum(done.long(), 1) - done.long()  # episode index within the row
        base = torch.from_numpy(self._row_episode).unsqueeze(1)
        keys = (torch.arange(k).unsqueeze(1) << 40) + base + local
        self._row_episode += done.sum(1).numpy()
        # keys of finished episodes are dropped after the batch (see _forget_finished)
        return keys.reshape(-1)

    def _forget_finished(self, episodes: torch.Tensor, done: Optional[torch.Tensor]) -> None:
        if done is not None:
            for ep in torch.unique(episodes[done.reshape(-1).cpu()]).tolist():
                self._paid.pop(ep, None)
        while len(self._paid) > self._max_episodes:  # episodes that never reported their end
            self._paid.popitem(last=False)

    # ------------------------------------------------------------------ the batch
    def _reset_window(self) -> None:
        self._w = {"steps": 0, "with_goals": 0, "paid": 0, "reward": 0.0, "seconds": 0.0,
                   "caption_seconds": 0.0, "new_states": 0}

    def on_batch(self, batch: TensorDictBase, trainer: Any = None) -> TensorDictBase:
        """Writes ``state_hash``, ``("next", "intrinsic_reward")`` (and goal embeddings); never waits."""
        start = time.perf_counter()
        shape = batch.batch_size
        if len(shape) == 0:
            raise ValueError("ELLMReward needs a batch with at least one dimension")
        t = shape[-1] if len(shape) >= 2 else 1
        n = int(shape.numel())
        k = n // t
        nxt = batch.get("next")
        # 1. states acted in → captions → hashes; new ones go to the worker
        caps = self.captioner(batch.get(MESSAGE_KEY), batch.get("blstats"), batch.get("crop"),
                              batch.get(CAPTION_HASH_KEY, None))
        t_caption = time.perf_counter() - start
        counts = torch.unique(caps.hashes.reshape(-1), return_counts=True)
        seen = dict(zip(counts[0].tolist(), counts[1].tolist()))
        new = self.table.add(caps.unique_hashes, caps.texts, [seen[h] for h in caps.unique_hashes])
        if not self._closed:
            if self.autostart and not self.worker.running:
                self.worker.start()
            if new.any():
                self.worker.wake()
        state_hashes = caps.hashes.reshape(shape)
        batch.set(STATE_HASH_KEY, state_hashes)
        goal_ids = self.table.lookup(state_hashes.reshape(-1))  # [N, M]
        has_goals = (goal_ids >= 0).any(1)
        # 2. the transition's caption, embedded once per distinct message
        source = nxt if self.message == "next" else batch
        messages = source.get(MESSAGE_KEY).reshape(n, MESSAGE_LEN)
        reward = torch.zeros(n)
        if bool(has_goals.any()):
            rows = torch.nonzero(has_goals).squeeze(1)
            hashes = source.get(CAPTION_HASH_KEY, None)
            keys = hashes.reshape(-1)[rows] if hashes is not None else None
            if keys is None:
                from torchrl_oni.captions import hash_messages

                keys = torch.from_numpy(hash_messages(messages[rows].cpu().numpy()))
            unique, first, inverse = _unique_first(keys.cpu())
            sentences = self._transition_sentences(unique, messages, rows[first])
            vectors = self.goal_vectors()
            ids = goal_ids[rows]
            # cosines of each distinct (caption, goal) pair of the batch, then gathered per step
            batch_goals, goal_inverse = torch.unique(ids.clamp(min=0), return_inverse=True)
            table = sentence_goal_similarity(self.encoder, sentences, vectors[batch_goals])  # [U, G]
            sims = table[inverse.unsqueeze(1), goal_inverse]
            sims = torch.where(ids >= 0, sims, torch.zeros_like(sims))
            if self.once_per_episode:
                episodes = self._episode_keys(batch, k, t)
                paid_r, paid_g = pay_once_per_episode(sims, ids, self.threshold, episodes[rows], self._paid)
                for g in paid_g[paid_g >= 0].tolist():
                    self.paid_goal_counts[g] += 1
            else:
                best = torch.where((sims > self.threshold) & (ids >= 0), sims, torch.zeros_like(sims))
                paid_r = best.max(1).values
            reward[rows] = paid_r
        elif self.once_per_episode:
            episodes = self._episode_keys(batch, k, t)  # keeps the per-row counters in step
        if self.once_per_episode:
            done = nxt.get("done", None)
            self._forget_finished(episodes, done)
        if self.beta > 0:
            count = source.get(MSG_COUNT_KEY, None)
            if count is not None:
                reward = reward * count.reshape(-1).float().clamp(min=1).pow(-self.beta)
        nxt.set(INTRINSIC_REWARD_KEY, reward.reshape(*shape, 1).to(batch.device))
        # 3. optional goal conditioning: what the state's goals point at
        if self.shared is not None:
            self._publish(state_hashes.reshape(-1), goal_ids)
        if self.goal_conditioned and GOAL_EMBEDDING_KEY not in batch.keys():
            # the acting-time values (GoalEmbeddingTransform in the env) win: PPO's old log-probs
            # were computed with them; this learner-side view is for pipelines without it
            batch.set(GOAL_EMBEDDING_KEY, self.state_goal_embedding(goal_ids).reshape(*shape, -1))
            next_caps = self.captioner(nxt.get(MESSAGE_KEY), nxt.get("blstats"), nxt.get("crop"),
                                       nxt.get(CAPTION_HASH_KEY, None))
            next_ids = self.table.lookup(next_caps.hashes.reshape(-1))
            nxt.set(GOAL_EMBEDDING_KEY, self.state_goal_embedding(next_ids).reshape(*shape, -1))
        w = self._w
        w["steps"] += n
        w["with_goals"] += int(has_goals.sum())
        w["paid"] += int((reward != 0).sum())
        w["reward"] += float(reward.sum())
        w["new_states"] += int(new.sum())
        w["caption_seconds"] += t_caption
        w["seconds"] += time.perf_counter() - start
        return batch

    __call__ = on_batch

    # ------------------------------------------------------------------ reporting
    def metrics(self) -> Dict[str, float]:
        """Numbers for the logs since the last call (``ellm/...``); resets the window."""
        out: Dict[str, float] = {f"ellm/{k}": float(v) for k, v in self.table.stats().items()}
        out["ellm/states_with_goals"] = out.pop("ellm/done")
        out["ellm/queue"] = out["ellm/unseen"] + out["ellm/pending"]
        for key, value in self.worker.metrics().items():
            out[f"ellm/{key}"] = float(value)
        w = self._w
        if w["steps"]:
            out["ellm/goal_coverage"] = w["with_goals"] / w["steps"]
            out["ellm/paid_fraction"] = w["paid"] / w["steps"]
            out["ellm/reward_mean"] = w["reward"] / w["steps"]
            out["ellm/new_states_per_1k_steps"] = 1000.0 * w["new_states"] / w["steps"]
            out["ellm/ms_per_1k_steps"] = 1e6 * w["seconds"] / w["steps"]
            out["ellm/caption_ms_per_1k_steps"] = 1e6 * w["caption_seconds"] / w["steps"]
        out["ellm/threshold"] = self.threshold
        self._reset_window()
        return out

    def top_goals(self, n: int = 20) -> List[Tuple[str, int]]:
        """The goals paid most often so far, ``[(goal, times), ...]`` (read them for reward hacking)."""
        return [(self.table.goal_texts[g], c) for g, c in self.paid_goal_counts.most_common(n)]

    def state_dict(self) -> dict:
        """Saves the goal table to ``table_path`` (if set); paid-goal sets are not kept (new games
        start on resume)."""
        path = None
        if self.table_path is not None:
            self.table.save(self.table_path)
            path = self.table_path
        return {"table_path": path, "threshold": self.threshold,
                "paid_goal_counts": {int(k): int(v) for k, v in self.paid_goal_counts.items()}}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.paid_goal_counts = collections.Counter({int(k): int(v) for k, v in
                                                     state.get("paid_goal_counts", {}).items()})

    def __repr__(self) -> str:
        return (f"ELLMReward(encoder={self.encoder.name}, threshold={self.threshold:g}, message={self.message!r}, "
                f"once_per_episode={self.once_per_episode}, table={self.table!r})")


def _unique_first(keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(unique, index of each unique's first occurrence, inverse)`` of a 1-D tensor."""
    unique, inverse = torch.unique(keys, return_inverse=True)
    first = torch.full((len(unique),), len(keys), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(len(keys)), reduce="amin")
    return unique, first, inverse


# ---------------------------------------------------------------------------------- building
def build_ellm_reward(
    *,
    annotator_kind: str = "llm",
    url: Union[None, str, Sequence[str]] = None,
    model: Optional[str] = None,
    api_key: Optional[str] = None,
    encoder: str = "auto",
    threshold: Optional[float] = None,
    goals_per_state: int = 5,
    message: str = "next",
    once_per_episode: bool = True,
    beta: float = 0.0,
    goal_conditioned: bool = False,
    shared: Optional[SharedGoalEmbeddings] = None,
    include_message: bool = False,
    goal_table: Optional[Union[str, os.PathLike]] = None,
    api: str = "chat",
    batch_size: int = 32,
    max_concurrency: int = 4,
    timeout_s: Optional[float] = None,
    device: Union[str, torch.device] = "cpu",
    check_server: bool = True,
) -> ELLMReward:
    """Builds an :class:`ELLMReward` from plain settings (what ``oni-train`` would pass).

    Args:
        annotator_kind: ``"scripted"`` (goals from rules) or ``"llm"`` (``url`` + ``model``).
        url, model: the OpenAI-compatible server, or a list of them (a pool: each request goes
            to the least loaded usable one), and the served model (``None``: the only one the
            servers list) for ``"llm"``.
        api_key: bearer token for the servers (``None``: ``OPENAI_API_KEY``, or none).
        encoder: ``"auto"``, ``"minilm"`` or ``"hashed"`` (:func:`~torchrl_oni.rewards.encoder.make_encoder`).
        threshold: ``None``: the encoder's calibrated default.
        goals_per_state: goals asked for and kept per state.
        message, once_per_episode, beta, goal_conditioned, shared: see :class:`ELLMReward`.
        include_message: put NLE's message in state captions (more distinct states, more requests).
        goal_table: a file: loaded when it exists, saved at checkpoints and at close.
        api: ``"chat"`` or ``"completions"`` for the server.
        batch_size, max_concurrency: goal requests (most prompts per ``completions`` request,
            requests in flight per server).
        timeout_s: a fixed time limit per goal request (``None``: adapted to each server's
            latency, as for labels).
        device: where the MiniLM encoder runs (the learner's device).
        check_server: ask the server for its models first; a dead server raises one line.

    Raises:
        ValueError: bad settings, a missing ``url``/``model``, an unusable encoder, or a server
            that does not answer (:class:`~torchrl_oni.annotators.openai.AnnotatorUnavailable`
            is a ``RuntimeError``; it is re-raised as ``ValueError`` with its one line).
    """
    from torchrl_oni.annotators.goals import OpenAIGoalSuggester, ScriptedGoalSuggester
    from torchrl_oni.envs.state_captions import StateCaptioner
    from torchrl_oni.rewards.text import make_encoder

    if annotator_kind not in ("scripted", "llm"):
        raise ValueError(f"unknown goal annotator {annotator_kind!r}; choose scripted or llm")
    if goals_per_state < 1:
        raise ValueError("goals per state must be at least 1")
    if threshold is not None and not -1.0 <= threshold <= 1.0:
        raise ValueError(f"the ELLM threshold is a cosine in [-1, 1], got {threshold}")
    enc = make_encoder(encoder, device=device)
    if annotator_kind == "scripted":
        suggester = ScriptedGoalSuggester(max_goals=goals_per_state)
    else:
        urls = [url] if isinstance(url, str) else list(url or [])
        if not any(urls):
            raise ValueError("ELLM goals from an LLM need a server URL (or the scripted goal suggester)")
        suggester = OpenAIGoalSuggester(urls, model, api=api, max_goals=goals_per_state,
                                        batch_size=batch_size, max_concurrency=max_concurrency,
                                        timeout_s=timeout_s, api_key=api_key)
        if check_server or model is None:
            async def check():
                try:
                    await suggester.check()
                finally:
                    await suggester.aclose()

            try:
                asyncio.run(check())
            except RuntimeError as err:  # AnnotatorUnavailable
                raise ValueError(str(err)) from None
    table = None
    if goal_table is not None and os.path.exists(goal_table):
        table = GoalTable.load(goal_table)
        if table.max_goals != goals_per_state:
            raise ValueError(f"{goal_table} keeps {table.max_goals} goals per state, not {goals_per_state}")
        log.info("ELLM goal table: %d states (%d with goals) from %s", len(table),
                 table.stats()["done"], goal_table)
    if table is None:
        table = GoalTable(max_goals=goals_per_state)
    return ELLMReward(table, suggester, enc, threshold=threshold, message=message,
                      once_per_episode=once_per_episode, beta=beta,
                      captioner=StateCaptioner(include_message=include_message),
                      goal_conditioned=goal_conditioned, shared=shared, table_path=goal_table,
                      batch_size=batch_size, max_concurrency=max_concurrency)
