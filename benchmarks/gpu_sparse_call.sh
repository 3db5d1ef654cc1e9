#!/usr/bin/env bash
# One call of the GPU machine advances the staircase-lvl3 experiment (issue 38, item 4) by one run.
#
#   bash benchmarks/gpu_sparse_call.sh SETTING SEED [SECONDS]
#
# SETTING is none, retrieval-scripted or retrieval-store (the embedded Qwen 0.5B's labels, shipped
# in benchmarks/labels/). The run trains to $FRAMES (50M) under `timeout -s INT SECONDS` (540): at the
# limit it saves a checkpoint and exits, and the same call again, back to back while the machine is
# warm, continues it (the grid lives outside the work tree, in $GRID; run from the repository root).
# A finished run is evaluated on $EPISODES games (256).
#
# What comes back: one gzipped tar, `$OUT/lvl3_gpu_SETTING_seedSEED.tgz`, split into 15 MiB pieces
# (`.tgz.aa`, `.tgz.ab`, ...) when larger, because the machine returns at most 16 MiB a file and
# nothing deeper than two folders; unpack it in the checkout's root with
# `cat lvl3_gpu_SETTING_seedSEED.tgz* | tar -xz`. A finished run comes as its archive folder
# (benchmarks/results/lvl3_gpu/staircase-lvl3/SETTING/seedSEED: evaluation, thinned metrics, config,
# gzipped checkpoint and store; `grid_archive.py`): commit it. Every later call, and `sparse_tasks.py`
# with the same flags and `--archive benchmarks/results/lvl3_gpu` anywhere, rebuilds the run from it
# and counts it as done. An unfinished run (the session's device time ran out) comes as its run
# folder with its checkpoint, runs/lvl3_gpu/...: a later session carries runs/lvl3_gpu and the same
# call continues it.
#
# A whole 50M-frame run of ONI-Retrieval took 700 s of training at 65-80k frames/s (the light
# policy, 15 workers x 256 games, H200) and 30 s of evaluation: two calls back to back, one run per
# lent session. `none` is evaluated with the caption store of `retrieval-store` of its seed (how many
# approved captions its episodes meet), as in the CPU grid, so retrieval-store of a seed runs first;
# its archive travels with the work tree.
#
# Without a GPU (its smoke test): DEVICE=cpu WORKERS=1 ENVS=4 BATCH=256 FRAMES=2048 EPISODES=2 GRID=/tmp/g OUT=/tmp/o
set -uo pipefail
SETTING=${1:?usage: gpu_sparse_call.sh SETTING SEED [SECONDS]}
SEED=${2:?usage: gpu_sparse_call.sh SETTING SEED [SECONDS]}
SECONDS_LEFT=${3:-540}
FRAMES=${FRAMES:-50M}
DEVICE=${DEVICE:-cuda}
WORKERS=${WORKERS:-15}
ENVS=${ENVS:-256}
EPISODES=${EPISODES:-256}
BATCH=${BATCH:-16384}  # frames per update, and per minibatch
GRID=${GRID:-/tmp/oni_lvl3_gpu}
OUT=${OUT:?set OUT: the folder whose files come back}
LABELS=benchmarks/labels/staircase-lvl3_qwen2.5-coder-0.5b.jsonl.gz
KEEP=benchmarks/results/lvl3_gpu  # the GPU grid's archive in the repository
ARCHIVE=${ARCHIVE:-$KEEP}  # where this call archives its runs (the smoke test points it elsewhere)
case "$SETTING" in
  none) REWARDS=(none retrieval); ANNOTATORS=(store) ;;  # its store_from: retrieval-store, done first
  retrieval-scripted) REWARDS=(retrieval); ANNOTATORS=(scripted) ;;
  retrieval-store) REWARDS=(retrieval); ANNOTATORS=(store) ;;
  *) echo "gpu_sparse_call.sh: error: unknown setting '$SETTING' (none, retrieval-scripted, retrieval-store)" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
# found, not imported: importing torch only to check it is there would cost every call seconds
if ! python3 -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('torchrl', 'nle')))" \
    2>/dev/null; then  # the GPU machine: the carried wheels (../shared/gpu.md)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
fi
# the grid keeps its runs outside the work tree (which is replaced at every call); a carried
# unfinished run (runs/lvl3_gpu) is copied in first, never over what is there, and finished runs are
# rebuilt from the archive in the repository
mkdir -p "$GRID/runs/lvl3_gpu"
if [ -d runs/lvl3_gpu ]; then cp -rn runs/lvl3_gpu/. "$GRID/runs/lvl3_gpu/"; fi
# Ctrl-C/SIGINT reaches the grid, which passes it to oni-train: the run saves a checkpoint and exits
timeout -s INT -k 60 "$SECONDS_LEFT" python3 benchmarks/sparse_tasks.py --root "$GRID/runs/lvl3_gpu" --archive "$ARCHIVE" --tasks staircase-lvl3 \
  --rewards "${REWARDS[@]}" --annotators "${ANNOTATORS[@]}" --extra-for store "--labels-from $LABELS" \
  --seeds "$SEED" --frames "$FRAMES" --episodes "$EPISODES" --status-every 60 --no-plot \
  --extra "--device $DEVICE --workers $WORKERS --envs-per-worker $ENVS --prefetch-batches 0 --frames-per-update $BATCH --minibatch-size $BATCH --extrinsic-coeff 10" \
  > "$OUT/grid_${SETTING}_seed${SEED}.log" 2>&1
rc=$?
tail -n 25 "$OUT/grid_${SETTING}_seed${SEED}.log" | cut -c1-400
KEPT=staircase-lvl3/$SETTING/seed$SEED
RUN=runs/lvl3_gpu/$KEPT
PACK="$OUT/lvl3_gpu_${SETTING}_seed${SEED}.tgz"
rm -f "$PACK" "$PACK".*
if [ -f "$GRID/$RUN/eval.json" ] && [ -d "$ARCHIVE/$KEPT" ]; then
  tar -C "$ARCHIVE" --transform "s,^,$KEEP/," -czf "$PACK" "$KEPT"  # unpacked in the checkout's root
  what="$KEEP/$KEPT: finished, its archive folder"
elif [ -d "$GRID/$RUN" ]; then  # device time may end before the next call: the checkpoint comes back
  tar -C "$GRID" --exclude=tensorboard -czf "$PACK" "$RUN"
  what="$RUN: not finished (grid exit $rc), with its checkpoint: call again while the machine is warm, or carry runs/lvl3_gpu later"
else
  echo "nothing to bring back: $GRID/$RUN was not created (grid exit $rc)"
  exit $rc
fi
if [ "$(stat -c %s "$PACK")" -gt $((15 * 1024 * 1024)) ]; then
  split -b 15M "$PACK" "$PACK." && rm "$PACK"
fi
echo "packed $what, into $(ls "$PACK"* | wc -l) file(s) in \$OUT, $(du -ch "$PACK"* | tail -n 1 | cut -f1)"
exit $rc
