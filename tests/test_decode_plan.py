"""The split plan of split-KV decode attention, in plain Python (no Triton): which rows each
kernel program reads, and that the grid depends only on shapes."""

import pytest

from kvferry.model.decode_attention import Tiling, num_splits, split_range


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


def test_tiling_rejects_tiles_that_do_not_divide_a_split():
    with pytest.raises(ValueError, match="multiple of block_n"):
        Tiling(split_rows=96, block_n=64)
    with pytest.raises(ValueError, match="power of two"):
        Tiling(split_rows=96, block_n=48)
