"""mlx-lily ops: one module per fused boundary.

Each module defines a pure-MLX ``*_reference`` (the contract; runs on any backend),
kernel factories that return None off their backend, and a dispatcher that picks the
kernel, the reference, or (kill switch) signals the caller to run stock mlx-lm code.
"""

from __future__ import annotations

from .. import registry

#: ``{op: "mlx_lily.ops.<module>[:<status function>]"}``, from ``mlx_lily.registry.OPS``.
_MODULES = registry.status_functions()


def kernel_status(name: str, backend: str) -> bool:
    """True when op ``name`` has a custom kernel that can serve on ``backend`` now (the op
    module's own answer: ``registry.kernel_serves``)."""
    return registry.kernel_serves(name, backend)
