"""mlx_lily.cuda_pool: the CUDA memory pool's release threshold raised by patch() and put
back by unpatch() (driver stand-in here; the real driver under -m gpu on CUDA)."""
import pytest

from mlx_lily import backend, cuda_pool, patching

GIB = 2**30


class FakeDriver:
    def __init__(self, before=0, fail=None):
        self.threshold = {7: before}
        self.fail = fail
        self.sets = []

    def default_pool(self, ordinal):
        if self.fail == "pool":
            raise RuntimeError("cuDeviceGetDefaultMemPool failed with status 100")
        assert ordinal == 0
        return 7

    def release_threshold(self, pool):
        return self.threshold[pool]

    def set_release_threshold(self, pool, nbytes):
        if self.fail == "set":
            raise RuntimeError("cuMemPoolSetAttribute failed with status 1")
        self.sets.append(nbytes)
        self.threshold[pool] = nbytes


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(cuda_pool.POOL_ENV, raising=False)
    monkeypatch.delenv(backend.DISABLE_ENV, raising=False)
    cuda_pool._APPLIED.clear()
    yield
    cuda_pool._APPLIED.clear()


def test_apply_raises_threshold_once_and_restore_puts_it_back():
    d = FakeDriver(before=0)
    assert cuda_pool.apply(d) == 16 * GIB
    assert d.threshold[7] == 16 * GIB and cuda_pool.applied() == 16 * GIB
    assert cuda_pool.apply(d) == 16 * GIB and d.sets == [16 * GIB]  # idempotent
    assert cuda_pool.restore() is True
    assert d.threshold[7] == 0 and cuda_pool.applied() is None
    assert cuda_pool.restore() is False


def test_keep_from_env_and_switches(monkeypatch):
    d = FakeDriver()
    monkeypatch.setenv(cuda_pool.POOL_ENV, "2.5")
    assert cuda_pool.apply(d) == int(2.5 * GIB) and d.threshold[7] == int(2.5 * GIB)
    cuda_pool.restore()
    monkeypatch.setenv(cuda_pool.POOL_ENV, "0")
    assert cuda_pool.apply(d) is None and d.threshold[7] == 0
    monkeypatch.delenv(cuda_pool.POOL_ENV)
    monkeypatch.setenv(backend.DISABLE_ENV, "all")
    assert cuda_pool.apply(d) is None and d.threshold[7] == 0
    for bad in ("lots", "-1", "nan", "inf"):
        monkeypatch.setenv(cuda_pool.POOL_ENV, bad)
        with pytest.raises(ValueError, match=cuda_pool.POOL_ENV):
            cuda_pool.keep_bytes()


def test_never_lowers_and_driver_failures_change_nothing():
    high = FakeDriver(before=64 * GIB)
    assert cuda_pool.apply(high) is None and high.threshold[7] == 64 * GIB
    assert cuda_pool.restore() is False
    for fail in ("pool", "set"):
        d = FakeDriver(fail=fail)
        assert cuda_pool.apply(d) is None
        assert d.threshold[7] == 0 and cuda_pool.applied() is None


def test_restore_leaves_a_threshold_someone_else_changed():
    d = FakeDriver()
    cuda_pool.apply(d)
    d.threshold[7] = 3 * GIB
    assert cuda_pool.restore() is False and d.threshold[7] == 3 * GIB


def test_off_cuda_nothing_happens():
    if backend.current_backend() == "cuda":
        pytest.skip("this machine runs MLX's CUDA backend")
    assert cuda_pool.apply() is None and cuda_pool.applied() is None


def test_patch_applies_and_unpatch_restores(monkeypatch):
    d = FakeDriver()
    monkeypatch.setattr(cuda_pool.Driver, "load", classmethod(lambda cls: d))
    monkeypatch.setattr(backend, "current_backend", lambda: "cuda")
    assert not patching.is_patched()
    patching.patch()
    try:
        assert d.threshold[7] == 16 * GIB
        assert "pool_keep=16GiB" in backend.describe()
        patching.patch()  # idempotent
        assert d.sets == [16 * GIB]
    finally:
        patching.unpatch()
    assert d.threshold[7] == 0


def test_patch_rejects_a_malformed_keep(monkeypatch):
    import os

    monkeypatch.setenv(cuda_pool.POOL_ENV, "16GB")
    before = os.environ.get("MLX_PTX_CACHE_DIR")
    with pytest.raises(ValueError, match="MLX_LILY_CUDA_POOL_KEEP_GB='16GB'"):
        patching.patch()
    assert not patching.is_patched()
    assert os.environ.get("MLX_PTX_CACHE_DIR") == before


@pytest.mark.gpu
@pytest.mark.skipif(backend.current_backend() != "cuda", reason="needs MLX's CUDA backend")
def test_real_driver_pool_threshold():
    d = cuda_pool.Driver.load()
    assert d is not None
    pool = d.default_pool(0)
    before = d.release_threshold(pool)
    try:
        set_to = cuda_pool.apply()
        now = d.release_threshold(pool)
        assert now == max(before, 16 * GIB)
        assert set_to == (16 * GIB if before < 16 * GIB else None)
    finally:
        cuda_pool.restore()
    assert d.release_threshold(pool) == before
