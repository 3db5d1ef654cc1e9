"""oni-train's ``ellm`` reward type: ELLM, an LLM (or rules) suggests goals per state and a
transition pays when its message matches one (:func:`~torchrl_oni.rewards.ellm.build_ellm_reward`);
with ``--ellm-goal-conditioned`` the policy also sees the goals' embedding."""
import os
from dataclasses import dataclass
from typing import Literal, Optional

from torchrl_oni.config_tree import setting
from torchrl_oni.rewards.ellm import GoalEmbeddingTransform, SharedGoalEmbeddings, build_ellm_reward
from torchrl_oni.train.reward_types._registry import RewardParts, register_reward


@dataclass
class ELLMSettings:
    PREFIX = "ellm"
    threshold: Optional[float] = setting(
        None, "cosine above which a transition achieves a suggested goal (none: the encoder's calibrated "
              "value, 0.81 for minilm, 0.51 for hashed)")
    goals_per_state: int = setting(5, "goals asked for and kept per state")
    encoder: Literal["auto", "minilm", "hashed"] = setting(
        "auto", "sentence encoder: minilm (the full all-MiniLM-L6-v2 transformer), hashed (no weights, "
                "lexical), auto (minilm if installed)")
    message: Literal["next", "acted"] = setting(
        "next", "the transition caption: next (the message the action produced, ELLM) or acted")
    once_per_episode: bool = setting(True, "pay each goal at most once per episode (ELLM's rule)")
    count_exponent: float = setting(0.0, "beta of msg_count^-beta on the paying message (0: no decay)")
    goal_conditioned: bool = setting(False, "give the policy goal_embedding, the mean embedding of the state's "
                                            "suggested goals, at acting time (ELLM's main variant)")
    state_message: bool = setting(False, "put NLE's message in state captions (about 4x more states to ask about)")
    goal_table: Optional[str] = setting(None, "goal table file, loaded if it exists and saved at checkpoints "
                                              "(none: LOGDIR/goals.pt)", metavar="PATH")
    api: Literal["chat", "completions"] = setting("chat", "server endpoint for goal requests")
    goal_table_dir: Optional[str] = setting(
        None, "--ellm-goal-conditioned: where the shared goal table's files go (none: /dev/shm, or the temp "
              "dir when it has no room; 50 MB)", metavar="DIR")


def _check(cfg) -> None:
    s = cfg.reward.ellm
    if s.threshold is not None and not -1.0 <= s.threshold <= 1.0:
        raise ValueError("--ellm-threshold is a cosine in [-1, 1]")
    if s.goal_table_dir is not None and not os.path.isdir(s.goal_table_dir):
        raise ValueError(f"--ellm-goal-table-dir {s.goal_table_dir}: no such directory")
    if s.goals_per_state < 1:
        raise ValueError("--ellm-goals-per-state must be at least 1")
    if cfg.reward.count_scope != "episode":
        raise ValueError("--count-scope run decays rewards paid per caption; ELLM pays per goal "
                         "(its decay: --ellm-count-exponent)")
    if cfg.annotation.annotator not in ("llm", "scripted"):
        raise ValueError("--intrinsic-reward ellm asks an LLM (--annotator llm) or rules (--annotator scripted) "
                         "for goals")


@register_reward("ellm", llm=True, settings=ELLMSettings, check=_check,
                 help="ELLM: an LLM suggests goals per state; a transition pays when its message matches one")
def _build(ctx) -> RewardParts:
    s, ann = ctx.settings, ctx.cfg.annotation
    shared = SharedGoalEmbeddings(directory=s.goal_table_dir) if s.goal_conditioned else None
    llm = ctx.llm
    ellm = build_ellm_reward(
        annotator_kind=ann.annotator, url=list(llm.urls) if llm else None, model=llm.model if llm else None,
        api_key=llm.api_key if llm else None, encoder=s.encoder, threshold=s.threshold,
        goals_per_state=s.goals_per_state, message=s.message, once_per_episode=s.once_per_episode,
        beta=s.count_exponent, goal_conditioned=s.goal_conditioned, include_message=s.state_message,
        goal_table=s.goal_table or os.path.join(ctx.cfg.log.logdir, "goals.pt"), api=s.api,
        batch_size=min(ann.llm_batch_size, 32), max_concurrency=ann.llm_concurrency,
        timeout_s=ann.llm_timeout, device=ctx.device, shared=shared)
    transforms = [GoalEmbeddingTransform(shared, include_message=s.state_message)] if shared is not None else []
    return RewardParts(reward=None, on_batch=ellm.on_batch, metrics=ellm.metrics, stateful={"ellm": ellm},
                       close=ellm.close, env_transforms=transforms)
