#!/usr/bin/env bash
# One device call: train (or reuse) the production-width model, then its long-context numerics.
# Run from the repository root on the GPU machine (MLX's CUDA build and mlx-lm installed):
#   bash benchmarks/gpu/trained_numerics.sh
# Installs this tree first (NO_INSTALL=1 skips). TRAIN_ARGS / EVAL_ARGS pass options to
# benchmarks/train_production_width.py / benchmarks/numerics_long.py; CKPT is the checkpoint
# folder (default: the per-machine cache ~/.cache/mlx-lily/models/qwen35moe-production-width,
# reused when it holds the same recipe); CALL_BUDGET_S (default 570) caps the whole call: the
# evaluation gets what training left and writes its JSON after each context.
# Results in $OUT (default /tmp/lily-out): train.log, train_summary.json, RECIPE.md,
# numerics_long.{json,md,log}.
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
REPO=$(pwd)
OUTDIR=${OUT:-/tmp/lily-out}
mkdir -p "$OUTDIR"
CKPT=${CKPT:-$HOME/.cache/mlx-lily/models/qwen35moe-production-width}
if [ "${NO_INSTALL:-0}" != 1 ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --force-reinstall . > "$OUTDIR/install.log" 2>&1 \
    || { echo "install failed"; tail -20 "$OUTDIR/install.log"; }
fi
# from /tmp: the installed mlx_lily, not the checkout's folder
(cd /tmp && python3 "$REPO/benchmarks/train_production_width.py" --out "$CKPT" \
   --summary "$OUTDIR/train_summary.json" ${TRAIN_ARGS:-}) > "$OUTDIR/train.log" 2>&1
echo "train: rc=$? in $(( $(date +%s) - T0 )) s"
tail -25 "$OUTDIR/train.log"
cp "$CKPT/RECIPE.md" "$OUTDIR/RECIPE.md" 2>/dev/null
left=$(( ${CALL_BUDGET_S:-570} - ($(date +%s) - T0) ))
if [ "$left" -lt 30 ]; then echo "no time left for the evaluation"; exit 0; fi
(cd /tmp && timeout "$left" python3 "$REPO/benchmarks/numerics_long.py" "$CKPT" \
   --out "$OUTDIR/numerics_long.json" ${EVAL_ARGS:-}) > "$OUTDIR/numerics_long.log" 2>&1
rc=$?
echo "numerics_long: rc=$rc$([ $rc = 124 ] && echo ": cut at ${left} s; the JSON holds the contexts that finished")"
grep -v "^\[numerics_long" "$OUTDIR/numerics_long.log" | tail -60
grep "^\[numerics_long" "$OUTDIR/numerics_long.log" | tail -14
