"""The Triton encode kernel for q8_0 / q4_0 rows against the eager encoding (quant.quantize),
byte for byte: on CPU under Triton's interpreter, on a GPU compiled (where the eager ops run
on the same device, so both sides round on CUDA)."""

import pytest
import torch

from kvferry.kv import quant
from triton_cpu import DEVICE, interpreter_fixture, load

interpreter_while_these_tests_run = interpreter_fixture()

pytestmark = pytest.mark.skipif((why := load("kvferry.kv.quant_kernels")) is not None, reason=why or "")


def _encode(k, v, kv_type):
    from kvferry.kv import quant_kernels
    return quant_kernels.encode(k, v, kv_type)


def _rows(n, h, d, dtype, seed):
    """Random rows with the cases that decide a rounding: all-zero blocks (with -0.0 first),
    ties in magnitude of opposite sign, exact halves, tiny values (f16 scales that underflow
    or go subnormal), large values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=g) * torch.logspace(-3, 2, n)[:, None, None]
    if n >= 6 and d >= 32:
        x[0, 0, :32] = 0.0
        x[0, 0, 0] = -0.0
        x[1, 0, :32] = torch.arange(32) % 5 - 2.0  # halves after scaling, +-2 ties
        x[2, 0, 3], x[2, 0, 20] = -7.0, 7.0  # same magnitude: the first one's sign wins (q4_0)
        x[3, 0, :32] = 1e-9 * torch.randn(32, generator=g)  # the f16 scale underflows
        x[4, 0, :32] = 5e-6 * torch.randn(32, generator=g)  # a subnormal f16 scale
        x[5, 0, :32] = 3e3 * torch.randn(32, generator=g)  # large, still finite in f16
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,h,d", [(8, 2, 64), (1, 8, 128), (7, 3, 96), (6, 1, 32)])
def test_kernel_encodes_the_bytes_of_the_eager_encoding(kv_type, dtype, n, h, d):
    k, v = _rows(n, h, d, dtype, 1), _rows(n, h, d, dtype, 2)
    kq, vq = _encode(k, v, kv_type)
    assert kq.shape == vq.shape == (n, h, quant.row_bytes(kv_type, d)) and kq.dtype == torch.uint8
    assert torch.equal(kq, quant.quantize(k, kv_type)), "K codes differ from the eager encoding"
    assert torch.equal(vq, quant.quantize(v, kv_type)), "V codes differ from the eager encoding"


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_kernel_reads_strided_views_of_one_projection(kv_type):
    """K and V as the model hands them over: views into one (N, Hq + 2 Hkv, D) projection."""
    n, hq, hkv, d = 5, 8, 2, 64
    qkv = _rows(n, hq + 2 * hkv, d, torch.bfloat16, 3)
    k, v = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    assert not k.is_contiguous()
    kq, vq = _encode(k, v, kv_type)
    assert torch.equal(kq, quant.quantize(k, kv_type)) and torch.equal(vq, quant.quantize(v, kv_type))


def test_a_changed_rounding_is_caught():
    """Negative control: the comparison above sees a one-bit change of one scale and of one code."""
    k = _rows(6, 1, 32, torch.float32, 4)
    kq, _ = _encode(k, k, "q8_0")
    ref = quant.quantize(k, "q8_0")
    for byte in (0, 32):  # a code, then the low byte of the first scale
        bad = kq.clone()
        bad[1, 0, byte] ^= 1
        assert not torch.equal(bad, ref)


def test_zero_rows_and_bad_shapes():
    k = torch.empty(0, 2, 64, device=DEVICE)
    kq, vq = _encode(k, k, "q4_0")
    assert kq.shape == (0, 2, quant.row_bytes("q4_0", 64))
    with pytest.raises(ValueError, match="q8_0 and q4_0"):
        _encode(k, k, "fp8")
    x = torch.zeros(2, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous last dim"):
        _encode(x.transpose(1, 2), x.transpose(1, 2), "q8_0")
