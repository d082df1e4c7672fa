#!/usr/bin/env bash
# One lease's runs for the open GPU measurements, started in the background on a machine
# set up by lease_setup.sh (from the repository root, in the call that sourced it):
#   setsid nohup bash benchmarks/gpu/lease_round.sh > /tmp/w/round.log 2>&1 < /dev/null &
# later calls on the warm machine only wait and archive /tmp/w (lease_setup.sh's snap).
# Phases (ROUND_PHASES, comma-separated names, run in the order given; default
# checks,bench,qualify,long):
#   gputests: the GPU tests of batched decode, the grouped MoE and the router top-k
#            (pytest -m gpu, a small random model; time limit GPUTESTS_LIMIT_S, default 400 s;
#            GPUTESTS_FILES, test files relative to the repository, replaces that list;
#            GPUTESTS_K, a pytest -k expression)
#   trained: train (or reuse) the production-width model, then its long-context numerics;
#            alone on the GPU (beside a 35B model the trainer ran out of memory)
#   (PARITY_ENV: space-separated VAR=VALUE words every parity phase runs under, after the
#   knob sweep's picks, e.g. "MLX_LILY_QGEMV_MMA=1")
#   checks:  batch-vs-alone parity (parity-equal: prompts of one length, the compiled batch
#            step; parity-one: one request, default kernels; parity-mixed: mixed lengths;
#            each also a phase of its own; parity-join, a phase only: two of four mixed-
#            length requests join the running batch; parity-join-eager, the same with
#            MLX_LILY_COMPILE=0); the first carries this machine's MLX JIT,
#            nothing in it is timed
#   profile: per-kernel GPU time of Lily's decode step (kernel_times.py, ncu) at each batch
#            of PROFILE_BATCHES (default 1 2 8) and context of PROFILE_CONTEXTS (default
#            512), kernels PROFILE_KERNELS (default: the shipped CUDA set plus batch_decode,
#            whatever the device's record says), each ncu pass limited to PROFILE_LIMIT_S
#            (default 240 s; kernel_times.py may run a second pass; the first run on a fresh
#            machine carries MLX's JIT)
#   detail:  Nsight Compute's sections (occupancy, throughput, warp states) of the decode
#            step's launches matching DETAIL_REGEX (default: the MoE and GDN decode kernels),
#            the first DETAIL_COUNT (default 6) of them, at each batch of DETAIL_BATCHES
#            (default 1 8), context 512, the preset's first 4 layers (3 GDN + attention;
#            with all 40 the run did not finish in 300 s, likely because ncu saves and
#            restores device memory around each replay pass), kernels as profile's; each
#            limited to PROFILE_LIMIT_S
#   bench:   mlx_lm.benchmark through user_bench.py, stock and Lily in one run (BENCH_CASES,
#            user_bench.py's --cases, replaces the default list; limit BENCH_LIMIT_S;
#            BENCH_TRIALS, default 1); Lily's kernels are the device's record (the last
#            qualification of this round when one ran; off the H200 without one, the shipped
#            set by name: batch_set) plus batch_decode; BENCH_PICKS=1:
#            under the knob sweep's picks (bench and long; user_bench.json records them)
#   gemv-micro: the decode GEMVs at 1..8 rows, lily_qgemv against lily_qgemv_mma
#            (gemv_rows_bench.py, limit GEMV_MICRO_LIMIT_S, default 240)
#   qualify: qualification on a fresh record folder (QUALIFY_RUNS times, default 1, each on
#            its own folder, limited to QUALIFY_LIMIT_S, default 600; QUALIFY_WARM=1:
#            once more on the first run's folder, whose kernel caches that run filled,
#            once per method of QUALIFY_WARM_METHODS, e.g. "greedy top-down"; default:
#            qualify's own default method), then the A/B gate
#            under the last record unless the list names the gate itself or QUALIFY_GATE=0
#   gate:    the A/B gate (benchmarks/ab.py) under this round's record (limit GATE_LIMIT_S,
#            default 420 s: on a fresh H100 the stock arm's JIT alone took 212 s)
#   long:    Lily alone at B = 1 over 512 / 4K / 32K / 128K (LONG_CASES; 3 trials, limit
#            LONG_LIMIT_S, default 300), then 4K at B = 4 / 8 (unless LONG_BATCH=0)
#   timeline: host phases against the GPU's start and end of each B = 1 decode step
#            (decode_timeline.py, Lily alone, kernels as bench's) at each context of
#            TIMELINE_CONTEXTS (default 512 4096 32768), TIMELINE_STEPS steps (default 128)
#            x 2 rounds, each limited to TIMELINE_LIMIT_S (default 240); TIMELINE_RUNS:
#            space-separated runs, each "default" or comma-joined words that are VAR=VALUE
#            (environment, e.g. MLX_USE_CUDA_GRAPHS=0) or --gc=off / --gc=freeze (default:
#            one run, "default"); each run's folders end in -r<n> after the first
#   env-sweep: mlx_lm.benchmark (user_bench.py, Lily alone, kernels as bench's) once per
#            setting of ENV_SWEEP (space-separated; "default" or comma-joined VAR=VALUE, e.g.
#            MLX_USE_CUDA_GRAPHS=0), cases ENV_SWEEP_CASES (default 4096:128:1,512:128:8),
#            each run limited to ENV_SWEEP_LIMIT_S (default 300 s)
#   attn-sweep: decode attention's split through mlx_lm.benchmark (user_bench.py, Lily alone,
#            the shipped CUDA set by name), one run per setting of ATTN_SWEEP (space-separated;
#            "default" or comma-joined VAR=VALUE of the MLX_LILY_ATTN_* / MLX_LILY_DECODE_PF
#            knobs; default: five settings), cases ATTN_SWEEP_CASES (default
#            4096:128:1,32768:128:1), each run limited to ATTN_SWEEP_LIMIT_S (default 300 s)
#   dispatch: MLX's host cost per custom-kernel launch (dispatch_bench.py: input count, input
#            size, a long source inline and as #include lines), limit DISPATCH_LIMIT_S (120)
#   moe-micro: the one-launch MoE kernel at each launch shape (moe_decode_bench.py --sections
#            fused) at MOE_MICRO_ROWS rows (default 1,2,8), limit MOE_MICRO_LIMIT_S
#   phase-trace: per-block stamps of the one-launch MoE block and the GDN decode
#            (phase_trace.py: 40 chained launches over 8 weight sets, production dims) at
#            each row count of PHASE_TRACE_ROWS (default 1 8), limit PHASE_TRACE_LIMIT_S (240);
#            PHASE_TRACE_ARGS: more arguments (e.g. "--variants base,l2pf --rounds 2")
#   fold-sweep: the GDN decode's batch fold (MLX_LILY_GDN_BATCH_FOLD) the same way, with
#            batched decode on: FOLD_SWEEP settings (default: default, 4, 8), cases
#            FOLD_SWEEP_CASES (default 512:128:2,512:128:8), FOLD_SWEEP_LIMIT_S
#   knob-sweep: benchmarking knobs compared in one process (knob_sweep.py: one model load,
#            mlx_lm.benchmark's procedure per case), groups KNOB_GROUPS ('|'-separated
#            CASES=SETTINGS; default: the one-launch MoE block against its three launches
#            at B = 1 / 8, decode attention's fixed block at 32K / 128K and its target warps
#            at 4K, the one-launch MoE block's rows per lane group at B = 2 / 4 / 8),
#            KNOB_TRIALS (2) x KNOB_ROUNDS (2), limit KNOB_SWEEP_LIMIT_S (900); kernels the
#            shipped CUDA set plus batch_decode. Its picks (W/knob-sweep/picks.env) apply to
#            the parity-mixed and parity-join(-eager) phases that follow; W/knob-sweep.clocks.csv
#            samples the GPU's clocks, power and load every 200 ms meanwhile.
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
  [ "$rc" = 124 ] && reap_gpu
}
reap_gpu() {  # a timed-out step's grandchildren (ncu's target) may still hold GPU memory
  local p
  for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    echo "[$(el) s] killing GPU process $p left by a timed-out step"
    kill -9 "$p" 2>/dev/null
  done
  sleep 2
}
Q36=/tmp/q36
AUTH="$HOME/.cache/mlx-lily/models"
# the shipped CUDA set (kernels.VERIFIED["cuda"]) by name, for runs that must not depend on
# the device's record (another GPU than the shipped record's qualifies first)
SHIPPED=$(cd /tmp && python3 -c "from mlx_lily.kernels import VERIFIED; print(','.join(sorted(VERIFIED['cuda'])))")
QUALIFIED_DIR=""  # the last qualification's record folder, once one ran
# whether the shipped set applies to this GPU (kernels.SHIPPED_DEVICES: the H200)
SHIPPED_HERE=$(cd /tmp && python3 -c "from mlx_lily.kernels import shipped_matches; print(int(shipped_matches('cuda')))")
batch_set() {  # the device's set plus batched decode (not yet verified): "verified" where the
  # shipped set or this round's qualification applies, else the shipped set by name (on
  # another GPU without a record "verified" names no op, and Lily would run stock)
  if [ -n "$QUALIFIED_DIR" ] || [ "$SHIPPED_HERE" = 1 ]; then
    echo verified,batch_decode
  else
    echo "$SHIPPED,batch_decode"
  fi
}

phase_gputests() {
  # -v names each test: a run cut by the limit (a fresh machine's JIT) still says how far it got
  local files=() f
  for f in ${GPUTESTS_FILES:-tests/test_op_moe_router_topk.py tests/test_op_moe_grouped.py tests/test_batch_decode.py}; do
    files+=("$R/$f")
  done
  local sel=(); [ -n "${GPUTESTS_K:-}" ] && sel=(-k "$GPUTESTS_K")
  step gpu-tests-batch ${GPUTESTS_LIMIT_S:-400} python3 -m pytest -m gpu -v -p no:cacheprovider \
    "${files[@]}" ${sel[@]+"${sel[@]}"}
}

phase_trained() {
  echo "[$(el) s] trained: start"
  # "default" kernels are this device's: the record of this round's qualification when one ran
  MLX_LILY_CACHE_DIR=${QUALIFIED_DIR:-${MLX_LILY_CACHE_DIR:-$HOME/.cache/mlx-lily}} \
    OUT="$W/trained" NO_INSTALL=1 CALL_BUDGET_S=${TRAINED_BUDGET_S:-540} \
    TRAIN_ARGS="${TRAIN_ARGS:---time-budget-s 330}" bash benchmarks/gpu/trained_numerics.sh \
    > "$W/trained.log" 2>&1
  local rc=$?  # before $(el), which would reset $?
  echo "[$(el) s] trained: rc=$rc"
}

# the first of these to run carries the 35B model's MLX JIT (up to ~320 s)
phase_parity_equal() {
  # prompts of one length: the batch decodes through the compiled whole-stack step
  MLX_LILY_KERNELS=$(batch_set) step batch-parity-equal 480 env ${PARITY_ENV:-} \
    python3 "$R/benchmarks/gpu/batch_parity.py" --model "$Q36" --lengths 130,130,130,130 \
    --gen 32 --out "$W/batch-parity-equal"
}
phase_parity_one() {
  # one request in mlx-lm's batch caches (mlx_lm.server), default kernels
  step batch-parity-one 480 env ${PARITY_ENV:-} \
    python3 "$R/benchmarks/gpu/batch_parity.py" --model "$Q36" --lengths 130 \
    --gen 32 --out "$W/batch-parity-one"
}
phase_parity_mixed() {
  MLX_LILY_KERNELS=$(batch_set) step batch-parity 240 env $(picks) ${PARITY_ENV:-} \
    python3 "$R/benchmarks/gpu/batch_parity.py" --model "$Q36" --lengths 5,37,130,2049 \
    --gen 32 --out "$W/batch-parity"
}

phase_parity_join() {
  # a request joining a running batch (mlx_lm.server's case), mixed lengths
  MLX_LILY_KERNELS=$(batch_set) step batch-parity-join 300 env $(picks) ${PARITY_ENV:-} \
    python3 "$R/benchmarks/gpu/batch_parity.py" --model "$Q36" --lengths 37,5,130,2049 \
    --gen 16 --join 2 --out "$W/batch-parity-join"
}

phase_parity_join_eager() {
  # the same with every decode step eager (MLX_LILY_COMPILE=0): tells mx.compile's part
  MLX_LILY_KERNELS=$(batch_set) MLX_LILY_COMPILE=0 step batch-parity-join-eager 300 env $(picks) ${PARITY_ENV:-} \
    python3 "$R/benchmarks/gpu/batch_parity.py" --model "$Q36" --lengths 37,5,130,2049 \
    --gen 16 --join 2 --out "$W/batch-parity-join-eager"
}

phase_profile() {
  # where a decode step's time goes: per-kernel GPU time (ncu)
  local b c
  for c in ${PROFILE_CONTEXTS:-512}; do
    for b in ${PROFILE_BATCHES:-1 2 8}; do
      MLX_LILY_KERNELS=${PROFILE_KERNELS:-$SHIPPED,batch_decode} step kernel-times-c$c-b$b \
        $(( 2 * ${PROFILE_LIMIT_S:-240} + 20 )) \
        python3 "$R/benchmarks/gpu/kernel_times.py" --context $c --batch $b --arms lily \
        --steps 2 --timeout-s ${PROFILE_LIMIT_S:-240} --out "$W/kernel-times-c$c-b$b"
    done
  done
}

phase_detail() {
  # why a decode kernel takes its time: ncu's sections for its first launches
  local b
  for b in ${DETAIL_BATCHES:-1 8}; do
    MLX_LILY_KERNELS=${PROFILE_KERNELS:-$SHIPPED,batch_decode} step kernel-detail-b$b \
      $(( 2 * ${PROFILE_LIMIT_S:-240} + 20 )) \
      python3 "$R/benchmarks/gpu/kernel_times.py" --context 512 --batch $b --arms lily \
      --layers 4 --steps 1 --timeout-s ${PROFILE_LIMIT_S:-240} \
      --detail "${DETAIL_REGEX:-lily_moe_decode|lily_gdn_decode}" \
      --detail-count ${DETAIL_COUNT:-6} --out "$W/kernel-detail-b$b"
  done
}

phase_moe_micro() {
  # the one-launch MoE block's launch shapes at 1..8 rows (moe_decode_bench.py, one layer's
  # weights, 40 chained launches)
  MLX_LILY_KERNELS=all step moe-micro ${MOE_MICRO_LIMIT_S:-300} \
    python3 "$R/benchmarks/gpu/moe_decode_bench.py" --sections fused \
    --rows "${MOE_MICRO_ROWS:-1,2,8}" --out "$W/moe-micro"
}

phase_phase_trace() {
  local n
  for n in ${PHASE_TRACE_ROWS:-1 8}; do
    step phase-trace-b$n ${PHASE_TRACE_LIMIT_S:-240} \
      python3 "$R/benchmarks/gpu/phase_trace.py" --rows "$n" ${PHASE_TRACE_ARGS:-} --out "$W/phase-trace"
  done
}

bench_env() {  # the knob sweep's picks under BENCH_PICKS=1, as an env command; else none
  [ "${BENCH_PICKS:-0}" = 1 ] && echo env $(picks)
}

phase_dispatch() {
  step dispatch-bench ${DISPATCH_LIMIT_S:-120} \
    python3 "$R/benchmarks/gpu/dispatch_bench.py" --out "$W/dispatch-bench"
}

phase_gemv_micro() {
  step gemv-micro ${GEMV_MICRO_LIMIT_S:-240} \
    python3 "$R/benchmarks/gpu/gemv_rows_bench.py" --out "$W/gemv-micro"
}

phase_bench() {
  # stock's -b 4 at 4K would fail in MLX (4 x 2,048-token chunks exceed its CUDA grid limit)
  MLX_LILY_CACHE_DIR=${QUALIFIED_DIR:-${MLX_LILY_CACHE_DIR:-$HOME/.cache/mlx-lily}} \
  MLX_LILY_KERNELS=$(batch_set) step bench-ab ${BENCH_LIMIT_S:-780} $(bench_env) \
    python3 "$R/benchmarks/user_bench.py" --model "$Q36" --arms lily,stock \
    --trials ${BENCH_TRIALS:-1} \
    --cases "${BENCH_CASES:-512:128:1,512:128:2,512:128:4,512:128:8,4096:128:1,4096:128:2}" \
    --out "$W/bench-ab"
}

phase_qualify() {
  local n qd="" d
  for n in $(seq 1 "${QUALIFY_RUNS:-1}"); do
    qd=/tmp/qc$n; [ "$n" = 1 ] && qd=/tmp/qc; d=qualify; [ "$n" = 1 ] || d=qualify-$n
    MLX_LILY_CACHE_DIR=$qd step $d ${QUALIFY_LIMIT_S:-600} \
      python3 -m mlx_lily.qualify --model "$Q36" --report --out "$W/$d" \
      --timeout-s $(( ${QUALIFY_LIMIT_S:-600} - 20 ))
  done
  if [ "${QUALIFY_WARM:-0}" = 1 ]; then  # again on the first run's folder: its kernel caches are warm
    local m
    for m in ${QUALIFY_WARM_METHODS:-default}; do
      qd=/tmp/qc; d=qualify-warm; [ -n "${QUALIFY_WARM_METHODS:-}" ] && d=qualify-warm-$m
      local how=(); [ "$m" = default ] || how=(--method "$m")
      MLX_LILY_CACHE_DIR=$qd step $d 600 \
        python3 -m mlx_lily.qualify --model "$Q36" --report --out "$W/$d" --timeout-s 580 \
        "${how[@]}"
    done
  fi
  [ -n "$qd" ] && QUALIFIED_DIR=$qd
  [ "${QUALIFY_GATE:-1}" = 0 ] && return 0
  case ",${ROUND_PHASES:-}," in *,gate,*) ;; *) phase_gate ;; esac
}

phase_gate() {
  # the A/B gate under this round's record (else the device's); the trained model, when this
  # machine has one, is its numerics authority
  local qd=${QUALIFIED_DIR:-${MLX_LILY_CACHE_DIR:-$HOME/.cache/mlx-lily}}
  mkdir -p "$qd" "$AUTH"  # AUTH first: when qd/models is AUTH, ln would link it to itself
  [ "$qd/models" -ef "$AUTH" ] || ln -sfn "$AUTH" "$qd/models"
  MLX_LILY_CACHE_DIR=$qd step gate-qualified ${GATE_LIMIT_S:-420} \
    python3 "$R/benchmarks/ab.py" "$Q36" --lengths 1024 --rounds 2 --decode-steps 32 \
    --watchdog-s 120 --out "$W/gate-qualified"
}

phase_long() {
  MLX_LILY_KERNELS=$(batch_set) step bench-lily ${LONG_LIMIT_S:-300} $(bench_env) \
    python3 "$R/benchmarks/user_bench.py" --model "$Q36" --arms lily --trials 3 \
    --cases ${LONG_CASES:-512:128:1,4096:128:1,32768:128:1,131072:128:1} --out "$W/bench-lily"
  [ "${LONG_BATCH:-1}" = 1 ] || return 0
  MLX_LILY_KERNELS=$(batch_set) step bench-lily-batch 200 $(bench_env) \
    python3 "$R/benchmarks/user_bench.py" --model "$Q36" --arms lily --trials 1 \
    --cases 4096:128:4,4096:128:8 --out "$W/bench-lily-batch"
}

phase_timeline() {
  local c run i=0 envs args w ws sfx
  for run in ${TIMELINE_RUNS:-default}; do
    i=$((i + 1)); sfx=""; [ "$i" = 1 ] || sfx="-r$i"
    envs=(); args=()
    if [ "$run" != default ]; then
      IFS=, read -r -a ws <<< "$run"
      for w in "${ws[@]}"; do
        case "$w" in --*) args+=("$w") ;; *) envs+=("$w") ;; esac
      done
    fi
    for c in ${TIMELINE_CONTEXTS:-512 4096 32768}; do
      echo "$run" > "$W/decode-timeline-c$c$sfx.setting"
      MLX_LILY_KERNELS=$(batch_set) step decode-timeline-c$c$sfx ${TIMELINE_LIMIT_S:-240} \
        env ${envs[@]+"${envs[@]}"} python3 "$R/benchmarks/gpu/decode_timeline.py" "$Q36" \
        --context "$c" --arms lily --steps ${TIMELINE_STEPS:-128} --warmup 8 --rounds 2 \
        ${args[@]+"${args[@]}"} --out "$W/decode-timeline-c$c$sfx"
    done
  done
}

sweep_run() {  # sweep_run NAME "SETTINGS" CASES KERNELS LIMIT_S: one user_bench run per setting
  local name=$1 settings=$2 cases=$3 kset=$4 limit=$5 s i=0 envs
  for s in $settings; do
    i=$((i + 1))
    envs=()
    [ "$s" = default ] || IFS=, read -r -a envs <<< "$s"
    echo "$s" > "$W/$name-$i.setting"
    MLX_LILY_KERNELS=$kset step $name-$i $limit \
      env ${envs[@]+"${envs[@]}"} python3 "$R/benchmarks/user_bench.py" --model "$Q36" \
      --arms lily --trials 1 --cases "$cases" --out "$W/$name-$i"
  done
}

picks() {  # the knob sweep's picks as VAR=VALUE words (none before it ran)
  [ -f "$W/knob-sweep/picks.env" ] && cat "$W/knob-sweep/picks.env"
}

phase_knob_sweep() {
  local d="512:128:1,4096:128:1,512:128:8=default MLX_LILY_DISABLE=moe_fused"
  d+="|32768:128:1,131072:128:1=default MLX_LILY_ATTN_FIXED_BLOCK=256"
  d+=" MLX_LILY_ATTN_FIXED_BLOCK=512"
  d+="|4096:128:1,4096:128:4=default MLX_LILY_ATTN_DECODE_WARPS=128"
  d+="|512:128:2,512:128:4,512:128:8=default MLX_LILY_MOE_FUSED_RPW=1,2,1"
  d+=" MLX_LILY_MOE_FUSED_RPW=2,2,1"
  local gl g args=() limit=${KNOB_SWEEP_LIMIT_S:-900}
  IFS='|' read -r -a gl <<< "${KNOB_GROUPS:-$d}"
  for g in "${gl[@]}"; do args+=(--group "$g"); done
  # the GPU's clocks, power and load every 200 ms beside it (B = 1 trials spread widely)
  timeout $(( limit + 5 )) nvidia-smi \
    --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu \
    --format=csv -lms 200 > "$W/knob-sweep.clocks.csv" 2>&1 &
  local smi=$!
  MLX_LILY_KERNELS=$SHIPPED,batch_decode step knob-sweep "$limit" \
    python3 "$R/benchmarks/gpu/knob_sweep.py" --model "$Q36" "${args[@]}" \
    --trials ${KNOB_TRIALS:-2} --rounds ${KNOB_ROUNDS:-2} --budget-s $(( limit - 60 )) \
    --out "$W/knob-sweep"
  kill "$smi" 2>/dev/null
  echo "[$(el) s] knob-sweep picks: $(picks | tr '\n' ' ')"
}

phase_attn_sweep() {
  local all="default MLX_LILY_DECODE_PF=2"
  all+=" MLX_LILY_ATTN_DECODE_WARPS=128,MLX_LILY_ATTN_FIXED_BLOCK=512"
  all+=" MLX_LILY_ATTN_FIXED_BLOCK=256,MLX_LILY_DECODE_PF=2"
  all+=" MLX_LILY_ATTN_DECODE_WARPS=256,MLX_LILY_ATTN_FIXED_BLOCK=64"
  sweep_run attn-sweep "${ATTN_SWEEP:-$all}" "${ATTN_SWEEP_CASES:-4096:128:1,32768:128:1}" \
    "$SHIPPED" ${ATTN_SWEEP_LIMIT_S:-300}
}

phase_env_sweep() {
  sweep_run env-sweep "${ENV_SWEEP:-default}" "${ENV_SWEEP_CASES:-4096:128:1,512:128:8}" \
    "$(batch_set)" ${ENV_SWEEP_LIMIT_S:-300}
}

phase_fold_sweep() {
  sweep_run fold-sweep "${FOLD_SWEEP:-default MLX_LILY_GDN_BATCH_FOLD=4 MLX_LILY_GDN_BATCH_FOLD=8}" \
    "${FOLD_SWEEP_CASES:-512:128:2,512:128:8}" "$SHIPPED,batch_decode" \
    ${FOLD_SWEEP_LIMIT_S:-300}
}

IFS=, read -r -a PHASE_LIST <<< "${ROUND_PHASES:-checks,bench,qualify,long}"
for p in "${PHASE_LIST[@]}"; do
  case "$p" in
    checks) phase_parity_equal; phase_parity_one; phase_parity_mixed ;;
    parity-equal) phase_parity_equal ;;
    parity-one) phase_parity_one ;;
    parity-mixed) phase_parity_mixed ;;
    parity-join) phase_parity_join ;;
    parity-join-eager) phase_parity_join_eager ;;
    gputests|trained|profile|detail|bench|qualify|gate|long|timeline) "phase_$p" ;;
    gemv-micro) phase_gemv_micro ;;
    dispatch) phase_dispatch ;;
    attn-sweep) phase_attn_sweep ;;
    env-sweep) phase_env_sweep ;;
    fold-sweep) phase_fold_sweep ;;
    knob-sweep) phase_knob_sweep ;;
    moe-micro) phase_moe_micro ;;
    phase-trace) phase_phase_trace ;;
    *) echo "[$(el) s] unknown phase: $p" ;;
  esac
done
echo "[$(el) s] round done"
