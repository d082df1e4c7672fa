#!/usr/bin/env bash
# The GPU-machine run: install this tree, GPU parity tests, per-op benchmarks, A/B.
# Run from the repository root on a machine with MLX's CUDA (or Metal) build installed:
#   STAGES=install,tests,bench,ab AB_ARGS="--lengths 256,4096" bash benchmarks/gpu/suite.sh
# Stages: jitload, install, tests (all op files in parallel, T_TESTS seconds cap each, default 300;
# TEST_OPS=a,b selects files; NVRTC compiles of every template make a cold file take 1-3 min),
# bench (BENCHES=a,b selects scripts), startup, prims, ab, numerics, timeline (decode_timeline.py:
# TL_ARGS, TL_ENVS), ktimes (per-kernel GPU
# time under ncu: kernel_times.py, KT_ARGS), profile (decode_profile.py;
# PROFILE_ARGS passes options, e.g. "--no-stock-arm --arm-env NAME:VAR=VAL --rounds 2 --cprofile";
# PROFILE_ENVS adds runs under other MLX settings, one process each). With tests, prims and
# numerics run alongside the test processes (they count nodes / measure accuracy, not time).
# jitsave (last) / jitload (first) carry the machine's kernel caches to the next lease.
# install also writes CUDA's crt/ headers (MLX's own qmm_sm90 JIT needs crt/mma.h) from
# .devcache/crt when carried: `python3 benchmarks/gpu/crt_headers.py prepare .devcache/crt`.
# The device tool allows 10 min per command: split stages over calls on the warm machine.
# Everything lands in one archive, $OUT/results.tgz, rewritten after each stage (the device
# tool returns at most 8 files), plus $OUT/summary.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1
export MLX_LILY_KERNELS=${MLX_LILY_KERNELS:-all}  # exercise every kernel; MLX_LILY_DISABLE narrows it
# A fresh install starts with every op on: /tmp can outlive a lease on these machines, and
# a disable list from an earlier lease once switched an op off in a later one.
[[ ",${STAGES:-install,tests,bench,ab}," == *",install,"* ]] && rm -f /tmp/lily-disable
if [ -f /tmp/lily-disable ] && [ -z "${MLX_LILY_DISABLE:-}" ]; then
  export MLX_LILY_DISABLE=$(cat /tmp/lily-disable)
fi
REPO=$(pwd)
# the tree's commit for the results (the installed copy has no git): .lily-rev, written
# here by benchmarks/gpu/stamp_rev.sh and carried with the call, else git when present
if [ -f .lily-rev ]; then
  export MLX_LILY_TREE_REV=$(cat .lily-rev)
elif git rev-parse HEAD > /dev/null 2>&1; then
  export MLX_LILY_TREE_REV=$(git rev-parse HEAD)$([ -n "$(git status --porcelain --untracked-files=no)" ] && echo +dirty)
fi
OUTDIR=${OUT:-/tmp/lily-out}
W=/tmp/lily-results
mkdir -p "$OUTDIR" "$W"
STAGES=${STAGES:-install,tests,bench,ab}
S="$OUTDIR/summary.txt"
say() { echo "$@" | tee -a "$S"; }
# one archive, rewritten after every stage: a run cut short still returns what finished
snapshot() { tar czf "$OUTDIR/results.tgz" -C "$W" . 2>/dev/null; }
has() { [[ ",$STAGES," == *",$1,"* ]]; }

# jitload: restore MLX's and Lily's kernel caches saved by a jitsave stage of an earlier
# lease (parts carried in .devcache/jit/ or stashed in ~/.lily-jit-stash/): a fresh machine
# otherwise spends ~160 s on stock's first forward and ~80 s on the A/B gate's fp32 anchor.
if has jitload; then
  for d in .devcache/jit "$HOME/.lily-jit-stash"; do
    if ls "$d"/jit.tgz.part* > /dev/null 2>&1; then
      cat "$d"/jit.tgz.part* | tar xzf - -C / && echo "jit cache restored from $d" >> "$OUTDIR/summary.txt"
      break
    fi
  done
fi
if has install; then
  python3 -m pip install -q --no-deps --no-build-isolation --force-reinstall . > "$W/install.log" 2>&1 \
    || { say "install failed"; tail -20 "$W/install.log" | tee -a "$S"; }
  # CUDA's crt/ headers for MLX's own qmm_sm90 JIT, when carried (crt_headers.py prepare)
  if ls .devcache/crt/nvidia_cuda_crt-*.whl > /dev/null 2>&1; then
    python3 benchmarks/gpu/crt_headers.py install .devcache/crt 2>&1 | tee -a "$S"
  fi
fi
say "MLX_LILY_DISABLE=${MLX_LILY_DISABLE:-} tree=${MLX_LILY_TREE_REV:-unknown}"
(cd /tmp && python3 - <<'PY') 2>&1 | tee "$W/env.txt" | tee -a "$S"
import mlx.core as mx, mlx_lm, mlx_lily
print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, "device", mx.default_device())
print(mlx_lily.backend_info())
PY
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv >> "$W/env.txt" 2>&1

run_prims() {
  (cd /tmp && timeout 200 python3 "$REPO/benchmarks/primitives.py" --synthetic ${PRIMS_PRESET:-qwen3.6-35b-a3b} --out "$W/primitives.json") > "$W/primitives.log" 2>&1
}
run_numerics() {
  (cd /tmp && timeout 240 python3 "$REPO/benchmarks/numerics.py" "$REPO/tests/fixtures/qwen35moe-tiny-trained" --out "$W/numerics.json") > "$W/numerics.log" 2>&1
}
report_prims() { say "== primitives per decode token"; tail -20 "$W/primitives.log" | tee -a "$S"; }
report_numerics() { say "== numerics (trained fixture)"; tail -20 "$W/numerics.log" | tee -a "$S"; }

if has tests; then
  say "== GPU parity tests, per op file, all files at once (an op whose tests fail is disabled for the later stages)"
  : > /tmp/lily-disable
  # NVRTC compiles are CPU-bound: one process per file, each with its own kernel cache
  # (no two processes write one cache entry), merged into the default cache afterwards.
  pids=()
  bg=()
  if has prims; then MLX_PTX_CACHE_DIR=/tmp/lily-ptx-prims run_prims & bg+=("$!"); fi
  if has numerics; then MLX_PTX_CACHE_DIR=/tmp/lily-ptx-numerics run_numerics & bg+=("$!"); fi
  for f in tests/test_op_*.py tests/test_cuda_cache.py tests/test_gpu_clock.py; do
    op=$(basename "$f" .py); op=${op#test_op_}; op=${op#test_}
    if [ -n "${TEST_OPS:-}" ] && [[ ",$TEST_OPS," != *",$op,"* ]]; then continue; fi
    (cd /tmp && MLX_PTX_CACHE_DIR=/tmp/lily-ptx-$op timeout "${T_TESTS:-300}" python3 -m pytest -m gpu -q \
       -p no:cacheprovider -rfs --durations=5 "$REPO/$f" --junitxml="$W/junit-$op.xml") > "$W/gpu_tests-$op.log" 2>&1 &
    pids+=("$!:$op")
  done
  for pe in "${pids[@]}"; do
    pid=${pe%%:*}; op=${pe#*:}
    wait "$pid"; rc=$?
    say "$op: rc=$rc $(grep -E '[0-9]+ (passed|failed)' "$W/gpu_tests-$op.log" | tail -1)"
    grep -E "^FAILED" "$W/gpu_tests-$op.log" | head -5 | tee -a "$S"
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 5 ]; then
      case $op in qgemv|norm_qgemv|attention|gated_delta|add_rms_norm|moe_router_topk|moe_experts|moe_route|moe_grouped)
        echo -n "$op," >> /tmp/lily-disable;;
      qmm_dequant) echo -n "prefill_dequant,shared_dequant," >> /tmp/lily-disable;; esac
    fi
  done
  for p in "${bg[@]}"; do wait "$p"; done
  has prims && report_prims
  has numerics && report_numerics
  mkdir -p ~/.cache/mlx-lily/cuda-kernels
  for d in /tmp/lily-ptx-*; do [ -d "$d" ] && cp -n "$d"/* ~/.cache/mlx-lily/cuda-kernels/ 2>/dev/null; done
  say "disabled after tests: $(cat /tmp/lily-disable)"
  snapshot
fi
if ! has tests; then
  has prims && { run_prims; report_prims; }
  has numerics && { run_numerics; report_numerics; }
fi
if has bench; then
  for b in benchmarks/gpu/*_bench.py; do
    n=$(basename "$b" .py)
    if [ -n "${BENCHES:-}" ] && [[ ",$BENCHES," != *",${n%_bench},"* ]]; then continue; fi
    say "== $n"
    (cd /tmp && timeout "${T_BENCH:-100}" python3 "$REPO/$b" --out "$W") > "$W/$n.log" 2>&1
    tail -25 "$W/$n.log" | tee -a "$S"
  done
fi
if has startup; then
  say "== start-up (cold / warm kernel cache)"
  (cd /tmp && timeout "${T_STARTUP:-300}" python3 "$REPO/benchmarks/startup.py" ${STARTUP_ARGS:---preset qwen3.6-35b-a3b --layers 4} \
     --out "$W/startup.json") > "$W/startup.log" 2>&1
  tail -8 "$W/startup.log" | tee -a "$S"; snapshot
fi
if has ab; then
  say "== A/B"
  (cd /tmp && timeout "${T_AB:-420}" python3 "$REPO/benchmarks/ab.py" --synthetic qwen3.6-35b-a3b --watchdog-s ${AB_WATCHDOG_S:-90} ${AB_ARGS:-} --out "$W/ab") > "$W/ab.log" 2>&1
  tail -40 "$W/ab.log" | tee -a "$S"
  snapshot
fi
if has profile; then
  say "== decode profile (host build / eval / pipelined, per primitive dispatch cost)"
  (cd /tmp && timeout "${T_PROFILE:-150}" python3 "$REPO/benchmarks/decode_profile.py" --synthetic ${PROFILE_PRESET:-qwen3.6-35b-a3b} \
     --context ${PROFILE_CONTEXT:-4096} ${PROFILE_ARGS:-} --out "$W") > "$W/decode_profile.log" 2>&1
  grep -A12 "^decode step at context" "$W/decode_profile.log" | tee -a "$S"; snapshot
  # PROFILE_GPU=1: device-side figures in their own process, one CUDA graph per eval (so
  # MLX's dispatch does not wait for the spinning GPU: mlx_lily.bench.gpu_clock)
  if [ "${PROFILE_GPU:-0}" = "1" ]; then
    mkdir -p "$W/profile-gpu"
    say "== decode profile, device-side (one graph per eval)"
    (cd /tmp && MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=10000000 timeout "${T_PROFILE:-150}" \
       python3 "$REPO/benchmarks/decode_profile.py" --synthetic ${PROFILE_PRESET:-qwen3.6-35b-a3b} \
       --context ${PROFILE_CONTEXT:-4096} --gpu-only ${PROFILE_ARGS:-} --out "$W/profile-gpu") > "$W/profile-gpu/decode_profile.log" 2>&1
    grep -A12 "^decode step at context" "$W/profile-gpu/decode_profile.log" | tee -a "$S"; snapshot
  fi
  # PROFILE_ENVS="MLX_USE_CUDA_GRAPHS=0;MLX_MAX_OPS_PER_BUFFER=400": one more profile per
  # setting, each in its own process (MLX reads these once), into $W/profile-<n>/
  n=0
  IFS=';' read -ra envs <<< "${PROFILE_ENVS:-}"
  for e in "${envs[@]}"; do
    [ -z "$e" ] && continue
    n=$((n + 1)); mkdir -p "$W/profile-$n"; echo "$e" > "$W/profile-$n/env.txt"
    say "== decode profile with $e"
    (cd /tmp && env $e timeout "${T_PROFILE:-150}" python3 "$REPO/benchmarks/decode_profile.py" --synthetic ${PROFILE_PRESET:-qwen3.6-35b-a3b} \
       --context ${PROFILE_CONTEXT:-4096} --no-eager-arm --out "$W/profile-$n") > "$W/profile-$n/decode_profile.log" 2>&1
    tail -5 "$W/profile-$n/decode_profile.log" | tee -a "$S"; snapshot
  done
fi
# timeline: host phases vs the GPU's start/end of each pipelined decode step
# (decode_timeline.py; TL_ARGS passes options, TL_PRESET the model, T_TL caps each process,
# default 150 s). TL_ENVS="A=1;B=2 C=3": one process per setting after the default one
# (MLX reads its graph settings once), into $W/timeline-<n>/
if has timeline; then
  n=0
  IFS=';' read -ra tl_envs <<< ";${TL_ENVS:-}"
  for e in "${tl_envs[@]}"; do
    [ -n "$e" ] || [ $n -eq 0 ] || continue
    d="$W/timeline-$n"; mkdir -p "$d"; echo "${e:-default}" > "$d/env.txt"
    say "== decode timeline (${e:-default MLX settings})"
    (cd /tmp && env $e timeout "${T_TL:-150}" python3 "$REPO/benchmarks/gpu/decode_timeline.py" \
       --synthetic ${TL_PRESET:-qwen3.6-35b-a3b} ${TL_ARGS:-} --out "$d") > "$d/decode_timeline.log" 2>&1
    awk '/^decode timeline at/{f=1} f&&/^\[mlx_lily/{exit} f' "$d/decode_timeline.log" | tee -a "$S"
    tail -3 "$d/decode_timeline.log" | grep -i "error\|Traceback" | tee -a "$S"
    snapshot
    n=$((n + 1))
  done
fi
# ktimes: per-kernel GPU time of decode steps under Nsight Compute (kernel_times.py;
# KT_ARGS passes options, e.g. "--context 32768 --arms lily": split on blanks, quotes stay
# literal, so a --detail regex goes in KT_DETAIL instead, e.g. KT_DETAIL='norm_qgemv|down';
# with KT_DETAIL the run gives the sections of those launches INSTEAD of the time table)
if has ktimes; then
  say "== per-kernel GPU time (ncu)"
  mkdir -p "$W/ktimes"
  kt_detail=()
  [ -n "${KT_DETAIL:-}" ] && kt_detail=(--detail "$KT_DETAIL")
  (cd /tmp && timeout "${T_KT:-420}" python3 "$REPO/benchmarks/gpu/kernel_times.py" ${KT_ARGS:-} \
     ${kt_detail[@]+"${kt_detail[@]}"} --out "$W/ktimes") > "$W/ktimes/kernel_times.log" 2>&1
  head -70 "$W/ktimes/kernel_times.log" | tee -a "$S"; snapshot
fi
# jitsave: MLX's kernel caches (its default /tmp/mlx/<version>/ptx and the folder patch()
# points MLX_PTX_CACHE_DIR at) as 15 MiB parts under $OUT/jit/ for the next lease's jitload
if has jitsave; then
  mkdir -p "$OUTDIR/jit"
  dirs=$(for d in tmp/mlx "${HOME#/}/.cache/mlx-lily/cuda-kernels"; do [ -d "/$d" ] && echo "$d"; done)
  if [ -n "$dirs" ]; then
    tar czf /tmp/lily-jit.tgz -C / $dirs 2>/dev/null
    split -b 15m -d /tmp/lily-jit.tgz "$OUTDIR/jit/jit.tgz.part"
    say "jit cache saved: $(du -h /tmp/lily-jit.tgz | cut -f1) in $(ls "$OUTDIR/jit" | wc -l) part(s)"
  fi
fi
snapshot
