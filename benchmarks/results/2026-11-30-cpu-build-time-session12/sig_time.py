"""Microseconds per ``WeightSig.valid()`` over the 40-layer Qwen3.6-35B-A3B decoder stack
(lazy weights): patched (the mutation count answers) and unpatched (the identity check).
Run from the repository root: python benchmarks/results/2026-11-30-cpu-build-time-session12/sig_time.py"""

import timeit

import mlx_lily
from mlx_lily import synth
from mlx_lily.patches import qwen3_next as nxt

model, _ = synth._lazy_model(synth._text_config(num_hidden_layers=40))
inner = model.model if hasattr(model, "model") else model.language_model.model
n = 20000
for patched in (False, True):
    with (mlx_lily.patched() if patched else mlx_lily.patching.contextlib.nullcontext()):
        sig = nxt.WeightSig(inner.norm, *inner.layers)
        assert sig.valid()
        us = timeit.timeit(sig.valid, number=n) / n * 1e6
    print(f"{'patched' if patched else 'unpatched'}: {len(sig._values)} entries, "
          f"{us:.2f} us per valid()")
