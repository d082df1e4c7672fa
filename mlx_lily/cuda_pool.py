"""Keep freed GPU memory mapped in the CUDA driver's default memory pool between prefill
chunks (MLX's CUDA backend).

MLX 0.32's CUDA allocator (``backend/cuda/allocator.cpp``, read, not copied) takes device
memory with ``cudaMallocAsync`` from the device's default memory pool, and
``mx.clear_cache()`` hands every cached buffer back with ``cudaFreeAsync``. mlx-lm's
``generate_step`` calls ``mx.clear_cache()`` after every prefill chunk. The default pool's
release threshold is 0 bytes (CUDA driver API, ``CU_MEMPOOL_ATTR_RELEASE_THRESHOLD``), so
at the next synchronisation the driver unmaps all of it, and the next chunk maps it
again. On the H200 (session 13) that ``clear_cache()`` took 14-23 ms per 2048-token chunk
(~12% of a chunk). A release threshold of ``keep`` bytes lets the pool hold up to that much
freed memory for the next allocations. MLX's own figures (active, cache and peak memory)
do not change; while the process is idle, other processes can allocate up to ``keep``
bytes less than before.

``MLX_LILY_CUDA_POOL_KEEP_GB`` sets ``keep`` in GiB (default 16; ``0`` leaves the pool
alone); ``MLX_LILY_DISABLE=all`` leaves it alone too. ``patch()`` applies it, ``unpatch()``
puts the previous threshold back.
"""

from __future__ import annotations

import ctypes
import threading

POOL_ENV = "MLX_LILY_CUDA_POOL_KEEP_GB"
DEFAULT_KEEP_GB = 16.0
#: ``CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`` of ``cuda.h`` (value type ``cuuint64_t``).
_ATTR_RELEASE_THRESHOLD = 4


class Driver:
    """The four CUDA driver calls this module makes, through ``libcuda.so.1`` (ctypes).

    Every method raises ``RuntimeError`` with the driver's status on failure."""

    def __init__(self, lib):
        self._lib = lib

    @classmethod
    def load(cls) -> "Driver | None":
        """The driver library of this process, or None where there is none (no NVIDIA
        driver: Apple Silicon, CPU-only machines)."""
        try:
            return cls(ctypes.CDLL("libcuda.so.1"))
        except OSError:
            return None

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"mlx-lily: CUDA driver call {what} failed with status {status}")

    def default_pool(self, ordinal: int) -> int:
        """The handle of device ``ordinal``'s default memory pool."""
        self._check(self._lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(ordinal)),
                    "cuDeviceGet")
        pool = ctypes.c_void_p()
        self._check(self._lib.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev),
                    "cuDeviceGetDefaultMemPool")
        return int(pool.value or 0)

    def release_threshold(self, pool: int) -> int:
        """The pool's release threshold in bytes."""
        v = ctypes.c_uint64()
        self._check(self._lib.cuMemPoolGetAttribute(ctypes.c_void_p(pool),
                                                    ctypes.c_int(_ATTR_RELEASE_THRESHOLD),
                                                    ctypes.byref(v)), "cuMemPoolGetAttribute")
        return int(v.value)

    def set_release_threshold(self, pool: int, nbytes: int) -> None:
        """Set the pool's release threshold to ``nbytes``."""
        v = ctypes.c_uint64(nbytes)
        self._check(self._lib.cuMemPoolSetAttribute(ctypes.c_void_p(pool),
                                                    ctypes.c_int(_ATTR_RELEASE_THRESHOLD),
                                                    ctypes.byref(v)), "cuMemPoolSetAttribute")


_LOCK = threading.Lock()
_APPLIED: dict = {}  # "pool", "before", "set": what apply() changed, for restore()


def keep_bytes() -> int:
    """Bytes the pool may keep (``MLX_LILY_CUDA_POOL_KEEP_GB``, GiB, default 16).

    Raises:
        ValueError: the variable is not a non-negative number.
    """
    from .backend import env_value

    raw = env_value(POOL_ENV, "").strip()
    if not raw:
        return int(DEFAULT_KEEP_GB * 2**30)
    try:
        gb = float(raw)
    except ValueError:
        gb = -1.0
    if not gb >= 0.0 or gb == float("inf"):
        raise ValueError(f"{POOL_ENV}={raw!r}: expected a number of GiB >= 0 (0 leaves the "
                         "CUDA memory pool as MLX set it)")
    return int(gb * 2**30)


def apply(driver: Driver | None = None, ordinal: int = 0) -> int | None:
    """Raise device ``ordinal``'s default-pool release threshold to ``keep_bytes()`` when
    MLX runs on its CUDA backend (never lowers it).

    Args:
        driver: the driver calls (tests pass a stand-in); default ``Driver.load()``.
        ordinal: the CUDA device (MLX uses device 0 unless told otherwise).
    Returns:
        The threshold now set in bytes, or None when nothing changed (not CUDA, switched
        off, no driver, a driver call failed, or the threshold was already as high).
    Raises:
        ValueError: a malformed ``MLX_LILY_CUDA_POOL_KEEP_GB``.
    """
    from . import backend

    keep = keep_bytes()
    if keep == 0 or "all" in backend.disabled_ops():
        return None
    if driver is None:
        if backend.current_backend() != "cuda":
            return None
        driver = Driver.load()
        if driver is None:
            return None
    with _LOCK:
        if _APPLIED:
            return _APPLIED["set"]
        try:
            pool = driver.default_pool(ordinal)
            before = driver.release_threshold(pool)
            if before >= keep:
                return None
            driver.set_release_threshold(pool, keep)
        except RuntimeError:
            return None
        _APPLIED.update(pool=pool, before=before, set=keep, driver=driver)
        return keep


def restore() -> bool:
    """Put back the threshold ``apply()`` replaced, unless someone changed it since.

    Returns:
        True when the previous threshold was restored."""
    with _LOCK:
        if not _APPLIED:
            return False
        a = dict(_APPLIED)
        _APPLIED.clear()
        try:
            if a["driver"].release_threshold(a["pool"]) != a["set"]:
                return False
            a["driver"].set_release_threshold(a["pool"], a["before"])
        except RuntimeError:
            return False
        return True


def applied() -> int | None:
    """The threshold ``apply()`` set (bytes), or None."""
    return _APPLIED.get("set")
