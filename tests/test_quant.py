"""KV row encodings: error bounds per type, gguf's reference quantizer agrees, and every
KV type is byte-identical across placements."""

import numpy as np
import pytest
import torch

from kvferry.kv import quant

D = 128


def _rows(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, D, generator=g) * 3.0


@pytest.mark.parametrize("kv_type,rel", [("f32", 0), ("f16", 1e-3), ("bf16", 8e-3), ("q8_0", 1 / 127), ("q4_0", 1 / 7),
                                         ("fp8", 0.07)])
def test_round_trip_error_is_within_the_type_step(kv_type, rel):
    x = _rows()
    b = quant.quantize(x, kv_type)
    assert b.dtype == torch.uint8 and b.shape == (*x.shape[:-1], quant.row_bytes(kv_type, D))
    y = quant.dequantize(b, kv_type, D, torch.float32)
    # per block of 32: error <= rel * block max magnitude (plus rounding slack)
    err = (y - x).abs().reshape(*x.shape[:-1], D // 32, 32).amax(-1)
    peak = x.abs().reshape(*x.shape[:-1], D // 32, 32).amax(-1)
    assert bool((err <= rel * peak * 1.01 + 1e-6).all()), f"{kv_type}: max rel err {(err / peak).max()}"


def test_q8_0_and_q4_0_agree_with_the_gguf_reference_quantizer():
    gguf = pytest.importorskip("gguf")
    x = _rows(8)
    flat = x.reshape(-1, D).numpy().astype(np.float32)
    for kv_type, qt in (("q8_0", gguf.GGMLQuantizationType.Q8_0), ("q4_0", gguf.GGMLQuantizationType.Q4_0)):
        ref = gguf.quants.dequantize(gguf.quants.quantize(flat, qt), qt)
        ours = quant.dequantize(quant.quantize(torch.from_numpy(flat), kv_type), kv_type, D, torch.float32).numpy()
        # same scales; codes may differ by one step where the two round a tie differently
        step = np.abs(flat).reshape(-1, D // 32, 32).max(-1, keepdims=True) / (127 if kv_type == "q8_0" else 8)
        diff = np.abs(ours - ref).reshape(-1, D // 32, 32)
        assert (diff <= step * 1.01 + 1e-6).all()
        assert (diff < 1e-6).mean() > 0.99, f"{kv_type}: most values must match the reference exactly"


def test_rows_of_zeros_stay_zero():
    z = torch.zeros(3, 2, D)
    for t in quant.KV_TYPES:
        assert torch.equal(quant.dequantize(quant.quantize(z, t), t, D, torch.float32), z), t


@pytest.mark.parametrize("kv_type", ["q4_0", "fp8", "f16"])
def test_every_kv_type_is_byte_identical_across_placements(kv_type):
    from test_transport_gates import PLACEMENTS, _assert_same, _engine, _prompts, _run
    prompts, results = None, {}
    for name in ("device", "host-ordered", "host-kvpd1"):
        eng = _engine(PLACEMENTS[name], kv_type=kv_type)
        prompts = prompts or _prompts(eng, 1)
        results[name] = _run(eng, prompts, 24)
    _assert_same(results)


def test_auto_chunk_rows_hold_the_same_bytes_for_every_kv_type():
    """--kv-chunk auto: 8192 rows of bf16 at head dim 128, and about as many bytes per chunk
    (within a factor sqrt(2), the nearest power of two) for every type and head dim."""
    assert quant.chunk_rows("bf16", 128) == 8192
    assert quant.chunk_rows("q4_0", 128) == 32768 and quant.chunk_rows("f32", 128) == 4096
    assert quant.chunk_rows("bf16", 128, 24) == 24, "an explicit --kv-chunk is kept"
    for t in quant.KV_TYPES:
        for d in (64, 128, 256):
            rows = quant.chunk_rows(t, d)
            assert rows & (rows - 1) == 0
            ratio = rows * quant.row_bytes(t, d) / quant.CHUNK_HEAD_BYTES
            assert 2 ** -0.5 <= ratio <= 2 ** 0.5, (t, d, rows)
