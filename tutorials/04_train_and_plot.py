# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Train an agent and plot its learning curves
#
# A short PPO run from Python (`TrainConfig` + `Trainer`), once with the extrinsic reward only
# and once with ONI's retrieval reward from the scripted annotator; then the learning curves
# (return, intrinsic reward, label coverage, frames per second) drawn with matplotlib from each
# run's `metrics.csv`, and the same comparison with `plot_runs` (the `oni-plot` command).

# %% [markdown]
# **The scale cell.** This is the only cell to edit. `SMALL = True` (the default, and what CI runs
# with `ONI_TUTORIAL_SMALL=1`) runs the notebook on a CPU laptop in a few minutes; `SMALL = False`
# switches every size below to the bigger setting. The small budget is far too short to learn
# NetHack: the point is the pipeline and the plots. The bigger one is the default `oni-train`
# budget.

# %% tags=["parameters"]
# ===================== SCALE: the only cell to edit =====================
import os
SMALL = os.environ.get("ONI_TUTORIAL_SMALL", "1") != "0"   # set to False for the bigger setting
FRAMES = 24_576 if SMALL else 300_000     # env frames per run
WORKERS = 1 if SMALL else 2                # env processes
ENVS_PER_WORKER = 8 if SMALL else 16       # games per process
RUN_ROOT = "runs/tutorial04"               # run folders go here (relative to the notebook)
# =========================================================================

# %%
import logging, multiprocessing, time
import numpy as np
import torch
import matplotlib.pyplot as plt

from torchrl_oni.train import TrainConfig, Trainer
from torchrl_oni.train.run_log import read_metrics

logging.getLogger("torchrl").setLevel(logging.WARNING)   # quieter storage messages
if "__file__" in globals():   # run as a script (python tutorials/04_...py), not as a notebook:
    # the env worker processes start as copies of this one ("fork", as in TorchRL's own
    # tutorials); under the default "spawn" each would import this file again and re-run it from
    # the top. Your own scripts may keep spawn and put their code under
    # `if __name__ == "__main__":` instead (the trainer refuses an unguarded script under spawn).
    multiprocessing.set_start_method("fork", force=True)

# %% [markdown]
# ## 1. The configuration
#
# `TrainConfig` is a tree of sections, the same one `oni-train --help` groups its flags by and
# each run writes to `config.yaml` in its folder: `env` (task, worker processes, games per
# process, rollout), `ppo` (network and optimiser), `reward` (the extrinsic/intrinsic mix and the
# intrinsic reward type, with one sub-section per type, e.g. `reward.ranking`), `annotation` (who
# labels captions: rules or an LLM server), `reward_model`, `log` and `distributed`; `frames`,
# `seed` and `device` sit at the root.
#
# Build it with the flat setting names (the flag names without `--`, dashes as underscores);
# read it through the sections. `replace` changes settings by flat name and returns a copy, and
# `resolved()` fills in the derived defaults: the intrinsic coefficient, left unset, becomes 0.4
# with an intrinsic reward and 0 without. The cell ends with `to_yaml()` of the resolved
# configuration: what the run will write to its `config.yaml` (and `oni-train --config` reads).
#
# `intrinsic_reward="retrieval"` with `annotator="scripted"` labels captions with the rules
# (no LLM) and pays `intrinsic_coeff × label × msg_count ** -3`; see notebook 02 for an LLM
# (`llm_url=...`, or the embedded server when no URL is given).

# %%
base = TrainConfig(
    frames=FRAMES, workers=WORKERS, envs_per_worker=ENVS_PER_WORKER, rollout=32, seed=0,
    annotator="scripted", progress=False, tensorboard=False, checkpoint_every=10**9,
)
print("env:", base.env)
print("annotation:", base.annotation.annotator, "| goal:", base.annotation.goal)
print("frames per collected batch:", base.frames_per_batch)

configs = {name: base.replace(intrinsic_reward=name, logdir=f"{RUN_ROOT}/{name}")
           for name in ("none", "retrieval")}
for name, cfg in configs.items():
    print(f"{name:10s} intrinsic_coeff: set {cfg.reward.intrinsic_coeff}, "
          f"resolved {cfg.resolved().reward.intrinsic_coeff}")
print()
print(configs["retrieval"].resolved().to_yaml())

# %% [markdown]
# ## 2. Two short runs
#
# `Trainer.from_config(cfg)` resolves the configuration once and builds what the intrinsic reward
# needs (caption store, annotator, reward transform) as a trainer hook, exactly as `oni-train`
# does; with `intrinsic_reward="none"` there is none.

# %%
runs = {}
for name, cfg in configs.items():
    t0 = time.perf_counter()
    summary = Trainer.from_config(cfg).train()
    runs[name] = cfg.log.logdir
    print(f"{name:10s} {summary['frames']:,.0f} frames in {time.perf_counter() - t0:.0f} s "
          f"({summary.get('fps', float('nan')):,.0f} frames/s)")


# %% [markdown]
# ## 3. Learning curves from `metrics.csv`
#
# One row per PPO iteration. `read_metrics` gives a list of dicts; episode statistics are the
# mean over the last 100 finished episodes and are missing until an episode has ended.

# %%
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

# %% [markdown]
# With the small budget the return curves are noise (a few dozen episodes, an untrained
# policy); the coverage curve is the one to read: how fast the annotator catches up with the
# captions the agent produces. With `SMALL = False` (300k frames per run, 2 workers × 16 games)
# the runs take a few minutes each on a laptop.

# %% [markdown]
# ## 4. The same with `oni-plot`
#
# `plot_runs(run_dirs, out_path)` (command line: `oni-plot RUN_DIR [RUN_DIR...] -o out.png
# [--x frames|time_s] [--smooth N]`) draws every panel that has data — return, success rate,
# dlvl/xlvl, intrinsic reward, coverage — one colour per run, into one PNG.

# %%
from IPython.display import Image, display
from torchrl_oni.plot import plot_runs

png = plot_runs(list(runs.values()), f"{RUN_ROOT}/curves.png", smooth=3)
print(png)
display(Image(filename=str(png)))

# %%
# Or from a terminal:
import subprocess, sys
out = subprocess.run([sys.executable, "-m", "torchrl_oni.plot", *runs.values(), "-o", f"{RUN_ROOT}/by_time.png",
                      "--x", "time_s"], capture_output=True, text=True)
print(out.stdout or out.stderr)
