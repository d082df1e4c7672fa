"""Test helpers for mlx-lily kernels (imported lazily; nothing heavy at import time).

* :mod:`mlx_lily.testing.metal_emu`: a CPU emulator of ``mx.fast.metal_kernel``
  (clang from the ``ziglang`` package + fibers), so Metal kernel bodies run in
  Linux CI; ``metal_emu.install()`` swaps it in for ``mx.fast.metal_kernel``.
* :mod:`mlx_lily.testing.msl_lint`: ``clang -fsyntax-only`` of Metal kernel
  bodies with Metal address spaces typed as distinct clang address spaces, plus
  MSL language restrictions; defines the ``shaders/metal/*.metal`` directive
  convention (``parse_body_file``).
* :mod:`mlx_lily.testing.backends`: ``parity_backends()`` ("reference",
  "metal-emu", "metal", "cuda" where each really runs) and
  ``metal_kernel_factory(backend)`` for op parity tests.
* :mod:`mlx_lily.testing.cuda_check`: offline nvcc compile check of CUDA bodies.
"""
