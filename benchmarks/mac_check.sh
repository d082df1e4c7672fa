#!/usr/bin/env bash
# The Mac check, one command: qualification of every Lily kernel on this GPU, the A/B
# correctness gate and a short A/B (stock mlx-lm vs Lily) with the qualified set and with
# every kernel on, the Metal parity tests and the trained fixture's numerics; the whole
# log is kept and one shareable report written.
#
# Usage (Apple Silicon, macOS 15+, from a checkout after `pip install ".[test]"`):
#   bash benchmarks/mac_check.sh
#   MODEL=DIR bash benchmarks/mac_check.sh       # your checkpoint instead of the synthetic one
# Settings: PRESET (synthetic preset, default qwen3.6-35b-a3b: its first 4 layers for
# qualification, the `small` preset for the A/B unless MODEL is set), LENGTHS (A/B prompt
# lengths, default 256,1024), QUALIFY_TIMEOUT_S (default 900), SKIP_TESTS=1 (no pytest).
# Output: mac-check-<date>/ with report.md (share this), log.txt (everything),
# qualify.json/.md, ab-qualified/ and ab-all/ (ab.json, ab.md).
set -uo pipefail
cd "$(dirname "$0")/.."
out="mac-check-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"
log="$out/log.txt"
report="$out/report.md"
PY=${PYTHON:-python}
PRESET=${PRESET:-qwen3.6-35b-a3b}
LENGTHS=${LENGTHS:-256,1024}
if [ -n "${MODEL:-}" ]; then qsrc=(--model "$MODEL"); absrc=("$MODEL"); else
  qsrc=(--synthetic "$PRESET"); absrc=(--synthetic small); fi
codes="$out/exit-codes.txt"
: > "$codes"

step() {  # step NAME CMD...: run CMD with its output in the log (and on the terminal)
  local name=$1; shift
  echo; echo "## $name: $*"
  "$@"
  local rc=$?
  echo "$name=$rc" >> "$codes"
  echo "## $name: exit $rc"
}

section() {  # section NAME: the output of step NAME in the log
  awk -v n="$1" '$0 == "## " n ": exit" || index($0, "## " n ": exit ") == 1 {f = 0}
                 f {print}
                 index($0, "## " n ": ") == 1 && index($0, "## " n ": exit") != 1 {f = 1}' "$log"
}

{
  echo "# mlx-lily Mac check, $(date)"
  uname -a; sw_vers 2>/dev/null; sysctl -n machdep.cpu.brand_string 2>/dev/null
  $PY -c "import mlx.core as mx, mlx_lm, mlx_lily; print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, 'mlx-lily', mlx_lily.__version__); print(mx.device_info())"
  # a fresh qualification: the record of an earlier run is replaced
  step qualify $PY -m mlx_lily.qualify "${qsrc[@]}" --timeout-s "${QUALIFY_TIMEOUT_S:-900}" --report --out "$out"
  step backend_info $PY -c "import mlx_lily, json; mlx_lily.patch(); print(json.dumps(mlx_lily.backend_info(), indent=1))"
  # the gate and a short A/B with what qualified (MLX_LILY_KERNELS=verified reads the record)
  step ab_qualified env MLX_LILY_KERNELS=verified $PY benchmarks/ab.py "${absrc[@]}" --lengths "$LENGTHS" --out "$out/ab-qualified"
  # the same with every Metal kernel on (what qualification may have turned down)
  step ab_all env MLX_LILY_KERNELS=all $PY benchmarks/ab.py "${absrc[@]}" --lengths "$LENGTHS" --out "$out/ab-all"
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    step gpu_tests env MLX_LILY_KERNELS=all $PY -m pytest -m gpu -q -p no:cacheprovider
    step numerics env MLX_LILY_KERNELS=all $PY benchmarks/numerics.py tests/fixtures/qwen35moe-tiny-trained
  fi
} 2>&1 | tee "$log"

{
  echo "# mlx-lily Mac check report"
  echo
  echo "Created $(date); source: ${MODEL:-synthetic $PRESET (qualification) / small (A/B)}."
  echo
  echo '```'
  awk 'NR > 1 && /^$/ {exit} NR > 1 {print}' "$log"
  echo '```'
  echo
  echo "Exit codes: $(tr '\n' ' ' < "$codes")"
  echo
  if [ -f "$out/qualify.md" ]; then cat "$out/qualify.md"; else
    echo "No qualification report; the end of its output:"; echo; echo '```'; section qualify | tail -15; echo '```'; fi
  for arm in qualified all; do
    echo; echo "## A/B with MLX_LILY_KERNELS=$( [ $arm = qualified ] && echo verified || echo all )"; echo
    if [ -f "$out/ab-$arm/ab.md" ]; then cat "$out/ab-$arm/ab.md"; else
      echo '```'; section "ab_$arm" | tail -12; echo '```'; fi
  done
  echo; echo "## backend_info after qualification"; echo
  echo '```'; section backend_info; echo '```'
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    echo; echo "## Metal parity tests on the GPU (tail)"; echo
    echo '```'; section gpu_tests | tail -25; echo '```'
    echo; echo "## Numerics on the trained fixture (tail)"; echo
    echo '```'; section numerics | tail -15; echo '```'
  fi
} > "$report"
echo
echo "wrote $report (share it) and the whole log $log"
