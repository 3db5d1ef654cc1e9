"""``oni-train``: PPO on ONI's NetHack tasks, with or without LLM intrinsic rewards.

Examples::

    oni-train                                   # a few CPU minutes on Score, extrinsic reward only
    oni-train --task oracle --frames 2e6 --workers 8 --envs-per-worker 32
    oni-train --resume --logdir runs/oni        # continue from runs/oni/checkpoint.pt

Bad flags, unknown task names and impossible sizes end with one ``oni-train: error: ...`` line
and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import List, Optional

from .config import ANNOTATORS, GOALS, INTRINSIC_REWARDS, PRESETS, TrainConfig

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line (no usage dump) with exit code 2."""

    def error(self, message: str):  # noqa: D401
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(EXIT_USAGE)


def _frames(text: str) -> int:
    """Accepts 300000, 3e5, 300k, 2M."""
    t = text.strip().lower().replace("_", "")
    mult = 1
    if t and t[-1] in "km":
        mult = 1_000 if t[-1] == "k" else 1_000_000
        t = t[:-1]
    try:
        value = float(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of frames: {text!r}")
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number of frames: {text!r}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = _Parser(prog="oni-train", description="Train a NetHack agent with PPO and ONI intrinsic rewards.")
    p.add_argument("--task", default=d.task, help="score, oracle, staircase, staircase-lvl3, staircase-lvl4, "
                   "oracle-sober, or a full task id such as NetHackScore-v1 (default: %(default)s)")
    p.add_argument("--frames", type=_frames, default=d.frames, help="total env frames, e.g. 3e5 or 2M (default: %(default)s)")
    p.add_argument("--workers", type=int, default=d.workers, help="env processes (default: %(default)s)")
    p.add_argument("--envs-per-worker", type=int, default=d.envs_per_worker, help="games per process (default: %(default)s)")
    p.add_argument("--rollout", type=int, default=d.rollout, help="steps per game per batch (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--logdir", default=d.logdir, help="run folder: metrics.csv, tensorboard/, checkpoint.pt (default: %(default)s)")
    p.add_argument("--device", default=d.device, help="learner device: auto, cpu, cuda, cuda:1 (default: %(default)s)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default", help="hyper-parameter preset; 'oni' = the paper's optimiser settings and GRU policy")
    p.add_argument("--arch", choices=["light", "oni", "oni-lstm"], default=None,
                   help="policy network: light (default), oni (ONI's GRU policy), oni-lstm")
    p.add_argument("--value-heads", type=int, choices=[1, 2], default=d.value_heads,
                   help="1: one value of the mixed reward (ONI); 2: separate extrinsic/intrinsic heads and GAEs")
    p.add_argument("--extrinsic-coeff", type=float, default=d.extrinsic_coeff)
    p.add_argument("--intrinsic-coeff", type=float, default=None, help="default: 0 with --intrinsic-reward none, else 0.4")
    p.add_argument("--intrinsic-reward", choices=INTRINSIC_REWARDS, default=d.intrinsic_reward)
    p.add_argument("--llm-url", default=None, help="OpenAI-compatible server, e.g. http://gpu-node:8000/v1 (default: start the embedded one)")
    g = p.add_argument_group("intrinsic reward (with --intrinsic-reward other than none)")
    g.add_argument("--llm-model", default=None, help="with --llm-url: the served model name (required); "
                   "without: the packaged model the embedded server loads (default qwen2.5-coder-0.5b-instruct)")
    g.add_argument("--annotator", choices=ANNOTATORS, default=d.annotator,
                   help="llm: an LLM labels captions; scripted: hand-written rules, no LLM (default: %(default)s)")
    g.add_argument("--llm-prompt", choices=["auto", "tagged", "short"], default=d.llm_prompt,
                   help="auto: short yes/no + logprobs for the embedded server, ONI's tagged prompt for --llm-url")
    g.add_argument("--llm-batch-size", type=int, default=d.llm_batch_size, help="captions per LLM request (default: %(default)s)")
    g.add_argument("--llm-concurrency", type=int, default=d.llm_concurrency, help="LLM requests in flight (default: %(default)s)")
    g.add_argument("--goal", choices=GOALS, default=d.goal, help="what counts as progress for the annotator / BoW (default: %(default)s)")
    g.add_argument("--caption-store", default=None, metavar="PATH",
                   help="caption/label store, loaded if it exists and saved at checkpoints (default: LOGDIR/captions.pt)")
    g.add_argument("--reward-message", choices=["acted", "next"], default=d.reward_message,
                   help="which observation's message pays: acted (ONI: the one the action was taken on) or next")
    g.add_argument("--count-exponent", type=float, default=d.count_exponent, help="beta in R(m)·msg_count^-beta (default: %(default)s)")
    g.add_argument("--classification-threshold", type=float, default=d.classification_threshold)
    g.add_argument("--ranking-threshold", type=float, default=d.ranking_threshold, help="cut on the normalised ranking score (default: %(default)s)")
    g.add_argument("--ranking-raw", action="store_true", help="pay the raw ranking score, as ONI's code did by accident")
    g.add_argument("--ranking-pairs", type=int, default=d.ranking_pairs, help="pairs queued per batch (default: %(default)s)")
    g.add_argument("--reward-model", default=None, metavar="PATH", help="motif: checkpoint written by oni-train-reward")
    g.add_argument("--motif-quantile", type=float, default=d.motif_quantile, help="motif: threshold quantile, 0.05..0.95 (default: %(default)s)")
    g.add_argument("--bow-threshold", type=float, default=d.bow_threshold)
    g.add_argument("--bow-vectors", choices=["auto", "minilm", "hashed"], default=d.bow_vectors)
    g.add_argument("--rm-lr", type=float, default=d.rm_lr, help="reward-model Adam learning rate (default: %(default)s)")
    g.add_argument("--rm-batch-size", type=int, default=d.rm_batch_size)
    g.add_argument("--rm-steps-per-labels", type=int, default=d.rm_steps_per_labels,
                   help="reward-model steps whenever new labels arrived, below --rm-switch-at items (default: %(default)s)")
    g.add_argument("--rm-switch-at", type=int, default=d.rm_switch_at)
    g.add_argument("--rm-steps-per-iteration", type=int, default=d.rm_steps_per_iteration,
                   help="reward-model steps per PPO iteration from --rm-switch-at items on (default: %(default)s)")
    g.add_argument("--rm-time-fraction", type=float, default=None,
                   help="cap on the share of wall time spent training the reward model; owed steps are spread "
                        "over later iterations (default: 0.1 on CPU, no cap on GPU; 0: no cap)")
    p.add_argument("--extrinsic-clip", type=float, default=d.extrinsic_clip, help="clip env rewards to ±this before the coefficient; 0 = no clip (default: %(default)s)")
    p.add_argument("--timeout-as-termination", action="store_true", help="treat the step limit as a terminal state, like the original ONI (default: truncation)")
    p.add_argument("--max-episode-steps", type=int, default=d.max_episode_steps)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--entropy-coeff", type=float, default=None)
    p.add_argument("--clip-epsilon", type=float, default=None)
    p.add_argument("--minibatch-size", type=int, default=None)
    p.add_argument("--ppo-epochs", type=int, default=d.ppo_epochs)
    p.add_argument("--checkpoint-every", type=_frames, default=d.checkpoint_every, help="frames between checkpoints (default: %(default)s)")
    p.add_argument("--resume", nargs="?", const="auto", default=None, metavar="CHECKPOINT",
                   help="continue a run: from LOGDIR/checkpoint.pt, or the given checkpoint file")
    p.add_argument("--wandb", action="store_true", help="also log to Weights & Biases")
    p.add_argument("--wandb-mode", choices=["offline", "online"], default=d.wandb_mode)
    p.add_argument("--no-tensorboard", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--quiet", action="store_true", help="no summary on stdout")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    cfg = TrainConfig()
    for key, value in PRESETS[args.preset].items():
        setattr(cfg, key, value)
    direct = ["value_heads", "task", "frames", "workers", "envs_per_worker", "rollout", "seed", "logdir", "device",
              "extrinsic_coeff", "intrinsic_reward", "llm_url", "timeout_as_termination",
              "max_episode_steps", "ppo_epochs", "checkpoint_every", "resume", "wandb", "wandb_mode",
              "llm_model", "annotator", "llm_prompt", "llm_batch_size", "llm_concurrency", "goal", "caption_store",
              "reward_message", "count_exponent", "classification_threshold", "ranking_threshold", "ranking_raw",
              "ranking_pairs", "reward_model", "motif_quantile", "bow_threshold", "bow_vectors", "rm_lr",
              "rm_batch_size", "rm_steps_per_labels", "rm_switch_at", "rm_steps_per_iteration", "rm_time_fraction"]
    for key in direct:
        setattr(cfg, key, getattr(args, key))
    for key in ("arch", "lr", "entropy_coeff", "clip_epsilon", "minibatch_size"):
        value = getattr(args, key)
        if value is not None:
            setattr(cfg, key, value)
    cfg.extrinsic_clip = None if not args.extrinsic_clip else args.extrinsic_clip
    if args.intrinsic_coeff is not None:
        cfg.intrinsic_coeff = args.intrinsic_coeff
    else:
        cfg.intrinsic_coeff = 0.0 if args.intrinsic_reward == "none" else 0.4
    cfg.tensorboard = not args.no_tensorboard
    cfg.progress = not args.no_progress
    return cfg


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    try:
        cfg.validate()
        if cfg.resume == "auto" and not os.path.exists(os.path.join(cfg.logdir, "checkpoint.pt")):
            raise ValueError(f"--resume: no checkpoint in {cfg.logdir} (pass --logdir of the run to continue)")
        if cfg.resume not in (None, "auto") and not os.path.exists(cfg.resume):
            raise ValueError(f"--resume: no such checkpoint {cfg.resume}")
        from .ppo import resolve_device

        resolve_device(cfg.device)
    except (ValueError, RuntimeError) as err:
        parser.error(str(err))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .ppo import Trainer
    from .intrinsic import build_intrinsic_hooks

    try:
        hooks = build_intrinsic_hooks(cfg)
    except (ValueError, RuntimeError, OSError) as err:  # ConnectionError and TimeoutError are OSErrors
        parser.error(" ".join(str(err).split()))
    trainer = Trainer(cfg, hooks=hooks)
    try:
        summary = trainer.train()
    except KeyboardInterrupt:
        sys.stderr.write(f"\ninterrupted: checkpoint saved to {trainer.checkpoint_path}; continue with --resume\n")
        return 130
    if not args.quiet:
        _print_summary(cfg, summary)
    return 0


def _print_summary(cfg: TrainConfig, summary: dict) -> None:
    keys = [("frames", "frames", "{:,.0f}"), ("fps", "frames/s", "{:,.0f}"), ("episodes", "episodes", "{:,.0f}"),
            ("episode/return", "return (last 100 episodes)", "{:.2f}"), ("episode/length", "episode length", "{:.0f}"),
            ("episode/dlvl", "dungeon level", "{:.2f}"), ("episode/xlvl", "experience level", "{:.2f}"),
            ("episode/success", "success rate", "{:.3f}"), ("reward/intrinsic_mean", "intrinsic reward / step", "{:.4f}"),
            ("collect_fraction", "time waiting for envs", "{:.0%}")]
    print(f"\n== oni-train: {cfg.task}, {cfg.intrinsic_reward} intrinsic reward ==")
    for key, label, fmt in keys:
        if key in summary:
            print(f"  {label:<28} {fmt.format(summary[key])}")
    print(f"  {'run folder':<28} {cfg.logdir}")
    print(f"  {'checkpoint':<28} {summary.get('checkpoint')}")
    print(json.dumps({k: v for k, v in summary.items() if isinstance(v, (int, float))}))


if __name__ == "__main__":
    sys.exit(main())
