"""Split-KV decode attention over KV codes: the split plan (plain Python), and the Triton
kernels against a float64 softmax reference on the dequantized values, for every KV type.

Without CUDA the kernels run under Triton's CPU interpreter; with CUDA, compiled, on the GPU
(Triton picks one of the two when the kernels are decorated, once per process)."""

import pytest
import torch

from kvferry.kv import quant
from kvferry.model.decode_attention import DecodeAttention, Tiling
from triton_cpu import DEVICE, interpreter_fixture, load

SMALL = Tiling(split_rows=64, block_n=32)  # several splits and tiles at CPU sizes


interpreter_while_these_tests_run = interpreter_fixture()

pytestmark = pytest.mark.skipif((why := load("kvferry.model.decode_kernels")) is not None, reason=why or "")


def _case(kv_type, dtype, num_seqs, hkv, group, head_dim, ctx, seed=0):
    """Codes for a cache of num_seqs sequences and q for one token each."""
    g = torch.Generator().manual_seed(seed)
    k = quant.quantize(torch.randn(num_seqs, ctx, hkv, head_dim, generator=g), kv_type)
    v = quant.quantize(torch.randn(num_seqs, ctx, hkv, head_dim, generator=g), kv_type)
    return k.to(DEVICE), v.to(DEVICE)


def _q(num_seqs, hkv, group, head_dim, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_seqs, hkv * group, head_dim, generator=g).to(dtype).to(DEVICE)


def _reference(q, k, v, kv_type, seq_ids, ends, scale=None):
    """float64 softmax attention over the values the kernel sees: codes dequantized to the
    compute dtype (so quantization error does not count) -> (out, mag), both (B, Hq * D);
    mag = sum_i p_i |v_i|, the scale of the error that rounding the weights p brings."""
    num_seqs, hq, d = q.shape
    hkv = k.shape[2]
    out, mag = [], []
    for b, (s, e) in enumerate(zip(seq_ids, ends)):
        kk = quant.dequantize(k[s, :e].cpu(), kv_type, d, q.dtype).double()  # (n, Hkv, D)
        vv = quant.dequantize(v[s, :e].cpu(), kv_type, d, q.dtype).double()
        qq = q[b].cpu().double().view(hkv, hq // hkv, d)
        w = (torch.einsum("hgd,nhd->hgn", qq, kk) * (scale or d ** -0.5)).softmax(-1)
        out.append(torch.einsum("hgn,nhd->hgd", w, vv).reshape(-1))
        mag.append(torch.einsum("hgn,nhd->hgd", w, vv.abs()).reshape(-1))
    return torch.stack(out), torch.stack(mag)


def _assert_close(out, reference, dtype):
    """float32: 1e-5 relative. 16-bit compute: 2e-3 absolute, plus what rounding to the
    compute dtype costs, as in any flash attention: the weights p before they multiply V
    (half an ulp of each, so at most half an ulp of sum p |v|) and the output (at most as much)."""
    ref, mag = reference
    out = out.cpu().double()
    if dtype == torch.float32:
        bound = 1e-5 * ref.abs().amax() + 1e-6
    else:
        bound = 2e-3 + mag * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10)
    err = (out - ref).abs()
    assert bool((err <= bound).all()), f"max error {err.max():.3g} (worst excess {(err - bound).max():.3g})"


def _run(att, q, k, v, seq_ids, ends, num_chunks):
    si, en = att.index_tensors(seq_ids, ends)
    att.layer(q, k, v, si, en, num_chunks)
    return att.merge(num_chunks, en).clone()


def _layer_case(kv_type, dtype, num_seqs=2, hkv=2, group=4, head_dim=64, chunk=128, ctx=300,
                seq_ids=None, ends=None, tiling=SMALL, seed=0):
    k, v = _case(kv_type, dtype, max(seq_ids or [num_seqs - 1]) + 1, hkv, group, head_dim, ctx, seed)
    q = _q(num_seqs, hkv, group, head_dim, dtype, seed + 1)
    seq_ids = seq_ids or list(range(num_seqs))
    ends = ends or [ctx - 3 * b for b in range(num_seqs)]
    num_chunks = -(-max(ends) // chunk)
    att = DecodeAttention(num_seqs, hkv, group, head_dim, kv_type, chunk, num_chunks, dtype, DEVICE, tiling=tiling)
    return att, q, k, v, seq_ids, ends, num_chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("kv_type", quant.KV_TYPES)
def test_every_kv_type_matches_the_reference_over_chunks_with_a_tail(kv_type, dtype):
    # ends 300 and 297 over chunks of 128: two full chunks and a tail of 44 / 41 rows
    att, q, k, v, seq_ids, ends, nc = _layer_case(kv_type, dtype, seq_ids=[2, 0])
    _assert_close(_run(att, q, k, v, seq_ids, ends, nc), _reference(q, k, v, kv_type, seq_ids, ends), dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_head_dims_and_gqa_groups(head_dim, group):
    kv_type = ("q4_0", "q8_0", "fp8")[group % 3]
    att, q, k, v, seq_ids, ends, nc = _layer_case(kv_type, torch.bfloat16, group=group, head_dim=head_dim,
                                                  chunk=64, ctx=150, ends=[150, 65])
    _assert_close(_run(att, q, k, v, seq_ids, ends, nc), _reference(q, k, v, kv_type, seq_ids, ends), torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 31, 32, 33])
@pytest.mark.parametrize("kv_type", ["bf16", "q4_0"])
def test_row_counts_around_tile_and_chunk_edges(rows, kv_type):
    # chunks of 32 rows, tiles of 16: 33 rows are a full chunk and one row of the next
    att, q, k, v, seq_ids, ends, nc = _layer_case(kv_type, torch.bfloat16, num_seqs=1, chunk=32, ctx=40,
                                                  ends=[rows], tiling=Tiling(split_rows=16, block_n=16))
    _assert_close(_run(att, q, k, v, seq_ids, ends, nc), _reference(q, k, v, kv_type, seq_ids, ends), torch.bfloat16)


@pytest.mark.parametrize("rows", [8191, 8192])
@pytest.mark.parametrize("kv_type", ["q4_0", "bf16"] if DEVICE == "cpu" else quant.KV_TYPES)
def test_a_full_chunk_of_8192_rows_with_the_default_tiling(rows, kv_type):
    hkv = 1 if DEVICE == "cpu" else 8
    att, q, k, v, seq_ids, ends, nc = _layer_case(kv_type, torch.bfloat16, num_seqs=1, hkv=hkv, head_dim=128,
                                                  chunk=8192, ctx=8192, ends=[rows], tiling=Tiling())
    assert att.num_splits == 32
    _assert_close(_run(att, q, k, v, seq_ids, ends, nc), _reference(q, k, v, kv_type, seq_ids, ends), torch.bfloat16)


def test_eight_sequences_of_different_lengths_in_any_cache_order():
    seq_ids = [5, 0, 9, 3, 7, 1, 8, 2]  # batch entry b reads cache sequence seq_ids[b]
    ends = [1, 200, 64, 65, 129, 33, 256, 7]
    att, q, k, v, seq_ids, ends, nc = _layer_case("q8_0", torch.bfloat16, num_seqs=8, hkv=1, chunk=64, ctx=256,
                                                  seq_ids=seq_ids, ends=ends)
    _assert_close(_run(att, q, k, v, seq_ids, ends, nc), _reference(q, k, v, "q8_0", seq_ids, ends), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kv_type", quant.KV_TYPES)
def test_one_row_gives_back_its_value_row_exactly(kv_type, dtype):
    # softmax over one row is 1: the output is V dequantized to the compute dtype, bit for bit,
    # so the kernel's dequantization and rounding are quant.dequantize's
    att, q, k, v, seq_ids, ends, nc = _layer_case(kv_type, dtype, num_seqs=2, chunk=64, ctx=8, ends=[1, 1])
    out = _run(att, q, k, v, seq_ids, ends, nc).cpu()
    # (Hkv, D) per sequence -> each of the G = 4 query heads of a kv head gets that head's row
    want = torch.stack([quant.dequantize(v[s, 0].cpu(), kv_type, 64, dtype)[:, None].expand(2, 4, 64).reshape(-1)
                        for s in seq_ids])
    if dtype == torch.float32 and q.device.type == "cuda":
        # float32 operands go through tensor cores as three tf32 products (tf32x3): within
        # about 1e-6 of float32, not bit for bit (seen on the H200)
        torch.testing.assert_close(out, want, rtol=4e-6, atol=1e-6)
    else:
        assert torch.equal(out, want)


def _ring_pass(att, q, k, v, seq_ids, ends, nc, poison):
    """The host ring's pattern: per chunk, each sequence's rows copied into a slot
    (B, slot_rows, H, row_bytes) at its batch index, the rest of the slot garbage."""
    _, en = att.index_tensors(seq_ids, ends)
    c = att.chunk_cap
    for i in range(nc):
        slot = torch.full((len(seq_ids), c, *k.shape[2:]), poison, dtype=torch.uint8, device=DEVICE)
        for j, (s, e) in enumerate(zip(seq_ids, ends)):
            n = min(c, e - i * c)
            if n > 0:
                slot[j, :n] = k[s, i * c:i * c + n]
        vslot = torch.full_like(slot, poison)
        for j, (s, e) in enumerate(zip(seq_ids, ends)):
            n = min(c, e - i * c)
            if n > 0:
                vslot[j, :n] = v[s, i * c:i * c + n]
        att.chunk(q, slot, vslot, i, en)
    return att.merge(nc, en).clone()


@pytest.mark.parametrize("kv_type", ["bf16", "q4_0", "fp8"])
def test_layer_launch_and_per_chunk_ring_launches_give_the_same_bits(kv_type):
    att, q, k, v, seq_ids, ends, nc = _layer_case(kv_type, torch.bfloat16, num_seqs=3, seq_ids=[1, 4, 0],
                                                  ends=[300, 129, 5])
    att.o_part.zero_()  # splits past a sequence's rows are never written: keep them comparable
    att.lse_part.zero_()
    a = _run(att, q, k, v, seq_ids, ends, nc)
    parts_a = att.o_part.clone(), att.lse_part.clone()
    b = _ring_pass(att, q, k, v, seq_ids, ends, nc, poison=0x7E)  # 0x7E: a large finite value in every type
    assert torch.equal(a, b)
    assert torch.equal(parts_a[0][:, :nc * att.num_splits], att.o_part[:, :nc * att.num_splits])
    assert torch.equal(parts_a[1][:, :nc * att.num_splits], att.lse_part[:, :nc * att.num_splits])


def test_a_launch_over_every_chunk_and_a_merge_of_every_part_give_the_same_bits():
    # what a CUDA graph replays whatever the step's rows: the grid and the merge sized for
    # the whole context; the splits past each sequence's rows write nothing, and the merge
    # stops at each sequence's last split (the unwritten parts hold NaN here)
    att, q, k, v, seq_ids, ends, nc = _layer_case("q8_0", torch.bfloat16, num_seqs=3, seq_ids=[1, 4, 0],
                                                  ends=[140, 129, 5])
    att = DecodeAttention(3, 2, 4, 64, "q8_0", 128, 5, torch.bfloat16, DEVICE, tiling=SMALL)
    assert nc == 2 and att.max_chunks == 5
    want = _run(att, q, k, v, seq_ids, ends, nc)
    att.o_part.fill_(float("nan"))
    att.lse_part.fill_(float("nan"))
    si, en = att.index_tensors(seq_ids, ends)
    att.layer(q, k, v, si, en, att.max_chunks)
    assert torch.equal(att.merge(att.max_chunks, en).clone(), want)
    # negative control: a merge told of more rows than were attended reads an unwritten part
    si, en2 = att.index_tensors(seq_ids, [300, 129, 5])
    assert not bool(att.merge(att.max_chunks, en2).isfinite().all())


def test_repeated_runs_are_bitwise_identical():
    att, q, k, v, seq_ids, ends, nc = _layer_case("q8_0", torch.bfloat16)
    first = _run(att, q, k, v, seq_ids, ends, nc)
    for _ in range(2):
        assert torch.equal(_run(att, q, k, v, seq_ids, ends, nc), first)


def test_poisoned_buffers_are_fully_overwritten():
    att, q, k, v, seq_ids, ends, nc = _layer_case("f16", torch.float16, ends=[300, 20])
    clean = _run(att, q, k, v, seq_ids, ends, nc)
    att.o_part.fill_(float("nan"))
    att.lse_part.fill_(float("inf"))
    att.out.fill_(float("nan"))
    again = _run(att, q, k, v, seq_ids, ends, nc)
    assert torch.equal(again, clean) and bool(again.isfinite().all())
    out = torch.full_like(clean, float("nan"))
    si, en = att.index_tensors(seq_ids, ends)
    att.layer(q, k, v, si, en, nc)
    assert torch.equal(att.merge(nc, en, out=out), clean)


def test_a_wrong_row_count_is_caught_by_the_comparison():
    # negative control: the kernel is told one row less than the reference reads
    att, q, k, v, seq_ids, ends, nc = _layer_case("bf16", torch.bfloat16, ends=[300, 200])
    out = _run(att, q, k, v, seq_ids, [299, 200], nc)
    with pytest.raises(AssertionError, match="max error"):
        _assert_close(out, _reference(q, k, v, "bf16", seq_ids, ends), torch.bfloat16)


def test_bad_inputs_raise_value_errors_that_say_what_to_change():
    mk = lambda **kw: DecodeAttention(**dict(dict(num_seqs=1, num_kv_heads=2, group=4, head_dim=64, kv_type="q8_0",
                                                  chunk_cap=64, max_chunks=2, dtype=torch.bfloat16,
                                                  device=DEVICE), **kw))
    with pytest.raises(ValueError, match="unknown KV type"):
        mk(kv_type="q5_1")
    with pytest.raises(ValueError, match="power of two"):
        mk(head_dim=96)
    with pytest.raises(ValueError, match="multiple of 32"):
        mk(head_dim=16)
    with pytest.raises(ValueError, match="compute dtype"):
        mk(dtype=torch.float64)
    att = mk()
    k, v = _case("q8_0", torch.bfloat16, 1, 2, 4, 64, 64)
    q = _q(1, 2, 4, 64, torch.bfloat16)
    si, en = att.index_tensors([0], [10])
    with pytest.raises(ValueError, match="q must be"):
        att.layer(q.float(), k, v, si, en, 1)
    with pytest.raises(ValueError, match="k and v must be"):
        att.layer(q, k[..., :-2], v[..., :-2], si, en, 1)
    with pytest.raises(ValueError, match="ends must be int32"):
        att.layer(q, k, v, si, en.long(), 1)
    with pytest.raises(ValueError, match="outside"):
        att.layer(q, k, v, si, en, 3)


def test_model_decode_with_the_kernel_is_placement_exact_and_close_to_the_chunk_path():
    """The model's decode through the kernel (forced on here: by default it is on for CUDA
    only): device-resident and host pipelined caches give bitwise equal logits, and the kernel
    path agrees with today's chunk path within float32 rounding."""
    from test_transport_gates import _engine, _prompts
    results, ids = {}, None
    for name, kv in {"device": {}, "host-kvpd1": dict(offload=True, depth=1)}.items():
        eng = _engine(kv)
        ids = ids or _prompts(eng, 1)[0][:40]
        eng.cache.reset(0)
        eng.prefill(0, ids)
        logits = []
        tok, pos = ids[-1], len(ids)
        for kernel in (False, True):
            eng.model.decode_kernel = kernel
            try:
                eng.cache.truncate(0, pos)
                logits.append(eng.decode([0], [tok], [pos])[0].clone())
            finally:
                eng.model.decode_kernel = False
        results[name] = logits
    chunk_path, kernel_path = zip(*results.values())
    assert torch.equal(kernel_path[0], kernel_path[1]), "the kernel's output depends on where the KV lives"
    assert torch.equal(chunk_path[0], chunk_path[1])
    torch.testing.assert_close(kernel_path[0], chunk_path[0], rtol=1e-4, atol=1e-4)
