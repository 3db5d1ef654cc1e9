"""Learning check: does intrinsic-only training raise the rate of LLM-approved messages?

1. Train on Score with ONI-Retrieval (or ELLM, ``--intrinsic-reward ellm``) and NO extrinsic
   reward (``extrinsic_coeff=0``): with Retrieval the agent is paid only for captions the
   annotator labels helpful (× the episodic count decay); with ELLM, for messages that match a
   goal the annotator kind (scripted rules or the LLM) suggested for the state it acted in.
2. Roll out the trained policy and a uniformly random policy for the same number of episodes.
3. Label every caption seen in those rollouts with the same annotator (with Retrieval most were
   labelled during training; the rest are labelled now, so both policies are judged alike), and
   count per episode the distinct approved captions, approved captions per 1,000 steps, and the
   deepest dungeon level reached.
4. With ELLM, also count the goals achieved per episode, by ELLM's own rule (each suggested goal
   paid at most once per episode), judged by the training run's goal table and settings; states
   new to the table get their goals now, from the same suggester, for both policies alike.

Usage::

    python benchmarks/learning_check.py --frames 300000                  # embedded LLM (Qwen 0.5B)
    python benchmarks/learning_check.py --frames 300000 --annotator scripted
    python benchmarks/learning_check.py --frames 300000 --annotator scripted --intrinsic-reward ellm

The last line of output is one JSON object (``approved_per_episode_trained`` / ``_random``,
``ratio``, ``deepest_level_trained`` / ``_random``, with ELLM ``goals_per_episode_trained`` /
``_random``, …). The run folder (metrics.csv, captions.pt or goals.pt, checkpoint) is kept for
``oni-plot``.
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


# what ELLM's reward reads of a step (ELLMReward.on_batch)
ELLM_KEYS = ("message", "blstats", "crop", "caption_hash", ("next", "message"), ("next", "caption_hash"),
             ("next", "msg_count"), ("next", "done"))


def rollout_episodes(env, act, episodes: int, max_steps: int = 200_000, keep_steps: bool = False):
    """Runs until ``episodes`` episodes ended; returns one dict per episode: ``captions`` (hashes
    seen), ``texts``, ``steps``, ``return``, ``deepest`` (dungeon level), and with
    ``keep_steps`` ``batch``, the episode's steps as a TensorDict ``[1, T]`` of :data:`ELLM_KEYS`."""
    from nle import nethack

    from torchrl_oni.captions import decode_message

    td = env.reset()
    k = env.batch_size[0]
    seen = [set() for _ in range(k)]
    texts = [dict() for _ in range(k)]
    steps = [0] * k
    deepest = [0] * k
    first = [0] * k  # index in ``kept`` of each game's first step of its episode
    kept = []
    out = []
    for t in range(max_steps // k):
        for i, h in enumerate(td["caption_hash"].tolist()):
            if h not in seen[i]:
                seen[i].add(h)
                texts[i][h] = decode_message(td["message"][i])
        with torch.no_grad():
            td = act(td)
        td, nxt = env.step_and_maybe_reset(td)
        if keep_steps:
            kept.append(td.select(*ELLM_KEYS).clone())
        done = td["next", "done"].reshape(-1).tolist()
        depth = td["blstats"][:, nethack.NLE_BL_DEPTH].tolist()  # zeros after death: max() ignores them
        for i in range(k):
            steps[i] += 1
            deepest[i] = max(deepest[i], depth[i])
            if done[i]:
                out.append({"captions": seen[i], "texts": texts[i], "steps": steps[i], "deepest": deepest[i],
                            "return": float(td["next", "episode", "return"][i]), "span": (i, first[i], t + 1)})
                seen[i], texts[i], steps[i], deepest[i], first[i] = set(), dict(), 0, 0, t + 1
        td = nxt
        if len(out) >= episodes:
            break
    out = out[:episodes]
    stacked = torch.stack(kept, dim=1) if kept else None  # [K, T]: one stack, then views
    for ep in out:
        i, a, b = ep.pop("span")
        if stacked is not None:
            ep["batch"] = stacked[i : i + 1, a:b]
    return out


def ellm_goals_per_episode(cfg, policies, seconds: float):
    """Goals achieved per episode of each policy's episodes, by ELLM's rule with the training
    run's settings and goal table; the states new to the table get their goals first (at most
    ``seconds``; states still without goals pay 0). Returns ``(per policy: [goals per episode],
    per policy: fraction of steps whose state had goals, states left without goals)``."""
    from torchrl_oni.rewards.ellm import build_ellm_reward
    from torchrl_oni.train.annotator_types import start_llm

    s, ann = cfg.reward.ellm, cfg.annotation
    endpoint, server = start_llm(ann) if ann.annotator == "llm" else (None, None)
    try:
        ellm = build_ellm_reward(
            annotator_kind=ann.annotator, url=list(endpoint.urls) if endpoint else None,
            model=endpoint.model if endpoint else None, api_key=ann.llm_api_key, encoder=s.encoder,
            threshold=s.threshold, goals_per_state=s.goals_per_state, message=s.message,
            once_per_episode=s.once_per_episode, beta=s.count_exponent, include_message=s.state_message,
            goal_table=s.goal_table or os.path.join(cfg.log.logdir, "goals.pt"), api=s.api,
            timeout_s=ann.llm_timeout)
        ellm.table_path = None  # a judge: the run's goal table is read, never rewritten
        try:
            for eps in policies:  # every state of both evaluations is asked for, first
                for ep in eps:
                    ellm.on_batch(ep["batch"])
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                stats = ellm.table.stats()
                if stats["unseen"] + stats["pending"] == 0:
                    break
                ellm.wait_idle(timeout=min(5.0, max(deadline - time.monotonic(), 0.0)))
            goals, coverage = [], []
            for eps in policies:
                ellm.metrics()  # resets the window
                goals.append([int((ellm.on_batch(ep["batch"])["next", "intrinsic_reward"] > 0).sum()) for ep in eps])
                coverage.append(ellm.metrics().get("ellm/goal_coverage", 0.0))
            missing = ellm.table.stats()["states"] - ellm.table.stats()["done"]
        finally:
            ellm.close()
    finally:
        if server is not None:
            server.stop()
    return goals, coverage, missing


def label_now(cfg, captions):
    """Labels captions with the run's annotator (same model and prompt); None where it failed."""
    import asyncio

    from torchrl_oni.train.labelling import make_annotator

    if not captions:
        return []
    annotator, server = make_annotator(cfg.annotation, seed=cfg.seed)

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
    from torchrl_oni.train.config import COMPILE_MODES, EnvConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frames", type=int, default=300_000)
    p.add_argument("--intrinsic-reward", choices=["retrieval", "ellm"], default="retrieval",
                   help="the intrinsic reward trained on (ELLM's goals come from the --annotator kind)")
    p.add_argument("--annotator", choices=["llm", "scripted"], default="llm")
    p.add_argument("--llm-model", default=None)
    p.add_argument("--llm-url", default=None)
    p.add_argument("--episodes", type=int, default=64, help="evaluation episodes per policy")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs-per-worker", type=int, default=EnvConfig.envs_per_worker,
                   help=f"games per worker (default {EnvConfig.envs_per_worker}, oni-train's)")
    p.add_argument("--intrinsic-coeff", type=float, default=1.0)
    p.add_argument("--logdir", default=None)
    p.add_argument("--goal-seconds", type=float, default=900.0,
                   help="ELLM: longest wait for the goals of evaluation states new to the goal table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames-per-update", type=int, default=None,
                   help="frames gathered per PPO update (default: one worker's batch)")
    p.add_argument("--acting", choices=["workers", "server"], default="workers",
                   help="where the policy acts: env workers' CPUs or one inference server")
    p.add_argument("--acting-splits", type=int, default=1,
                   help="with --acting server: groups of each worker's games that take turns (the trainer's)")
    p.add_argument("--prefetch-batches", type=int, default=None,
                   help="batches the trainer takes from the workers while it learns (default: the trainer's)")
    p.add_argument("--compile", choices=COMPILE_MODES,
                   default="off", help="torch.compile of the update (the trainer's --compile)")
    args = p.parse_args(argv)
    ellm = args.intrinsic_reward == "ellm"

    from torchrl_oni.envs import NLEBatchEnv
    from torchrl_oni.store import CaptionStore
    from torchrl_oni.train import TrainConfig, Trainer
    from torchrl_oni.train.policy import make_actor_critic

    logdir = args.logdir or tempfile.mkdtemp(prefix="oni-learning-check-")
    cfg = TrainConfig(task="score", frames=args.frames, workers=args.workers, envs_per_worker=args.envs_per_worker,
                      seed=args.seed, logdir=logdir, intrinsic_reward=args.intrinsic_reward, extrinsic_coeff=0.0,
                      intrinsic_coeff=args.intrinsic_coeff, annotator=args.annotator, llm_model=args.llm_model,
                      llm_url=args.llm_url, progress=True, tensorboard=False,
                      frames_per_update=args.frames_per_update, acting=args.acting, acting_splits=args.acting_splits,
                      prefetch_batches=args.prefetch_batches, compile=args.compile)
    t0 = time.perf_counter()
    trainer = Trainer.from_config(cfg)
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
        trained_eps = rollout_episodes(env, actor, args.episodes, keep_steps=ellm)
    random_eps = rollout_episodes(env, random_policy, args.episodes, keep_steps=ellm)
    env.close()
    if ellm:
        (tr_goals, rd_goals), (tr_cov, rd_cov), no_goals = ellm_goals_per_episode(
            trainer.run.cfg, (trained_eps, random_eps), args.goal_seconds)

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
        return (float(np.mean(per_ep)), float(np.mean(per_k)), float(np.mean([e["steps"] for e in eps])),
                float(np.mean([e["deepest"] for e in eps])))

    tr_ep, tr_k, tr_len, tr_depth = rates(trained_eps)
    rd_ep, rd_k, rd_len, rd_depth = rates(random_eps)
    name = "ELLM" if ellm else "ONI-Retrieval"
    print(f"\nlearning check: Score, {name}, intrinsic only, {summary['frames']:,.0f} frames in {train_s:.0f} s "
          f"({args.annotator} annotator); {len(trained_eps)} + {len(random_eps)} evaluation episodes")
    goal_head = f" {'goals achieved / episode':>25}" if ellm else ""
    print(f"{'policy':<10} {'approved captions / episode':>28} {'per 1000 steps':>15} {'episode length':>15} "
          f"{'deepest level':>14}" + goal_head)
    for policy, ep_, k_, len_, depth_, eps in (("random", rd_ep, rd_k, rd_len, rd_depth, random_eps),
                                               ("trained", tr_ep, tr_k, tr_len, tr_depth, trained_eps)):
        goal_cell = f" {np.mean(rd_goals if eps is random_eps else tr_goals):>25.2f}" if ellm else ""
        print(f"{policy:<10} {ep_:>28.2f} {k_:>15.2f} {len_:>15.0f} {depth_:>14.2f}" + goal_cell)
    top = sorted(approved, key=lambda h: -sum(h in e["captions"] for e in trained_eps))[:8]
    if top:
        print("approved captions the trained agent sees most (episodes with it, trained vs random):")
        for h in top:
            n_tr = sum(h in e["captions"] for e in trained_eps)
            n_rd = sum(h in e["captions"] for e in random_eps)
            print(f"   {n_tr:>4} {n_rd:>4}  {texts[h]!r}")
    print(f"captions judged: {len(hashes)} ({missing} could not be labelled: counted as not approved); run folder {logdir}")
    result = {
        "frames": int(summary["frames"]), "train_s": round(train_s), "annotator": args.annotator,
        "intrinsic_reward": args.intrinsic_reward, "frames_per_update": cfg.frames_per_update, "acting": args.acting,
        "acting_splits": args.acting_splits,
        "prefetch_batches": trainer.run.cfg.distributed.prefetch_batches, "compile": args.compile,
        "approved_per_episode_trained": round(tr_ep, 3), "approved_per_episode_random": round(rd_ep, 3),
        "approved_per_1k_steps_trained": round(tr_k, 3), "approved_per_1k_steps_random": round(rd_k, 3),
        "ratio": round(tr_ep / max(rd_ep, 1e-9), 3), "unlabelled_captions": int(missing),
        "episode_length_trained": round(tr_len), "episode_length_random": round(rd_len),
        "deepest_level_trained": round(tr_depth, 3), "deepest_level_random": round(rd_depth, 3),
    }
    if ellm:
        print(f"goals judged with the run's goal table: steps whose state had goals {tr_cov:.1%} (trained), "
              f"{rd_cov:.1%} (random); {no_goals} states without goals (pay 0)")
        result.update({
            "goals_per_episode_trained": round(float(np.mean(tr_goals)), 3),
            "goals_per_episode_random": round(float(np.mean(rd_goals)), 3),
            "goal_coverage_trained": round(tr_cov, 3), "goal_coverage_random": round(rd_cov, 3),
            "states_without_goals": int(no_goals),
        })
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
