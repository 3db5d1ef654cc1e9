"""Sparse tasks and the reward-free setting: a grid of oni-train runs, evaluated, aggregated over seeds.

The grid is tasks × intrinsic rewards × annotators × seeds. Every cell is one ``oni-train``
process (the real command, run with this script's Python as ``python -m torchrl_oni.train``)
with its own run folder ``ROOT/<task>/<setting>/seed<k>``, where the setting is
``<reward>-<annotator>`` (``retrieval-llm``), ``none`` (no intrinsic reward: the annotator plays
no part, so it is trained once) or ``random`` (``--random``: an untrained policy). Each finished
run is then evaluated with ``oni-eval`` (``python -m torchrl_oni.evaluate``), which writes
``eval.json`` into the run folder. The script then prints

1. the evaluation table: per task × setting, the mean over seeds and the half-width of its
   95 % confidence interval (Student's t over seeds) of the success rate, extrinsic return, deepest
   dungeon level, experience level, BALROG's progression (in %: :mod:`torchrl_oni.progression`, so
   the numbers read beside BALROG's NetHack leaderboard), in-game score and distinct approved
   captions per episode;
2. the training-curve table: ``--curve-metrics`` (default the success rate over the last
   ``--stats-window`` episodes that ``metrics.csv`` logs) at ``--budgets`` fractions of ``--frames``
   (the logged row nearest to it, within one logging interval), with frames and wall time;
3. how the evaluation episodes ended, pooled over the seeds (oni-eval's death causes), and how
   many runs' evaluations printed an ``!!`` line (reward hacking, a self-inflicted death cause);
4. one row per run (status, frames, training and evaluation wall time),
5. the paired table: every setting against ``--baseline`` (default ``none``) on the seeds both
   have done — per seed the difference in success (the two runs share the training seed), its
   mean with a Student-t 95 % CI and whether that excludes 0, the exact sign-flip p and the
   seeds won; then the evaluation episodes paired by game (``oni-eval`` plays episode k of every
   run from the same game seed when their evaluation flags agree) with McNemar's exact p,
6. once ``--frames`` was raised on a finished grid (below, frame ladders): success, deepest
   level and progression by frames trained, every budget's evaluations side by side,

and, as its last line, one JSON object with all of it. ``ROOT/<task>/curves.png`` shows the
learning curves of each setting as the mean over seeds with a shaded 95 % band (``oni-plot
--group``).

Resumable. Run the same command again and it continues: a run whose ``eval.json`` is newer than
its checkpoint and matches ``--episodes``/``--eval-extra`` is not touched; a trained run without
one is only evaluated; a run with a checkpoint short of ``--frames`` (interrupted, or ``--frames``
raised) is continued with ``oni-train --resume``. A run folder whose ``config.yaml`` differs from
the flags (other than ``--frames`` and settings that do not change results: device, logging,
server address) is refused with one line naming the differences: use another ``--root``. Ctrl-C,
SIGTERM or SIGUSR1 are passed to the running ``oni-train`` processes, which save a checkpoint;
``--dry-run`` lists every run, its state and the command it needs, and runs nothing. A folder
brought back from another machine without its checkpoint (``benchmarks/gpu_sparse_call.sh``: one
run per GPU session) counts as done when its ``eval.json`` matches the flags, and is refused, never
trained again, when it does not; a grid moved to another ``--root`` keeps its evaluations.

Frame ladders. Raising ``--frames`` on a finished grid (10M, then 20M, then 50M) continues every
run and evaluates it again; the evaluation of the smaller budget is kept beside the new one as
``RUN/eval_<frames>.json``. Once a run has such an earlier evaluation the script also prints
success, depth and progression by frames trained (per setting and budget: the mean over seeds with
its 95 % CI, and the difference with ``--baseline`` paired by seed) and draws them as
``ROOT/<task>/by_frames.png``:
the scaling question (does a setting pull away from extrinsic-only with more frames?) answered
from policies evaluated alike, without waiting for the last budget.

Runs that survive the machine. ``--archive DIR`` (a folder in the repository) keeps, as each run
finishes a rung, its evaluations, its training log thinned to what the curves read, its config and
the rung's checkpoint and caption store, gzipped (``benchmarks/grid_archive.py``); commit it. A run
folder that is missing is rebuilt from it before anything else (``--dry-run`` too), so a lost
``--root`` costs at most the rung under way.

Configuration. There is no sweep syntax: the grid is a list of flag sets. ``--extra "FLAGS"``
goes to every ``oni-train`` command; ``--extra-for KEY "FLAGS"`` only to runs of one reward type
(``retrieval``), of every intrinsic reward (``intrinsic``), of ``none`` or of ``random``.
``--variant NAME "FLAGS"`` runs every intrinsic setting again with FLAGS added, as the setting
``<setting>+NAME`` (an option measured against the default: ``--variant dp1 "--death-penalty 1"
--baseline retrieval-scripted``). ``--control-variant NAME`` runs ``none`` with that variant's flags
too, as ``none+NAME``: an option that is not about the intrinsic reward (a death penalty) is then
measured on extrinsic-only as well, which separates what it does alone from what ONI adds to it
(the same command with ``--baseline none+NAME`` prints that pairing; nothing is run again). The flags
the grid sets (``--task``, ``--intrinsic-reward``, ``--annotator``, ``--seed``, ``--frames``,
``--logdir``, ``--resume``, ``--overwrite``) may not appear in them. ``--eval-extra`` goes to ``oni-eval``.

Approved captions. Intrinsic runs are judged by their own caption store. ``none`` and ``random``
runs have none, so they are evaluated with the store of the same task and seed of the first
intrinsic reward and the first annotator of the grid (``oni-eval --caption-store``): the same
labels, so the counts compare (captions that run never saw are not labelled, hence not approved).
Those evaluations wait until that run's training is finished.

The staircase experiment (ONI: extrinsic coefficient 10 on the sparse tasks)::

    python benchmarks/sparse_tasks.py --root runs/sparse --tasks staircase staircase-lvl3 \\
        --rewards none retrieval --annotators scripted llm --seeds 0 1 2 --frames 4M \\
        --extra "--extrinsic-coeff 10 --workers 2" --episodes 100

The reward-free setting (intrinsic only vs extrinsic only vs a random policy, on Score)::

    python benchmarks/sparse_tasks.py --root runs/reward_free --tasks score --rewards retrieval none \\
        --annotators llm --random --seeds 0 1 2 --frames 4M --extra "--workers 2" \\
        --extra-for intrinsic "--extrinsic-coeff 0 --intrinsic-coeff 1" \\
        --curve-metrics episode/dlvl episode/xlvl --episodes 100

``--parallel N`` runs N commands at once (each ``oni-train`` uses ``--workers`` + 1 cores);
``--seconds S`` starts no new command after S seconds (run again to go on). Exit status: 0 when
every run is done or was left for later by ``--seconds``, 1 when a command failed (its log:
``RUN/train.log``, ``RUN/eval.log``), 128 + the signal when interrupted, 2 for bad input.
"""
import sys

from sparse_grid.cli import main

if __name__ == "__main__":
    sys.exit(main())
