"""benchmarks/train_production_width.py: its training-only forms against mlx-lm's code (CPU)."""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pw():
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "train_production_width", REPO / "benchmarks" / "train_production_width.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_unit_lower_inverse_matches_numpy(pw):
    import mlx.core as mx

    rng = np.random.default_rng(0)
    C = 32
    for scale in (0.1, 1.0):  # 1.0: the all-ones-like case where powers of A grow binomially
        a = np.tril(scale * (1.0 + 0.1 * rng.normal(size=(3, C, C))), k=-1).astype(np.float32)
        got = np.array(pw.unit_lower_inverse(mx.array(a), C))
        want = np.linalg.inv(np.eye(C) + a.astype(np.float64))
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


def test_chunked_gdn_matches_ops_on_correlated_keys(pw):
    assert pw.check_chunked_matches_ops(32) <= 1e-4


def test_dense_moe_block_matches_switch_glu_values_and_gradients(pw):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_next

    assert pw.check_dense_moe_matches() <= 1e-5
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=1, intermediate_size=32,
        num_attention_heads=2, num_key_value_heads=1, linear_num_value_heads=2,
        linear_num_key_heads=1, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=3, decoder_sparse_step=1,
        shared_expert_intermediate_size=32, mlp_only_layers=[], moe_intermediate_size=32,
        rms_norm_eps=1e-6, vocab_size=64, rope_theta=1e4, partial_rotary_factor=0.25,
        max_position_embeddings=128, norm_topk_prob=True, head_dim=32)
    mx.random.seed(3)
    block = qwen3_next.Qwen3NextSparseMoeBlock(args)
    x = mx.random.normal((2, 33, 64), key=mx.random.key(9))
    stock = nn.value_and_grad(block, lambda m, x: (m(x) ** 2).sum())
    dense = nn.value_and_grad(block, lambda m, x: (pw.dense_moe_block(m, x) ** 2).sum())
    (v1, g1), (v2, g2) = stock(block, x), dense(block, x)
    assert abs(v1.item() - v2.item()) <= 1e-4 * abs(v1.item())
    g1, g2 = dict(tree_flatten(g1)), dict(tree_flatten(g2))
    assert g1.keys() == g2.keys()
    for name in g1:
        scale = max(mx.abs(g1[name]).max().item(), 1e-6)
        assert mx.abs(g1[name] - g2[name]).max().item() <= 1e-4 * scale, name


def test_lr_schedule(pw):
    assert pw.lr_at(0, 100, 1e-3, 10) == pytest.approx(2e-5)
    assert pw.lr_at(10, 100, 1e-3, 10) == pytest.approx(1e-3)
    assert pw.lr_at(100, 100, 1e-3, 10) == pytest.approx(5e-5)


def test_micro_batch_rule(pw):
    class FakeMx:
        gpu, cpu = "gpu", "cpu"

        def __init__(self, device, memory):
            self.device, self.memory = device, memory

        def default_device(self):
            return self.device

        def device_info(self):
            return dict(self.memory)

    metal = {"memory_size": 141 * 10**9}  # Metal's key
    cuda = {"total_memory": 81559 * 2**20, "free_memory": 80 * 10**9}  # MLX's CUDA build
    assert pw.resolve_micro_batch("auto", 4, FakeMx("gpu", metal)) == 4
    assert pw.resolve_micro_batch("auto", 4, FakeMx("gpu", {"memory_size": 64 * 10**9})) == 1
    assert pw.resolve_micro_batch("auto", 4, FakeMx("gpu", cuda)) == 1
    assert pw.resolve_micro_batch("auto", 4, FakeMx("gpu", {"total_memory": 150754820096})) == 4
    assert pw.resolve_micro_batch("auto", 4, FakeMx("gpu", {})) == 1  # size unknown
    assert pw.resolve_micro_batch("auto", 4, FakeMx("cpu", {})) == 4
    assert pw.resolve_micro_batch("2", 4, FakeMx("gpu", cuda)) == 2
    for bad in ("3", "0", "x"):
        with pytest.raises(SystemExit, match="--micro-batch"):
            pw.resolve_micro_batch(bad, 4, FakeMx("gpu", cuda))


def test_micro_batches_give_the_whole_batch_gradient(pw):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.out = nn.Linear(16, 32)

        def __call__(self, x):
            return self.out(nn.gelu(self.emb(x)))

    def loss_fn(model, x, y):
        ce = nn.losses.cross_entropy(model(x), y).mean()
        return ce, (ce, mx.array(0.0))

    mx.random.seed(1)
    model = Tiny()
    vg = nn.value_and_grad(model, loss_fn)
    x = mx.random.randint(0, 32, (4, 12))
    y = mx.random.randint(0, 32, (4, 12))
    (_, (ce_all, _)), g_all = vg(model, x, y)
    for rows in (1, 2):
        ce, aux, g = pw.accumulated_grads(vg, model, x, y, rows)
        assert abs(ce.item() - ce_all.item()) <= 1e-5 * abs(ce_all.item())
        a, b = dict(tree_flatten(g_all)), dict(tree_flatten(g))
        assert a.keys() == b.keys()
        for k in a:
            assert b[k].dtype == a[k].dtype
            assert mx.abs(a[k] - b[k]).max().item() <= 1e-5 * max(1e-6, mx.abs(a[k]).max().item())


def test_production_width_trains_a_fixed_step_count(pw):
    """The production-width recipe has one schedule on every GPU (``--steps auto`` fitted
    114 steps on an H200 and 89 on an H100 to one budget); ``--steps auto`` still fits."""
    assert pw.parse_args([]).steps == 100
    assert pw.parse_args(["--steps", "auto"]).steps == "auto"
    assert pw.parse_args(["--steps", "7"]).steps == 7
