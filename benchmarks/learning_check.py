"""Learning check: does intrinsic-only ONI training raise the rate of LLM-approved messages?

1. Train on Score with ONI-Retrieval and NO extrinsic reward (``extrinsic_coeff=0``): the agent
   is paid only for captions the annotator labels helpful (× the episodic count decay).
2. Roll out the trained policy and a uniformly random policy for the same number of episodes.
3. Label every caption seen in those rollouts with the same annotator (most were labelled
   during training; the rest are labelled now, so both policies are judged alike), and count
   per episode the distinct approved captions, and approved captions per 1,000 steps.

Usage::

    python benchmarks/learning_check.py --frames 300000                  # embedded LLM (Qwen 0.5B)
    python benchmarks/learning_check.py --frames 300000 --annotator scripted

The last line of output is one JSON object (``approved_per_episode_trained`` / ``_random``,
``ratio``, …). The run folder (metrics.csv, captions.pt, checkpoint) is kept for ``oni-plot``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch


def rollout_episodes(env, act, episodes: int, max_steps: int = 200_000):
    """Runs until ``episodes`` episodes ended; returns one dict per episode."""
    from torchrl_oni.captions import decode_message

    td = env.reset()
    k = env.batch_size[0]
    seen = [set() for _ in range(k)]
    texts = [dict() for _ in range(k)]
    steps = [0] * k
    out = []
    for _ in range(max_steps // k):
        for i, h in enumerate(td["caption_hash"].tolist()):
            if h not in seen[i]:
                seen[i].add(h)
                texts[i][h] = decode_message(td["message"][i])
        with torch.no_grad():
            td = act(td)
        td, nxt = env.step_and_maybe_reset(td)
        done = td["next", "done"].reshape(-1).tolist()
        for i in range(k):
            steps[i] += 1
            if done[i]:
                out.append({"captions": seen[i], "texts": texts[i], "steps": steps[i],
                            "return": float(td["next", "episode", "return"][i])})
                seen[i], texts[i], steps[i] = set(), dict(), 0
        td = nxt
        if len(out) >= episodes:
            break
    return out[:episodes]


def label_now(cfg, captions):
    """Labels captions with the run's annotator (same model and prompt); None where it failed."""
    import asyncio

    from torchrl_oni.train.intrinsic import make_annotator

    if not captions:
        return []
    annotator, server = make_annotator(cfg)

    async def go():
        try:
            return await annotator.annotate(captions)
        finally:
            await annotator.aclose()

    try:
        labels = asyncio.run(go())
    finally:
        if server is not None:
            server.stop()
    return [lab.value if lab.ok else None for lab in labels]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frames", type=int, default=300_000)
    p.add_argument("--annotator", choices=["llm", "scripted"], default="llm")
    p.add_argument("--llm-model", default=None)
    p.add_argument("--llm-url", default=None)
    p.add_argument("--episodes", type=int, default=64, help="evaluation episodes per policy")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs-per-worker", type=int, default=32)
    p.add_argument("--intrinsic-coeff", type=float, default=1.0)
    p.add_argument("--logdir", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from torchrl_oni.captions import decode_message
    from torchrl_oni.envs import NLEBatchEnv
    from torchrl_oni.store import CaptionStore
    from torchrl_oni.train import TrainConfig, Trainer
    from torchrl_oni.train.intrinsic import build_intrinsic_hooks
    from torchrl_oni.train.policy import make_actor_critic

    logdir = args.logdir or tempfile.mkdtemp(prefix="oni-learning-check-")
    cfg = TrainConfig(task="score", frames=args.frames, workers=args.workers, envs_per_worker=args.envs_per_worker,
                      seed=args.seed, logdir=logdir, intrinsic_reward="retrieval", extrinsic_coeff=0.0,
                      intrinsic_coeff=args.intrinsic_coeff, annotator=args.annotator, llm_model=args.llm_model,
                      llm_url=args.llm_url, progress=True, tensorboard=False)
    t0 = time.perf_counter()
    hooks = build_intrinsic_hooks(cfg)
    trainer = Trainer(cfg, hooks=hooks)
    summary = trainer.train()
    train_s = time.perf_counter() - t0

    torch.set_num_threads(2)
    env = NLEBatchEnv("score", num_envs=16, seed=10_000 + args.seed)
    actor, _ = make_actor_critic(env, arch=cfg.ppo.arch)
    actor.load_state_dict(trainer.actor.state_dict())

    def random_policy(td):
        td.set("action", env.action_spec.rand())
        return td

    from torchrl.envs.utils import ExplorationType, set_exploration_type

    with set_exploration_type(ExplorationType.RANDOM):  # sample actions, as during training
        trained_eps = rollout_episodes(env, actor, args.episodes)
    random_eps = rollout_episodes(env, random_policy, args.episodes)
    env.close()

    # judge every caption of both evaluations with the training run's annotator
    store_path = os.path.join(logdir, "captions.pt")
    store = CaptionStore.load(store_path) if os.path.exists(store_path) else CaptionStore()
    texts = {}
    for e in trained_eps + random_eps:
        texts.update(e["texts"])
    hashes = sorted(texts)
    labels, found = store.lookup(torch.tensor(hashes, dtype=torch.int64))
    missing = [h for h, f in zip(hashes, found.tolist()) if not f]
    newly = label_now(cfg, [texts[h] for h in missing])
    for h, value in zip(missing, newly):
        if value is not None:
            labels[hashes.index(h)] = value
            found[hashes.index(h)] = True
    missing = (~found).sum().item()
    approved = {h for h, lab, f in zip(hashes, labels.tolist(), found.tolist()) if f and lab > 0.5}

    def rates(eps):
        per_ep = [len(e["captions"] & approved) for e in eps]
        per_k = [1000 * len(e["captions"] & approved) / max(e["steps"], 1) for e in eps]
        return float(np.mean(per_ep)), float(np.mean(per_k)), float(np.mean([e["steps"] for e in eps]))

    tr_ep, tr_k, tr_len = rates(trained_eps)
    rd_ep, rd_k, rd_len = rates(random_eps)
    print(f"\nlearning check: Score, ONI-Retrieval, intrinsic only, {summary['frames']:,.0f} frames in {train_s:.0f} s "
          f"({args.annotator} annotator); {len(trained_eps)} + {len(random_eps)} evaluation episodes")
    print(f"{'policy':<10} {'approved captions / episode':>28} {'per 1000 steps':>15} {'episode length':>15}")
    print(f"{'random':<10} {rd_ep:>28.2f} {rd_k:>15.2f} {rd_len:>15.0f}")
    print(f"{'trained':<10} {tr_ep:>28.2f} {tr_k:>15.2f} {tr_len:>15.0f}")
    top = sorted(approved, key=lambda h: -sum(h in e["captions"] for e in trained_eps))[:8]
    if top:
        print("approved captions the trained agent sees most (episodes with it, trained vs random):")
        for h in top:
            n_tr = sum(h in e["captions"] for e in trained_eps)
            n_rd = sum(h in e["captions"] for e in random_eps)
            print(f"   {n_tr:>4} {n_rd:>4}  {texts[h]!r}")
    print(f"captions judged: {len(hashes)} ({missing} could not be labelled: counted as not approved); run folder {logdir}")
    print(json.dumps({
        "frames": int(summary["frames"]), "train_s": round(train_s), "annotator": args.annotator,
        "approved_per_episode_trained": round(tr_ep, 3), "approved_per_episode_random": round(rd_ep, 3),
        "approved_per_1k_steps_trained": round(tr_k, 3), "approved_per_1k_steps_random": round(rd_k, 3),
        "ratio": round(tr_ep / max(rd_ep, 1e-9), 3), "unlabelled_captions": int(missing),
        "episode_length_trained": round(tr_len), "episode_length_random": round(rd_len),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
