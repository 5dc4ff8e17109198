"""The sdpa backend's one-sequence decode: chunked SDPA with log-sum-exp merging, against float64.

`attend_chunked` cuts a sequence into ``chunk``-token pieces and merges them; these cases put
the cut everywhere it can fall (one piece, exact multiples, a tail of one token, GQA, MQA) and
use large scores so a merge that lost the max subtraction would overflow. `sdpa_paged_decode`
reaches it for one sequence both in place (consecutive pages) and after gathering pages.
"""

import pytest
import torch
from attention_cases import dense_oracle, make_decode_case, rel_error

from paged_ref.attention.sdpa import DECODE_CHUNK, attend_chunked, prepare, sdpa_paged_decode

HEADS = {"mha": (2, 1), "gqa3": (3, 3), "mqa": (1, 4)}  # (num_kv_heads, group)


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("num_tokens, chunk", [(5, 8), (15, 8), (16, 8), (17, 8), (64, 8), (65, 16), (100, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attend_chunked_matches_float64(heads, num_tokens, chunk, dtype):
    num_kv_heads, group = HEADS[heads]
    g = torch.Generator().manual_seed(num_tokens * 100 + chunk + num_kv_heads)
    k = torch.randn(num_tokens, num_kv_heads, 16, generator=g, dtype=torch.float64)  # [T, Hkv, D]
    v = torch.randn(num_tokens, num_kv_heads, 16, generator=g, dtype=torch.float64)  # [T, Hkv, D]
    q = torch.randn(1, num_kv_heads * group, 16, generator=g, dtype=torch.float64) * 8  # [1, Hq, D]
    scale = 2.0  # scores in the tens to hundreds
    want = dense_oracle(q, [k], [v], scale=scale)[0]  # [Hq, D]
    got = attend_chunked(q[0].to(dtype), k.to(dtype), v.to(dtype), scale, chunk=chunk)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert rel_error(got, want) < (1e-12 if dtype == torch.float64 else 1e-5)


def test_attend_chunked_reads_strided_views_without_copying_them():
    """K/V as they lie in a cache (``[T, Hkv, D]`` rows of a larger buffer) give the same result."""
    g = torch.Generator().manual_seed(7)
    buffer = torch.randn(300, 3, 16, generator=g)  # [slots, Hkv, D]
    k, v = buffer[10:250], buffer.flip(0)[5:245]  # [240, 3, 16] views, v with a negative stride
    q = torch.randn(9, 16, generator=g)  # [Hq, D]
    want = dense_oracle(q[None], [k.double()], [v.double()], scale=0.25)[0]
    assert rel_error(attend_chunked(q, k, v, 0.25, chunk=32), want) < 1e-5


@pytest.mark.parametrize("consecutive", [True, False], ids=["in_place", "gathered"])
def test_one_long_sequence_crosses_the_chunk_size(consecutive):
    """2.3 chunks of tokens through the public decode, on consecutive and on shuffled pages."""
    n = 2 * DECODE_CHUNK + DECODE_CHUNK // 3
    case = make_decode_case(seed=11, batch=1, page_size=16, num_kv_heads=3, group=3, head_dim=64, seq_lens=[n])
    table, k_cache, v_cache = case.block_table, case.k_cache, case.v_cache
    if consecutive:  # move the sequence's pages to 0..P-1, in order
        used = -(-n // 16)
        order = table[0, :used].long()
        k_cache = torch.cat([k_cache[order], k_cache[:2]])  # [used + 2, 16, 3, 64]
        v_cache = torch.cat([v_cache[order], v_cache[:2]])
        table = torch.arange(used + 2, dtype=torch.int32)[None]
    assert (prepare(table, case.seq_lens, 16).start is not None) == consecutive
    got = sdpa_paged_decode(case.q, k_cache, v_cache, table, case.seq_lens)
    assert rel_error(got, dense_oracle(case.q, case.k_logical, case.v_logical)) < 1e-5


def test_a_gather_plan_made_for_another_call_is_refused_naming_it():
    """``gather=`` takes `prepare`'s plan for this call only: another type, the other mode, another batch or page
    size is an error naming ``gather``, what it must fit and what it was made for; the right plan gives the answer."""
    from paged_ref.attention.sdpa import sdpa_paged_prefill

    case = make_decode_case(seed=3, batch=2, page_size=8, num_kv_heads=2, group=2, head_dim=16, seq_lens=[13, 5])
    args = (case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens)
    with pytest.raises(TypeError, match=r"gather must be a SlotGather from prepare\(\.\.\.\) or None, got dict"):
        sdpa_paged_decode(*args, gather={"slots": None})
    q_lens = torch.tensor([1, 1])
    wrong = {
        "prefill's": prepare(case.block_table, case.seq_lens, 8, q_lens, 1),
        "one sequence's": prepare(case.block_table[:1], case.seq_lens[:1], 8),
        "pages of 4's": prepare(case.block_table, case.seq_lens, 4),
    }
    for plan in wrong.values():
        with pytest.raises(
            ValueError, match=r"gather must be prepare's for \(q_len, batch, page_size\) \('decode', 2, 8\)"
        ):
            sdpa_paged_decode(*args, gather=plan)
    with pytest.raises(ValueError, match=r"\(1, 2, 8\), got \('decode', 2, 8\)"):
        sdpa_paged_prefill(case.q[:, :, None], *args[1:], q_lens, gather=prepare(case.block_table, case.seq_lens, 8))
    right = sdpa_paged_decode(*args, gather=prepare(case.block_table, case.seq_lens, 8))
    assert torch.equal(right, sdpa_paged_decode(*args))
