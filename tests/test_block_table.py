import pytest
import torch

import paged_ref as pr
import paged_ref.allocator
import paged_ref.block_table
import paged_ref.cache
from paged_ref.block_table import pad_block_tables, pages_needed, slot_mapping, to_csr
from paged_ref.lab.csr import from_csr


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
    assert pr.lab.csr.from_csr(indptr, indices, last, page_size=16) == (tables, lens)


def test_csr_lists_only_pages_holding_tokens():
    indptr, indices, last = pr.to_csr([[5, 6, 7, 8]], [3], page_size=4)
    assert indptr.tolist() == [0, 1] and indices.tolist() == [5] and last.tolist() == [3]


def test_slot_mapping_crosses_pages():
    assert pr.slot_mapping([4, 0, 2, 7], start=3, num_tokens=4, page_size=2).tolist() == [1, 4, 5, 14]


@pytest.mark.parametrize("start", [0, 4, 5, 100])
def test_slot_mapping_of_no_tokens_is_empty_wherever_it_starts(start):
    assert slot_mapping([1], start=start, num_tokens=0, page_size=4).tolist() == []


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


# --- inputs that must be refused (they would wrap, read padding silently or divide by zero) ---
@pytest.mark.parametrize(
    "args, words",
    [
        (([0, 1, 3], [3, 1, 2], [9, 8]), r"kv_last_page_len\[0\] must be in \[1, 8\]"),
        (([0, 1, 3], [3, 1, 2], [0, 8]), r"kv_last_page_len\[0\] must be in \[1, 8\]"),
        (([0, 2, 1], [3, 1], [1, 1]), "kv_indptr must not decrease|must start at 0 and end"),
        (([0, 3, 2], [3, 1, 2], [1, 1]), "kv_indptr must not decrease|end at len"),
        (([1, 2], [3, 1], [1]), "must start at 0"),
        (([0, 1], [-4], [1]), "kv_indices must be page ids >= 0"),
        (([0, 0, 1], [2], [1, 1]), r"kv_last_page_len\[0\] must be in \[0, 0\]"),
        (([0, 1], [2], [1, 1]), "kv_last_page_len must have batch"),
    ],
)
def test_from_csr_checks_flashinfer_rules(args, words):
    tensors = [torch.tensor(a, dtype=torch.int32) for a in args]
    with pytest.raises(ValueError, match=words):
        from_csr(*tensors, page_size=8)


def test_from_csr_rejects_lists_floats_and_page_size_zero():
    ok = [torch.tensor(a, dtype=torch.int32) for a in ([0, 1], [2], [3])]
    with pytest.raises(TypeError, match="kv_indptr must be a 1-D integer torch.Tensor, got list"):
        from_csr([0, 1], ok[1], ok[2], page_size=8)
    with pytest.raises(TypeError, match="kv_indices must be a 1-D integer"):
        from_csr(ok[0], ok[1].float(), ok[2], page_size=8)
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        from_csr(*ok, page_size=0)
    assert from_csr(*ok, page_size=8) == ([[2]], [3])


@pytest.mark.parametrize(
    "tables, words",
    [
        ([[1, -1]], r"tables\[0\]\[1\] must be >= 0, got -1"),
        ([[2, -5, 3]], r"tables\[0\]\[1\] must be >= 0, got -5"),
        ([[4, 4]], r"tables\[0\] must not list a page twice, got page\(s\) \[4\]"),
        ([[1.0, 2]], r"tables\[0\]\[0\] must be an int, got float"),
    ],
)
def test_tables_reject_negative_duplicate_and_float_pages(tables, words):
    with pytest.raises((TypeError, ValueError), match=words):
        pad_block_tables(tables, [1])
    with pytest.raises((TypeError, ValueError), match=words):
        to_csr(tables, [1], page_size=4)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(start=-1, num_tokens=1, page_size=4), "start must be >= 0, got -1"),
        (dict(start=0, num_tokens=-2, page_size=4), "num_tokens must be >= 0, got -2"),
        (dict(start=0, num_tokens=1, page_size=0), "page_size must be >= 1, got 0"),
        (dict(start=0, num_tokens=1, page_size=-4), "page_size must be >= 1, got -4"),
    ],
)
def test_slot_mapping_rejects_negative_and_zero(kwargs, words):
    with pytest.raises(ValueError, match=words):
        slot_mapping([1, 2], **kwargs)


def test_pages_needed_rejects_negative_and_zero():
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -5"):
        pages_needed(-5, 4)
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        pages_needed(5, 0)
    assert pages_needed(0, 4) == 0 and pages_needed(5, 4) == 2


def test_pad_block_tables_with_page_size_refuses_rows_that_do_not_cover_their_length():
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=9 needs 2 pages of 8, but tables\[0\] has 1"):
        pad_block_tables([[3]], [9], page_size=8)  # attention would read padding page 0 for tokens 8
    bt, lens = pad_block_tables([[3, 4]], [9], page_size=8)
    assert bt.tolist() == [[3, 4]] and lens.tolist() == [9]
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        pad_block_tables([[3]], [1], page_size=0)


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (
            lambda: slot_mapping([-3], start=0, num_tokens=1, page_size=4),
            ValueError,
            r"pages\[0\] must be >= 0, got -3",
        ),
        (lambda: slot_mapping([2, -1], start=4, num_tokens=1, page_size=4), ValueError, r"pages\[1\] must be >= 0"),
        (lambda: slot_mapping([1.0], start=0, num_tokens=1, page_size=4), TypeError, r"pages\[0\] must be an int"),
        (
            lambda: slot_mapping(3, start=0, num_tokens=1, page_size=4),
            TypeError,
            "pages must be a list of page ids, got int",
        ),
        (lambda: pad_block_tables(3, [1]), TypeError, "tables must be a list of page lists, got int"),
        (lambda: pad_block_tables([[1]], 1), TypeError, "seq_lens must be a list of token counts, got int"),
        (lambda: pad_block_tables([1], [1]), TypeError, r"tables\[0\] must be a list of page ids, got int"),
        (lambda: to_csr([[1]], 5, page_size=4), TypeError, "seq_lens must be a list of token counts, got int"),
    ],
)
def test_scalars_and_negative_pages_are_named(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


@pytest.mark.parametrize("huge", [2**31, 2**63, 10**30])
@pytest.mark.parametrize(
    "call, name",
    [
        (lambda h: pad_block_tables([[h]], [1]), r"tables\[0\]\[0\]"),
        (lambda h: to_csr([[0, h]], [5], page_size=4), r"tables\[0\]\[1\]"),
        (lambda h: pad_block_tables([[0]], [h]), r"seq_lens\[0\]"),
        (lambda h: to_csr([list(range(4))], [h], page_size=h), r"seq_lens\[0\]"),
        (lambda h: slot_mapping([h], start=0, num_tokens=1, page_size=4), r"pages\[0\]"),
        (lambda h: slot_mapping([1], start=0, num_tokens=1, page_size=h), "page_size"),
    ],
)
def test_values_beyond_int32_are_refused_by_name(call, name, huge):
    """Block tables hold int32 page ids and lengths; slots page * page_size + offset fit int64 when both do."""
    low = 1 if name == "page_size" else 0
    with pytest.raises(ValueError, match=rf"{name} must be in \[{low}, 2147483647\], got {huge}$"):
        call(huge)
