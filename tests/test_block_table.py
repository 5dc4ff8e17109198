import doctest

import pytest
import torch

import paged_ref as pr
import paged_ref.allocator
import paged_ref.block_table
import paged_ref.cache


@pytest.mark.parametrize("module", [paged_ref.allocator, paged_ref.block_table, paged_ref.cache])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_pad_and_csr_round_trip():
    tables = [[9, 3, 4], [1], [], [6, 2]]
    lens = [33, 16, 0, 17]
    bt, sl = pr.pad_block_tables(tables, lens)
    assert bt.dtype == torch.int32 and sl.dtype == torch.int32
    assert bt.tolist() == [[9, 3, 4], [1, 0, 0], [0, 0, 0], [6, 2, 0]]
    indptr, indices, last = pr.to_csr(tables, lens, page_size=16)
    assert indptr.tolist() == [0, 3, 4, 4, 6]
    assert indices.tolist() == [9, 3, 4, 1, 6, 2]
    assert last.tolist() == [1, 16, 0, 1]
    assert pr.from_csr(indptr, indices, last, page_size=16) == (tables, lens)


def test_csr_lists_only_pages_holding_tokens():
    indptr, indices, last = pr.to_csr([[5, 6, 7, 8]], [3], page_size=4)
    assert indptr.tolist() == [0, 1] and indices.tolist() == [5] and last.tolist() == [3]


def test_slot_mapping_crosses_pages():
    assert pr.slot_mapping([4, 0, 2, 7], start=3, num_tokens=4, page_size=2).tolist() == [1, 4, 5, 14]


def test_errors():
    with pytest.raises(ValueError, match="same length"):
        pr.pad_block_tables([[1]], [1, 2])
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=5 needs 2 pages of 4, but tables\[0\] has 1"):
        pr.to_csr([[1]], [5], page_size=4)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] must be >= 0"):
        pr.pad_block_tables([[1]], [-1])
    with pytest.raises(ValueError, match="needs logical page 1"):
        pr.slot_mapping([3], start=3, num_tokens=2, page_size=4)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        pr.to_csr([[1]], [1], page_size=0)
