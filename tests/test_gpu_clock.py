"""The device timer used by the GPU benchmarks (``mlx_lily.bench.gpu_clock``)."""
import mlx.core as mx
import pytest

from mlx_lily.bench import gpu_clock

on_cuda = pytest.mark.skipif(not gpu_clock.available(), reason="needs MLX's CUDA backend")


def test_refuses_off_cuda():
    if gpu_clock.available():
        pytest.skip("CUDA backend present")
    with pytest.raises(RuntimeError, match="CUDA"):
        gpu_clock.spin(mx.zeros((4,)), 1.0)
    with pytest.raises(RuntimeError, match="CUDA"):
        gpu_clock.spin_us(mx.zeros((4,)), mx.zeros((4,), mx.uint32))
    with pytest.raises(RuntimeError, match="CUDA"):
        gpu_clock.time_chain(lambda x: x + 1, mx.zeros((4,)))


@pytest.mark.gpu
@on_cuda
def test_spin_orders_and_waits():
    x = mx.arange(300, dtype=mx.float32)
    t_a = gpu_clock.stamp(x)
    y, t_b = gpu_clock.spin(t_a, 20.0)  # waits for the stamp, then spins 20 ms
    z, _ = gpu_clock.spin(x, 0.0)
    w, t_w = gpu_clock.spin_us(z, mx.zeros((4,), mx.uint32))  # after z, no wait
    mx.eval(y, t_b, z, w, t_w)
    assert mx.array_equal(w, x).item() and gpu_clock.ns(t_w) > 0
    assert gpu_clock.ns(t_b) - gpu_clock.ns(t_a) >= 20_000_000
    assert y.tolist() == t_a.tolist()
    assert mx.array_equal(z, x).item()


@pytest.mark.gpu
@on_cuda
def test_chain_time_grows_with_work():
    x = mx.zeros((1 << 20,), dtype=mx.float32)

    def work(n):
        def f(v):
            for _ in range(n):
                v = mx.sqrt(v * v + 1.0)
            return v
        return f

    small = gpu_clock.time_chain(work(2), x, spin_ms=50.0)
    big = gpu_clock.time_chain(work(200), x, spin_ms=50.0)
    # host_covered is not asserted: on the H200 MLX's dispatch waited for the
    # spinning GPU even for this short chain, so gpu_s is an upper bound there
    assert 0 < small["gpu_s"] < big["gpu_s"] < 0.05 + big["host_dispatch_s"]
