# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · Reward models: retrieval vs classification vs ranking
#
# ONI turns LLM labels into an intrinsic reward in three ways:
#
# * **retrieval** (`RetrievalReward`): the reward *is* the label of the caption, looked up by
#   hash; unlabelled captions pay 0. No model, but no generalisation either.
# * **classification** (`ClassificationReward` + `ClassifierTrainer`): a character-level CNN
#   distils the labels and pays `1[P(helpful) > 0.5]` for any caption, labelled or not.
# * **ranking** (`RankingReward` + `RankingTrainer`): the LLM compares *pairs* of captions and a
#   Bradley–Terry model learns a score; the reward is the normalised, thresholded score.
#
# Section 6 puts **ELLM** beside them: no labels at all, the LLM suggests goals for each state
# and a step pays when its message achieves one.
#
# Here the three ONI rewards learn from the same labels: captions from a short random rollout, labelled
# by the scripted annotator (so the "truth" is known), with a held-out slice of captions that
# no model sees in training. We compare accuracy, calibration and the top-rewarded messages.

# %% [markdown]
# **The scale cell.** This is the only cell to edit. `SMALL = True` (the default, and what CI runs
# with `ONI_TUTORIAL_SMALL=1`) runs the notebook on a CPU laptop in a few minutes; `SMALL = False`
# switches every size below to the bigger setting.

# %% tags=["parameters"]
# ===================== SCALE: the only cell to edit =====================
import os
SMALL = os.environ.get("ONI_TUTORIAL_SMALL", "1") != "0"   # set to False for the bigger setting
NUM_ENVS = 32 if SMALL else 128
STEPS = 2000 if SMALL else 5000       # random-rollout length (distinct captions grow with it)
CLS_STEPS = 200 if SMALL else 3000    # classifier gradient steps
RANK_STEPS = 200 if SMALL else 3000   # ranking-model gradient steps
PAIRS = 3000 if SMALL else 30000      # caption pairs sent for comparison
BATCH = 32 if SMALL else 256
ELLM_STEPS = 200 if SMALL else 1000   # steps per game judged by ELLM (section 6)
# =========================================================================

# %%
import logging, time
import numpy as np
import torch
import matplotlib.pyplot as plt
from tensordict import TensorDict

from torchrl_oni.envs import NLEBatchEnv
from torchrl_oni.store import CaptionStore
from torchrl_oni.annotators import ScriptedAnnotator
from torchrl_oni.annotation import LLMAnnotationTransform
from torchrl_oni.captions import decode_messages
from torchrl_oni.rewards import (ClassificationReward, ClassifierTrainer, RankingReward, RankingTrainer,
                                 RetrievalReward, UniqueCaptionPairSampler, holdout_mask)

torch.set_num_threads(1)
_ = torch.manual_seed(0)
logging.getLogger("torchrl").setLevel(logging.WARNING)   # quieter storage/spec messages

# %% [markdown]
# ## 1. Collect captions and label them
#
# A random policy plays `NUM_ENVS` games; every caption goes into a `CaptionStore` and is
# labelled in the background by the scripted annotator. 20 % of the distinct captions (chosen by
# hash) are held out: they are kept in a separate list and never shown to any model.

# %%
t0 = time.perf_counter()
env = NLEBatchEnv("score", num_envs=NUM_ENVS, seed=0)
rollout = env.rollout(STEPS, break_when_any_done=False)
env.close()
messages = rollout["next", "message"].reshape(-1, 256)
hashes = rollout["next", "caption_hash"].reshape(-1)
uniq, first = np.unique(hashes.numpy(), return_index=True)
messages, hashes = messages[first], hashes[first]
held = holdout_mask(hashes, 0.2)
print(f"{rollout.numel():,} steps, {len(hashes)} distinct captions "
      f"({int(held.sum())} held out) in {time.perf_counter() - t0:.1f} s")

store = CaptionStore(capacity=50_000)            # the training captions only
train_batch = TensorDict(message=messages[~held], caption_hash=hashes[~held],
                         batch_size=[int((~held).sum())])
with LLMAnnotationTransform(store, ScriptedAnnotator()) as annotate:
    annotate(train_batch)                     # returns at once; labels arrive in the background
    # Pairs of distinct training captions for the ranking model, answered by compare().
    sampler = UniqueCaptionPairSampler(capacity=100_000, seed=0)
    sampler.observe(messages[~held], hashes[~held])
    _, _, h1, h2 = sampler.sample_pairs(PAIRS)
    store.add_pairs(h1, h2)
    annotate.worker.wake()
    annotate.wait_idle(timeout=60)
stats = store.stats()
print({k: stats[k] for k in ("size", "labelled", "positives", "pairs", "pairs_labelled")})

rules = ScriptedAnnotator()
test_msgs, test_hashes = messages[held], hashes[held]
test_texts = decode_messages(test_msgs.numpy())
test_y = np.array([rules.label(t) for t in test_texts])
train_texts = decode_messages(messages[~held].numpy())
print(f"held-out: {len(test_y)} captions, {int(test_y.sum())} helpful; e.g.",
      [t for t, y in zip(test_texts, test_y) if y][:4])

# %% [markdown]
# ## 2. Train the three reward models
#
# Retrieval needs no training. The classifier and the ranking model are trained for a fixed
# number of steps on the store's labels / labelled pairs (in `oni-train` this happens between
# PPO iterations, on the schedule of `RewardModelSchedule`).

# %%
retrieval = RetrievalReward(store)

classification = ClassificationReward(threshold=0.5)
cls_trainer = ClassifierTrainer(classification, store, lr=1e-3, batch_size=BATCH, holdout_fraction=0.0)
ranking = RankingReward(threshold=-0.5)
rank_trainer = RankingTrainer(ranking, store, lr=1e-3, batch_size=BATCH)

history = {"cls_loss": [], "rank_loss": []}
t0 = time.perf_counter()
for _ in range(CLS_STEPS // 10):
    history["cls_loss"].append(cls_trainer.train_steps(10, publish=False)["loss"])
cls_trainer.publish()
t_cls = time.perf_counter() - t0
t0 = time.perf_counter()
for _ in range(RANK_STEPS // 10):
    history["rank_loss"].append(rank_trainer.train_steps(10, publish=False)["loss"])
rank_trainer.publish()
t_rank = time.perf_counter() - t0
print(f"classifier: {CLS_STEPS} steps in {t_cls:.1f} s; ranking: {RANK_STEPS} steps in {t_rank:.1f} s")

fig, axes = plt.subplots(1, 2, figsize=(10, 3))
for ax, key, title in [(axes[0], "cls_loss", "classifier: cross-entropy"),
                       (axes[1], "rank_loss", "ranking: Bradley-Terry loss")]:
    ax.plot(np.arange(1, len(history[key]) + 1) * 10, history[key])
    ax.set(title=title, xlabel="step"); ax.grid(alpha=0.3)
plt.tight_layout(); plt.show()

# %% [markdown]
# ## 3. Accuracy on captions no model has seen
#
# Retrieval pays 0 for every held-out caption (it has no label for them), so its accuracy is
# the share of unhelpful captions and its recall of helpful ones is 0 — the reason ONI also
# trains models. The classifier pays 1 when `P(helpful) > 0.5`. The ranking reward is the
# *normalised* score kept above ONI's threshold of -0.5 standard deviations, which pays most
# captions something: its information is in the **size** of the reward (compare the mean
# reward of helpful and unhelpful captions), not in whether it is positive. AUC — how well each
# model's score orders helpful above unhelpful captions — is the fair common measure.

# %%
from torchrl_oni.stats import auc  # P(helpful scores above unhelpful), ties ½

ranking.update_stats = False   # evaluate with the statistics gathered so far
ranking.stats.update(ranking.scores(messages[~held]))   # running stats over training captions
outputs = {
    "retrieval": (retrieval(test_msgs, test_hashes).numpy(), retrieval(test_msgs, test_hashes).numpy()),
    "classification": (classification(test_msgs, test_hashes).numpy(),
                       classification.helpful_probability(test_msgs).numpy()),
    "ranking": ((ranking(test_msgs, test_hashes) > 0).float().numpy(), ranking.scores(test_msgs).numpy()),
}
mean_reward = {
    "retrieval": retrieval(test_msgs, test_hashes).numpy(),
    "classification": classification(test_msgs, test_hashes).numpy(),
    "ranking": ranking(test_msgs, test_hashes).numpy(),
}
print(f"{'model':16s} {'accuracy':>9s} {'balanced':>9s} {'recall+':>8s} {'precision+':>11s} {'AUC':>6s}"
      f" {'R(helpful)':>11s} {'R(other)':>9s}")
for name, (reward, score) in outputs.items():
    pred = reward > 0
    r = mean_reward[name]
    acc = (pred == test_y.astype(bool)).mean()
    rec = pred[test_y == 1].mean() if test_y.sum() else float("nan")
    spec = (~pred[test_y == 0]).mean()
    prec = test_y[pred].mean() if pred.any() else float("nan")
    print(f"{name:16s} {acc:9.3f} {(rec + spec) / 2:9.3f} {rec:8.3f} {prec:11.3f} {auc(score, test_y):6.3f}"
          f" {r[test_y == 1].mean():11.3f} {r[test_y == 0].mean():9.3f}")

# %% [markdown]
# ## 4. Calibration
#
# A reliability plot bins held-out captions by the classifier's `P(helpful)` and compares each
# bin's mean prediction with the share of truly helpful captions in it (points below the
# diagonal: too eager to say "helpful"). Trained on balanced batches, the classifier is
# calibrated for a 50/50 prior, which pushes it to over-predict on the real, mostly-unhelpful
# data; trained many steps on few captions it is also very confident (most captions land in the
# first or the last bin). The reward only uses the 0.5 threshold. The ranking score has no
# probability scale; its histogram shows how it separates the classes.

# %%
prob = outputs["classification"][1]
bins = np.linspace(0, 1, 11)
idx = np.clip(np.digitize(prob, bins) - 1, 0, 9)
mean_pred = [prob[idx == b].mean() for b in range(10) if (idx == b).any()]
frac_pos = [test_y[idx == b].mean() for b in range(10) if (idx == b).any()]
counts = [(idx == b).sum() for b in range(10) if (idx == b).any()]

fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
axes[0].plot([0, 1], [0, 1], "k--", lw=1, label="perfect")
axes[0].scatter(mean_pred, frac_pos, s=[20 + 3 * c for c in counts], label="classifier (size = #captions)")
axes[0].plot(mean_pred, frac_pos)
axes[0].set(title="reliability (held-out captions)", xlabel="mean P(helpful) in bin",
            ylabel="fraction helpful", xlim=(0, 1), ylim=(-0.02, 1.02))
axes[0].legend(fontsize=8)
axes[1].hist([prob[test_y == 0], prob[test_y == 1]], bins=20, range=(0, 1), label=["unhelpful", "helpful"], log=True)
axes[1].set(title="classifier P(helpful)", xlabel="P(helpful)"); axes[1].legend(fontsize=8)
score = outputs["ranking"][1]
axes[2].hist([score[test_y == 0], score[test_y == 1]], bins=20, label=["unhelpful", "helpful"], log=True)
axes[2].set(title="ranking score g(m)", xlabel="raw score"); axes[2].legend(fontsize=8)
for ax in axes: ax.grid(alpha=0.3)
plt.tight_layout(); plt.show()

# %% [markdown]
# ## 5. Top-rewarded messages
#
# Over all distinct captions of the rollout (training and held-out), which ones does each model
# rate highest? `*` marks held-out captions.

# %%
all_texts = decode_messages(messages.numpy())
is_held = held.numpy()
views = {
    "retrieval (label)": retrieval(messages, hashes).numpy(),
    "classification P(helpful)": classification.helpful_probability(messages).numpy(),
    "ranking score": ranking.scores(messages).numpy(),
}
for name, values in views.items():
    order = np.argsort(-values, kind="stable")[:10]
    print(f"--- {name} ---")
    for i in order:
        print(f"  {values[i]:7.3f} {'*' if is_held[i] else ' '} {all_texts[i][:80]!r}")
    print()

# %% [markdown]
# **Reading the results.** Retrieval is exact where it has labels and blind elsewhere; the
# classifier generalises to unseen variants of helpful messages (`You kill the jackal!  The
# kitten ...`), at the price of some false positives; ranking learns an ordering from pairs
# only, so its threshold is a quantile of the score distribution rather than a probability.
# With `SMALL = False` there are more distinct captions, more pairs and more steps.

# %% [markdown]
# ## 6. Beside them: ELLM
#
# ELLM (Du et al., 2023; `--intrinsic-reward ellm`) needs no labels and trains no model. For
# each state the agent acts in (a *state caption*: dungeon level, health, hunger, what is next
# to it and nearby), the LLM suggests a few goals ("kill the jackal", "descend the stairs"); a
# step pays the cosine between its message and one of its state's goals when that is above a
# threshold (a sentence encoder's space), and each goal pays at most once per episode. So it
# pays for **doing what was suggested in that state**, where the ONI rewards pay for messages
# judged helpful anywhere. Goals are asked for in the background and cached per state, so a
# state whose goals have not arrived yet pays 0 — below, the first half of the rollout asks
# for the goals, the second half is paid. The goals come from `--annotator` (here the scripted
# rules; with `llm`, from `--llm-url`, a pool of servers, with the labels' fault handling);
# the settings are the `--ellm-*` flags: `--ellm-threshold`, `--ellm-goals-per-state`,
# `--ellm-encoder {auto,minilm,hashed}`, `--ellm-message {next,acted}`,
# `--no-ellm-once-per-episode`, `--ellm-count-exponent`, `--ellm-goal-conditioned`,
# `--ellm-state-message`, `--ellm-goal-table`, `--ellm-api`.

# %%
from torchrl_oni.rewards.ellm import build_ellm_reward, transition_caption

ellm = build_ellm_reward(annotator_kind="scripted", encoder="auto")  # MiniLM if installed, else hashed
first_half = rollout[:, :ELLM_STEPS].clone()                 # [games, steps], time last
second_half = rollout[:, ELLM_STEPS:2 * ELLM_STEPS].clone()  # the same games, later
t0 = time.perf_counter()
ellm.on_batch(first_half)            # new states' goals are asked for; returns at once
ellm.wait_idle(timeout=60)
ellm.metrics()                       # (starts a fresh reporting window)
paid = ellm.on_batch(second_half)["next", "intrinsic_reward"].reshape(-1)
m = ellm.metrics()
print(f"ELLM on {second_half.numel():,} steps in {time.perf_counter() - t0:.1f} s ({ellm.encoder.name} "
      f"encoder, threshold {ellm.threshold:.2f}): {int(m['ellm/states'])} states, "
      f"{m['ellm/goal_coverage']:.0%} of steps with goals, {m['ellm/paid_fraction']:.2%} paid")
print("goals paid most often:", ellm.top_goals(6))
state_hash = second_half["state_hash"].reshape(-1)
next_msgs = decode_messages(second_half["next", "message"].reshape(-1, 256).numpy())
labels = retrieval(second_half["next", "message"].reshape(-1, 256), second_half["next", "caption_hash"].reshape(-1))
print(f"\n{'ELLM':>5} {'label':>5}  message  <-  goals suggested for the state")
for i in torch.nonzero(paid > 0).squeeze(1)[:8].tolist():
    print(f"{paid[i]:5.2f} {labels[i]:5.1f}  {transition_caption(next_msgs[i])!r}  <-  "
          f"{', '.join(ellm.table.goals_of(int(state_hash[i])))}")
ellm.close()

# %% [markdown]
# The `label` column is the scripted label retrieval would pay for the same message (0 for
# captions it holds no label for). ELLM pays a kill only in a state where that kill was
# suggested, and once per episode; the ONI rewards pay a helpful message wherever it appears
# (decayed by its count in the episode). Read the pairs for what ELLM really rewards: the
# transition caption is NetHack's message, so "The jackal is killed!" (the kitten's work)
# achieves "kill the jackal" too, and a near miss just above the threshold pays as much as a
# hit. With the MiniLM encoder paraphrases match; the `hashed` fallback (`--ellm-encoder
# hashed`, no weights) is lexical and pays messages that merely share words with a goal.
