"""ELLM (Du et al., 2023): reward the agent for doing what a language model suggested, built the ONI way.

For each state the agent acts in, a language model suggests a few goals ("kill the jackal",
"descend the stairs"); a transition pays when its caption (the message the action produced)
is close, in a sentence encoder's space, to one of the goals suggested for the state it was
taken in. Here, as in ONI, nothing waits for the model: goals are requested in the background
for new states, cached by state, and a state whose goals have not arrived yet pays 0.

Pieces (all in the trainer process, except :class:`GoalEmbeddingTransform`, which goal-conditioned
runs put in the env workers), one submodule each:

* :class:`~torchrl_oni.envs.state_captions.StateCaptioner`: observation → state caption and its
  blake2b-64 hash (computed once per distinct state key);
* :class:`GoalTable` (:mod:`~torchrl_oni.rewards.ellm.table`): state hash → goals (ids into a goal
  vocabulary), with a request queue under :class:`~torchrl_oni.store.CaptionStore`'s rule (unseen
  → pending → done; a server fault sends a state back after a short wait and never gives it up,
  unparsable answers give it up after ``max_attempts``), saved atomically;
* :class:`GoalWorker` (:mod:`~torchrl_oni.rewards.ellm.worker`): a
  :class:`~torchrl_oni.background.BackgroundLoop` (the caption annotation worker's thread and
  asyncio loop) that claims new states, awaits ``suggester.suggest(captions)``
  (:mod:`torchrl_oni.annotators.goals`) with bounded concurrency, writes goals or failures back,
  and pre-computes the goals' embeddings;
* :mod:`~torchrl_oni.rewards.ellm.matching`: transition captions, their similarity to goals, the
  threshold's calibration and :func:`pay_once_per_episode` (the rule below);
* :class:`ELLMReward` (:mod:`~torchrl_oni.rewards.ellm.reward`): the trainer hook (``on_batch``,
  ``metrics``, ``state_dict``, ``load_state_dict``, ``close``); :func:`build_ellm_reward`
  (:mod:`~torchrl_oni.rewards.ellm.build`) builds it from plain settings;
* :class:`SharedGoalEmbeddings` and :class:`GoalEmbeddingTransform`
  (:mod:`~torchrl_oni.rewards.ellm.conditioning`): goal conditioning at acting time (below).

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

**Cost**: :meth:`ELLMReward.metrics` reports ``ellm/ms_per_1k_steps``; goal requests cost the
trainer only a wake-up of the worker thread. Measured figures: ``BENCHMARKS.md``, "ELLM costs".

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

from torchrl_oni.captions import GOAL_EMBEDDING_KEY
from torchrl_oni.rewards.ellm.build import build_ellm_reward
from torchrl_oni.rewards.ellm.conditioning import GoalEmbeddingTransform, SharedGoalEmbeddings
from torchrl_oni.rewards.ellm.matching import (
    CALIBRATION_PAIRS,
    DEFAULT_THRESHOLDS,
    calibrate_threshold,
    pay_once_per_episode,
    sentence_goal_similarity,
    transition_caption,
    transition_sentences,
)
from torchrl_oni.rewards.ellm.reward import TRAJ_IDS_KEY, ELLMReward
from torchrl_oni.rewards.ellm.table import GoalTable
from torchrl_oni.rewards.ellm.worker import GoalWorker

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
