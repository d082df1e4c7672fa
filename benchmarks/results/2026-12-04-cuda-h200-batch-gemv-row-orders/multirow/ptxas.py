"""ptxas's registers and spills of the multi-row lily_qgemv of tree 1900bf3.

    git worktree add /tmp/t1900 1900bf3
    python3 ptxas.py /tmp/t1900 > ptxas.txt   # with tree 7471474 installed; nvcc on the PATH
"""
import sys
from pathlib import Path

import mlx.core as mx

from mlx_lily import kernels
from mlx_lily.testing import cuda_check as C

kernels.shader_path = lambda b, f, r=sys.argv[1]: Path(r) / "shaders" / b / f
bf = mx.bfloat16
head, body = kernels.cuda_parts("qgemv")
for k, o, rpw, nr in [(2048, 248320, 4, 1), (2048, 248320, 4, 2), (2048, 248320, 4, 8),
                      (2048, 248320, 2, 8), (2048, 248320, 1, 8), (4096, 2048, 2, 8)]:
    res = C.resources(
        "lily_qgemv", [("x", bf, 2), ("w", mx.uint32, 2), ("scales", bf, 2), ("biases", bf, 2)],
        [("y", bf)], body, head,
        template=[("T", bf), ("S", bf), ("K", k), ("O", o), ("BITS", 4), ("GS", 64),
                  ("NW", 4), ("RPW", rpw), ("NR", nr)])
    print(f"K={k} O={o} RPW={rpw} NR={nr}: {res}")
