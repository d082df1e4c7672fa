"""The CUDA kernel sources one Lily decode step hands MLX, as ``#include`` lines (the
default, ``MLX_LILY_CUDA_SOURCE=include``) and as whole texts (``inline``): bytes MLX
hashes per step in each form, and, where NVRTC can be loaded, whether every distinct
launch compiles to the same image both ways. Runs without a GPU: the production-dims
model (lazy weights, ``--layers`` of 40) on the CUDA path with kernels stubbed
(``build_time.py``'s model), one B = 1 decode step (and a ``--batch`` step) recorded with
``mlx_lily.cuda_cache.recording``.

    python benchmarks/source_forms.py --out DIR [--nvrtc /path/libnvrtc.so.13] [--arch 9.0] \
        [--include $CUDA_HOME/include/cccl]

Writes ``DIR/source_forms.json``: per kernel instantiation its launches per step and
rendered bytes in both forms, the per-step totals, and ``same_image`` per module pair
(None without NVRTC). Exits 1 when an include-form text does not expand to the inline
text, or any image differs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

_INCLUDE = re.compile(r'^#include "(/[^"]+)"\n', re.M)


def expand(text: str) -> str:
    """``text`` with each line ``#include "/abs/path"`` replaced by that file's text and the
    comment lines ``cuda_include_parts`` adds dropped: what NVRTC's preprocessor reads."""
    out = _INCLUDE.sub(lambda m: Path(m.group(1)).read_text(), text)
    return re.sub(r"^// [\w ]+\n", "", out, flags=re.M) if out != text else out


def record_step(layers: int, batch: int, kernel_set: str):
    """The ``Launch`` records of one decode step at ``batch`` rows after an 8-token
    prefill (``Launch`` objects, header / source as handed to MLX)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from build_time import _stubbed_lily
    from mlx_lily import cuda_cache

    with _stubbed_lily(layers, kernel_set) as model:
        cache = make_prompt_cache(model)
        model(mx.zeros((batch, 8), dtype=mx.int32), cache=cache)
        with cuda_cache.recording() as launches:
            model(mx.zeros((batch, 1), dtype=mx.int32), cache=cache)
    return list(launches)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--batch", type=int, default=0, help="also a decode step of this many rows")
    p.add_argument("--kernels", default=None,
                   help="MLX_LILY_KERNELS value (default: the shipped CUDA set + batch_decode)")
    p.add_argument("--nvrtc", default=None, help="libnvrtc.so to compile with (default: none)")
    p.add_argument("--arch", default="9.0", help="compute capability to compile for")
    p.add_argument("--include", action="append", default=[],
                   help="another NVRTC include folder (e.g. CUDA's include/cccl)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)

    os.environ["MLX_LILY_CUDA_SOURCE"] = "include"  # the form compared with the texts
    from mlx_lily import cuda_cache, kernels

    kset = a.kernels or ",".join(sorted(kernels.VERIFIED["cuda"])) + ",batch_decode"
    res = {"layers": a.layers, "kernels": kset, "cuda_source": os.environ["MLX_LILY_CUDA_SOURCE"],
           "steps": {}, "images": {}}
    ok = True
    pairs = {}
    for rows in [1] + ([a.batch] if a.batch > 1 else []):
        launches = record_step(a.layers, rows, kset)
        per = Counter()
        sizes = {}
        for ln in launches:
            inline = ln._replace(header=expand(ln.header), source=expand(ln.source))
            if (inline.header, inline.source) != kernels.cuda_parts(_stem(ln)):
                print(f"MISMATCH {ln.name}: its include lines do not expand to its texts")
                ok = False
            name = cuda_cache.kernel_name(ln)
            per[name] += 1
            src_inc, src_inl = cuda_cache.render(ln), cuda_cache.render(inline)
            sizes[name] = (len(src_inc.encode()), len(src_inl.encode()))
            pairs.setdefault(name, (src_inc, src_inl, "mlx::core::cu::" + name))
        tot_inc = sum(per[n] * sizes[n][0] for n in per)
        tot_inl = sum(per[n] * sizes[n][1] for n in per)
        res["steps"][f"b{rows}"] = {
            "launches": sum(per.values()), "bytes_include": tot_inc, "bytes_inline": tot_inl,
            "kernels": {n: {"launches": c, "bytes_include": sizes[n][0],
                            "bytes_inline": sizes[n][1]} for n, c in per.most_common()}}
        print(f"B = {rows}: {sum(per.values())} launches, {tot_inl / 1024:.1f} KiB of source "
              f"inline, {tot_inc / 1024:.1f} KiB as include lines")
    if a.nvrtc:
        nv = cuda_cache.Nvrtc(a.nvrtc)
        major, minor = (int(x) for x in a.arch.split("."))
        opts = cuda_cache.nvrtc_options((major, minor),
                                         cuda_cache.mlx_include_dirs() + a.include)
        hdr = {cuda_cache.SHIM_NAME: cuda_cache._SHIM}
        for name, (src_inc, src_inl, expr) in sorted(pairs.items()):
            img_inc, _ = nv.compile(src_inc, name, expr, opts, hdr)
            img_inl, _ = nv.compile(src_inl, name, expr, opts, hdr)
            same = img_inc == img_inl
            res["images"][name] = same
            ok &= same
            print(f"{'same' if same else 'DIFFERENT'} image: {name}")
    res["ok"] = ok
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "source_forms.json").write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


def _stem(ln) -> str:
    """The shader stem of an include-form launch (its folder is ``<stem>-<hash>``)."""
    m = _INCLUDE.search(ln.source)
    if m is None:
        raise ValueError(f"{ln.name}: no #include line in its body")
    return Path(m.group(1)).parent.name.rsplit("-", 1)[0]


if __name__ == "__main__":
    sys.exit(main())
