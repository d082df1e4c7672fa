#!/usr/bin/env bash
# One lease's runs for the open GPU measurements, started in the background on a machine
# set up by lease_setup.sh (from the repository root, in the call that sourced it):
#   setsid nohup bash benchmarks/gpu/lease_round.sh > /tmp/w/round.log 2>&1 < /dev/null &
# later calls on the warm machine only wait and archive /tmp/w (lease_setup.sh's snap).
# Phases (ROUND_PHASES, comma-separated names, default checks,bench,qualify,long), in order:
#   gputests: the GPU tests of batched decode, the grouped MoE and the router top-k
#            (pytest -m gpu, a small random model; time limit GPUTESTS_LIMIT_S, default 400 s;
#            GPUTESTS_FILES, test files relative to the repository, replaces that list)
#   trained: train (or reuse) the production-width model, then its long-context numerics;
#            alone on the GPU (beside a 35B model the trainer ran out of memory)
#   checks:  batch-vs-alone parity (parity-equal: prompts of one length, the compiled batch
#            step; parity-one: one request, default kernels; parity-mixed: mixed lengths;
#            each also a phase of its own); the first carries this machine's MLX JIT,
#            nothing in it is timed
#   profile: per-kernel GPU time of Lily's decode step at B = PROFILE_BATCHES (default
#            1 2 8; kernel_times.py, ncu)
#   bench:   mlx_lm.benchmark through user_bench.py, stock and Lily in one run (BENCH_CASES,
#            user_bench.py's --cases, replaces the default list; limit BENCH_LIMIT_S)
#   qualify: qualification on a fresh record folder (QUALIFY_RUNS times, default 1, each on
#            its own folder), then the A/B gate under the last record
#   long:    Lily alone at B = 1 over 512 / 4K / 32K / 128K (3 trials), then 4K at B = 4 / 8
# One process at a time; each step's log is W/<step>.log, the timeline W/round.log.
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
PHASES=",${ROUND_PHASES:-checks,bench,qualify,long},"
Q36=/tmp/q36
AUTH="$HOME/.cache/mlx-lily/models"

BATCH_SET=verified,batch_decode  # the default set plus batched decode (not yet verified)

if [[ $PHASES == *",gputests,"* ]]; then
  # -v names each test: a run cut by the limit (a fresh machine's JIT) still says how far it got
  files=()
  for f in ${GPUTESTS_FILES:-tests/test_op_moe_router_topk.py tests/test_op_moe_grouped.py tests/test_batch_decode.py}; do
    files+=("$R/$f")
  done
  step gpu-tests-batch ${GPUTESTS_LIMIT_S:-400} python3 -m pytest -m gpu -v -p no:cacheprovider \
    "${files[@]}"
fi

if [[ $PHASES == *",trained,"* ]]; then
  echo "[$(el) s] trained: start"
  OUT="$W/trained" NO_INSTALL=1 CALL_BUDGET_S=${TRAINED_BUDGET_S:-540} \
    TRAIN_ARGS="${TRAIN_ARGS:---time-budget-s 300}" bash benchmarks/gpu/trained_numerics.sh \
    > "$W/trained.log" 2>&1
  rc=$?
  echo "[$(el) s] trained: rc=$rc"
fi

[[ $PHASES == *",checks,"* ]] && PHASES="$PHASES,parity-equal,parity-one,parity-mixed,"
# the first of these to run carries the 35B model's MLX JIT (up to ~320 s)
if [[ $PHASES == *",parity-equal,"* ]]; then
  # prompts of one length: the batch decodes through the compiled whole-stack step
  MLX_LILY_KERNELS=$BATCH_SET step batch-parity-equal 480 \
    python3 "$R/benchmarks/gpu/batch_parity.py" --model "$Q36" --lengths 130,130,130,130 \
    --gen 32 --out "$W/batch-parity-equal"
fi
if [[ $PHASES == *",parity-one,"* ]]; then
  # one request in mlx-lm's batch caches (mlx_lm.server), default kernels
  step batch-parity-one 480 \
    python3 "$R/benchmarks/gpu/batch_parity.py" --model "$Q36" --lengths 130 \
    --gen 32 --out "$W/batch-parity-one"
fi
if [[ $PHASES == *",parity-mixed,"* ]]; then
  MLX_LILY_KERNELS=$BATCH_SET step batch-parity 240 \
    python3 "$R/benchmarks/gpu/batch_parity.py" --model "$Q36" --lengths 5,37,130,2049 \
    --gen 32 --out "$W/batch-parity"
fi

if [[ $PHASES == *",profile,"* ]]; then
  # where the batch step's time goes: per-kernel GPU time (ncu)
  for b in ${PROFILE_BATCHES:-1 2 8}; do
    MLX_LILY_KERNELS=$BATCH_SET step kernel-times-b$b 240 \
      python3 "$R/benchmarks/gpu/kernel_times.py" --context 512 --batch $b --arms lily \
      --steps 2 --out "$W/kernel-times-b$b"
  done
fi

if [[ $PHASES == *",bench,"* ]]; then
  # stock's -b 4 at 4K would fail in MLX (4 x 2,048-token chunks exceed its CUDA grid limit)
  MLX_LILY_KERNELS=$BATCH_SET step bench-ab ${BENCH_LIMIT_S:-780} \
    python3 "$R/benchmarks/user_bench.py" --model "$Q36" --arms lily,stock --trials 1 \
    --cases "${BENCH_CASES:-512:128:1,512:128:2,512:128:4,512:128:8,4096:128:1,4096:128:2}" \
    --out "$W/bench-ab"
fi

if [[ $PHASES == *",qualify,"* ]]; then
  for n in $(seq 1 "${QUALIFY_RUNS:-1}"); do
    qd=/tmp/qc$n; [ "$n" = 1 ] && qd=/tmp/qc; d=qualify; [ "$n" = 1 ] || d=qualify-$n
    MLX_LILY_CACHE_DIR=$qd step $d 600 \
      python3 -m mlx_lily.qualify --model "$Q36" --report --out "$W/$d" --timeout-s 580
  done
  mkdir -p "$qd" && ln -sfn "$AUTH" "$qd/models"
  MLX_LILY_CACHE_DIR=$qd step gate-qualified 300 \
    python3 "$R/benchmarks/ab.py" "$Q36" --lengths 1024 --rounds 2 --decode-steps 32 \
    --watchdog-s 120 --out "$W/gate-qualified"
fi

if [[ $PHASES == *",long,"* ]]; then
  MLX_LILY_KERNELS=$BATCH_SET step bench-lily 300 \
    python3 "$R/benchmarks/user_bench.py" --model "$Q36" --arms lily --trials 3 \
    --cases 512:128:1,4096:128:1,32768:128:1,131072:128:1 --out "$W/bench-lily"
  MLX_LILY_KERNELS=$BATCH_SET step bench-lily-batch 200 \
    python3 "$R/benchmarks/user_bench.py" --model "$Q36" --arms lily --trials 1 \
    --cases 4096:128:4,4096:128:8 --out "$W/bench-lily-batch"
fi
echo "[$(el) s] round done"
