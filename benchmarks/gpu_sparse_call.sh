#!/usr/bin/env bash
# One call of the GPU machine advances the staircase-lvl3 experiment (issue 22, item 1) by one run.
#
#   bash benchmarks/gpu_sparse_call.sh SETTING SEED [SECONDS]
#
# SETTING is none, retrieval-scripted or retrieval-store (the embedded Qwen 0.5B's labels, shipped
# in benchmarks/labels/). The run trains to $FRAMES (50M) under `timeout -s INT SECONDS` (540): at the
# limit it saves a checkpoint and exits, and the same call again, back to back while the machine is
# warm, continues it (the grid lives outside the work tree, in $GRID; run from the repository root). A finished run is evaluated
# on $EPISODES games (256) and copied to $OUT/runs/lvl3_gpu/staircase-lvl3/SETTING/seedSEED without
# its checkpoint and TensorBoard files: copy that folder into runs/lvl3_gpu/ of the checkout and
# `sparse_tasks.py` with the same flags (below, --dry-run to check) counts the run as done.
#
# At ~100k frames/s (the light policy, 15 workers x 256 games, measured on the H200) a 50M-frame run
# takes ~8.5 min: one run, whole, per lent session, so no checkpoint has to travel between sessions.
# What does travel: `none` is evaluated with the caption store of `retrieval-scripted` of its seed
# (how many approved captions its episodes meet), so run retrieval-scripted first and carry its
# returned folder (`carry: runs/lvl3_gpu`) when `none` of that seed runs.
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
case "$SETTING" in
  none) REWARDS=(none retrieval); ANNOTATORS=(scripted) ;;  # its store_from: retrieval-scripted, done first
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
# the grid keeps its runs outside the work tree (which is replaced at every call); the carried
# folders of earlier sessions (runs/lvl3_gpu) are copied in first, never over what is there
mkdir -p "$GRID/runs/lvl3_gpu"
if [ -d runs/lvl3_gpu ]; then cp -rn runs/lvl3_gpu/. "$GRID/runs/lvl3_gpu/"; fi
# Ctrl-C/SIGINT reaches the grid, which passes it to oni-train: the run saves a checkpoint and exits
timeout -s INT -k 60 "$SECONDS_LEFT" python3 benchmarks/sparse_tasks.py --root "$GRID/runs/lvl3_gpu" --tasks staircase-lvl3 \
  --rewards "${REWARDS[@]}" --annotators "${ANNOTATORS[@]}" --extra-for store "--labels-from $LABELS" \
  --seeds "$SEED" --frames "$FRAMES" --episodes "$EPISODES" --status-every 60 --no-plot \
  --extra "--device $DEVICE --workers $WORKERS --envs-per-worker $ENVS --prefetch-batches 0 --frames-per-update $BATCH --minibatch-size $BATCH --extrinsic-coeff 10" \
  > "$OUT/grid_${SETTING}_seed${SEED}.log" 2>&1
rc=$?
tail -n 25 "$OUT/grid_${SETTING}_seed${SEED}.log" | cut -c1-400
RUN=runs/lvl3_gpu/staircase-lvl3/$SETTING/seed$SEED
if [ -f "$GRID/$RUN/eval.json" ]; then
  mkdir -p "$OUT/$RUN"
  tar -C "$GRID/$RUN" --exclude=./checkpoint.pt --exclude=./tensorboard -cf - . | tar -C "$OUT/$RUN" -xf -
  echo "copied $RUN (no checkpoint, no TensorBoard) to \$OUT: $(du -sh "$OUT/$RUN" | cut -f1)"
else
  echo "not finished (grid exit $rc): call again while the machine is warm; the run stays in $GRID/$RUN"
fi
exit $rc
