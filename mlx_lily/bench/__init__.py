"""A/B throughput, numerics and primitive-count harnesses (stock mlx-lm vs mlx-lily)."""
