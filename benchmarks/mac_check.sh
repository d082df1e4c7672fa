#!/usr/bin/env bash
# Real-Mac validation: Metal parity tests on the GPU + the A/B benchmark, into one report.
# Usage (Apple Silicon, macOS 15+, after `pip install ".[test]"`):  bash benchmarks/mac_check.sh
#   MODEL=DIR to benchmark a checkpoint you have; LENGTHS=256,...,8192 to change the sweep.
set -uo pipefail
export MLX_LILY_KERNELS=${MLX_LILY_KERNELS:-all}  # every Metal kernel (none is on by default before this check)
cd "$(dirname "$0")/.."
report="mac-report-$(date +%Y%m%d-%H%M%S).txt"
{
  echo "# mlx-lily Mac report"; date; uname -a; sw_vers 2>/dev/null; sysctl -n machdep.cpu.brand_string 2>/dev/null
  python -c "import mlx.core as mx, mlx_lm, mlx_lily; print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, 'mlx-lily', mlx_lily.__version__); print(mx.device_info() if hasattr(mx,'device_info') else mx.metal.device_info()); print(mlx_lily.backend_info())"
  echo; echo "## Metal parity tests on the GPU"
  pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -40
  echo; echo "## Numerics on the trained fixture"
  python benchmarks/numerics.py tests/fixtures/qwen35moe-tiny-trained 2>&1 | tail -20
  echo; echo "## A/B benchmark"
  if [ -n "${MODEL:-}" ]; then src=("$MODEL"); else src=(--synthetic small); fi
  python benchmarks/ab.py "${src[@]}" --lengths "${LENGTHS:-256,1024,4096}" --out "mac-ab-results" 2>&1 | tail -40
} > "$report" 2>&1
echo "wrote $report (and mac-ab-results/): please share them"
