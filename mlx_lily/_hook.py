"""Startup hook behind ``mlx_lm.generate ... --lily`` (loaded by ``mlx_lily_hook.pth``).

It runs in every Python process of the environment, so it imports nothing heavy, never
raises, and acts only when an mlx-lm entry point runs with ``--lily`` (or ``MLX_LILY=1``):
then it removes the flag from ``sys.argv`` and applies ``mlx_lily.patch()`` right after
the ``mlx_lm`` package (imported by every mlx-lm command) has loaded. It prints nothing
itself: the patch prints one status line when it prepares a model it serves.
"""

import os
import sys

FLAG = "--lily"
ENV = "MLX_LILY"


def _entry_point(argv0: str, orig: list) -> bool:
    name = os.path.basename(argv0 or "")
    if name.startswith("mlx_lm.") or name.startswith("mlx_lm-") or name == "mlx_lm":
        return True
    for i, a in enumerate(orig[:-1]):
        if a == "-m":
            mod = orig[i + 1]
            return mod == "mlx_lm" or mod.startswith("mlx_lm.")
    return False


class _PatchAfterMlxLm:
    """Meta-path finder: when the ``mlx_lm`` package finishes importing, patch mlx-lm."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "mlx_lm":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, _exec=exec_module):
                    _exec(module)
                    _apply()

                spec.loader.exec_module = exec_and_patch
                return spec
        return None


def _apply():
    try:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchAfterMlxLm)]
        import mlx_lily

        mlx_lily.patch(announce=True)
    except Exception as e:  # never break the user's command
        print(f"[mlx-lily] patch not applied ({type(e).__name__}: {e}); running stock mlx-lm",
              file=sys.stderr)


def _env_wants() -> bool:
    """``MLX_LILY=1`` (``mlx_lily.config.hook``, read only when the variable is set)."""
    if not os.environ.get(ENV):
        return False
    from mlx_lily import config

    return bool(config.hook)


def activate() -> bool:
    """Install the hook if this process is an mlx-lm command asking for Lily."""
    argv = sys.argv if isinstance(getattr(sys, "argv", None), list) else []
    orig = list(getattr(sys, "orig_argv", argv))
    if not _entry_point(argv[0] if argv else "", orig):
        return False
    if not (FLAG in argv or FLAG in orig or _env_wants()):
        return False
    while FLAG in argv:
        argv.remove(FLAG)
    if "mlx_lm" in sys.modules:
        _apply()
    else:
        sys.meta_path.insert(0, _PatchAfterMlxLm())
    return True


try:
    activate()
except Exception:
    pass
