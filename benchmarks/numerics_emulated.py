"""Numerics of the Metal kernels on a machine without a GPU: the trained fixture's
teacher-forced logits with every Lily dispatcher on the Metal kernel path served by the
CPU emulator (``mlx_lily.testing.dispatch.emulated_metal``), against stock mlx-lm (CPU)
and against an fp32 evaluation of the same weights (stock code, every float parameter in
fp32), with all ops and with each listed op alone.

    python benchmarks/numerics_emulated.py tests/fixtures/qwen35moe-tiny-trained \\
        --ops gated_delta,attention --out DIR

The harness's targets (``mlx_lily.bench.numerics.TARGETS``) compare Lily with stock; the
fp32 rows show how far stock's own bf16 rounding sits from fp32, the scale against which
a kernel that rounds differently from stock can be judged. Writes DIR/numerics_emulated.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KEYS = ("ppl_rel_diff", "top1_agreement", "kl_stock_lily_mean", "max_abs_logit_diff")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("model", help="MLX checkpoint directory (the trained fixture)")
    p.add_argument("--ops", default="", help="comma list: also run each of these ops alone")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)

    from mlx_lily.bench.ab import arm_context, load_target
    from mlx_lily.bench.numerics import (compare_logits, engine_logits, fp32_engine_logits,
                                         reference_ids)
    from mlx_lily.testing.dispatch import emulated_metal

    t = load_target(a.model, None, 0)
    ids, source = reference_ids(t)
    with arm_context("stock", t.model, None):
        stock = engine_logits(t.model, ids)
        fp32 = fp32_engine_logits(t.model, ids)
    rows = {"stock vs fp32": compare_logits(fp32, stock, ids)}
    for ops in [None] + [[o] for o in a.ops.split(",") if o]:
        with emulated_metal(), arm_context("lily", t.model, ops):
            lily = engine_logits(t.model, ids)
        name = "all ops" if ops is None else ops[0]
        rows[f"lily[{name}] vs stock"] = compare_logits(stock, lily, ids)
        rows[f"lily[{name}] vs fp32"] = compare_logits(fp32, lily, ids)
    print(f"{len(ids)} positions ({source})")
    print(f"{'comparison':32s}{'ppl rel diff':>14s}{'top-1 agree':>13s}{'mean KL':>11s}")
    for name, m in rows.items():
        print(f"{name:32s}{m['ppl_rel_diff'] * 100:+13.4f}%{m['top1_agreement'] * 100:12.2f}%"
              f"{m['kl_stock_lily_mean']:11.2e}")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        out = {"model": a.model, "positions": len(ids), "ids_source": source,
               "rows": {k: {kk: m[kk] for kk in KEYS if kk in m} for k, m in rows.items()}}
        (a.out / "numerics_emulated.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
