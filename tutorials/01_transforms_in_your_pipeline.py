# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · ONI in your own TorchRL pipeline
#
# ONI (*Online Intrinsic Rewards from LLM Feedback*) turns the messages a NetHack agent sees
# into an intrinsic reward: captions are labelled by an LLM **in the background** while the agent
# trains, and a reward is looked up from those labels. For a TorchRL user this is one call:
#
# ```python
# env = TransformedEnv(GymEnv("NetHackScore-v0"), oni_transforms(annotator=...))
# ```
#
# This notebook builds that env, looks at what each transform of the stack adds, checks that the
# stored data are right (NLE reuses its observation arrays, which silently corrupts a plain
# `GymEnv` rollout), recomputes rewards on a replay buffer, runs the stack over a `ParallelEnv`
# and the fast batched env, trains with TorchRL's collector, and saves and restores the labels
# with `state_dict()`. No LLM is needed: the **scripted annotator** (NetHack rules) stands in
# for it; notebook 02 swaps in a real model.

# %% [markdown]
# **The scale cell.** This is the only cell to edit. `SMALL = True` (the default, and what CI runs
# with `ONI_TUTORIAL_SMALL=1`) runs the notebook on a CPU laptop in a few minutes; `SMALL = False`
# switches every size below to the bigger setting.

# %% tags=["parameters"]
# ===================== SCALE: the only cell to edit =====================
import os
SMALL = os.environ.get("ONI_TUTORIAL_SMALL", "1") != "0"   # set to False for the bigger setting
STEPS = 300 if SMALL else 3000       # rollout length of one game
NUM_ENVS = 8 if SMALL else 64        # games stepped together by NLEBatchEnv
PARALLEL_WORKERS = 2 if SMALL else 8 # ParallelEnv processes in section 5
FRAMES = 2048 if SMALL else 50_000   # collector frames in section 6
# =========================================================================

# %%
import logging, multiprocessing, time
import torch
import matplotlib.pyplot as plt
from torchrl.envs import Compose, GymEnv, TransformedEnv
from torchrl.envs.utils import check_env_specs

import torchrl_oni                                   # registers the task ids with gymnasium
from torchrl_oni import ScriptedAnnotator, oni_transforms
from torchrl_oni.captions import decode_messages

torch.set_num_threads(1)
_ = torch.manual_seed(0)
logging.getLogger("torchrl").setLevel(logging.WARNING)   # quieter spec checks
if "__file__" in globals():   # run as a script (python tutorials/01_...py), not as a notebook:
    # worker processes start as copies of this one ("fork", as in TorchRL's own tutorials); under
    # the default "spawn" each would import this file again and re-run it from the top. Your own
    # scripts may keep spawn and put their code under `if __name__ == "__main__":` instead.
    multiprocessing.set_start_method("fork", force=True)

# %% [markdown]
# ## 1. One call
#
# `oni_transforms` returns a TorchRL `Compose`. With `intrinsic_coeff` it also mixes the
# intrinsic reward into `("next", "reward")` (ONI: `0.1 · clip(r, ±10) + 0.4 · r_int` on score;
# here `extrinsic_coeff` keeps its default 1) and keeps the env's own reward in
# `("next", "extrinsic_reward")`.

# %%
oni = oni_transforms(annotator=ScriptedAnnotator(), intrinsic_coeff=0.4)
env = TransformedEnv(GymEnv("NetHackScore-v0"), oni)
check_env_specs(env)
print(oni)
print("observation keys the stack adds:", [k for k in env.observation_spec.keys() if k in ("caption_hash", "msg_count")])
print("reward keys:", list(env.full_reward_spec.keys(True, True)))

# %%
env.set_seed(0)
t0 = time.perf_counter()
rollout = env.rollout(STEPS, break_when_any_done=False)
elapsed = time.perf_counter() - t0
oni.wait_idle(timeout=30)          # let the background thread finish labelling
print(f"{rollout.numel():,} steps in {elapsed:.1f} s ({rollout.numel() / elapsed:,.0f} steps/s)")
print({k: v for k, v in oni.metrics().items() if k in ("size", "labelled", "positives", "coverage", "queue_depth")})

# %% [markdown]
# ## 2. What each transform adds
#
# | transform | writes |
# |---|---|
# | `CopyAliasedObservations` | copies of observations the env hands out in reused arrays |
# | `CaptionHash` | `caption_hash`: a stable 64-bit hash of the `message` bytes |
# | `MessageCounter` | `msg_count`: how often this caption was seen in the episode (1 the first time) |
# | `LLMAnnotationTransform` | nothing: new captions go to the annotator, labels to `oni.store` |
# | `IntrinsicRewardTransform` | `("next", "intrinsic_reward")` = label · `msg_count`⁻³ |
# | `CombineRewards` | `("next", "reward")` mixed, `("next", "extrinsic_reward")` kept |
#
# **Why the copy.** NLE's gymnasium env writes every observation into the same numpy arrays and
# `GymEnv` hands them over without copying, so a plain rollout keeps the *last* observation at
# every step. Rewards computed at step time are right, but anything recomputed from stored data
# (a replay buffer, rewards relabelled when new labels arrive: what ONI does) would be wrong.

# %%
plain = GymEnv("NetHackScore-v0")
plain.set_seed(0)
bad = plain.rollout(STEPS, break_when_any_done=False)
plain.close()
distinct = lambda td: len({bytes(m.tolist()) for m in td["next", "message"]})
print("distinct stored messages, plain GymEnv:", distinct(bad), "  with the stack:", distinct(rollout))
print("the stack saw the env reuse its arrays:", oni[0].aliased)

# %% [markdown]
# ## 3. Captions, labels and rewards
#
# Every distinct caption lives once in the store with its label and how often it was seen. The
# first sighting of a helpful caption in an episode pays 1, the second 1/8, the third 1/27.

# %%
data = oni.store.labelled_data()
rows = sorted(zip(data["times_seen"].tolist(), data["label"].tolist(), decode_messages(data["message"].numpy())), reverse=True)
print(f"{len(rows)} distinct captions, {sum(l for _, l, _ in rows):.0f} labelled helpful\n")
for seen, label, text in rows[:10]:
    print(f"  {seen:5d}×  label={label:.0f}  {text!r}")

r_int = rollout["next", "intrinsic_reward"].squeeze(-1)
count = rollout["msg_count"]
for c in (1, 2, 3):
    sel = (r_int > 0) & (count == c)
    if sel.any():
        print(f"paid at msg_count={c}: {float(r_int[sel].mean()):.4f}")

fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
axes[0].plot(r_int.cumsum(0).numpy())
axes[0].set(title="cumulative intrinsic reward", xlabel="step", ylabel="reward")
axes[1].plot(rollout["msg_count"].numpy(), lw=0.8)
axes[1].set(title="msg_count along the game", xlabel="step", ylabel="sightings this episode")
for ax in axes:
    ax.grid(alpha=0.3)
plt.tight_layout(); plt.show()

# %% [markdown]
# ## 4. Replay buffers: the reward from today's labels
#
# Called on a batch or a sample, the reward transform recomputes the reward from the stored
# observations with the labels known *now*. Give the buffer a clone of it (a transform has one
# parent).

# %%
from torchrl.data import LazyTensorStorage, ReplayBuffer

buffer = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=oni.intrinsic.clone(), batch_size=64)
buffer.extend(rollout)
sample = buffer.sample()
labels, found = oni.store.lookup(sample["caption_hash"])
print("sampled steps whose caption has a label:", int(found.sum()), "of", len(sample))
print("reward recomputed on the sample:", round(float(sample["next", "intrinsic_reward"].sum()), 3))
env.close()                        # closes the stack too: the annotation thread stops

# %% [markdown]
# ## 5. Many games: `ParallelEnv`, and the fast batched env
#
# Put the stack on the **outer** env: the workers step the games, and counting, labelling and the
# reward run in this process, where the store lives. (Inside a worker factory the annotation
# transform refuses to be copied into another process, with an error naming this fix.) A worker
# process has imported neither NLE nor `torchrl_oni`, so name the id with its module
# (`"nle:NetHackScore-v0"`, `"torchrl_oni:NetHackScore-v1"`): gymnasium imports it first. The same
# stack also serves `NLEBatchEnv`, which steps K games in one process about 10× faster per frame
# and writes `caption_hash` and `msg_count` itself; the stack leaves them. (Run as a script, this
# file forks its `ParallelEnv` workers: see the imports cell.)

# %%
from functools import partial
from torchrl.envs import ParallelEnv
from torchrl_oni.envs import NLEBatchEnv

with oni_transforms(annotator=ScriptedAnnotator()) as par_oni:
    parallel = TransformedEnv(ParallelEnv(PARALLEL_WORKERS, partial(GymEnv, "nle:NetHackScore-v0")), par_oni)
    par = parallel.rollout(100 if SMALL else 1000, break_when_any_done=False)
    parallel.close()
    torch.set_num_threads(1)   # closing it gave this process a torch thread per core again; keep 1
    print("ParallelEnv:", par.batch_size, "msg_count", tuple(par["msg_count"].shape), "store:", len(par_oni.store))

fast_oni = oni_transforms(annotator=ScriptedAnnotator())
fast = TransformedEnv(NLEBatchEnv("score", num_envs=NUM_ENVS, seed=0), fast_oni)
t0 = time.perf_counter()
batch = fast.rollout(STEPS, break_when_any_done=False)
print(f"NLEBatchEnv: {batch.numel() / (time.perf_counter() - t0):,.0f} steps/s over {NUM_ENVS} games;",
      "aliased:", fast_oni[0].aliased, "(fresh tensors: nothing to copy)")
fast.close()

# %% [markdown]
# ## 6. Training with TorchRL's collector and PPO, then a checkpoint
#
# The single-process `Collector` steps the env in this process, so the stack is used as is. A
# small PPO (TorchRL's `ClipPPOLoss` with its default GAE) on the bottom-line statistics.
# (`oni-train` instead runs many env processes and applies the annotation and reward transforms to
# each collected batch in the trainer.)

# %%
from torchrl.collectors import Collector
from torchrl.envs import DTypeCastTransform
from torchrl.modules import MLP, ProbabilisticActor, SafeModule, ValueOperator
from torchrl.objectives import ClipPPOLoss

oni = oni_transforms(annotator=ScriptedAnnotator(), intrinsic_coeff=0.4)
env = TransformedEnv(GymEnv("NetHackScore-v0", categorical_action_encoding=True), oni)
env.append_transform(DTypeCastTransform(torch.int64, torch.float32, ["blstats"], ["obs"]))
net = lambda out: torch.nn.Sequential(torch.nn.LayerNorm(27), MLP(27, out, num_cells=[64]))
actor = ProbabilisticActor(SafeModule(net(env.action_spec.n), ["obs"], ["logits"]), ["logits"],
                           distribution_class=torch.distributions.Categorical, return_log_prob=True)
loss = ClipPPOLoss(actor, ValueOperator(net(1), ["obs"]))
opt = torch.optim.Adam(loss.parameters(), lr=3e-4)
history = []
for batch in Collector(env, actor, frames_per_batch=256, total_frames=FRAMES):
    loss.value_estimator(batch)
    sum(v for k, v in loss(batch).items() if k.startswith("loss_")).backward()
    opt.step(); opt.zero_grad()
    m = oni.metrics()
    history.append((float(batch["next", "intrinsic_reward"].sum()), m["size"], m["coverage"]))
    print(f"batch {len(history)}: intrinsic {history[-1][0]:.3f}, captions {m['size']}, coverage {m['coverage']:.2f}")

# %% [markdown]
# **Checkpoints.** The labels travel in the pipeline's `state_dict()`: the annotation transform
# keeps the store's state as its extra state. A fresh pipeline with an empty store gets them back
# with `load_state_dict`, and pays the same rewards on the same data.

# %%
oni.wait_idle(timeout=30)
state = env.transform.state_dict()
restored = oni_transforms(annotator=ScriptedAnnotator(), intrinsic_coeff=0.4)
restored_env = TransformedEnv(GymEnv("NetHackScore-v0", categorical_action_encoding=True), restored)
restored_env.append_transform(DTypeCastTransform(torch.int64, torch.float32, ["blstats"], ["obs"]))
print("store before loading:", len(restored.store))
restored_env.transform.load_state_dict(state)
print("store after loading: ", len(restored.store), "(saved:", len(oni.store), ")")
same = torch.allclose(oni.intrinsic(batch.clone())["next", "intrinsic_reward"],
                      restored.intrinsic(batch.clone())["next", "intrinsic_reward"])
print("same rewards on the last batch:", same)
env.close(); restored_env.close()

# %% [markdown]
# **Next:** notebook 02 replaces the scripted rules with an LLM (embedded CPU server or vLLM),
# 03 compares the ways of turning labels into a reward, and 04 trains with `oni-train`.
