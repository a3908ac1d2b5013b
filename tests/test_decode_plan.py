"""The split plan of split-KV decode attention, in plain Python (no Triton): which rows each
kernel program reads, and that the grid depends only on shapes."""

import pytest

from kvferry.model.decode_attention import Tiling, num_splits, parts_with_rows, split_range


@pytest.mark.parametrize("chunk_cap,split_rows", [(8192, 256), (100, 32), (64, 64), (1, 256)])
def test_splits_cover_each_row_once_and_depend_only_on_the_chunk_capacity(chunk_cap, split_rows):
    splits = num_splits(chunk_cap, split_rows)
    assert splits == -(-chunk_cap // split_rows)
    for end in (1, chunk_cap - 1, chunk_cap, chunk_cap + 1, 3 * chunk_cap + 7):
        chunks = -(-end // chunk_cap)
        seen = [r for c in range(chunks) for s in range(splits) for r in split_range(end, c, s, chunk_cap, split_rows)]
        assert seen == list(range(end)), f"end {end}: rows read {len(seen)}, in order once each"
        for c in range(chunks):
            for s in range(splits):
                rows = split_range(end, c, s, chunk_cap, split_rows)
                assert len(rows) <= split_rows and (not rows or rows.start == c * chunk_cap + s * split_rows)
        # a chunk past the sequence's rows still has its programs, each with no rows
        assert all(not split_range(end, chunks, s, chunk_cap, split_rows) for s in range(splits))


@pytest.mark.parametrize("chunk_cap,split_rows", [(8192, 256), (100, 32), (64, 64), (1, 256), (4128, 256)])
def test_the_partials_with_rows_are_the_first_ones_and_the_merge_counts_them(chunk_cap, split_rows):
    # what lets the merge stop at a sequence's own last split, and a CUDA graph launch and
    # merge over the whole context: no split before the last one with rows is empty
    splits = num_splits(chunk_cap, split_rows)
    for end in (1, 2, split_rows, split_rows + 1, chunk_cap - 1, chunk_cap, chunk_cap + 1, 3 * chunk_cap + 7):
        chunks = -(-end // chunk_cap) + 2  # two more chunks than the rows need: a whole-context launch
        full = [bool(split_range(end, c, s, chunk_cap, split_rows)) for c in range(chunks) for s in range(splits)]
        own = parts_with_rows(end, chunk_cap, split_rows)
        assert full == [True] * own + [False] * (len(full) - own), f"end {end}"


def test_tiling_rejects_tiles_that_do_not_divide_a_split():
    with pytest.raises(ValueError, match="multiple of block_n"):
        Tiling(split_rows=96, block_n=64)
    with pytest.raises(ValueError, match="power of two"):
        Tiling(split_rows=96, block_n=48)


def test_the_device_cache_writes_the_same_bytes_from_device_index_tensors():
    # write_at (what the whole-pass CUDA graph records) against write_codes for a decode pass
    import torch

    from kvferry.kv.cache import Batch, DeviceKVCache, KVSpec
    spec = KVSpec(num_layers=2, num_seqs=4, ctx=32, num_kv_heads=2, head_dim=32, kv_type="q8_0", chunk_rows=8)
    a, b = (DeviceKVCache(spec, torch.device("cpu"), torch.float32) for _ in range(2))
    g = torch.Generator().manual_seed(0)
    batch = Batch([3, 0, 2], [5, 17, 0], [1, 1, 1])
    a.seq_lens = [17, 0, 0, 5]  # as if prefilled: the pass appends at these rows
    for layer in range(2):
        kq = torch.randint(0, 256, (3, 2, spec.row_bytes), dtype=torch.uint8, generator=g)
        vq = torch.randint(0, 256, (3, 2, spec.row_bytes), dtype=torch.uint8, generator=g)
        a.begin(batch)
        a.write_codes(layer, kq, vq)
        a.end()
        b.write_at(layer, torch.tensor(batch.seq_ids), torch.tensor(batch.starts), kq, vq)
    assert all(torch.equal(x, y) for x, y in zip(a.k + a.v, b.k + b.v))
    assert int(a.k[0].count_nonzero()) > 0
    # negative control: rows one position later are other bytes
    c = DeviceKVCache(spec, torch.device("cpu"), torch.float32)
    c.write_at(1, torch.tensor(batch.seq_ids), torch.tensor(batch.starts) + 1, kq, vq)
    assert not torch.equal(c.k[1], b.k[1])
