# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · ONI's transforms in your own TorchRL pipeline
#
# ONI (*Online Intrinsic Rewards from LLM Feedback*) turns the messages a NetHack agent sees
# into an intrinsic reward: captions are labelled by an LLM **in the background** and a reward
# is looked up (or predicted) from those labels. In `torchrl_oni` this is two TorchRL transforms:
#
# * `LLMAnnotationTransform(store, annotator)` records every caption in a `CaptionStore` and has
#   a background thread label the new ones; data pass through untouched (optionally with a
#   boolean "this caption is labelled" entry);
# * `IntrinsicRewardTransform(reward_source, beta=3.0)` writes `("next", "intrinsic_reward")`
#   from a reward source such as `RetrievalReward(store)`, decayed by how often the caption was
#   already seen in the episode (`msg_count ** -beta`).
#
# This notebook plugs them into (1) the batched `NLEBatchEnv`, (2) the plain TorchRL
# `GymEnv` / `ParallelEnv` path, and (3) a collector loop, then inspects captions, labels and
# rewards. No LLM is needed: the **scripted annotator** (NetHack rules) stands in for it here;
# notebook 02 swaps in a real model.

# %% [markdown]
# **The scale cell.** This is the only cell to edit. `SMALL = True` (the default, and what CI runs
# with `ONI_TUTORIAL_SMALL=1`) runs the notebook on a CPU laptop in a few minutes; `SMALL = False`
# switches every size below to the bigger setting.

# %% tags=["parameters"]
# ===================== SCALE: the only cell to edit =====================
import os
SMALL = os.environ.get("ONI_TUTORIAL_SMALL", "1") != "0"   # set to False for the bigger setting
NUM_ENVS = 8 if SMALL else 64        # games stepped together by NLEBatchEnv
STEPS = 300 if SMALL else 3000       # rollout length
PARALLEL_WORKERS = 2 if SMALL else 8 # ParallelEnv processes in section 4
# =========================================================================

# %%
import logging, time
import numpy as np
import torch
import matplotlib.pyplot as plt
from torchrl.envs import Compose, TransformedEnv
from torchrl.envs.utils import check_env_specs

from torchrl_oni.envs import NLEBatchEnv
from torchrl_oni.store import CaptionStore
from torchrl_oni.annotators import ScriptedAnnotator
from torchrl_oni.rewards import RetrievalReward
from torchrl_oni.transforms import IntrinsicRewardTransform, LLMAnnotationTransform
from torchrl_oni.captions import decode_message, decode_messages

torch.set_num_threads(1)
_ = torch.manual_seed(0)
logging.getLogger("torchrl").setLevel(logging.WARNING)   # quieter storage/spec messages

# %% [markdown]
# ## 1. A plain TorchRL NetHack env
#
# `NLEBatchEnv` steps K games in one process and returns one TensorDict of batch size `[K]` per
# step: the caption (`message`, NUL-padded bytes), its stable 64-bit `caption_hash`, the
# per-episode `msg_count`, `blstats`, a `crop` of the map around the agent, and running
# `episode` statistics. It is an ordinary `EnvBase`: `check_env_specs` passes and `rollout` works.

# %%
base = NLEBatchEnv("score", num_envs=NUM_ENVS, seed=0)
check_env_specs(base)
td = base.rollout(3, break_when_any_done=False)
print(td)
print("first game's captions:", decode_messages(td["next", "message"][0].numpy()))

# %% [markdown]
# ## 2. Add annotation and the intrinsic reward as transforms
#
# One `CaptionStore` is shared: the annotation transform writes labels into it, the retrieval
# reward reads them back by hash. `labelled_key` adds a boolean per step saying whether the
# caption already had a label when the step was taken.

# %%
store = CaptionStore(capacity=100_000)
annotate = LLMAnnotationTransform(store, ScriptedAnnotator(goal="default"),
                                  labelled_key="caption_labelled")
intrinsic = IntrinsicRewardTransform(RetrievalReward(store), beta=3.0, message="acted")
env = TransformedEnv(NLEBatchEnv("score", num_envs=NUM_ENVS, seed=0), Compose(annotate, intrinsic))
print(env.transform)
print("reward keys:", list(env.full_reward_spec.keys(True, True)))

# %%
t0 = time.perf_counter()
rollout = env.rollout(STEPS, break_when_any_done=False)
elapsed = time.perf_counter() - t0
annotate.wait_idle(timeout=30)          # let the background worker finish labelling
print(f"{rollout.numel():,} steps in {elapsed:.1f} s ({rollout.numel() / elapsed:,.0f} steps/s)")
print({k: v for k, v in annotate.metrics().items()
       if k in ("size", "labelled", "positives", "coverage", "labels_total", "queue_depth")})

# %% [markdown]
# ## 3. Inspect captions, labels and rewards
#
# Every unique caption lives once in the store with its label and how often it was seen.

# %%
data = store.labelled_data()
texts = decode_messages(data["message"].numpy())
rows = sorted(zip(data["times_seen"].tolist(), data["label"].tolist(), texts), reverse=True)
print(f"{len(rows)} unique captions, {sum(l for _, l, _ in rows):.0f} labelled helpful\n")
print("most frequent captions:")
for seen, label, text in rows[:8]:
    print(f"  {seen:6d}×  label={label:.0f}  {text!r}")
print("\ncaptions labelled helpful:")
for seen, label, text in [r for r in rows if r[1] > 0.5][:12]:
    print(f"  {seen:6d}×  {text!r}")

# %% [markdown]
# The intrinsic reward of a step is `label(caption) × msg_count ** -3`: the first sighting of a
# helpful caption in an episode pays 1, the second 1/8, the third 1/27. Retrieval pays only once
# the label has *arrived*: the first sightings of a caption are unpaid while the annotator is
# still working on it, which is what the per-step `caption_labelled` flag shows. (The rules
# answer in microseconds, so coverage is high from the start; with an LLM it climbs slowly.)

# %%
r_int = rollout["next", "intrinsic_reward"].squeeze(-1)          # [NUM_ENVS, STEPS]
count = rollout["msg_count"]
paid = r_int > 0
print(f"steps paid: {int(paid.sum())} of {r_int.numel()}   total intrinsic reward: {float(r_int.sum()):.2f}")
for c in (1, 2, 3):
    sel = paid & (count == c)
    if sel.any():
        print(f"  msg_count={c}: reward {float(r_int[sel].mean()):.4f}")

fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
coverage = rollout["caption_labelled"].float().mean(0)
axes[0].plot(coverage.numpy())
axes[0].set(title="captions already labelled when seen", xlabel="step", ylabel="fraction of games", ylim=(0, 1.05))
axes[1].plot(r_int.sum(0).cumsum(0).numpy())
axes[1].set(title="cumulative intrinsic reward (all games)", xlabel="step", ylabel="reward")
for ax in axes:
    ax.grid(alpha=0.3)
plt.tight_layout(); plt.show()

# %% [markdown]
# **Recomputing on a batch.** Called on a collected batch (root + `"next"`), the reward transform
# recomputes the reward from the stored observations with the labels known *now*. That is what
# the trainer does: it applies both transforms to each collected batch, in the trainer process.

# %%
again = IntrinsicRewardTransform(RetrievalReward(store), beta=3.0)(rollout.clone())
print("intrinsic reward at step time :", round(float(rollout["next", "intrinsic_reward"].sum()), 2))
print("recomputed with today's labels:", round(float(again["next", "intrinsic_reward"].sum()), 2))
print("'next' pays the caption the action produced:",
      round(float(IntrinsicRewardTransform(RetrievalReward(store), message="next")(rollout.clone())
                  ["next", "intrinsic_reward"].sum()), 2))
env.close()

# %% [markdown]
# ## 4. The plain TorchRL path: `GymEnv` pieces and `ParallelEnv`
#
# `make_gym_env(task)` builds one game from TorchRL's own pieces (`GymWrapper` + a
# `MessageCounter` transform), with the same keys (scalars get a trailing dimension of 1).
# Wrap a `ParallelEnv` of them in a `TransformedEnv`: the transforms of the *outer* env run in
# the main process, where the store and the annotation thread live. (Do not put the annotation
# transform inside the worker factories: it refuses to be copied into another process.)

# %%
from functools import partial
from torchrl.envs import ParallelEnv
from torchrl_oni.envs.gym_wrapper import make_gym_env

gym_store = CaptionStore(capacity=10_000)
gym_annotate = LLMAnnotationTransform(gym_store, ScriptedAnnotator())
parallel = TransformedEnv(
    ParallelEnv(PARALLEL_WORKERS, partial(make_gym_env, "score", seed=1)),
    Compose(gym_annotate, IntrinsicRewardTransform(RetrievalReward(gym_store))),
)
gym_rollout = parallel.rollout(200 if SMALL else 1000, break_when_any_done=False)
gym_annotate.wait_idle(timeout=30)
print(gym_rollout.batch_size, gym_rollout["caption_hash"].shape, gym_rollout["next", "intrinsic_reward"].shape)
print("unique captions:", len(gym_store), " labelled helpful:", gym_store.stats()["positives"])
parallel.close(); gym_annotate.close()

# %% [markdown]
# ## 5. In a collector loop (how `oni-train` does it)
#
# With a collector, call the transforms on each batch in the training process. Here a
# `Collector` (TorchRL 0.14's single-process collector) with a random policy stands in for PPO's collector.

# %%
from torchrl.collectors import Collector

collector = Collector(lambda: NLEBatchEnv("score", num_envs=NUM_ENVS, seed=2), policy=None,
                              frames_per_batch=NUM_ENVS * 32, total_frames=NUM_ENVS * 32 * 4)
for i, batch in enumerate(collector):
    batch = annotate(batch)        # new captions go to the annotation thread; returns at once
    batch = intrinsic(batch)       # reward from the labels known now
    m = annotate.metrics()
    print(f"batch {i}: {batch.shape}, intrinsic mean {float(batch['next', 'intrinsic_reward'].mean()):.4f}, "
          f"coverage {m['coverage']:.2f}, store size {m['size']}")
collector.shutdown()
annotate.close()

# %% [markdown]
# **Next:** notebook 02 replaces the scripted rules with an LLM (embedded CPU server or vLLM),
# 03 compares the three ways of turning labels into a reward, and 04 trains an agent with them.
