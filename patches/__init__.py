"""Per-model patch modules (installed as ``mlx_lily.patches``).

Each module exposes ``MODEL_TYPES`` (the mlx-lm ``model_type`` values it serves),
``targets()`` (``(owner, attribute, replacement)`` triples applied by ``mlx_lily.patch``)
and ``prepare(model)`` (one-time weight re-layouts for a loaded model). ``qwen3_next``'s
code is split by job into ``blocks``, ``stack``, ``decode_graph``, ``kv_growth``,
``projections``, ``launch_order`` and ``layouts`` (mlx-lm module layouts turned into the
plain arrays the ops take) (``qwen3_next`` re-exports their names).
"""

PATCH_MODULES = ("mlx_lily.patches.qwen3_next", "mlx_lily.patches.qwen3_5")
