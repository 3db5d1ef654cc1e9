"""Training configuration: one dataclass, the defaults a CPU laptop can run in minutes.

The paper-scale settings (480 envs, batch 4096, lr 1e-4, entropy 0.003, clip 0.1, GRU core)
are one flag away: ``--preset oni``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

INTRINSIC_REWARDS = ("none", "retrieval", "classification", "ranking", "motif", "bow")
ANNOTATORS = ("llm", "scripted")
GOALS = ("default", "combat", "gold", "stairs", "zero-knowledge")


@dataclass
class TrainConfig:
    task: str = "score"
    frames: int = 300_000
    workers: int = 2
    envs_per_worker: int = 32
    rollout: int = 32  # steps per env per collected batch (ONI: 32)
    seed: int = 0
    logdir: str = "runs/oni"
    device: str = "auto"  # learner device; env workers always run on CPU
    arch: str = "light"  # light | oni (GRU core) | oni-lstm
    value_heads: int = 1  # 1: one value of the mixed reward; 2: extrinsic and intrinsic heads
    # rewards
    extrinsic_coeff: float = 1.0
    intrinsic_coeff: float = 0.0
    intrinsic_reward: str = "none"
    extrinsic_clip: Optional[float] = 10.0  # ONI clips the env reward to ±10; None: no clip
    timeout_as_termination: bool = False
    max_episode_steps: int = 5000
    # PPO
    lr: float = 3e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_epsilon: float = 0.2
    entropy_coeff: float = 0.01
    critic_coeff: float = 0.5
    max_grad_norm: float = 4.0
    minibatch_size: int = 1024
    ppo_epochs: int = 1
    # bookkeeping
    checkpoint_every: int = 100_000  # frames
    log_every: int = 1  # PPO iterations
    stats_window: int = 100  # episodes averaged in the logs
    wandb: bool = False
    wandb_mode: str = "offline"
    tensorboard: bool = True
    progress: bool = True
    resume: Optional[str] = None
    llm_url: Optional[str] = None
    # intrinsic reward (see train/intrinsic.py)
    annotator: str = "llm"  # llm (--llm-url or the embedded server) | scripted (rules, no LLM)
    llm_model: Optional[str] = None  # served name with --llm-url; packaged model otherwise
    llm_prompt: str = "auto"  # auto (short+logprobs for the embedded server, tagged for a URL)
    llm_batch_size: int = 100  # captions per annotation request (ONI: 100)
    llm_concurrency: int = 4
    goal: str = "default"
    caption_store: Optional[str] = None  # default <logdir>/captions.pt
    reward_message: str = "acted"  # acted (ONI) | next
    count_exponent: float = 3.0  # beta of msg_count ** -beta
    classification_threshold: float = 0.5
    ranking_threshold: float = -0.5
    ranking_raw: bool = False  # True: pay the raw ranking score, as ONI's code did by accident
    ranking_pairs: int = 10  # pairs queued per batch (ONI: 10)
    reward_model: Optional[str] = None  # motif checkpoint from oni-train-reward
    motif_quantile: float = 0.5
    bow_threshold: float = -0.5
    bow_vectors: str = "auto"  # auto | minilm | hashed
    rm_lr: float = 1e-4
    rm_batch_size: int = 256
    rm_steps_per_labels: int = 32
    rm_switch_at: int = 25_000
    rm_steps_per_iteration: int = 1
    # share of the trainer's wall time reward-model training may take (steps owed by the
    # schedule are spread over later iterations); None: 0.1 when it trains on CPU, no cap on GPU
    rm_time_fraction: Optional[float] = None
    extra: dict = field(default_factory=dict)

    @property
    def frames_per_batch(self) -> int:
        """Frames in one collected batch (one worker's K games × rollout steps)."""
        return self.envs_per_worker * self.rollout

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def validate(self) -> None:
        """Raises ``ValueError`` with one readable sentence for impossible settings."""
        from ..envs.tasks import resolve_task

        resolve_task(self.task)
        checks = [
            (self.frames > 0, "--frames must be positive"),
            (self.workers >= 1, "--workers must be at least 1"),
            (self.envs_per_worker >= 1, "--envs-per-worker must be at least 1"),
            (self.rollout >= 2, "--rollout must be at least 2"),
            (self.workers * self.envs_per_worker <= 4096, "at most 4096 games in total"),
            (self.frames >= self.frames_per_batch,
             f"--frames ({self.frames}) is smaller than one batch "
             f"(envs-per-worker × rollout = {self.frames_per_batch})"),
            (self.value_heads in (1, 2), "--value-heads must be 1 or 2"),
            (self.arch in ("light", "oni", "oni-lstm"), f"unknown --arch {self.arch!r} (light, oni or oni-lstm)"),
            (self.intrinsic_reward in INTRINSIC_REWARDS,
             f"unknown --intrinsic-reward {self.intrinsic_reward!r} ({', '.join(INTRINSIC_REWARDS)})"),
            (self.lr > 0, "--lr must be positive"),
            (0 < self.gamma <= 1, "--gamma must be in (0, 1]"),
            (self.minibatch_size >= 1, "--minibatch-size must be at least 1"),
            (self.ppo_epochs >= 1, "--ppo-epochs must be at least 1"),
            (self.checkpoint_every > 0, "--checkpoint-every must be positive"),
            (self.max_episode_steps >= 1, "--max-episode-steps must be at least 1"),
            (self.annotator in ANNOTATORS, f"unknown --annotator {self.annotator!r} (llm or scripted)"),
            (self.goal in GOALS, f"unknown --goal {self.goal!r} ({', '.join(GOALS)})"),
            (self.reward_message in ("acted", "next"), "--reward-message must be 'acted' or 'next'"),
            (self.llm_prompt in ("auto", "tagged", "short"), "--llm-prompt must be auto, tagged or short"),
            (self.count_exponent >= 0, "--count-exponent must be non-negative"),
            (self.llm_batch_size >= 1 and self.llm_concurrency >= 1,
             "--llm-batch-size and --llm-concurrency must be at least 1"),
            (self.rm_batch_size >= 1 and self.rm_lr > 0, "--rm-batch-size must be >= 1 and --rm-lr > 0"),
            (min(self.rm_steps_per_labels, self.rm_switch_at, self.rm_steps_per_iteration) >= 0,
             "reward-model schedule settings must be non-negative"),
            (self.rm_time_fraction is None or self.rm_time_fraction >= 0,
             "--rm-time-fraction must be non-negative (0: no cap)"),
            (self.ranking_pairs >= 1, "--ranking-pairs must be at least 1"),
            (self.bow_vectors in ("auto", "minilm", "hashed"), "--bow-vectors must be auto, minilm or hashed"),
            (self.intrinsic_reward != "motif" or bool(self.reward_model),
             "--intrinsic-reward motif needs --reward-model PATH (a checkpoint from oni-train-reward)"),
            (self.intrinsic_reward != "bow" or self.goal != "zero-knowledge",
             "--intrinsic-reward bow needs a goal sentence; --goal zero-knowledge has none"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.intrinsic_reward == "none" and self.intrinsic_coeff != 0.0:
            raise ValueError("--intrinsic-coeff needs an --intrinsic-reward other than 'none'")


PRESETS = {
    "default": {},
    # ONI/Motif-like optimisation settings (the paper also used 480 games and many CPUs)
    "oni": dict(arch="oni", lr=1e-4, clip_epsilon=0.1, entropy_coeff=0.003, minibatch_size=4096, rollout=32),
}
