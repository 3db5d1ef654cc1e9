"""Writes the tutorial notebooks from the cell sources below, and optionally executes them.

The notebooks are generated so that their text lives in one reviewable Python file; the
``.ipynb`` files are committed WITH their outputs (figures included).

    python tutorials/build_notebooks.py              # write the four notebooks, no outputs
    python tutorials/build_notebooks.py --execute    # write, run (small setting), save outputs

Executing runs each notebook top to bottom with nbclient in a temporary folder (their runs and
files go there), with ``ONI_TUTORIAL_SMALL=1``, and prints each notebook's wall time.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def md(text: str):
    return new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(text: str, tags=()):
    cell = new_code_cell(textwrap.dedent(text).strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


SCALE_NOTE = (
    "**The scale cell.** This is the only cell to edit. `SMALL = True` (the default, and what CI "
    "runs with `ONI_TUTORIAL_SMALL=1`) runs the notebook on a CPU laptop in a few minutes; "
    "`SMALL = False` switches every size below to the bigger setting."
)

# --------------------------------------------------------------------------------------------
NB01 = [
    md("""
    # 01 · ONI's transforms in your own TorchRL pipeline

    ONI (*Online Intrinsic Rewards from LLM Feedback*) turns the messages a NetHack agent sees
    into an intrinsic reward: captions are labelled by an LLM **in the background** and a reward
    is looked up (or predicted) from those labels. In `torchrl_oni` this is two TorchRL transforms:

    * `LLMAnnotationTransform(store, annotator)` records every caption in a `CaptionStore` and has
      a background thread label the new ones; data pass through untouched (optionally with a
      boolean "this caption is labelled" entry);
    * `IntrinsicRewardTransform(reward_source, beta=3.0)` writes `("next", "intrinsic_reward")`
      from a reward source such as `RetrievalReward(store)`, decayed by how often the caption was
      already seen in the episode (`msg_count ** -beta`).

    This notebook plugs them into (1) the batched `NLEBatchEnv`, (2) the plain TorchRL
    `GymEnv` / `ParallelEnv` path, and (3) a collector loop, then inspects captions, labels and
    rewards. No LLM is needed: the **scripted annotator** (NetHack rules) stands in for it here;
    notebook 02 swaps in a real model.
    """),
    md(SCALE_NOTE),
    code("""
    # ===================== SCALE: the only cell to edit =====================
    import os
    SMALL = os.environ.get("ONI_TUTORIAL_SMALL", "1") != "0"   # set to False for the bigger setting
    NUM_ENVS = 8 if SMALL else 64        # games stepped together by NLEBatchEnv
    STEPS = 300 if SMALL else 3000       # rollout length
    PARALLEL_WORKERS = 2 if SMALL else 8 # ParallelEnv processes in section 4
    # =========================================================================
    """),
    code("""
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
    """),
    md("""
    ## 1. A plain TorchRL NetHack env

    `NLEBatchEnv` steps K games in one process and returns one TensorDict of batch size `[K]` per
    step: the caption (`message`, NUL-padded bytes), its stable 64-bit `caption_hash`, the
    per-episode `msg_count`, `blstats`, a `crop` of the map around the agent, and running
    `episode` statistics. It is an ordinary `EnvBase`: `check_env_specs` passes and `rollout` works.
    """),
    code("""
    base = NLEBatchEnv("score", num_envs=NUM_ENVS, seed=0)
    check_env_specs(base)
    td = base.rollout(3, break_when_any_done=False)
    print(td)
    print("first game's captions:", decode_messages(td["next", "message"][0].numpy()))
    """),
    md("""
    ## 2. Add annotation and the intrinsic reward as transforms

    One `CaptionStore` is shared: the annotation transform writes labels into it, the retrieval
    reward reads them back by hash. `labelled_key` adds a boolean per step saying whether the
    caption already had a label when the step was taken.
    """),
    code("""
    store = CaptionStore(capacity=100_000)
    annotate = LLMAnnotationTransform(store, ScriptedAnnotator(goal="default"),
                                      labelled_key="caption_labelled")
    intrinsic = IntrinsicRewardTransform(RetrievalReward(store), beta=3.0, message="acted")
    env = TransformedEnv(NLEBatchEnv("score", num_envs=NUM_ENVS, seed=0), Compose(annotate, intrinsic))
    print(env.transform)
    print("reward keys:", list(env.full_reward_spec.keys(True, True)))
    """),
    code("""
    t0 = time.perf_counter()
    rollout = env.rollout(STEPS, break_when_any_done=False)
    elapsed = time.perf_counter() - t0
    annotate.wait_idle(timeout=30)          # let the background worker finish labelling
    print(f"{rollout.numel():,} steps in {elapsed:.1f} s ({rollout.numel() / elapsed:,.0f} steps/s)")
    print({k: v for k, v in annotate.metrics().items()
           if k in ("size", "labelled", "positives", "coverage", "labels_total", "queue_depth")})
    """),
    md("""
    ## 3. Inspect captions, labels and rewards

    Every unique caption lives once in the store with its label and how often it was seen.
    """),
    code("""
    data = store.labelled_data()
    texts = decode_messages(data["message"].numpy())
    rows = sorted(zip(data["times_seen"].tolist(), data["label"].tolist(), texts), reverse=True)
    print(f"{len(rows)} unique captions, {sum(l for _, l, _ in rows):.0f} labelled helpful\\n")
    print("most frequent captions:")
    for seen, label, text in rows[:8]:
        print(f"  {seen:6d}×  label={label:.0f}  {text!r}")
    print("\\ncaptions labelled helpful:")
    for seen, label, text in [r for r in rows if r[1] > 0.5][:12]:
        print(f"  {seen:6d}×  {text!r}")
    """),
    md("""
    The intrinsic reward of a step is `label(caption) × msg_count ** -3`: the first sighting of a
    helpful caption in an episode pays 1, the second 1/8, the third 1/27. Retrieval pays only once
    the label has *arrived*: the first sightings of a caption are unpaid while the annotator is
    still working on it, which is what the per-step `caption_labelled` flag shows. (The rules
    answer in microseconds, so coverage is high from the start; with an LLM it climbs slowly.)
    """),
    code("""
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
    """),
    md("""
    **Recomputing on a batch.** Called on a collected batch (root + `"next"`), the reward transform
    recomputes the reward from the stored observations with the labels known *now*. That is what
    the trainer does: it applies both transforms to each collected batch, in the trainer process.
    """),
    code("""
    again = IntrinsicRewardTransform(RetrievalReward(store), beta=3.0)(rollout.clone())
    print("intrinsic reward at step time :", round(float(rollout["next", "intrinsic_reward"].sum()), 2))
    print("recomputed with today's labels:", round(float(again["next", "intrinsic_reward"].sum()), 2))
    print("'next' pays the caption the action produced:",
          round(float(IntrinsicRewardTransform(RetrievalReward(store), message="next")(rollout.clone())
                      ["next", "intrinsic_reward"].sum()), 2))
    env.close()
    """),
    md("""
    ## 4. The plain TorchRL path: `GymEnv` pieces and `ParallelEnv`

    `make_gym_env(task)` builds one game from TorchRL's own pieces (`GymWrapper` + a
    `MessageCounter` transform), with the same keys (scalars get a trailing dimension of 1).
    Wrap a `ParallelEnv` of them in a `TransformedEnv`: the transforms of the *outer* env run in
    the main process, where the store and the annotation thread live. (Do not put the annotation
    transform inside the worker factories: it refuses to be copied into another process.)
    """),
    code("""
    from functools import partial
    from torchrl.envs import ParallelEnv
    from torchrl_oni.envs.gym_pieces import make_gym_env

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
    """),
    md("""
    ## 5. In a collector loop (how `oni-train` does it)

    With a collector, call the transforms on each batch in the training process. Here a
    `Collector` (TorchRL 0.14's single-process collector) with a random policy stands in for PPO's collector.
    """),
    code("""
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
    """),
    md("""
    **Next:** notebook 02 replaces the scripted rules with an LLM (embedded CPU server or vLLM),
    03 compares the three ways of turning labels into a reward, and 04 trains an agent with them.
    """),
]

# --------------------------------------------------------------------------------------------
NB02 = [
    md("""
    # 02 · Annotators: scripted rules, an embedded CPU LLM, a vLLM server

    An *annotator* turns captions into labels (`annotate`) and pairs of captions into
    preferences (`compare`); all of them share one async protocol (`torchrl_oni.annotators.base`).

    | annotator | what answers | when to use |
    |---|---|---|
    | `ScriptedAnnotator(goal)` | hand-written NetHack rules | no LLM at hand, tests, a baseline |
    | `OpenAIAnnotator(url, model)` + `start_embedded_server(...)` | a small model on the CPU, in-process | laptops, CI |
    | `OpenAIAnnotator(url, model)` + `oni-serve --backend vllm` | a large model on a GPU node | real experiments |

    We also look at the prompts, at how the goal steers them, and at what a **parse failure**
    looks like (answers are never guessed: an unreadable answer is counted and asked again later).
    """),
    md(SCALE_NOTE + " The small setting serves the 135M-parameter test model; the bigger one "
       "the default 0.5B model (both are installed from PyPI packages)."),
    code("""
    # ===================== SCALE: the only cell to edit =====================
    import os
    SMALL = os.environ.get("ONI_TUTORIAL_SMALL", "1") != "0"   # set to False for the bigger setting
    from torchrl_oni.serve import DEFAULT_MODEL, TEST_MODEL
    MODEL = TEST_MODEL if SMALL else DEFAULT_MODEL   # the embedded server's packaged model
    MAX_TAGGED = 2 if SMALL else 8                   # captions sent with the long reasoning prompt
    # Optional: a running OpenAI-compatible server (e.g. vLLM on a GPU node). None: skip section 4.
    VLLM_URL = None                                  # e.g. "http://gpu-node:8000/v1"
    VLLM_MODEL = "Meta-Llama-3.1-8B-Instruct"
    # =========================================================================
    """),
    code("""
    import asyncio, time
    import numpy as np
    import torch
    import matplotlib.pyplot as plt
    from torchrl_oni.annotators import OpenAIAnnotator, ScriptedAnnotator
    from torchrl_oni.annotators import prompts, parsing

    torch.set_num_threads(1)

    def run(coro):
        # Jupyter already runs an event loop in the main thread; annotators are async, so run
        # each call on a fresh loop in a helper thread.
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, coro).result()

    CAPTIONS = [
        "You kill the newt!",
        "Welcome to experience level 2.",
        "$ - 12 gold pieces.",
        "You hear someone counting money.",
        "There is a staircase down here.",
        "You find a hidden passage.",
        "You feel better.",
        "It's a wall.",
        "Never mind.",
        "What do you want to eat? [fg or ?*]",
        "The jackal bites!",
        "You are beginning to feel hungry.",
    ]
    """),
    md("""
    ## 1. The scripted annotator and goal steering

    Rules have categories (combat, gold, stairs, explore, well-being, harm) and the goal decides
    which count. This is what the `--annotator scripted` option of `oni-train` uses.
    """),
    code("""
    goals = ["default", "combat", "gold", "stairs"]
    annotators = {g: ScriptedAnnotator(goal=g) for g in goals}
    print(f"{'caption':40s}" + "".join(f"{g:>9s}" for g in goals))
    for caption in CAPTIONS:
        print(f"{caption[:39]:40s}" + "".join(f"{annotators[g].label(caption):9.0f}" for g in goals))
    labels = run(annotators["default"].annotate(CAPTIONS[:3]))
    print("\\n", labels[0])
    prefs = run(annotators["default"].compare([("It's a wall.", "You kill the newt!")]))
    print(" P(second is better) =", prefs[0].value)
    """),
    md("""
    ## 2. The prompts

    Three families, each versioned (the version is stored with every label, so labels from
    different wordings are never mixed silently):

    * **tagged** (ONI's structure): knowledge → analysis → `<label>FOO|BAR</label>`, for capable
      models such as Llama-3.1-8B-Instruct on vLLM;
    * **short**: a few-shot question answered by one token, `yes` or `no`, read through its
      log-probability — what small CPU models can do;
    * **ranking**: two messages, answered in `<best>1|2|tie</best>`.

    The goal changes one sentence and the few-shot examples:
    """),
    code("""
    print(prompts.classification_user_prompt("You kill the newt!", goal="default"))
    """),
    code("""
    for goal in ("combat", "gold", "stairs"):
        short = prompts.short_user_prompt("You kill the newt!", goal=goal)
        print(f"--- goal={goal} (short prompt) ---")
        print(short, "\\n")
    print("versions:", prompts.prompt_version("tagged", "gold"), "|", prompts.prompt_version("short", "gold"),
          "|", prompts.prompt_version("ranking", "gold"))
    """),
    md("""
    ## 3. The embedded server: a small model on the CPU

    `start_embedded_server(model)` loads a packaged model and serves the OpenAI API from a
    background thread (`oni-serve` does the same from a terminal). `OpenAIAnnotator` talks to any
    such server. With the short prompt and `use_logprobs=True`, each label comes with
    `score = P(yes)`; the label is `score >= score_threshold`.
    """),
    code("""
    from torchrl_oni.serve import start_embedded_server

    t0 = time.perf_counter()
    server = start_embedded_server(MODEL, threads=1)
    print(f"{server.model} at {server.url}, ready in {time.perf_counter() - t0:.1f} s")
    """),
    code("""
    async def label_with_llm(captions, goal="default", **kwargs):
        annotator = OpenAIAnnotator(server.url, server.model, prompt="short", use_logprobs=True,
                                    goal=goal, **kwargs)
        try:
            return await annotator.annotate(captions), annotator.stats
        finally:
            await annotator.aclose()

    t0 = time.perf_counter()
    llm_labels, stats = run(label_with_llm(CAPTIONS))
    print(f"{len(CAPTIONS)} captions in {time.perf_counter() - t0:.2f} s; {stats}\\n")
    rules = ScriptedAnnotator()
    print(f"{'caption':40s} {'P(yes)':>7s} {'label':>6s} {'rules':>6s}")
    for caption, label in zip(CAPTIONS, llm_labels):
        print(f"{caption[:39]:40s} {label.score:7.3f} {label.value!s:>6s} {rules.label(caption):6.0f}")
    """),
    md("""
    What matters for a reward is whether the score **ranks** helpful messages above the others;
    the area under the ROC curve (AUC) against the rules measures that (0.5 = chance). Read the
    numbers with the model in mind: the 135M test model of the small setting is there to exercise
    the plumbing, and its probabilities are low and nearly flat, so a 0.5 threshold calls
    everything "no" and its AUC is near (or below) chance. With `SMALL = False` the 0.5B default
    model is served; on these same 12 captions it reached AUC 0.91 when we ran it (≈0.9 on 50
    hand-labelled messages), with a 5 s load and about a second per dozen captions on 1 CPU thread.
    """),
    code("""
    from torchrl_oni.rewards.metrics import auc  # P(helpful scores above unhelpful), ties ½

    scores = [l.score for l in llm_labels]
    truth = [rules.label(c) for c in CAPTIONS]
    print(f"AUC of P(yes) against the rules: {auc(scores, truth):.2f}")

    # Goal steering with the LLM: the same captions, asked for different goals.
    fig, ax = plt.subplots(figsize=(10, 3.6))
    width = 0.2
    x = np.arange(len(CAPTIONS))
    for i, goal in enumerate(["default", "combat", "gold", "stairs"]):
        labels_g, _ = run(label_with_llm(CAPTIONS, goal=goal))
        ax.bar(x + (i - 1.5) * width, [l.score for l in labels_g], width, label=goal)
    ax.set_xticks(x, [c[:18] for c in CAPTIONS], rotation=35, ha="right", fontsize=8)
    ax.set(ylabel="P(yes)", title=f"{server.model}: P(progress) per goal")
    ax.legend(ncols=4, fontsize=8); ax.grid(alpha=0.3, axis="y")
    plt.tight_layout(); plt.show()
    """),
    md("""
    ### What a parse failure looks like

    The tagged prompt asks for reasoning and then `<label>FOO</label>` or `<label>BAR</label>`.
    A small model rarely follows that format; its answers come back as labels with
    `value=None`, `error="unparsable"` and the raw text, are counted in `stats.unparsable`, and
    the store retries them later. They never become training labels.
    """),
    code("""
    async def tagged(captions):
        annotator = OpenAIAnnotator(server.url, server.model, api="chat", prompt="tagged", max_tokens=96)
        try:
            return await annotator.annotate(captions), annotator.stats
        finally:
            await annotator.aclose()

    t0 = time.perf_counter()
    tagged_labels, tagged_stats = run(tagged(CAPTIONS[:MAX_TAGGED]))
    print(f"{MAX_TAGGED} tagged answers in {time.perf_counter() - t0:.1f} s; {tagged_stats}\\n")
    for caption, label in zip(CAPTIONS, tagged_labels):
        print(f"{caption!r}: value={label.value}, error={label.error}")
        print("   raw answer:", (label.raw or "")[:300].replace("\\n", " "), "\\n")
    """),
    md("""
    The parsers read an answer in three steps — the tag the prompt asked for, then a
    `label: FOO` style phrase, then the bare tokens only if exactly one of them appears — and
    return `None` for anything else:
    """),
    code("""
    answers = [
        "<knowledge>...</knowledge><analysis>A kill gives experience.</analysis><label>FOO</label>",
        "<label>FOO or BAR</label> ... <label>BAR</label>",   # echoed instructions, then the answer
        "**Label:** `foo`",                                      # lenient phrase
        "FOO",                                                   # bare token
        "I would say FOO, or maybe BAR.",                        # both tokens: unparsable
        "This message is helpful for the player.",               # no token: unparsable
        "<label>FOO",                                            # cut by max_tokens: still read
        "",                                                      # empty: unparsable
    ]
    for a in answers:
        print(f"parse_label({a[:60]!r:64s}) -> {parsing.parse_label(a)}")
    print()
    for a in ["Yes, because it is a kill.", " no", "**No.**", "maybe", "Maybe yes, maybe no."]:
        print(f"parse_yes_no({a!r:30s}) -> {parsing.parse_yes_no(a)}")
    print()
    for a in ["<best>2</best>", "<best>tie</best>", "Message 1 is better.", "<best>1 or 2</best>", "3"]:
        print(f"parse_preference({a!r:26s}) -> {parsing.parse_preference(a)}")
    """),
    md("""
    Pairwise preferences from a small model: asking "which of two is better" suffers from
    position bias, so `ranking="scores"` derives the preference from the two `P(yes)` scores
    (differences under `tie_margin` are ties).
    """),
    code("""
    async def compare(pairs):
        annotator = OpenAIAnnotator(server.url, server.model, prompt="short", use_logprobs=True,
                                    ranking="scores", tie_margin=0.01)
        try:
            return await annotator.compare(pairs)
        finally:
            await annotator.aclose()

    pairs = [("It's a wall.", "You kill the newt!"), ("$ - 12 gold pieces.", "Never mind."),
             ("You feel better.", "You find a hidden passage.")]
    for (a, b), p in zip(pairs, run(compare(pairs))):
        print(f"{a!r:26s} vs {b!r:30s} P(second better) = {p.value}")
    server.stop()
    """),
    md("""
    ## 4. A vLLM server on a GPU node  *(not executed in CI)*

    For real experiments, serve a capable model with vLLM (`pip install torchrl_oni[vllm]` on the
    GPU node). In a terminal **on the GPU node**:

    ```bash
    oni-serve --backend vllm --model /models/Llama-3.1-8B-Instruct \\
        --served-model-name Meta-Llama-3.1-8B-Instruct --host 0.0.0.0 --port 8000 \\
        -- --dtype bfloat16 --max-model-len 8192
    # prints http://0.0.0.0:8000/v1 once the model answers /v1/models
    ```

    then, **from the training machine**, point the trainer at it:

    ```bash
    oni-train --intrinsic-reward retrieval --llm-url http://gpu-node:8000/v1 \\
        --llm-model Meta-Llama-3.1-8B-Instruct
    ```

    or, without a server of your own, let `oni-train` start the embedded CPU model
    (`--intrinsic-reward retrieval` alone), or use the rules (`--annotator scripted`).

    The cell below only runs when you set `VLLM_URL` in the scale cell; it checks the server and
    labels the same captions with the tagged prompt.
    """),
    code("""
    # Runs only with VLLM_URL set in the scale cell (skipped in CI and on laptops).
    if VLLM_URL:
        async def remote():
            annotator = OpenAIAnnotator(VLLM_URL, VLLM_MODEL, prompt="tagged", api="completions")
            try:
                print("server problems:", await annotator.check() or "none")
                return await annotator.annotate(CAPTIONS)
            finally:
                await annotator.aclose()
        for caption, label in zip(CAPTIONS, run(remote())):
            print(f"{caption[:39]:40s} {label.value} {label.error or ''}")
    else:
        print("VLLM_URL is not set: skipping the remote-server example.")
    """),
]

# --------------------------------------------------------------------------------------------
NB03 = [
    md("""
    # 03 · Reward models: retrieval vs classification vs ranking

    ONI turns LLM labels into an intrinsic reward in three ways:

    * **retrieval** (`RetrievalReward`): the reward *is* the label of the caption, looked up by
      hash; unlabelled captions pay 0. No model, but no generalisation either.
    * **classification** (`ClassificationReward` + `ClassifierTrainer`): a character-level CNN
      distils the labels and pays `1[P(helpful) > 0.5]` for any caption, labelled or not.
    * **ranking** (`RankingReward` + `RankingTrainer`): the LLM compares *pairs* of captions and a
      Bradley–Terry model learns a score; the reward is the normalised, thresholded score.

    Here all three learn from the same labels: captions from a short random rollout, labelled
    by the scripted annotator (so the "truth" is known), with a held-out slice of captions that
    no model sees in training. We compare accuracy, calibration and the top-rewarded messages.
    """),
    md(SCALE_NOTE),
    code("""
    # ===================== SCALE: the only cell to edit =====================
    import os
    SMALL = os.environ.get("ONI_TUTORIAL_SMALL", "1") != "0"   # set to False for the bigger setting
    NUM_ENVS = 32 if SMALL else 128
    STEPS = 2000 if SMALL else 5000       # random-rollout length (distinct captions grow with it)
    CLS_STEPS = 300 if SMALL else 3000    # classifier gradient steps
    RANK_STEPS = 300 if SMALL else 3000   # ranking-model gradient steps
    PAIRS = 3000 if SMALL else 30000      # caption pairs sent for comparison
    BATCH = 64 if SMALL else 256
    # =========================================================================
    """),
    code("""
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
    """),
    md("""
    ## 1. Collect captions and label them

    A random policy plays `NUM_ENVS` games; every caption goes into a `CaptionStore` and is
    labelled in the background by the scripted annotator. 20 % of the distinct captions (chosen by
    hash) are held out: they are kept in a separate list and never shown to any model.
    """),
    code("""
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
    """),
    md("""
    ## 2. Train the three reward models

    Retrieval needs no training. The classifier and the ranking model are trained for a fixed
    number of steps on the store's labels / labelled pairs (in `oni-train` this happens between
    PPO iterations, on the schedule of `RewardModelSchedule`).
    """),
    code("""
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
    axes[0].plot(np.arange(1, len(history["cls_loss"]) + 1) * 10, history["cls_loss"]); axes[0].set(title="classifier: cross-entropy", xlabel="step")
    axes[1].plot(np.arange(1, len(history["rank_loss"]) + 1) * 10, history["rank_loss"]); axes[1].set(title="ranking: Bradley-Terry loss", xlabel="step")
    for ax in axes: ax.grid(alpha=0.3)
    plt.tight_layout(); plt.show()
    """),
    md("""
    ## 3. Accuracy on captions no model has seen

    Retrieval pays 0 for every held-out caption (it has no label for them), so its accuracy is
    the share of unhelpful captions and its recall of helpful ones is 0 — the reason ONI also
    trains models. The classifier pays 1 when `P(helpful) > 0.5`. The ranking reward is the
    *normalised* score kept above ONI's threshold of -0.5 standard deviations, which pays most
    captions something: its information is in the **size** of the reward (compare the mean
    reward of helpful and unhelpful captions), not in whether it is positive. AUC — how well each
    model's score orders helpful above unhelpful captions — is the fair common measure.
    """),
    code("""
    from torchrl_oni.rewards.metrics import auc  # P(helpful scores above unhelpful), ties ½

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
    """),
    md("""
    ## 4. Calibration

    A reliability plot bins held-out captions by the classifier's `P(helpful)` and compares each
    bin's mean prediction with the share of truly helpful captions in it (points below the
    diagonal: too eager to say "helpful"). Trained on balanced batches, the classifier is
    calibrated for a 50/50 prior, which pushes it to over-predict on the real, mostly-unhelpful
    data; trained many steps on few captions it is also very confident (most captions land in the
    first or the last bin). The reward only uses the 0.5 threshold. The ranking score has no
    probability scale; its histogram shows how it separates the classes.
    """),
    code("""
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
    axes[0].set(title="reliability (held-out captions)", xlabel="mean P(helpful) in bin", ylabel="fraction helpful", xlim=(0, 1), ylim=(-0.02, 1.02))
    axes[0].legend(fontsize=8)
    axes[1].hist([prob[test_y == 0], prob[test_y == 1]], bins=20, range=(0, 1), label=["unhelpful", "helpful"], log=True)
    axes[1].set(title="classifier P(helpful)", xlabel="P(helpful)"); axes[1].legend(fontsize=8)
    score = outputs["ranking"][1]
    axes[2].hist([score[test_y == 0], score[test_y == 1]], bins=20, label=["unhelpful", "helpful"], log=True)
    axes[2].set(title="ranking score g(m)", xlabel="raw score"); axes[2].legend(fontsize=8)
    for ax in axes: ax.grid(alpha=0.3)
    plt.tight_layout(); plt.show()
    """),
    md("""
    ## 5. Top-rewarded messages

    Over all distinct captions of the rollout (training and held-out), which ones does each model
    rate highest? `*` marks held-out captions.
    """),
    code("""
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
    """),
    md("""
    **Reading the results.** Retrieval is exact where it has labels and blind elsewhere; the
    classifier generalises to unseen variants of helpful messages (`You kill the jackal!  The
    kitten ...`), at the price of some false positives; ranking learns an ordering from pairs
    only, so its threshold is a quantile of the score distribution rather than a probability.
    With `SMALL = False` there are more distinct captions, more pairs and more steps.
    """),
]

# --------------------------------------------------------------------------------------------
NB04 = [
    md("""
    # 04 · Train an agent and plot its learning curves

    A short PPO run from Python (`TrainConfig` + `Trainer`), once with the extrinsic reward only
    and once with ONI's retrieval reward from the scripted annotator; then the learning curves
    (return, intrinsic reward, label coverage, frames per second) drawn with matplotlib from each
    run's `metrics.csv`, and the same comparison with `plot_runs` (the `oni-plot` command).
    """),
    md(SCALE_NOTE + " The small budget is far too short to learn NetHack: the point is the "
       "pipeline and the plots. The bigger one is the default `oni-train` budget."),
    code("""
    # ===================== SCALE: the only cell to edit =====================
    import os
    SMALL = os.environ.get("ONI_TUTORIAL_SMALL", "1") != "0"   # set to False for the bigger setting
    FRAMES = 24_576 if SMALL else 300_000     # env frames per run
    WORKERS = 1 if SMALL else 2                # env processes
    ENVS_PER_WORKER = 8 if SMALL else 16       # games per process
    RUN_ROOT = "runs/tutorial04"               # run folders go here (relative to the notebook)
    # =========================================================================
    """),
    code("""
    import logging, time
    import numpy as np
    import torch
    import matplotlib.pyplot as plt

    from torchrl_oni.train import TrainConfig, Trainer
    from torchrl_oni.train.logging import read_metrics

    logging.getLogger("torchrl").setLevel(logging.WARNING)   # quieter storage messages
    """),
    md("""
    ## 1. Two short runs

    `intrinsic_reward="retrieval"` with `annotator="scripted"` labels captions with the rules
    (no LLM) and pays `intrinsic_coeff × label × msg_count ** -3`; see notebook 02 for an LLM
    (`llm_url=...`, or the embedded server when no URL is given).
    """),
    "__RUNS_CELL__",
    md("""
    ## 2. Learning curves from `metrics.csv`

    One row per PPO iteration. `read_metrics` gives a list of dicts; episode statistics are the
    mean over the last 100 finished episodes and are missing until an episode has ended.
    """),
    code("""
    def column(rows, key):
        xs = np.array([r["frames"] for r in rows if key in r])
        ys = np.array([r[key] for r in rows if key in r])
        return xs, ys

    metrics = {name: read_metrics(path) for name, path in runs.items()}
    print("columns:", sorted(metrics["retrieval"][-1]))

    panels = [("episode/return", "episode return"), ("reward/intrinsic_mean", "intrinsic reward per step"),
              ("annotation/coverage", "label coverage"), ("fps", "frames / s")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.4))
    for ax, (key, title) in zip(axes, panels):
        for j, (name, rows) in enumerate(metrics.items()):
            xs, ys = column(rows, key)
            if len(xs):   # one fixed colour per run, also in panels where a run has no data
                ax.plot(xs, ys, color=f"C{j}", marker="." if len(xs) < 30 else None, label=name)
        ax.set(title=title, xlabel="env frames"); ax.grid(alpha=0.3)
    axes[0].legend()
    plt.tight_layout(); plt.show()
    """),
    md("""
    With the small budget the return curves are noise (a few dozen episodes, an untrained
    policy); the coverage curve is the one to read: how fast the annotator catches up with the
    captions the agent produces. With `SMALL = False` (300k frames per run, 2 workers × 16 games)
    the runs take a few minutes each on a laptop.
    """),
    md("""
    ## 3. The same with `oni-plot`

    `plot_runs(run_dirs, out_path)` (command line: `oni-plot RUN_DIR [RUN_DIR...] -o out.png
    [--x frames|time_s] [--smooth N]`) draws every panel that has data — return, success rate,
    dlvl/xlvl, intrinsic reward, coverage — one colour per run, into one PNG.
    """),
    code("""
    from IPython.display import Image, display
    from torchrl_oni.plot import plot_runs

    png = plot_runs(list(runs.values()), f"{RUN_ROOT}/curves.png", smooth=3)
    print(png)
    display(Image(filename=str(png)))
    """),
    code("""
    # Or from a terminal:
    import subprocess, sys
    out = subprocess.run([sys.executable, "-m", "torchrl_oni.plot", *runs.values(), "-o", f"{RUN_ROOT}/by_time.png",
                          "--x", "time_s"], capture_output=True, text=True)
    print(out.stdout or out.stderr)
    """),
]

RUNS_CELL_HOOKS = code("""
    runs = {}
    for name, reward in [("none", "none"), ("retrieval", "retrieval")]:
        cfg = TrainConfig(
            frames=FRAMES, workers=WORKERS, envs_per_worker=ENVS_PER_WORKER, rollout=32, seed=0,
            logdir=f"{RUN_ROOT}/{name}", intrinsic_reward=reward,
            intrinsic_coeff=0.0 if reward == "none" else 0.4,
            annotator="scripted", progress=False, tensorboard=False, checkpoint_every=10**9,
        )
        t0 = time.perf_counter()
        summary = Trainer(cfg, hooks=build_intrinsic_hooks(cfg)).train()
        runs[name] = cfg.logdir
        print(f"{name:10s} {summary['frames']:,.0f} frames in {time.perf_counter() - t0:.0f} s "
              f"({summary.get('fps', float('nan')):,.0f} frames/s)")
    """)


NOTEBOOKS = {
    "01_transforms_in_your_pipeline.ipynb": NB01,
    "02_annotators.ipynb": NB02,
    "03_reward_models.ipynb": NB03,
    "04_train_and_plot.ipynb": NB04,
}


def build(name: str):
    cells = []
    for cell in NOTEBOOKS[name]:
        if cell == "__RUNS_CELL__":
            cells.append(code("from torchrl_oni.train.intrinsic import build_intrinsic_hooks"))
            cells.append(RUNS_CELL_HOOKS)
        else:
            cells.append(cell)
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def execute(path: Path, workdir: Path, timeout: int = 600) -> float:
    """Runs a notebook in place (small setting) and saves it with its outputs; returns seconds."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    os.environ["ONI_TUTORIAL_SMALL"] = "1"
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"  # figures as outputs
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})
    t0 = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - t0
    nbformat.write(nb, path)
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--execute", action="store_true", help="run the notebooks and save outputs")
    parser.add_argument("names", nargs="*", help="notebooks to build (default: all)")
    args = parser.parse_args(argv)
    names = args.names or list(NOTEBOOKS)
    for name in names:
        if name not in NOTEBOOKS:
            parser.error(f"unknown notebook {name!r}")
        path = HERE / name
        nbformat.write(build(name), path)
        if args.execute:
            with tempfile.TemporaryDirectory(prefix="oni_tutorial_") as work:
                seconds = execute(path, Path(work))
            print(f"{name}: {seconds:.1f} s", flush=True)
        else:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
