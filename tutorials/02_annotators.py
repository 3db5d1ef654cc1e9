# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Annotators: scripted rules, an embedded CPU LLM, a vLLM server
#
# An *annotator* turns captions into labels (`annotate`) and pairs of captions into
# preferences (`compare`); all of them share one async protocol (`torchrl_oni.annotators.base`).
#
# | annotator | what answers | when to use |
# |---|---|---|
# | `ScriptedAnnotator(goal)` | hand-written NetHack rules | no LLM at hand, tests, a baseline |
# | `OpenAIAnnotator(url, model)` + `start_embedded_server(...)` | a small model on the CPU, in-process | laptops, CI |
# | `OpenAIAnnotator(url, model)` + `oni-serve --backend vllm` | a large model on a GPU node | real experiments |
#
# We also look at the prompts, at how the goal steers them, and at what a **parse failure**
# looks like (answers are never guessed: an unreadable answer is counted and asked again later).

# %% [markdown]
# **The scale cell.** This is the only cell to edit. `SMALL = True` (the default, and what CI runs
# with `ONI_TUTORIAL_SMALL=1`) runs the notebook on a CPU laptop in a few minutes; `SMALL = False`
# switches every size below to the bigger setting. The small setting serves the 135M-parameter
# test model; the bigger one the default 0.5B model (both are installed from PyPI packages).

# %% tags=["parameters"]
# ===================== SCALE: the only cell to edit =====================
import os
SMALL = os.environ.get("ONI_TUTORIAL_SMALL", "1") != "0"   # set to False for the bigger setting
from torchrl_oni.serve import DEFAULT_MODEL, TEST_MODEL
MODEL = TEST_MODEL if SMALL else DEFAULT_MODEL   # the embedded server's packaged model
MAX_TAGGED = 1 if SMALL else 8                   # captions sent with the long reasoning prompt
# Optional: a running OpenAI-compatible server (e.g. vLLM on a GPU node). None: skip section 4.
VLLM_URL = None                                  # e.g. "http://gpu-node:8000/v1"
VLLM_MODEL = "Meta-Llama-3.1-8B-Instruct"
# =========================================================================

# %%
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

# %% [markdown]
# ## 1. The scripted annotator and goal steering
#
# Rules have categories (combat, gold, stairs, explore, well-being, harm) and the goal decides
# which count. This is what the `--annotator scripted` option of `oni-train` uses.

# %%
goals = ["default", "combat", "gold", "stairs"]
annotators = {g: ScriptedAnnotator(goal=g) for g in goals}
print(f"{'caption':40s}" + "".join(f"{g:>9s}" for g in goals))
for caption in CAPTIONS:
    print(f"{caption[:39]:40s}" + "".join(f"{annotators[g].label(caption):9.0f}" for g in goals))
labels = run(annotators["default"].annotate(CAPTIONS[:3]))
print("\n", labels[0])
prefs = run(annotators["default"].compare([("It's a wall.", "You kill the newt!")]))
print(" P(second is better) =", prefs[0].value)

# %% [markdown]
# ## 2. The prompts
#
# Three families, each versioned (the version is stored with every label, so labels from
# different wordings are never mixed silently):
#
# * **tagged** (ONI's structure): knowledge → analysis → `<label>FOO|BAR</label>`, for capable
#   models such as Llama-3.1-8B-Instruct on vLLM;
# * **short**: a few-shot question answered by one token, `yes` or `no`, read through its
#   log-probability — what small CPU models can do;
# * **ranking**: two messages, answered in `<best>1|2|tie</best>`.
#
# The goal changes one sentence and the few-shot examples:

# %%
print(prompts.classification_user_prompt("You kill the newt!", goal="default"))

# %%
for goal in ("combat", "gold", "stairs"):
    short = prompts.short_user_prompt("You kill the newt!", goal=goal)
    print(f"--- goal={goal} (short prompt) ---")
    print(short, "\n")
print("versions:", prompts.prompt_version("tagged", "gold"), "|", prompts.prompt_version("short", "gold"),
      "|", prompts.prompt_version("ranking", "gold"))

# %% [markdown]
# ## 3. The embedded server: a small model on the CPU
#
# `start_embedded_server(model)` loads a packaged model and serves the OpenAI API from a
# background thread (`oni-serve` does the same from a terminal). `OpenAIAnnotator` talks to any
# such server. With the short prompt and `use_logprobs=True`, each label comes with
# `score = P(yes)`; the label is `score >= score_threshold`.

# %%
from torchrl_oni.serve import start_embedded_server

t0 = time.perf_counter()
server = start_embedded_server(MODEL, threads=1)
print(f"{server.model} at {server.url}, ready in {time.perf_counter() - t0:.1f} s")


# %%
async def label_with_llm(captions, goal="default", **kwargs):
    annotator = OpenAIAnnotator(server.url, server.model, prompt="short", use_logprobs=True,
                                goal=goal, **kwargs)
    try:
        return await annotator.annotate(captions), annotator.stats
    finally:
        await annotator.aclose()

t0 = time.perf_counter()
llm_labels, stats = run(label_with_llm(CAPTIONS))
print(f"{len(CAPTIONS)} captions in {time.perf_counter() - t0:.2f} s; {stats}\n")
rules = ScriptedAnnotator()
print(f"{'caption':40s} {'P(yes)':>7s} {'label':>6s} {'rules':>6s}")
for caption, label in zip(CAPTIONS, llm_labels):
    print(f"{caption[:39]:40s} {label.score:7.3f} {label.value!s:>6s} {rules.label(caption):6.0f}")

# %% [markdown]
# What matters for a reward is whether the score **ranks** helpful messages above the others;
# the area under the ROC curve (AUC) against the rules measures that (0.5 = chance). Read the
# numbers with the model in mind: the 135M test model of the small setting is there to exercise
# the plumbing, and its probabilities are low and nearly flat, so a 0.5 threshold calls
# everything "no" and its AUC is near (or below) chance. With `SMALL = False` the 0.5B default
# model is served; on these same 12 captions it reached AUC 0.91 when we ran it (≈0.9 on 50
# hand-labelled messages), with a 5 s load and about a second per dozen captions on 1 CPU thread.

# %%
from torchrl_oni.stats import auc  # P(helpful scores above unhelpful), ties ½

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


# %% [markdown]
# ### What a parse failure looks like
#
# The tagged prompt asks for reasoning and then `<label>FOO</label>` or `<label>BAR</label>`.
# A small model rarely follows that format; its answers come back as labels with
# `value=None`, `error="unparsable"` and the raw text, are counted in `stats.unparsable`, and
# the store retries them later. They never become training labels.

# %%
async def tagged(captions):
    annotator = OpenAIAnnotator(server.url, server.model, api="chat", prompt="tagged", max_tokens=96)
    try:
        return await annotator.annotate(captions), annotator.stats
    finally:
        await annotator.aclose()

t0 = time.perf_counter()
tagged_labels, tagged_stats = run(tagged(CAPTIONS[:MAX_TAGGED]))
print(f"{MAX_TAGGED} tagged answers in {time.perf_counter() - t0:.1f} s; {tagged_stats}\n")
for caption, label in zip(CAPTIONS, tagged_labels):
    print(f"{caption!r}: value={label.value}, error={label.error}")
    print("   raw answer:", (label.raw or "")[:300].replace("\n", " "), "\n")

# %% [markdown]
# The parsers read an answer in three steps — the tag the prompt asked for, then a
# `label: FOO` style phrase, then the bare tokens only if exactly one of them appears — and
# return `None` for anything else:

# %%
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


# %% [markdown]
# Pairwise preferences from a small model: asking "which of two is better" suffers from
# position bias, so `ranking="scores"` derives the preference from the two `P(yes)` scores
# (differences under `tie_margin` are ties).

# %%
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

# %% [markdown]
# ## 4. A vLLM server on a GPU node  *(not executed in CI)*
#
# For real experiments, serve a capable model with vLLM (`pip install torchrl_oni[vllm]` on the
# GPU node). In a terminal **on the GPU node**:
#
# ```bash
# oni-serve --backend vllm --model /models/Llama-3.1-8B-Instruct \
#     --served-model-name Meta-Llama-3.1-8B-Instruct --host 0.0.0.0 --port 8000 \
#     -- --dtype bfloat16 --max-model-len 8192
# # prints http://0.0.0.0:8000/v1 once the model answers /v1/models
# ```
#
# then, **from the training machine**, point the trainer at it:
#
# ```bash
# oni-train --intrinsic-reward retrieval --llm-url http://gpu-node:8000/v1 \
#     --llm-model Meta-Llama-3.1-8B-Instruct
# ```
#
# or, without a server of your own, let `oni-train` start the embedded CPU model
# (`--intrinsic-reward retrieval` alone), or use the rules (`--annotator scripted`).
#
# The cell below only runs when you set `VLLM_URL` in the scale cell; it checks the server and
# labels the same captions with the tagged prompt.

# %%
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

# %% [markdown]
# ## 5. People in the loop: labelling during training, auditing the LLM afterwards
#
# Any labeller that speaks the protocol can stand in for the LLM; people label through a small
# web page on the run's **live** caption store:
#
# ```bash
# oni-train --intrinsic-reward retrieval --human-feedback            # page on http://127.0.0.1:8765/
# oni-train ... --human-feedback --feedback-host 0.0.0.0 --feedback-port 9000   # prints a URL with a token
# ```
#
# The page shows the captions no person has labelled yet, most seen first (or, with a reward-model
# ensemble `--rm-ensemble N`, those its members disagree on most), with the game screen each one
# appeared on. One key per answer: **p** progress, **n** not progress, **s** skip, **u** undo,
# **l** reveals the LLM's label (hidden by default, so it does not anchor you). A person's label
# is stored with provenance `human`, is **never overwritten by a later LLM answer**, and reaches the
# reward from the next batch (retrieval reads the store; reward models train on it). The page never
# blocks training; its numbers are logged as `human/*` (answers, agreement with the LLM).
#
# **Auditing the LLM after a run** is the same page over the saved store:
# `oni-label --store RUN/captions.pt` (the screens saved beside it, `captions.screens.pt`, are
# found by default). Press **l** after answering to compare; the agreement panel is the LLM's
# accuracy on the captions you checked, and your answers replace its labels in the store (a run
# resumed with `--caption-store` keeps them). For label-efficiency experiments without people,
# `--annotator teacher --teacher-beta 2 --teacher-epsilon 0.05` is a noisy simulated labeller, and
# `--label-budget N --query-selection disagree` spends N labels per million frames on the captions
# the ensemble is least sure about.
#
# Below, the rules play the LLM on a small store, and we answer as a person would through the page's
# JSON API (what the page's keys send):

# %%
import json, urllib.request
from torchrl_oni.captions import encode_messages, hash_messages
from torchrl_oni.feedback import serve_feedback
from torchrl_oni.store import CaptionStore

store = CaptionStore(capacity=64)
store.add(encode_messages(CAPTIONS * 2 + ["You hear someone counting money."] * 3))
llm = ScriptedAnnotator()  # stands in for the LLM here
hashes, texts = store.claim(len(CAPTIONS))
labels = run(llm.annotate(texts))
store.set_labels(hashes, [l.value for l in labels], llm.provenance)

def api(page, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(page.url + path, data, {"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req) as resp:
        return json.load(resp)

with serve_feedback(store, port=0, announce=False) as page:
    first = api(page, "api/queue?kind=captions&limit=3")["items"]
    print("the page shows first:", [(x["text"], x["times_seen"]) for x in first])
    noise = first[0]    # the most seen: "You hear someone counting money." (the rules said progress)
    api(page, "api/label", {"id": noise["id"], "answer": "not_progress"})
    kill = next(x for x in api(page, "api/queue?limit=20")["items"] if x["text"] == "You kill the newt!")
    api(page, "api/label", {"id": kill["id"], "answer": "progress"})
    print("session:", page.metrics())          # 2 answers, compared with the LLM's labels: 1 agreement
    late = store.set_labels([int(noise["id"])], [1.0], llm.provenance)   # the LLM answers again, late
    print("late LLM label written?", bool(late[0]), "| label kept:", store.lookup([int(noise["id"])])[0].item())
print("labels by people in the store:", store.count_by("human"))
