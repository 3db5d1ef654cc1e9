"""ELLM's trainer hook, :class:`ELLMReward`: captions the states acted in, queues new ones for goals,
and pays transitions whose caption matches a goal of their state (keys, rule and episodes:
:mod:`torchrl_oni.rewards.ellm`).
"""
from __future__ import annotations

import collections
import os
import time
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import numpy as np
import torch
from tensordict import TensorDictBase

from torchrl_oni.captions import (
    CAPTION_HASH_KEY,
    GOAL_EMBEDDING_KEY,
    INTRINSIC_REWARD_KEY,
    MESSAGE_KEY,
    MESSAGE_LEN,
    MSG_COUNT_KEY,
    decode_message,
)
from torchrl_oni.rewards.ellm.conditioning import SharedGoalEmbeddings
from torchrl_oni.rewards.ellm.matching import (
    DEFAULT_THRESHOLDS,
    pay_once_per_episode,
    sentence_goal_similarity,
    transition_sentences,
)
from torchrl_oni.rewards.ellm.table import GoalTable
from torchrl_oni.rewards.ellm.worker import GoalWorker

__all__ = ["ELLMReward", "STATE_HASH_KEY", "TRAJ_IDS_KEY"]


STATE_HASH_KEY = "state_hash"
TRAJ_IDS_KEY = ("collector", "traj_ids")


class ELLMReward:
    """The ELLM intrinsic reward as a trainer hook (see :mod:`torchrl_oni.rewards.ellm`).

    Args:
        table: the :class:`GoalTable` (shared with the worker).
        suggester: a :class:`~torchrl_oni.annotators.goals.GoalSuggester` (scripted or HTTP).
        encoder: a sentence encoder (:mod:`torchrl_oni.rewards.text`).

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
            env workers' :class:`~torchrl_oni.rewards.ellm.conditioning.GoalEmbeddingTransform` (goal
            conditioning at acting time).
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
