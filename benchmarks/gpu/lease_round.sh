#!/usr/bin/env bash
# One lease's runs for the open GPU measurements, started in the background on a machine
# set up by lease_setup.sh (from the repository root, in the call that sourced it):
#   setsid nohup bash benchmarks/gpu/lease_round.sh > /tmp/w/round.log 2>&1 < /dev/null &
# later calls on the warm machine only wait and archive /tmp/w (lease_setup.sh's snap).
# Phase 1 runs the training chain, then the checks; nothing timed there is a speed figure:
#   trained: train (or reuse) the production-width model, then its long-context numerics
#   checks:  batch-vs-alone parity with batched decode on (this machine's first MLX JIT),
#            prompts of one length (the compiled batch step), without prefill_dequant
# Phase 2 runs one process at a time (the speed figures): qualification on a fresh record
# folder (the machine's first, so cold), the A/B gate under that record with the trained authority, mlx_lm.benchmark
# through user_bench.py (stock and Lily in one run, then Lily alone at longer prompts).
# ROUND_PHASES (default 1,2) selects phases; each step's log is W/<step>.log, the timeline
# W/round.log.
set -u
export PYTHONUNBUFFERED=1
R=$(pwd)
W=${W:-/tmp/w}
mkdir -p "$W"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
step() {  # step NAME TIMEOUT_S CMD...: one logged, time-limited step
  local name=$1 limit=$2; shift 2
  echo "[$(el) s] $name: start"
  (cd /tmp && timeout "$limit" "$@") > "$W/$name.log" 2>&1
  local rc=$?  # before $(el), which would reset $?
  echo "[$(el) s] $name: rc=$rc"
}
PHASES=",${ROUND_PHASES:-1,2},"
Q36=/tmp/q36
AUTH="$HOME/.cache/mlx-lily/models"

BATCH_SET=verified,batch_decode  # the default set plus batched decode (not yet verified)

if [[ $PHASES == *",1,"* ]]; then
  (
    echo "[$(el) s] trained: start"
    OUT="$W/trained" NO_INSTALL=1 CALL_BUDGET_S=${TRAINED_BUDGET_S:-540} \
      TRAIN_ARGS="${TRAIN_ARGS:---time-budget-s 300}" bash benchmarks/gpu/trained_numerics.sh \
      > "$W/trained.log" 2>&1
    rc=$?
    echo "[$(el) s] trained: rc=$rc"
  )  # alone: beside a 35B model on the GPU the trainer ran out of memory
  (
    MLX_LILY_KERNELS=$BATCH_SET step batch-parity 480 \
      python3 "$R/benchmarks/gpu/batch_parity.py" --model "$Q36" --lengths 5,37,130,2049 \
      --gen 32 --stock --out "$W/batch-parity"
    # prompts of one length: the batch decodes through the compiled whole-stack step
    MLX_LILY_KERNELS=$BATCH_SET step batch-parity-equal 300 \
      python3 "$R/benchmarks/gpu/batch_parity.py" --model "$Q36" --lengths 130,130,130,130 \
      --gen 32 --out "$W/batch-parity-equal"
    MLX_LILY_KERNELS=$BATCH_SET MLX_LILY_DISABLE=prefill_dequant step batch-parity-nodq 150 \
      python3 "$R/benchmarks/gpu/batch_parity.py" --model "$Q36" --lengths 5,2049 \
      --gen 16 --out "$W/batch-parity-nodq"
  ) &
  wait
fi

if [[ $PHASES == *",2,"* ]]; then
  # the machine's first qualification (cold: its variants compile here; 385 s before)
  MLX_LILY_CACHE_DIR=/tmp/qc-warm step qualify-warm 600 \
    python3 -m mlx_lily.qualify --model "$Q36" --report --out "$W/qualify-warm" --timeout-s 580
  mkdir -p /tmp/qc-warm && ln -sfn "$AUTH" /tmp/qc-warm/models
  MLX_LILY_CACHE_DIR=/tmp/qc-warm step gate-qualified 300 \
    python3 "$R/benchmarks/ab.py" "$Q36" --lengths 1024 --rounds 2 --decode-steps 32 \
    --watchdog-s 120 --out "$W/gate-qualified"
  # stock's -b 4 at 4K would fail in MLX (4 x 2,048-token chunks exceed its CUDA grid limit)
  MLX_LILY_KERNELS=$BATCH_SET step bench-ab 720 \
    python3 "$R/benchmarks/user_bench.py" --model "$Q36" --arms lily,stock --trials 1 \
    --cases 512:128:1,512:128:2,512:128:4,512:128:8,4096:128:1,4096:128:2 \
    --out "$W/bench-ab"
  MLX_LILY_KERNELS=$BATCH_SET step bench-lily 420 \
    python3 "$R/benchmarks/user_bench.py" --model "$Q36" --arms lily --trials 1 \
    --cases 4096:128:4,4096:128:8,32768:128:1,131072:128:1 --out "$W/bench-lily"
fi
echo "[$(el) s] round done"
