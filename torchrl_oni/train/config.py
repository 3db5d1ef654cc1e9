"""Training configuration: one tree of dataclasses, the single source of truth for ``oni-train``.

Every setting is declared once below with its default and help text; ``oni-train``'s flags,
``--help``, the run folder's ``config.yaml`` and ``TrainConfig(...)`` keyword construction are all
derived from these declarations (:mod:`torchrl_oni.config_tree`). The tree:

==================  ===============================================================  ===========
section             what                                                             flags
==================  ===============================================================  ===========
(root)              frames, seed, learner device                                     ``--frames``
``env``             task, worker processes, games per process, rollout, step limit   ``--task``
``ppo``             policy network, value heads, optimiser and PPO loss              ``--lr``
``reward``          extrinsic/intrinsic mix, the intrinsic reward type, count decay  ``--intrinsic-reward``
``reward.<type>``   settings of one intrinsic reward type, declared by its module     ``--ranking-threshold``
``annotation``      who labels captions (rules, a simulated teacher or an LLM), the      ``--llm-url``
                    label budget and which captions are asked first                  ``--label-budget``
``reward_model``    training of the classification/ranking reward models, ensembles,  ``--rm-lr``
                    SURF pseudo-labels and the RUNE exploration bonus                ``--rm-ensemble``
``feedback``        the labelling page for people during training                    ``--human-feedback``
``log``             run folder, checkpoints, metrics, wandb, resume                  ``--logdir``
``distributed``     where env workers run (this machine or a Ray cluster)            ``--backend``
==================  ===============================================================  ===========

Ranges are declared here too, on each number's ``setting(..., at_least=, above=, at_most=)``
(``--help`` shows them; :meth:`TrainConfig.validate` refuses a value outside with one sentence
naming the flag, whether it came from a flag, a file or Python). The upper bounds are far above
anything a run needs; they catch a typo (``--frames 3e12`` for ``3e6``, ``--lr 3`` for ``3e-4``)
before hours are spent on it:

=========================================  ================  =============================================
setting                                    range             why this far
=========================================  ================  =============================================
``--frames``, ``--checkpoint-every``       [1, 1e10]         5× the longest runs of ONI/Motif (2e9 frames)
``--seed``                                 [0, 2**63 - 1]    what torch and numpy seed from (as oni-eval)
``--workers``, ``--envs-per-worker``       [1, 4096]         at most 4096 games in all (one batch in memory)
``--rollout``                              [2, 2**20]        one game's batch within one update's bound
``--minibatch-size``, ``--rm-batch-size``  [1, 2**20]        the largest update (:data:`MAX_FRAMES_PER_UPDATE`)
``--lr``, ``--rm-lr``                      (0, 1]            Adam steps above 1 diverge at once
``--llm-batch-size``                       [1, 10000]        100× ONI's 100 captions a request
``--llm-concurrency``                      [1, 1024]         requests in flight to one pool of servers
``--feedback-port``                        [0, 65535]        TCP ports (0: any free one)
=========================================  ================  =============================================

Derived values are computed here too, in one place and once per run
(:meth:`TrainConfig.resolved`, called by ``oni-train`` right after parsing and by
``Trainer.from_config``): the defaults that depend on other settings, written to the run's
``config.yaml`` (``intrinsic_coeff`` left unset is 0.4 with an intrinsic reward and 0 without;
``prefetch_batches``), and :class:`Derived`, what the run reads but never writes (the learner's
device and threads, the reward model's share of wall time and whether it trains in a thread of
its own), whether the configuration comes from the command line, a file or Python.

Example:
    >>> from torchrl_oni.train.config import TrainConfig
    >>> cfg = TrainConfig(intrinsic_reward="retrieval", workers=1)
    >>> cfg.env.workers, cfg.reward.intrinsic_reward, cfg.resolved().reward.intrinsic_coeff
    (1, 'retrieval', 0.4)
    >>> TrainConfig(device="cpu").resolved().derived.rm_time_fraction  # --rm-time-fraction's CPU default
    0.1
    >>> TrainConfig(ranking_threshold=-1.0).reward.ranking.threshold
    -1.0
    >>> TrainConfig.from_yaml(TrainConfig(frames=2048).to_yaml()).frames
    2048
    >>> TrainConfig(lr=3.0).validate()
    Traceback (most recent call last):
    ...
    ValueError: --lr must be at most 1, not 3
"""
import copy
import math
import os
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Literal, Optional, Tuple

from ..config_tree import (
    check_values,
    dump_yaml,
    flat_init,
    from_dict,
    leaves,
    load_yaml,
    parse_count,
    replace_flat,
    setting,
    to_dict,
)
from ..annotators.prompts import GOALS
from ..queries import RULES, SCHEDULES
from ..run_folder import CONFIG_NAME
from ..store import CLAIM_ORDERS
from .annotator_types import annotator_names, get_annotator
from .archs import ARCHS
from .backends import backend_names, get_backend
from .reward_types import model_rewards, reward_names, reward_types

__all__ = ["TrainConfig", "Derived", "CONFIG_NAME", "PRESETS", "INTRINSIC_REWARDS", "ANNOTATORS", "GOALS",
           "QUERY_RULES", "LABEL_SCHEDULES", "intrinsic_rewards", "resolve_device"]

# choice lists are declared by the modules that implement them, read here
ANNOTATORS = annotator_names()  # the annotators registered in train/annotator_types.py
QUERY_RULES, LABEL_SCHEDULES = RULES, SCHEDULES
MAX_FRAMES_PER_UPDATE = 2**20  # gathered batches wait in the trainer's memory: ~1.4 GB at this size
MAX_FRAMES = 10**10  # 5x the longest runs of the papers (2e9): a larger --frames is a typo
MAX_GAMES = 4096  # games in all (workers x envs-per-worker)
MAX_SEED = 2**63 - 1  # torch.manual_seed's and numpy's SeedSequence's range (oni-eval's too)
MAX_LR = 1.0  # Adam's step size: above 1 every update overshoots
MAX_LLM_BATCH = 10_000  # captions in one LLM request: 100x ONI's 100
DEFAULT_INTRINSIC_COEFF = 0.4  # ONI's coefficient of the intrinsic reward (oni_spec §5)


def intrinsic_rewards() -> Tuple[str, ...]:
    """``none`` and every registered intrinsic reward type (:mod:`torchrl_oni.train.reward_types`)."""
    return reward_names()


# The reward types that train a reward model (classification, ranking), as their modules
# declare; read here once, after the registry has imported every reward-type module.
MODEL_REWARDS = model_rewards()


def _either(names) -> str:
    """``"a or b"``, ``"a, b or c"``: reward type names in a one-sentence error.

    Example:
        >>> _either(["classification", "ranking"]), _either(["a", "b", "c"])
        ('classification or ranking', 'a, b or c')
    """
    names = list(names)
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


# torch.compile's modes for the learner (--compile); "off": eager
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune-no-cudagraphs")


@dataclass
class EnvConfig:
    task: str = setting("score", "score, oracle, oracle-sober, staircase, staircase-lvl3, staircase-lvl4, "
                        "or a full task id such as NetHackScore-v1")
    workers: int = setting(2, "env worker processes (one core each)", at_least=1, at_most=MAX_GAMES)
    # a step's fixed costs (the policy's call, the batch's bookkeeping) spread over more games gain
    # more than the games' NetHack state loses to the cache (docs/design.md)
    envs_per_worker: int = setting(64, "NetHack games stepped by each worker process", at_least=1,
                                   at_most=MAX_GAMES)
    rollout: int = setting(32, "steps per game in one collected batch (ONI: 32)", at_least=2,
                           at_most=MAX_FRAMES_PER_UPDATE)
    max_episode_steps: int = setting(5000, "step limit of an episode", at_least=1)
    timeout_as_termination: bool = setting(False, "treat the step limit as a terminal state, like the original "
                                           "ONI (default: truncation, which bootstraps)")


@dataclass
class PPOConfig:
    arch: str = setting("light", "policy network: light (small MLP), oni (ONI's GRU network) or oni-lstm",
                        choices=ARCHS)
    value_heads: int = setting(1, "1: one value of the mixed reward (ONI); 2: separate extrinsic and intrinsic "
                               "heads and GAEs", choices=(1, 2))
    lr: float = setting(3e-4, "Adam learning rate", above=0, at_most=MAX_LR)
    gamma: float = setting(0.99, "discount factor of future rewards")
    gae_lambda: float = setting(0.95, "GAE lambda (bias–variance trade-off of the advantages)")
    clip_epsilon: float = setting(0.2, "PPO ratio clip")
    entropy_coeff: float = setting(0.01, "entropy bonus coefficient")
    critic_coeff: float = setting(0.5, "value loss coefficient")
    max_grad_norm: float = setting(4.0, "gradient norm clip")
    minibatch_size: int = setting(1024, "steps per PPO minibatch", at_least=1, at_most=MAX_FRAMES_PER_UPDATE)
    ppo_epochs: int = setting(1, "passes over each collected batch", at_least=1)
    compile: Literal[COMPILE_MODES] = setting(
        "off", "torch.compile the update's critic and PPO loss (light policy; a recurrent policy's heads): default "
        "fuses kernels, the first updates compiling for a minute or two; reduce-overhead adds CUDA graphs (GPU); "
        "off: eager")
    frames_per_update: Optional[int] = setting(
        None, "frames per PPO update: workers' batches (envs-per-worker × rollout each) are gathered until this "
        "many, a multiple of one batch, e.g. 16384 on a GPU node (none: one batch per update)", parse=parse_count)


@dataclass
class AnnotationConfig:
    annotator: str = setting(
        "llm", "who labels captions: llm (an LLM server), scripted (hand-written rules, no LLM), teacher (the "
        "rules with B-Pref noise: --teacher-beta, --teacher-epsilon; for label-efficiency experiments) or store "
        "(no new labels: only those of --labels-from; captions they do not cover pay nothing)",
        choices=annotator_names)
    teacher_beta: Optional[float] = setting(None, "--annotator teacher: rationality, answers drawn as "
                                            "sigmoid(beta · (rule score − 0.5)) (none: the rules' answer)")
    teacher_epsilon: float = setting(0.0, "--annotator teacher: probability of flipping an answer (a mistake)")
    llm_url: Tuple[str, ...] = setting((), "OpenAI-compatible server(s), e.g. http://gpu-node:8000/v1; several "
                                       "URLs form a pool (default: start the embedded CPU server)",
                                       default_factory=tuple, metavar="URL")
    llm_model: Optional[str] = setting(None, "served model name (default: the only model the server lists); "
                                       "without --llm-url: the model the embedded server loads, a packaged "
                                       "name, a transformers checkpoint folder, a .gguf file or a hub id "
                                       "(as oni-serve --model)")
    llm_api_key: Optional[str] = setting(None, "API key sent as 'Authorization: Bearer KEY' (default: the "
                                         "OPENAI_API_KEY environment variable; never written to the run folder)",
                                         secret=True)
    llm_prompt: Literal["auto", "tagged", "short"] = setting(
        "auto", "auto: short yes/no with logprobs for the embedded server, ONI's tagged prompt for --llm-url")
    llm_batch_size: int = setting(100, "most captions per LLM request (ONI: 100); the client adapts below it",
                                  at_least=1, at_most=MAX_LLM_BATCH)
    llm_concurrency: int = setting(4, "LLM requests in flight", at_least=1, at_most=1024)
    llm_timeout: Optional[float] = setting(None, "seconds before an LLM request is abandoned (default: adapts "
                                           "to the latency the server shows)")
    embedded_server: Literal["process", "thread"] = setting(
        "process", "without --llm-url: run the embedded CPU model in a process of its own (the OS gives it its "
        "share of the cores) or in a thread of the trainer (shares the learner's GIL and threads)")
    embedded_threads: Optional[int] = setting(None, "torch threads of the embedded CPU model (none: 1)")
    embedded_dtype: Literal["auto", "bfloat16", "float32", "int8"] = setting(
        "auto", "number format of the embedded CPU model: auto (bfloat16 where the CPU has it, else float32), "
        "or int8 (CTranslate2; the float path with a warning where it cannot run)")
    embedded_node_cache_mb: Optional[float] = setting(
        None, "MB of the embedded CPU model's cache of prompt tokens computed before, so a caption whose beginning "
        "it has seen computes only the rest (none: oni-serve's default; 0: off)", at_least=0)
    goal: str = setting("default", "what counts as progress for the annotator and the goal-based rewards",
                        choices=GOALS)
    caption_store: Optional[str] = setting(None, "caption/label store, loaded if it exists and saved at "
                                           "checkpoints (default: LOGDIR/captions.pt)", metavar="PATH")
    labels_from: Tuple[str, ...] = setting(
        (), "caption stores of earlier runs (their captions.pt), or labels files (.jsonl[.gz]: "
        "torchrl_oni.store.labels_file), whose caption labels this run starts with, copied "
        "into its store when it opens; a caption labelled by several takes the first one's label, one this run "
        "labelled keeps its own", default_factory=tuple, metavar="STORE")
    label_budget: Optional[float] = setting(None, "labels (captions, or pairs for ranking) that may be bought per "
                                            "million frames, on average over the run (none: no limit)",
                                            metavar="PER_MILLION")
    label_schedule: str = setting(
        "constant", "how --label-budget is spread over --frames: constant, or front-loaded (linear, exponential)",
        choices=LABEL_SCHEDULES)
    query_selection: str = setting(
        "frequency", "which captions (or pairs) are labelled first: fifo (oldest), frequency (most seen), uniform, "
        "disagree (reward-model ensemble members disagree most: --rm-ensemble > 1) or entropy (the reward "
        "model is least sure)", choices=QUERY_RULES)
    claim_order: str = setting(
        "seen_rate", "the order in which the caption store hands unseen captions to the annotator: seen_rate "
        "(most sightings per caption first seen since: what the agent has just started to see, and new captions, "
        "before older ones seen as often over a longer time), most_seen (most sightings) or oldest (first seen "
        "first); benchmarks/queue_order.py compares them. --query-selection and --label-budget choose within "
        "the captions it hands out first", choices=CLAIM_ORDERS)

    def validate(self) -> None:
        """Raises ``ValueError`` with one sentence for the first impossible setting of this section
        alone (:meth:`TrainConfig.validate` runs it; ``oni-annotate-pairs`` too, on its flags)."""
        for message in check_values(self):
            raise ValueError(message)
        checks = [
            (self.llm_batch_size >= 1 and self.llm_concurrency >= 1,
             "--llm-batch-size and --llm-concurrency must be at least 1"),
            (self.llm_timeout is None or self.llm_timeout > 0, "--llm-timeout must be positive"),
            (self.label_budget is None or self.label_budget >= 0, "--label-budget must be non-negative"),
            (self.teacher_beta is None or self.teacher_beta > 0, "--teacher-beta must be positive"),
            (0 <= self.teacher_epsilon <= 1, "--teacher-epsilon must be in [0, 1]"),
            (self.annotator == "teacher" or (self.teacher_beta is None and not self.teacher_epsilon),
             "--teacher-beta and --teacher-epsilon need --annotator teacher"),
            (get_annotator(self.annotator).answers or self.labels_from,
             f"--annotator {self.annotator} makes no labels of its own: give the labels with --labels-from STORE "
             f"(an earlier run's captions.pt)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class RewardModelConfig:
    PREFIX = "rm"
    lr: float = setting(1e-4, "reward-model Adam learning rate", above=0, at_most=MAX_LR)
    batch_size: int = setting(256, "reward-model minibatch size", at_least=1, at_most=MAX_FRAMES_PER_UPDATE)
    steps_per_labels: int = setting(32, "reward-model steps whenever new labels arrived, below --rm-switch-at "
                                    "labelled items")
    switch_at: int = setting(25_000, "labelled items from which training runs per PPO iteration instead")
    steps_per_iteration: int = setting(1, "reward-model steps per PPO iteration from --rm-switch-at on")
    time_fraction: Optional[float] = setting(
        None, "cap on the share of wall time spent training the reward model; owed steps are spread over later "
        "iterations (none: 0.1 on CPU, no cap on GPU; 0: no cap)")
    training: Literal["auto", "inline", "background"] = setting(
        "auto", "where the reward model trains: inline (between PPO updates: the next update waits for it) or "
        "background (a thread beside the trainer: updates never wait, rounds that fall behind are merged); "
        "auto: background when the learner is on a GPU, inline on CPU")
    ensemble: int = setting(1, "reward models trained side by side on bootstrap resamples of the labels; the "
                            "reward is their mean (classification, ranking; > 1 enables --query-selection disagree "
                            "and RUNE)")
    surf_tau: float = setting(0.0, "SURF: unlabelled captions whose ensemble-mean P(helpful) is >= tau or <= 1 - tau "
                              "join training with that pseudo-label (classification; 0: off; SURF used 0.999)")
    surf_lambda: float = setting(0.1, "SURF: weight of the pseudo-labelled captions' loss")
    rune_beta: float = setting(0.0, "RUNE: exploration bonus beta · std over the ensemble's members of the caption's "
                               "prediction, count-decayed and added to the intrinsic reward (0: off; RUNE used 0.05)")
    rune_decay: float = setting(1e-4, "RUNE: the bonus scale shrinks by this fraction after every PPO iteration")


@dataclass
class FeedbackConfig:
    human_feedback: bool = setting(False, "serve a labelling page on the run's live caption store: people's labels "
                                   "take precedence over the LLM's and reach the reward from the next batch")
    feedback_port: int = setting(8765, "port of the labelling page (0: any free port; the address is printed)",
                                 at_least=0, at_most=65535)
    feedback_host: str = setting("127.0.0.1", "address the labelling page binds; any other than loopback needs the "
                                 "access token printed at start")


@dataclass
class LogConfig:
    logdir: str = setting("runs/oni", "run folder: config.yaml, metrics.csv, tensorboard/, checkpoint.pt, "
                          "captions.pt. oni-train without --logdir (or a --config naming one) makes a new folder "
                          "for each run, this name + -YYYYmmdd-HHMMSS (-2, -3... if taken); a folder that "
                          "already holds a run (a checkpoint.pt or a non-empty metrics.csv) is refused unless "
                          "--resume or --overwrite says what to do with it")
    checkpoint_every: int = setting(100_000, "frames between checkpoints", parse=parse_count, at_least=1,
                                    at_most=MAX_FRAMES)
    log_every: int = setting(1, "PPO iterations between metrics rows")
    stats_window: int = setting(100, "episodes averaged in the logged episode statistics")
    tensorboard: bool = setting(True, "write TensorBoard logs")
    progress: bool = setting(True, "show a progress bar")
    wandb: bool = setting(False, "also log to Weights & Biases")
    wandb_mode: Literal["offline", "online"] = setting("offline", "wandb: offline (files in the run folder, sync later) or online")
    resume: Optional[str] = setting(None, "continue a run: from LOGDIR/checkpoint.pt (no value) or the given "
                                    "checkpoint file; without --logdir: the newest run folder named LOGDIR or "
                                    "LOGDIR-* (the one whose checkpoint was written last; the name is printed), or "
                                    "the given checkpoint's folder", nargs="?", const="auto", metavar="CHECKPOINT",
                                    secret=True)
    # resume and overwrite are secret: never written to config.yaml or a checkpoint. They are
    # orders for one start, not properties of the run: `--config RUN/config.yaml --logdir NEW` of a
    # resumed run must start NEW (not look for a checkpoint there), and of a run started with
    # --overwrite must not clear a folder again without being told
    overwrite: bool = setting(False, "start over in a --logdir that already holds a run: its checkpoint, "
                              "metrics, caption store, logs and evaluations are deleted first (other files stay)",
                              secret=True)


@dataclass
class DistributedConfig:
    backend: str = setting("local", "where env workers run: local processes, or Ray actors on any node of a Ray "
                           "cluster (the backends registered in train/backends.py)", choices=backend_names)
    ray_address: Optional[str] = setting(None, "Ray cluster to join: auto, or HOST:PORT (default: start a local "
                                         "Ray instance)")
    ray_num_cpus_per_actor: float = setting(1.0, "CPUs Ray reserves for each env worker actor (1: one NetHack "
                                            "process per core)")
    ray_max_restarts: int = setting(3, "times Ray restarts a dead env worker actor before the run goes on without it "
                                    "(-1: without limit)")
    worker_restarts: int = setting(3, "--backend local: times the env worker processes are restarted (from the "
                                   "current weights) after one of them dies; then the run stops with its checkpoint "
                                   "saved")
    worker_stall_timeout: float = setting(60.0, "--backend local: seconds an env worker process may stay alive "
                                          "but silent (no batch: stuck in NetHack, stopped by SIGSTOP; 5x as long "
                                          "before its first batch) before it is killed and the env workers restart as "
                                          "after a death (--worker-restarts); the log names it; 0: never")
    prefetch_batches: Optional[int] = setting(
        None, "--backend local: batches a trainer thread takes from the env workers while the learner learns (each "
        "re-arms its worker at once; 0: only when the trainer asks, as TorchRL's collector does); none: one update's "
        "worth (--frames-per-update / one batch) with a CUDA learner and several batches an update, else 0",
        at_least=0, at_most=1024)


def _reward_sections():
    """``(name, type, field)`` of every registered reward type that declares settings."""
    return [(name, spec.settings, field(default_factory=spec.settings))
            for name, spec in sorted(reward_types().items()) if spec.settings is not None]


# The reward section: the mix, plus one sub-section per reward type that has settings. Reward
# types declare their own settings (train/reward_types/), so adding a reward type touches only
# its module; the sub-sections are gathered here once, when this module is imported.
RewardConfig = make_dataclass("RewardConfig", [
    ("intrinsic_reward", str, setting("none", "intrinsic reward type", choices=intrinsic_rewards)),
    ("extrinsic_coeff", float, setting(1.0, "coefficient of the (clipped) env reward")),
    ("intrinsic_coeff", Optional[float], setting(None, f"coefficient of the intrinsic reward (none: "
                                                       f"{DEFAULT_INTRINSIC_COEFF} with an intrinsic reward, else 0)")),
    ("extrinsic_clip", float, setting(10.0, "clip env rewards to ±this before the coefficient (ONI: 10); 0: no clip")),
    ("reward_message", Literal["acted", "next"], setting("acted", "which observation's message pays: acted (ONI: "
                                                                  "the one the action was taken on) or next")),
    ("count_exponent", float, setting(3.0, "beta in R(m) · msg_count^-beta")),
    ("count_scope", Literal["episode", "run"], setting(
        "episode", "what msg_count counts: the message's sightings in the episode (ONI) or in the whole run so far "
                   "(not in ONI: a message stops paying for good instead of after each reset)")),
    ("death_penalty", float, setting(0.0, "subtracted from the reward on the step the agent dies (not in ONI; 0: "
                                          "off): against intrinsic rewards that pay for habits that kill")),
    ("survival_bonus", float, setting(0.0, "added to the reward on every step the agent does not die (not in "
                                           "ONI; 0: off)")),
    *_reward_sections(),
])
RewardConfig.__module__ = __name__  # pickling and get_type_hints look the class up here
RewardConfig.__doc__ = "The reward PPO optimises: ext · clip(r_env) + int · count-decayed R(m)."


@dataclass(frozen=True)
class Derived:
    """What a run computes from its settings (:meth:`TrainConfig.resolved`, once) and reads, but
    never writes: ``config.yaml`` keeps ``--device auto``, so the same file run on another
    machine derives its own.

    Attributes:
        device: the learner's ``torch.device`` (``--device auto``: CUDA where there is one); reward
            models sit with it, never on the env workers.
        learner_threads: torch threads of a CPU learner: the cores the local env workers leave
            (OpenMP threads spinning beside a worker's core cost 3x); None on a GPU.
        rm_time_fraction: the reward model's cap on the share of wall time
            (``--rm-time-fraction``; unset: 0.1 on a CPU learner, no cap on a GPU).
        rm_background: reward-model rounds run in a thread beside the trainer
            (``--rm-training background``, or ``auto`` with a CUDA learner) instead of between
            updates.
    """

    device: Any
    learner_threads: Optional[int]
    rm_time_fraction: float
    rm_background: bool


@flat_init
@dataclass
class TrainConfig:
    """Everything ``oni-train`` needs; build it from flat names (``TrainConfig(workers=1)``),
    sections, a YAML file (:meth:`from_yaml`) or the command line."""

    # The values :meth:`resolved` derived (a :class:`Derived`); None until then. A plain attribute,
    # not a setting: no flag, never written to config.yaml or a checkpoint.
    derived = None

    frames: int = setting(300_000, "total env frames, e.g. 3e5, 300k or 2M", parse=parse_count, at_least=1,
                          at_most=MAX_FRAMES)
    seed: int = setting(0, "random seed (games, networks, sampling)", at_least=0, at_most=MAX_SEED)
    device: str = setting("auto", "learner device: auto, cpu, cuda, cuda:1 (env workers always run on CPU)")
    acting: Literal["workers", "server"] = setting(
        "workers", "where the policy acts: workers (each env worker runs a CPU copy on its games) or server (one "
        "inference server runs it for all workers' games at once on the learner's device: for GPU nodes)")
    acting_splits: int = setting(
        1, "with --acting server: groups of each worker's games that take turns, each asking the server for its "
        "actions while the others step NetHack (2: Sample Factory's double-buffered workers); must divide "
        "--envs-per-worker", at_least=1)
    env: EnvConfig = field(default_factory=EnvConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)  # type: ignore[valid-type]
    annotation: AnnotationConfig = field(default_factory=AnnotationConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    log: LogConfig = field(default_factory=LogConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    # ------------------------------------------------------------------ derived
    @property
    def frames_per_batch(self) -> int:
        """Frames in one collected batch (one worker's K games × rollout steps)."""
        return self.env.envs_per_worker * self.env.rollout

    @property
    def frames_per_update(self) -> int:
        """Frames in one PPO update (``--frames-per-update``, or one collected batch)."""
        return self.ppo.frames_per_update or self.frames_per_batch

    @property
    def logdir(self) -> str:
        return self.log.logdir

    def resolved(self) -> "TrainConfig":
        """A copy with every derived value computed: the defaults that depend on other settings
        filled in (``intrinsic_coeff``, ``prefetch_batches``: what the run uses and records in
        ``config.yaml``) and :attr:`derived` (:class:`Derived`). A run calls it once: ``oni-train``
        right after parsing, ``Trainer.from_config`` for Python; the parts built from the result
        read these values instead of deriving their own.

        Settings out of range are :meth:`validate`'s to refuse, after this; the one error raised
        here: RuntimeError, ``--device`` names no torch device (whether CUDA is there is
        :meth:`validate`'s too).
        """
        out = copy.deepcopy(self)
        device = resolve_device(self.device)
        if out.reward.intrinsic_coeff is None:
            out.reward.intrinsic_coeff = 0.0 if out.reward.intrinsic_reward == "none" else DEFAULT_INTRINSIC_COEFF
        if out.distributed.prefetch_batches is None:
            # pays where the workers have cores of their own and wait while the learner updates on
            # several batches (1 worker x 128 games, 4 batches an update: 1.04 and 1.06); on a CPU
            # learner with every core busy, the workers playing on would take the learner's cores
            # (2 x 32 games on 2 cores: 0.93 with 1 batch an update, 0.97 with 4)
            # (validate() runs after this and names an empty batch: no division by zero before it)
            per_update = self.frames_per_update // self.frames_per_batch if self.frames_per_batch > 0 else 0
            out.distributed.prefetch_batches = per_update if per_update > 1 and device.type == "cuda" else 0
        rm = out.reward_model
        # workers of a Ray cluster that is not this machine leave its cores to the learner
        local_workers = 0 if out.distributed.ray_address else out.env.workers
        out.derived = Derived(
            device=device,
            learner_threads=max(1, (os.cpu_count() or 1) - local_workers) if device.type == "cpu" else None,
            rm_time_fraction=rm.time_fraction if rm.time_fraction is not None else (
                0.1 if device.type == "cpu" else 0.0),
            # the next update never waits for the reward model's steps (on a GPU node they were
            # 73 % of the trainer's time, inline): they overlap it and the wait for batches
            rm_background=rm.training == "background" or (rm.training == "auto" and device.type == "cuda"),
        )
        return out

    def replace(self, **flat) -> "TrainConfig":
        """A copy with flat-named settings changed: ``cfg.replace(frames=1024, lr=1e-3)`` (not
        resolved: what was derived from the old settings does not carry over)."""
        out = replace_flat(self, flat)
        out.derived = None
        return out

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return to_dict(self)

    @classmethod
    def from_dict(cls, d: dict, strict: bool = True) -> "TrainConfig":
        """From a nested dict (``config.yaml``, checkpoints) or flat names; ``strict=False`` skips
        names this version does not know (checkpoints of older versions)."""
        return from_dict(cls, d, strict=strict)

    def to_yaml(self) -> str:
        return dump_yaml(self)

    @classmethod
    def from_yaml(cls, text: str) -> "TrainConfig":
        return load_yaml(cls, text)

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raises ``ValueError`` with one readable sentence for the first impossible setting."""
        from ..envs.tasks import resolve_task

        for message in check_values(self):
            raise ValueError(message)
        resolve_task(self.env.task)
        env, ppo, reward, ann, rm = self.env, self.ppo, self.reward, self.annotation, self.reward_model
        checks = [
            (env.workers * env.envs_per_worker <= MAX_GAMES,
             f"--workers × --envs-per-worker must be at most {MAX_GAMES} games in all, not "
             f"{env.workers} × {env.envs_per_worker}"),
            (self.frames_per_batch <= MAX_FRAMES_PER_UPDATE,
             f"--envs-per-worker × --rollout (one batch: {self.frames_per_batch:,} frames) must be at most "
             f"{MAX_FRAMES_PER_UPDATE:,}"),
            (self.frames >= self.frames_per_batch,
             f"--frames ({self.frames}) is smaller than one batch "
             f"(envs-per-worker × rollout = {self.frames_per_batch})"),
            (0 < ppo.gamma <= 1, "--gamma must be in (0, 1]"),
            (0 <= ppo.gae_lambda <= 1, "--gae-lambda must be in [0, 1]"),
            (ppo.frames_per_update is None or (ppo.frames_per_update >= self.frames_per_batch
                                               and ppo.frames_per_update % self.frames_per_batch == 0),
             f"--frames-per-update ({ppo.frames_per_update}) must be a multiple of one batch "
             f"(envs-per-worker × rollout = {self.frames_per_batch}), e.g. "
             f"{max(1, round((ppo.frames_per_update or 0) / self.frames_per_batch)) * self.frames_per_batch}"),
            (ppo.frames_per_update is None or ppo.frames_per_update <= min(self.frames, MAX_FRAMES_PER_UPDATE),
             f"--frames-per-update ({ppo.frames_per_update}) must be at most --frames ({self.frames}) and "
             f"{MAX_FRAMES_PER_UPDATE:,} (its batches are held in memory, ~1.4 kB a frame)"),
            (self.acting_splits == 1 or self.acting == "server",
             f"--acting-splits {self.acting_splits} needs --acting server (the groups take turns asking it)"),
            (self.env.envs_per_worker % self.acting_splits == 0,
             f"--acting-splits ({self.acting_splits}) must divide --envs-per-worker ({self.env.envs_per_worker})"),
            (self.acting == "workers" or get_backend(self.distributed.backend).serves_policy,
             f"--acting server needs a backend whose workers can reach a policy server here (local), not "
             f"--backend {self.distributed.backend}"),
            (ppo.compile != "reduce-overhead" or _learner_on_gpu(self.device),
             "--compile reduce-overhead records CUDA graphs: it needs the learner on a GPU (--device cuda); on the "
             "CPU use --compile default"),
            (ppo.compile == "off" or _learner_on_gpu(self.device) or _has_cxx(),
             "--compile on the CPU needs a C++ compiler for torch.compile's kernels (g++ or clang++, or $CXX); "
             "none was found: install one or leave --compile off"),
            (self.log.log_every >= 1 and self.log.stats_window >= 1, "--log-every and --stats-window must be at least 1"),
            (reward.extrinsic_clip >= 0, "--extrinsic-clip must be non-negative (0: no clip)"),
            (reward.count_exponent >= 0, "--count-exponent must be non-negative"),
            (reward.count_scope == "episode" or reward.intrinsic_reward != "none",
             "--count-scope run changes the intrinsic reward's decay: it needs an --intrinsic-reward"),
            (0 <= reward.death_penalty < math.inf and 0 <= reward.survival_bonus < math.inf,
             "--death-penalty and --survival-bonus must be non-negative numbers"),
            (min(rm.steps_per_labels, rm.switch_at, rm.steps_per_iteration) >= 0,
             "reward-model schedule settings must be non-negative"),
            (rm.time_fraction is None or rm.time_fraction >= 0, "--rm-time-fraction must be non-negative (0: no cap)"),
            (self.distributed.ray_num_cpus_per_actor > 0, "--ray-num-cpus-per-actor must be positive"),
            (self.distributed.ray_max_restarts >= -1, "--ray-max-restarts must be -1 (no limit) or more"),
            (self.distributed.worker_restarts >= 0, "--worker-restarts must be non-negative"),
            (self.distributed.worker_stall_timeout >= 0, "--worker-stall-timeout must be non-negative (0: off)"),
            (rm.ensemble >= 1, "--rm-ensemble must be at least 1"),
            (rm.surf_tau == 0 or 0.5 < rm.surf_tau <= 1, "--rm-surf-tau must be in (0.5, 1] (0: SURF off)"),
            (rm.surf_lambda >= 0, "--rm-surf-lambda must be non-negative"),
            (rm.rune_beta >= 0, "--rm-rune-beta must be non-negative (0: RUNE off)"),
            (0 <= rm.rune_decay < 1, "--rm-rune-decay must be in [0, 1)"),
            (not self.device.startswith("cuda") or _cuda_available(),
             f"--device {self.device}: CUDA is not available on this machine"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        ann.validate()
        self._check_label_settings()
        self._check_reward_settings()
        if reward.intrinsic_reward == "none":
            if reward.intrinsic_coeff:
                raise ValueError("--intrinsic-coeff needs an --intrinsic-reward other than 'none'")
        else:
            spec = reward_types()[reward.intrinsic_reward]
            if spec.check is not None:
                spec.check(self)

    def _check_reward_settings(self) -> None:
        """A setting of another intrinsic reward type than this run's, changed from its default, is
        refused rather than silently ignored (``--ellm-goal-table`` without ``--intrinsic-reward
        ellm``)."""
        kind = self.reward.intrinsic_reward
        for leaf in leaves(TrainConfig):
            if len(leaf.path) == 3 and leaf.path[0] == "reward" and leaf.path[1] != kind \
                    and leaf.get(self) != leaf.default:
                raise ValueError(f"{leaf.flag} needs --intrinsic-reward {leaf.path[1]}, not {kind!r}")

    def _check_label_settings(self) -> None:
        """Label budget, query selection, ensembles, SURF, RUNE, teacher and the labelling page
        against the intrinsic reward type (one sentence per impossible combination)."""
        kind, ann, rm = self.reward.intrinsic_reward, self.annotation, self.reward_model
        types = reward_types()
        spec = types.get(kind)
        labelled = spec is not None and spec.needs_annotator
        model = spec is not None and spec.reward_model
        annotated = ", ".join(name for name, t in sorted(types.items()) if t.needs_annotator)
        models = _either(model_rewards())
        checks = [
            (labelled or ann.label_budget is None, "--label-budget"),
            (labelled or ann.query_selection == "frequency", "--query-selection"),
            (labelled or not self.feedback.human_feedback, "--human-feedback"),
            (labelled or not ann.labels_from, "--labels-from"),
        ]
        for ok, flag in checks:
            if not ok:
                raise ValueError(f"{flag} needs an --intrinsic-reward labelled by an annotator ({annotated}), "
                                 f"not {kind!r}")
        if spec is not None and spec.pairs and (ann.labels_from or not get_annotator(ann.annotator).answers):
            why = ("--labels-from carries caption labels, not preferences" if ann.labels_from else
                   f"--annotator {ann.annotator} compares none")
            raise ValueError(f"--intrinsic-reward {kind} learns from caption pairs and {why}: use --intrinsic-reward "
                             f"retrieval or classification")
        if ann.label_schedule != "constant" and ann.label_budget is None:
            raise ValueError(f"--label-schedule {ann.label_schedule} needs a --label-budget")
        if rm.ensemble > 1 and not model:
            raise ValueError(f"--rm-ensemble needs --intrinsic-reward {models}, not {kind!r}")
        if rm.surf_tau and kind != "classification":
            raise ValueError(f"--rm-surf-tau (SURF) needs --intrinsic-reward classification, not {kind!r}")
        if rm.rune_beta and (rm.ensemble < 2 or not model):
            raise ValueError("--rm-rune-beta (RUNE) needs an ensemble: --rm-ensemble 2 or more with "
                             f"--intrinsic-reward {models}")
        if ann.query_selection == "disagree" and (rm.ensemble < 2 or not model):
            raise ValueError("--query-selection disagree needs an ensemble: --rm-ensemble 2 or more with "
                             f"--intrinsic-reward {models}")
        if ann.query_selection == "entropy" and not model:
            raise ValueError(f"--query-selection entropy needs a reward model (--intrinsic-reward {models}), "
                             f"not {kind!r}")

    @staticmethod
    def settings():
        """Every leaf of the tree (:class:`~torchrl_oni.config_tree.Leaf`): flat name, flag, help."""
        return leaves(TrainConfig)


# Presets are configurations, not code paths: a preset is the base the flags are applied to.
PRESETS = {
    "default": TrainConfig(),
    # ONI/Motif's optimisation settings and GRU policy (the paper also used 480 games and many CPUs)
    "oni": TrainConfig(arch="oni", lr=1e-4, clip_epsilon=0.1, entropy_coeff=0.003, minibatch_size=4096, rollout=32),
}

INTRINSIC_REWARDS = intrinsic_rewards()


def _learner_on_gpu(name: str) -> bool:
    """Whether ``--device`` puts the learner on a GPU (never raises: :meth:`TrainConfig.validate` does)."""
    if name.startswith("cuda"):
        return True
    if name != "auto":
        return False
    import torch

    return torch.cuda.is_available()


def _has_cxx() -> bool:
    """Whether torch.compile can build CPU kernels here (a C++ compiler: $CXX, g++, clang++ or c++)."""
    import os
    import shutil

    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "clang++", "c++") if c)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_device(name: str) -> "torch.device":
    """The torch device ``--device`` names (``auto``: CUDA where there is one); RuntimeError for a
    name torch does not know. Whether a named CUDA device is there is :meth:`TrainConfig.validate`'s
    to say, in one sentence."""
    import torch  # here, not at the top: reading the configuration (``--help``) loads no torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
