"""Whether the production builds of lily_moe_decode and lily_gdn_decode are unchanged by
the L2 prefetch hints (which only LILY_L2_PREFETCH / LILY_L2_PREFETCH_PROJ turn on): every
instantiation of a recorded B = 1 and B = 3 decode step (4 layers, stubbed kernels, inline
sources) rendered from this tree's texts and from OLD's, compiled with NVRTC for sm_90.
Prints one line per instantiation; exits 1 when any image differs or fails to compile.

    LD_LIBRARY_PATH=<nvrtc lib> CUDA_HOME=/usr/local/cuda-13.0 \
    python same_image.py OLD_COMMIT <nvrtc lib>/libnvrtc.so.13      (from the repository root)
"""
import os, sys, subprocess
os.environ["MLX_LILY_CUDA_SOURCE"] = "inline"
os.environ["MLX_LILY_CACHE_DIR"] = "/tmp/lilycache-same-image"
sys.path.insert(0, "benchmarks")
import mlx.core as mx
from source_forms import record_step
from mlx_lily import cuda_cache, kernels
OLD = sys.argv[1]
kset = ",".join(sorted(kernels.VERIFIED["cuda"])) + ",batch_decode"
def rec():
    out = {}
    for rows in (1, 3):
        for ln in record_step(4, rows, kset):
            if ln.name in ("lily_moe_decode", "lily_gdn_decode"):
                out[cuda_cache.kernel_name(ln)] = ln
    return out
new = rec()
real = kernels.shader_source
def old_source(kind, name):
    if kind == "cuda" and name in ("moe_decode.cu", "gdn_decode.cu"):
        import re
        text = subprocess.run(["git", "show", f"{OLD}:shaders/cuda/{name}"], capture_output=True, text=True, check=True).stdout
        helpers = ""
        for h in re.findall(r"^\s*//\s*@header\s+(\S+)", text, flags=re.M):
            t = subprocess.run(["git", "show", f"{OLD}:shaders/cuda/{h}"], capture_output=True, text=True, check=True).stdout
            helpers += t + ("" if t.endswith("\n") else "\n")
        return helpers + text
    return real(kind, name)
kernels.shader_source = old_source
for f in ("cuda_parts",):
    getattr(kernels, f).cache_clear() if hasattr(getattr(kernels, f), "cache_clear") else None
kernels._CACHE.clear(); kernels._LAUNCH_PARTS.clear(); kernels._INCLUDE_FILES.clear()
old = rec()
nv = cuda_cache.Nvrtc(sys.argv[2])
opts = cuda_cache.nvrtc_options((9, 0), cuda_cache.mlx_include_dirs() + ["/usr/local/cuda-13.0/include/cccl"])
hdr = {cuda_cache.SHIM_NAME: cuda_cache._SHIM}
bad = 0
for name, ln in new.items():
    o = old[name]
    assert ("l2_prefetch" in ln.header or "LILY_PREFETCH_L2" in ln.header) and "LILY_PREFETCH_L2" not in o.header, name
    try:
        a = nv.compile(cuda_cache.render(ln), name, "mlx::core::cu::" + name, opts, hdr)
    except Exception as e:
        print("NEW fails", name, str(e)[:300]); open("/tmp/new_fail.cu","w").write(cuda_cache.render(ln)); bad += 1; continue
    try:
        b = nv.compile(cuda_cache.render(o), name, "mlx::core::cu::" + name, opts, hdr)
    except Exception as e:
        print("OLD fails", name, str(e)[:300]); open("/tmp/old_fail.cu","w").write(cuda_cache.render(o)); bad += 1; continue
    same = a == b
    bad += not same
    print(("same image" if same else "DIFFERENT"), name, len(ln.source) + len(ln.header), len(o.source) + len(o.header))
sys.exit(1 if bad else 0)
