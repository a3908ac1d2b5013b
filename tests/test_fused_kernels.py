"""The fused elementwise kernels (model/fused_kernels.py) against the eager ops they replace:
the residual add + RMS norm, RoPE and SiLU(gate) * up, then a small model with the kernels
against the same model on eager ops.

What is bitwise: the residual sum x + a and RoPE, in every dtype (float32 RoPE too: the eager
addcmul is one fused multiply-add, on CPU and in CUDA's compiled kernel, and so is the
kernel's). What is close: the norm (the sum of squares is reduced in another order than the
library's), within one unit in the last place of a 16-bit output, and SiLU(gate) * up
(another exp: silu's one unit, carried through the product's rounding), within two; float32
outputs within a few units.

Without CUDA the kernels run under Triton's CPU interpreter; with CUDA, compiled, against the
eager ops on the same GPU."""

import collections

import pytest
import torch
import torch.nn.functional as F

from kvferry.model.rope import apply_rope
from triton_cpu import DEVICE, interpreter_fixture, load

interpreter_while_these_tests_run = interpreter_fixture()

pytestmark = pytest.mark.skipif((why := load("kvferry.model.fused_kernels")) is not None, reason=why or "")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# one unit in the last place, relative: 2^-7 (bf16), 2^-10 (f16); float32 allows a few units
# (2^-20: the norm's 1 / sqrt and the library's rsqrt are each a few units off on CUDA)
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -20}


def _fk():
    from kvferry.model import fused_kernels
    return fused_kernels


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _assert_within_ulp(out, ref, units=1):
    """Equal dtype and shape, and each value within `units` units in the last place of ref's
    dtype (relative to the larger of the two magnitudes; a tiny absolute floor for values near 0)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    o, r = out.float(), ref.float()
    bound = units * ULP[ref.dtype] * torch.maximum(o.abs(), r.abs()) + 1e-30
    bad = (o - r).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} values beyond {units} ulp, e.g. {o[bad][:4]} vs {r[bad][:4]}"


# -- residual add + RMS norm ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 576, 4096])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_add_rms_norm_matches_the_eager_add_and_norm(dtype, width, rows):
    x = _randn(rows, width, dtype=dtype, seed=1, scale=3.0)
    a = _randn(rows, width, dtype=dtype, seed=2)
    w = _randn(width, dtype=dtype, seed=3, scale=0.5) + 1
    x_new, h = _fk().add_rms_norm(x, a, w, 1e-5)
    ref_x = x + a
    assert torch.equal(x_new, ref_x), "the residual sum differs from eager x + a"
    _assert_within_ulp(h, F.rms_norm(ref_x, (width,), w, 1e-5))
    _assert_within_ulp(_fk().rms_norm(x, w, 1e-5), F.rms_norm(x, (width,), w, 1e-5))


def test_rms_norm_reads_rows_of_a_wider_tensor():
    """The head's norm of the last row (a view) and strided residual inputs."""
    wide = _randn(5, 96, dtype=torch.bfloat16, seed=4)
    x, a = wide[:, :64], wide[:, 32:]
    w = _randn(64, dtype=torch.bfloat16, seed=5) + 1
    x_new, h = _fk().add_rms_norm(x, a, w, 1e-6)
    assert torch.equal(x_new, x + a) and x_new.is_contiguous()
    _assert_within_ulp(h, F.rms_norm(x + a, (64,), w, 1e-6))
    _assert_within_ulp(_fk().rms_norm(wide[-1:, :64], w, 1e-6), F.rms_norm(wide[-1:, :64], (64,), w, 1e-6))


def test_a_wrong_eps_or_weight_is_caught():
    """Negative control: the one-ulp comparison sees a changed eps (on small rows, where eps
    matters) and a weight off by one unit."""
    x = _randn(3, 576, dtype=torch.float32, seed=6, scale=1e-3)
    w = _randn(576, dtype=torch.float32, seed=7) + 1
    ref = F.rms_norm(x, (576,), w, 1e-6)
    with pytest.raises(AssertionError, match="beyond 1 ulp"):
        _assert_within_ulp(_fk().rms_norm(x, w, 1e-5), ref)
    wb = _randn(576, dtype=torch.bfloat16, seed=7) + 1
    xb = x.to(torch.bfloat16)
    w_off = wb.clone()
    w_off[5] = (w_off[5].float() * (1 + 2 ** -6)).to(torch.bfloat16)  # two units up
    with pytest.raises(AssertionError, match="beyond 1 ulp"):
        _assert_within_ulp(_fk().rms_norm(xb, w_off, 1e-6), F.rms_norm(xb, (576,), wb, 1e-6))


# -- RoPE ---------------------------------------------------------------------------------------
def _tables(n, d, dtype, seed):
    """cos and signed sin as Rope.tables hands them over: rows of a longer table, (N, 1, D)."""
    from kvferry.model.rope import Rope
    rope = Rope(d, 10000.0, None, torch.device(DEVICE))
    pos = torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    cos, sin = rope.tables(pos, 4000, dtype)
    assert cos.shape == (n, 1, d)
    return cos, sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 96])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_rope_is_bitwise_the_eager_rope_on_a_view_of_the_projection(dtype, d, rows):
    """q and k as the model hands them over: the first heads of an (N, Hq + 2 Hkv, D)
    projection, so tokens are strided. Bitwise, float32 included: the eager op is
    bf16(x * cos) then addcmul's one fused multiply-add, and the kernel computes the same."""
    hq, hkv = 4, 2
    qkv = _randn(rows, hq + 2 * hkv, d, dtype=dtype, seed=8, scale=4.0)
    qk = qkv[:, :hq + hkv]
    assert qk.stride(0) == (hq + 2 * hkv) * d  # rows of the wider projection
    cos, sin = _tables(rows, d, dtype, 9)
    out = _fk().rope(qk, cos, sin)
    assert out.is_contiguous() and out.shape == qk.shape
    assert torch.equal(out, apply_rope(qk, cos, sin))


def test_rope_reads_any_head_stride():
    """qk_norm models hand RoPE a normed tensor; a transposed view has a head stride != D."""
    x = _randn(6, 3, 64, dtype=torch.bfloat16, seed=10).transpose(0, 1)  # (3, 6, 64)
    cos, sin = _tables(3, 64, torch.bfloat16, 11)
    assert torch.equal(_fk().rope(x, cos, sin), apply_rope(x, cos, sin))


def test_a_swapped_rope_half_is_caught():
    """Negative control: rotating by the wrong sign (the halves of sin swapped) differs."""
    x = _randn(3, 2, 64, dtype=torch.bfloat16, seed=12)
    cos, sin = _tables(3, 64, torch.bfloat16, 13)
    swapped = torch.cat([sin[..., 32:], sin[..., :32]], dim=-1)
    assert not torch.equal(_fk().rope(x, cos, swapped), apply_rope(x, cos, sin))


# -- SiLU(gate) * up ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 576, 4096])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_silu_mul_matches_the_eager_op(dtype, width, rows):
    gu = _randn(rows, 2 * width, dtype=dtype, seed=14, scale=3.0)
    gate, up = gu.chunk(2, dim=-1)
    out = _fk().silu_mul(gu)
    assert out.shape == (rows, width) and out.is_contiguous()
    # 16-bit: silu's one unit, carried through the product. float32: Triton's exp on CUDA is an
    # exp2 approximation whose relative error grows with |gate| (about |gate| * 2^-24)
    _assert_within_ulp(out, F.silu(gate) * up, units=8 if dtype == torch.float32 else 2)


def test_swapped_gate_and_up_are_caught():
    gu = _randn(3, 128, dtype=torch.bfloat16, seed=15, scale=3.0)
    gate, up = gu.chunk(2, dim=-1)
    with pytest.raises(AssertionError, match="beyond 2 ulp"):
        _assert_within_ulp(_fk().silu_mul(torch.cat([up, gate], dim=-1)), F.silu(gate) * up, units=2)


def test_empty_inputs_and_bad_shapes():
    fk = _fk()
    w = torch.ones(64, device=DEVICE)
    x = torch.empty(0, 64, device=DEVICE)
    assert fk.add_rms_norm(x, x, w, 1e-5)[1].shape == (0, 64)
    assert fk.silu_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)
    with pytest.raises(ValueError, match="w must be"):
        fk.rms_norm(torch.zeros(2, 64, device=DEVICE), torch.ones(32, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="contiguous last dim"):
        fk.rope(torch.zeros(2, 64, 4, device=DEVICE).transpose(1, 2), *_tables(2, 64, torch.float32, 0))
    with pytest.raises(ValueError, match="cos must be"):
        fk.rope(torch.zeros(2, 4, 64, device=DEVICE), *_tables(2, 64, torch.bfloat16, 0))


# -- a model --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_small_model_with_the_kernels_matches_its_eager_ops(arch):
    """A random 2-layer model in bfloat16: prefill and greedy decode with the fused kernels
    (forced on here; by default they run on CUDA only) against the eager ops: logits within
    bfloat16 rounding and the same tokens."""
    from kvferry.config import EngineConfig
    from kvferry.engine.generation import Engine
    from kvferry.model.arch import ModelConfig
    mc = ModelConfig(arch=arch, vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, intermediate_size=96, max_position=128, name="tiny (random)")
    eng = Engine(EngineConfig(device=DEVICE, dtype="bf16", ctx_size=64, ubatch=16, cuda_graphs=False),
                 random_model=mc, progress=False)
    g = torch.Generator().manual_seed(0)
    for name, w in eng.model.w.items():  # the norms' weights are ones: make them matter
        if "norm" in name:
            w.copy_((1 + 0.5 * torch.randn(w.shape, generator=g)).to(w.dtype))
    for name in ("embed", "lm_head"):  # larger logits: clear greedy choices
        if name in eng.model.w:
            eng.model.w[name].mul_(50)
    prompt = torch.randint(0, 256, (11,), generator=g).tolist()

    def run(kernels):
        eng.model.kernels = kernels
        eng.cache.reset(0)
        logits = [eng.prefill(0, prompt)]
        tokens = []
        for step in range(4):
            tokens.append(int(logits[-1].argmax()))
            logits.append(eng.decode([0], [tokens[-1]], [len(prompt) + step])[0])
        return torch.stack(logits), tokens

    calls = collections.Counter()

    class Counted:  # the kernels module, counting calls: proof that the fused path ran
        def __getattr__(self, name):
            f = getattr(_fk(), name)

            def counted(*args):
                calls[name] += 1
                return f(*args)
            return counted

    default = eng.model.kernels
    try:
        ref_logits, ref_tokens = run(None)
        logits, tokens = run(Counted())
    finally:
        eng.model.kernels = default
        eng.close()
    passes, layers = 5, mc.num_layers
    assert calls == dict(rms_norm=passes * (layers + 1), add_rms_norm=passes * layers,
                         silu_mul=passes * layers, rope=passes * layers * (2 if arch == "qwen3" else 1))
    assert tokens == ref_tokens
    scale = ref_logits.abs().max().item()
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0.02 * scale)
