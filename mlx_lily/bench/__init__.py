"""A/B throughput, numerics and primitive-count harnesses (stock mlx-lm vs mlx-lily).

Modules (each imports MLX only when used):

- :mod:`mlx_lily.bench.ab` -- prefill / decode throughput sweeps, stock vs Lily, with a
  correctness gate; JSON + markdown + PNG outputs (console command ``mlx_lily.ab``).
- :mod:`mlx_lily.bench.numerics` -- teacher-forced perplexity, top-1 agreement, KL and
  logit differences of Lily against stock mlx-lm.
- :mod:`mlx_lily.bench.primitives` -- MLX primitives (graph nodes) per decode token.
"""

__all__ = ["ab", "numerics", "primitives"]
