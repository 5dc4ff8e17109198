"""FlexAttention over the physical paged cache: outputs against the float64 oracle, the physical
BlockMask replayed the way a block-sparse kernel reads it, torch's experimental PagedAttention.

On CPU flex_attention runs eagerly and evaluates the mask_mod everywhere (it ignores the
BlockMask's sparsity), so the output tests check the mask_mod and the BlockMask tests check
the block lists through `block_mask_visits`.
"""

import pytest
import torch
from attention_cases import (
    PAGE_SIZES,
    PagedCase,
    make_decode_case,
    make_prefill_case,
    rel_error,
    valid_inputs,
)
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from paged_ref.attention.flex import (
    flex_paged_decode,
    flex_paged_prefill,
    paged_block_masks,
    physical_to_logical,
)
from paged_ref.attention.reference import reference_paged_prefill
from paged_ref.lab.flex_inspect import block_mask_visits, dense_masks

F32_TOL = 1e-4
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _run(case: PagedCase, **kwargs) -> torch.Tensor:
    fn = flex_paged_decode if case.q_lens is None else flex_paged_prefill
    return fn(*case.args, **kwargs)


def test_float64_is_exact_and_scale_is_used():
    case = make_prefill_case(seed=7, batch=4, page_size=8, num_kv_heads=2, group=4, head_dim=64, dtype=torch.float64)
    assert rel_error(_run(case), case.expected()) < 1e-12
    assert rel_error(_run(case, scale=0.3), case.expected(scale=0.3)) < 1e-12


def test_block_mask_built_once_and_reused():
    """One BlockMask per step serves every layer: same answer as building it inside."""
    case = make_prefill_case(seed=15, batch=4, page_size=8, num_kv_heads=2, group=2, head_dim=64)
    masks = paged_block_masks(
        case.block_table, case.seq_lens, case.k_cache.shape[0], 8, q_len=case.q.shape[2], q_lens=case.q_lens
    )
    torch.testing.assert_close(_run(case, block_mask=masks.physical), _run(case))
    with pytest.raises(ValueError, match="block_mask must be the .physical BlockMask"):
        _run(case, block_mask=masks.logical)  # logical: wrong KV length
    with pytest.raises(TypeError, match="block_mask must be None or"):
        _run(case, block_mask="mask")


# ---- the physical BlockMask, checked the way a block-sparse kernel reads it -----------------


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("q_block_size", [1, 128])
@pytest.mark.parametrize("kv_block_size", [1, 4, 16, 128])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_physical_block_mask_visits_each_visible_slot_once(page_size, kv_block_size, q_block_size, prefill):
    """Every slot a query may see is added exactly once, every other slot never: pages smaller
    and larger than the flex block, and full blocks (q_block_size=1 makes them appear)."""
    make = make_prefill_case if prefill else make_decode_case
    case = make(
        seed=7000 + page_size + kv_block_size, batch=6, page_size=page_size, num_kv_heads=1, group=1, head_dim=4
    )
    masks = paged_block_masks(
        case.block_table,
        case.seq_lens,
        case.k_cache.shape[0],
        page_size,
        q_len=case.q.shape[2] if prefill else 1,
        q_lens=case.q_lens,
        kv_block_size=kv_block_size,
        q_block_size=q_block_size,
    )
    visits = block_mask_visits(masks.physical)[:, 0]  # [batch, q_len, num_pages * P]
    assert torch.equal(visits, case.physical_mask().to(torch.int32))
    if q_block_size == 1 and page_size % kv_block_size == 0:
        assert masks.physical.full_kv_num_blocks.sum() > 0  # the full-block path was taken


def test_dense_pictures_of_both_masks():
    case = make_prefill_case(seed=16, batch=4, page_size=4, num_kv_heads=1, group=1, head_dim=4, max_q_len=6)
    masks = paged_block_masks(
        case.block_table, case.seq_lens, case.k_cache.shape[0], 4, q_len=6, q_lens=case.q_lens, kv_block_size=8
    )
    logical, physical = dense_masks(masks)
    assert torch.equal(physical, case.physical_mask())
    kv = torch.arange(logical.shape[-1])
    for b, (n, m) in enumerate(zip(case.seq_lens.tolist(), case.q_lens.tolist())):
        for i in range(6):  # row i sees logical 0 .. n - m + i
            assert torch.equal(logical[b, i], (kv <= n - m + i) & (i < m))


def test_block_mask_visits_counts_a_block_listed_twice():
    """The checker itself can fail: a duplicated block shows up as 2 visits."""
    num = torch.tensor([[[2]]], dtype=torch.int32)  # [batch, heads, q_blocks]
    idx = torch.tensor([[[[1, 1, 0]]]], dtype=torch.int32)  # block 1 listed twice
    bm = BlockMask.from_kv_blocks(
        num, idx, BLOCK_SIZE=(4, 4), seq_lengths=(1, 12), mask_mod=lambda b, h, q, kv: kv >= 0
    )
    assert block_mask_visits(bm)[0, 0, 0].tolist() == [0] * 4 + [2] * 4 + [0] * 4


def test_physical_to_logical_ignores_padding_and_marks_unowned_pages():
    table = torch.tensor([[4, 0, 2, 0], [1, -1, 99, 3]], dtype=torch.int32)  # garbage tails
    p2l = physical_to_logical(table, torch.tensor([9, 3]), num_cols=6, page_size=4)
    assert p2l.tolist() == [
        [1, -1, 2, -1, 0, -1],  # pages 4, 0, 2 (9 tokens: 3 pages)
        [-1, 0, -1, -1, -1, -1],
    ]  # page 1 only (3 tokens)


# ---- what torch's experimental PagedAttention and attention-gym get wrong -------------------


def test_pages_freed_and_reused_by_another_sequence():
    """Sequence 0 is freed and its pages go to a new sequence: the map is rebuilt from the
    table given, so nothing of the old owner leaks (torch's `erase` leaves its map stale)."""
    case = make_decode_case(seed=9, batch=4, page_size=8, num_kv_heads=2, group=2, head_dim=64, seq_lens=[20, 9, 1, 16])
    _run(case)  # use the old table once
    gen = torch.Generator().manual_seed(10)
    table, lens = case.block_table.clone(), case.seq_lens.clone()
    table[0] = torch.cat(
        [case.block_table[0, 1:3], case.block_table[0, :1], case.block_table[0, 3:]]
    )  # same pages, new order
    lens[0] = 23
    k_new = torch.randn(23, 2, 64, generator=gen)
    v_new = torch.randn(23, 2, 64, generator=gen)
    pos = torch.arange(23)
    case.k_cache[table[0, pos // 8].long(), pos % 8] = k_new
    case.v_cache[table[0, pos // 8].long(), pos % 8] = v_new
    new = PagedCase(
        case.q,
        case.k_cache,
        case.v_cache,
        table,
        lens,
        None,
        [k_new.double()] + case.k_logical[1:],
        [v_new.double()] + case.v_logical[1:],
        seed=10,
    )
    assert rel_error(_run(new), new.expected()) < F32_TOL


def test_pages_shared_between_sequences():
    """Forked sequences share their prefix pages: each row owns them in its own map."""
    case = make_prefill_case(
        seed=11, batch=3, page_size=4, num_kv_heads=2, group=2, head_dim=64, seq_lens=[10, 7, 5], q_lens=[3, 2, 1]
    )
    table = case.block_table.clone()
    table[1, :1] = table[0, :1]  # rows 0 and 1 share page 0
    k_logical, v_logical = list(case.k_logical), list(case.v_logical)
    k_logical[1] = torch.cat([k_logical[0][:4], k_logical[1][4:]])
    v_logical[1] = torch.cat([v_logical[0][:4], v_logical[1][4:]])
    shared = PagedCase(
        case.q, case.k_cache, case.v_cache, table, case.seq_lens, case.q_lens, k_logical, v_logical, seed=11
    )
    assert rel_error(_run(shared), shared.expected()) < F32_TOL


def _torch_experimental(q4, seq_lens, q_lens, k_logical, v_logical, page_size, num_pages):
    """Run torch's own PagedAttention (kv block size = page size, its only supported case) and
    return its output with the cache and block table it built, in this package's layout."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    batch, num_kv_heads, head_dim = len(seq_lens), k_logical[0].shape[1], q4.shape[-1]
    pa = PagedAttention(num_pages, page_size, max_batch_size=batch, device="cpu")
    k_flat = torch.zeros(1, num_kv_heads, num_pages * page_size, head_dim)
    v_flat = torch.zeros(1, num_kv_heads, num_pages * page_size, head_dim)
    max_pages = max(-(-n // page_size) for n in seq_lens)
    for step in range(1, max_pages + 1):  # grow page by page, interleaved
        for b, n in enumerate(seq_lens):
            pa.reserve(torch.tensor(b), torch.tensor(min(step * page_size, n)))
    for b, n in enumerate(seq_lens):
        pa.assign(
            torch.tensor([b]),
            torch.arange(n)[None],
            k_logical[b].float().transpose(0, 1)[None],  # [1, Hkv, n, D]
            v_logical[b].float().transpose(0, 1)[None],
            k_flat,
            v_flat,
        )
    lens = torch.tensor(seq_lens)
    if q_lens is None:

        def logical(b, h, q, kv):
            return kv < lens[b]
    else:
        starts = lens - torch.tensor(q_lens)

        def logical(b, h, q, kv):
            return (q < lens[b] - starts[b]) & (kv <= starts[b] + q)

    bm = create_block_mask(
        logical, batch, None, q4.shape[2], max_pages * page_size, device="cpu", BLOCK_SIZE=(128, page_size)
    )
    physical = pa.convert_logical_block_mask(bm, kv_len=lens)
    out = flex_attention(q4, k_flat, v_flat, block_mask=physical, enable_gqa=q4.shape[1] != num_kv_heads)
    k_cache = k_flat[0].view(num_kv_heads, num_pages, page_size, head_dim).permute(1, 2, 0, 3)
    v_cache = v_flat[0].view(num_kv_heads, num_pages, page_size, head_dim).permute(1, 2, 0, 3)
    table = pa.page_table[:, : max_pages + 1].to(torch.int32)  # padding holds -1
    return out, k_cache.contiguous(), v_cache.contiguous(), table


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("page_size", [8, 16, 128])
def test_agrees_with_torch_experimental_paged_attention(page_size, prefill):
    make = make_prefill_case if prefill else make_decode_case
    case = make(seed=12 + page_size, batch=5, page_size=page_size, num_kv_heads=2, group=4, head_dim=64)
    seq_lens = case.seq_lens.tolist()
    q_lens = None if case.q_lens is None else case.q_lens.tolist()
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 2
    q4 = case.q if prefill else case.q.unsqueeze(2)
    theirs, k_cache, v_cache, table = _torch_experimental(
        q4, seq_lens, q_lens, case.k_logical, case.v_logical, page_size, num_pages
    )
    used = [-(-n // page_size) for n in seq_lens]
    assert any((table[b, 1:u] != table[b, : u - 1] + 1).any() for b, u in enumerate(used))
    ours = _run(
        PagedCase(
            case.q, k_cache, v_cache, table, case.seq_lens, case.q_lens, case.k_logical, case.v_logical, case.seed
        )
    )
    theirs = theirs if prefill else theirs.squeeze(2)
    if prefill:  # rows past q_lens are padding: theirs are unspecified
        for b, m in enumerate(q_lens):
            theirs[b, :, m:] = 0
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert rel_error(ours, case.expected()) < F32_TOL


# ---- validation: the same errors as the reference, plus flex's own -------------------------


@pytest.mark.parametrize("size,error", [(0, ValueError), (24, ValueError), (2.0, TypeError), (True, TypeError)])
def test_rejects_bad_kv_block_size(size, error):
    with pytest.raises(error, match="kv_block_size must be"):
        flex_paged_decode(*valid_inputs(decode=True).values(), kv_block_size=size)


def test_rejects_non_contiguous_cache():
    a = valid_inputs(decode=True)
    a["v_cache"] = a["v_cache"].transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="v_cache must be contiguous"):
        flex_paged_decode(*a.values())


# ---- compiled on a GPU (skipped without CUDA) -----------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_compiled_on_cuda(page_size, dtype, tol):
    for make in (make_decode_case, make_prefill_case):
        case = make(
            seed=13 + page_size, batch=6, page_size=page_size, num_kv_heads=2, group=4, head_dim=128, dtype=dtype
        )
        args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in case.args]
        out = (flex_paged_decode if case.q_lens is None else flex_paged_prefill)(*args)
        assert rel_error(out.cpu(), case.expected()) < tol


def _on_cuda(case):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in case.args]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_compiled_prefill_of_128_tokens_and_more_on_16_token_pages(dtype, tol):
    """128+ query rows: torch's general flex kernel (its decoding kernel takes fewer than 128),
    whose default tiles do not divide 16-token KV blocks (`cuda_kernel_options`)."""
    case = make_prefill_case(
        seed=21,
        batch=3,
        page_size=16,
        num_kv_heads=2,
        group=4,
        head_dim=128,
        max_q_len=200,
        seq_lens=[200, 300, 129],
        q_lens=[200, 150, 128],
        dtype=dtype,
    )
    out = flex_paged_prefill(*_on_cuda(case))
    assert rel_error(out.cpu(), case.expected()) < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_decode_as_the_batch_changes():
    """Batch 1, then 8, then 3: dynamo recompiles with a symbolic batch, and torch's general
    flex kernel (not its decoding kernel) takes the symbolic batch."""
    for batch, seed, lens in ((1, 31, [77]), (8, 32, None), (3, 33, None)):
        case = make_decode_case(seed, batch, 16, 2, 4, 128, seq_lens=lens, dtype=torch.bfloat16)
        out = flex_paged_decode(*_on_cuda(case))
        assert rel_error(out.cpu(), case.expected()) < 1e-2, batch


# --- reuse of a BlockMask, empty prefill, page ids past the cache --------------------------
def test_block_mask_built_for_another_table_is_refused():
    case = make_decode_case(seed=5, batch=3, page_size=4, num_kv_heads=1, group=2, head_dim=8)
    num_pages, page_size = case.k_cache.shape[:2]
    mask = paged_block_masks(case.block_table, case.seq_lens, num_pages, page_size).physical
    out = flex_paged_decode(*case.args, block_mask=mask)  # same tensors: no host read
    assert rel_error(out, case.expected()) < 1e-4
    assert torch.equal(
        flex_paged_decode(
            case.q, case.k_cache, case.v_cache, case.block_table.clone(), case.seq_lens.clone(), block_mask=mask
        ),
        out,
    )  # equal copies are fine
    other = case.block_table.clone()  # same shape, other pages
    other[0, 0], other[1, 0] = case.block_table[1, 0], case.block_table[0, 0]
    with pytest.raises(ValueError, match="block_mask was built for another block_table"):
        flex_paged_decode(case.q, case.k_cache, case.v_cache, other, case.seq_lens, block_mask=mask)
    case.block_table[0, 0] = case.block_table[1, 0]  # edited in place afterwards
    with pytest.raises(ValueError, match="another block_table"):
        flex_paged_decode(*case.args, block_mask=mask)
    foreign = create_block_mask(lambda b, h, q, kv: kv >= 0, 3, None, 1, num_pages * page_size, device="cpu")
    with pytest.raises(ValueError, match="BlockMask of unknown origin"):
        flex_paged_decode(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, block_mask=foreign)


def test_prefill_with_no_query_rows_returns_empty_like_the_reference():
    case = make_prefill_case(seed=2, batch=2, page_size=4, num_kv_heads=1, group=2, head_dim=8, max_q_len=4)
    q = case.q[:, :, :0]
    q_lens = torch.zeros(2, dtype=torch.int32)
    ref = reference_paged_prefill(q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, q_lens)
    out = flex_paged_prefill(q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, q_lens)
    assert out.shape == ref.shape == (2, 2, 0, 8)


def test_paged_block_masks_refuses_pages_past_the_cache():
    table = torch.tensor([[0, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"must be in \[0, num_pages=4\), got values in \[0, 5\]"):
        paged_block_masks(table, torch.tensor([8]), num_pages=4, page_size=4)
    paged_block_masks(table, torch.tensor([4]), num_pages=4, page_size=4)  # 5 is padding here


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(page_size=0), ValueError, "page_size must be >= 1, got 0"),
        (dict(num_pages=0), ValueError, "num_pages must be >= 1, got 0"),
        (dict(q_len=0), ValueError, "q_len must be >= 1, got 0"),
        (
            dict(block_table=[[0, 1]]),
            TypeError,
            r"block_table must be a 2-D integer torch.Tensor \[batch, max_pages\], got list",
        ),
        (dict(seq_lens=[8]), TypeError, r"seq_lens must be a 1-D integer torch.Tensor \[batch\], got list"),
        (dict(seq_lens=torch.tensor([8, 8])), ValueError, r"seq_lens must have shape \[batch=1\], got \[2\]"),
        (dict(q_lens=[1]), TypeError, r"q_lens must be None or a 1-D integer torch.Tensor \[batch\], got list"),
    ],
)
def test_paged_block_masks_names_the_argument_at_fault(kwargs, exc, words):
    args = dict(block_table=torch.tensor([[0, 1]]), seq_lens=torch.tensor([8]), num_pages=4, page_size=4) | kwargs
    with pytest.raises(exc, match=words):
        paged_block_masks(**args)
