"""Tests for paged_ref.eviction: scores, page scores, policies on a PagedKVCache, the decode runner.

Scores are checked on K/V built with known norms (which token wins, exact values); policies on
caches whose K/V make the right page obvious; the budget bound and the allocator on random runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from paged_ref.cache import PagedKVCache
from paged_ref.eviction import (
    POLICY_NAMES,
    FullCache,
    PagedEviction,
    Reserved,
    StreamingLLM,
    TokenTopK,
    make_policy,
    max_pages_held,
    page_scores,
    resolve_policy,
    sequence_scores,
    token_scores,
)


# ----------------------------------------------------------------------------- helpers
def kv_with_norms(k_norms, v_norms, head_dim=4):
    """k, v: [num_tokens, num_kv_heads, head_dim] whose per-head L2 norms are the given values.

    k_norms, v_norms: [num_tokens, num_kv_heads] nested lists. Each vector points along a random
    direction, so only the norm carries information.
    """
    g = torch.Generator().manual_seed(123)
    kn, vn = torch.tensor(k_norms, dtype=torch.float32), torch.tensor(v_norms, dtype=torch.float32)
    dk = torch.randn(*kn.shape, head_dim, generator=g)
    dv = torch.randn(*vn.shape, head_dim, generator=g)
    k = dk / dk.norm(dim=-1, keepdim=True) * kn[..., None]
    v = dv / dv.norm(dim=-1, keepdim=True) * vn[..., None]
    return k, v


def make_cache(num_layers=2, num_pages=64, page_size=4, num_kv_heads=2, head_dim=4):
    return PagedKVCache(
        num_layers=num_layers, num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim
    )


def append(cache, seq, k, v):
    """Write k, v: [n, Hkv, D] (same for every layer) as new tokens of seq."""
    slots = cache.reserve(seq, k.shape[0])
    for layer in range(cache.num_layers):
        cache.write(layer, slots, k, v)


def append_scored(cache, seq, scores):
    """New tokens whose value_key_ratio score is exactly `scores` (||K|| = 1, ||V|| = score)."""
    n, h = len(scores), cache.num_kv_heads
    k, v = kv_with_norms([[1.0] * h] * n, [[s] * h for s in scores], head_dim=cache.head_dim)
    append(cache, seq, k, v)


def random_kv(cache, n, g):
    shape = (n, cache.num_kv_heads, cache.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# ----------------------------------------------------------------------------- token scores
def test_value_key_ratio_exact_values_and_winner():
    # token 0: big K, small V (score 0.25); token 1: small K, big V (score 8); token 2: 1
    k, v = kv_with_norms([[4.0], [0.5], [2.0]], [[1.0], [4.0], [2.0]])
    s = token_scores(k, v, "value_key_ratio")
    torch.testing.assert_close(s, torch.tensor([0.25, 8.0, 1.0]))
    assert int(s.argmax()) == 1 and int(s.argmin()) == 0


def test_swapping_k_and_v_gives_the_inverse_not_the_score():
    # the defect in public code of the method: ||K||/||V||. It must not pass as the score.
    k, v = kv_with_norms([[4.0], [0.5], [2.0]], [[1.0], [4.0], [2.0]])
    swapped = token_scores(v, k, "value_key_ratio")
    torch.testing.assert_close(swapped, torch.tensor([4.0, 0.125, 1.0]))
    assert not torch.allclose(swapped, token_scores(k, v, "value_key_ratio"))
    assert int(swapped.argmax()) == 0  # the swap keeps the token PagedEviction would drop first


def test_ratio_is_averaged_over_kv_heads_not_a_ratio_of_averages():
    # head ratios 1/1 = 1 and 9/3 = 3 -> mean 2; the ratio of mean norms would be 5/2 = 2.5
    k, v = kv_with_norms([[1.0, 3.0]], [[1.0, 9.0]])
    torch.testing.assert_close(token_scores(k, v, "value_key_ratio"), torch.tensor([2.0]))


@pytest.mark.parametrize(
    "method, expected",
    [
        ("inverse_key_norm", [0.25, 2.0, 0.5]),
        ("value_norm", [1.0, 4.0, 2.0]),
        ("key_norm", [4.0, 0.5, 2.0]),
    ],
)
def test_single_tensor_scores(method, expected):
    k, v = kv_with_norms([[4.0], [0.5], [2.0]], [[1.0], [4.0], [2.0]])
    torch.testing.assert_close(token_scores(k, v, method), torch.tensor(expected))


def test_key_norm_ranks_opposite_to_inverse_key_norm():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(50, 3, 8, generator=g), torch.randn(50, 3, 8, generator=g)
    a = token_scores(k[:, :1], v[:, :1], "key_norm").argsort()
    b = token_scores(k[:, :1], v[:, :1], "inverse_key_norm").argsort()
    assert torch.equal(a, b.flip(0))


def test_zero_key_norm_is_clamped_not_inf():
    k, v = kv_with_norms([[0.0], [1.0]], [[1.0], [1.0]])
    s = token_scores(k, v, "value_key_ratio")
    assert torch.isfinite(s).all() and int(s.argmax()) == 0


def test_random_scores_draw_from_the_global_rng():
    k = v = torch.zeros(10, 1, 4)
    torch.manual_seed(7)
    a = token_scores(k, v, "random")
    assert a.shape == (10,) and bool(((a >= 0) & (a < 1)).all())
    torch.manual_seed(7)
    assert torch.equal(a, token_scores(k, v, "random"))


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((torch.zeros(3, 4), torch.zeros(3, 4)), {}, ValueError, "k must have shape"),
        ((torch.zeros(3, 1, 4), torch.zeros(2, 1, 4)), {}, ValueError, "same shape"),
        ((torch.zeros(3, 1, 4, dtype=torch.long),) * 2, {}, TypeError, "floating"),
        (([1.0], torch.zeros(1, 1, 1)), {}, TypeError, "k must be a tensor"),
        ((torch.zeros(3, 1, 4),) * 2, {"method": "ratio"}, ValueError, "method must be one of"),
    ],
)
def test_token_scores_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        token_scores(*args, **kwargs)


# ----------------------------------------------------------------------------- page scores
def test_page_scores_mean_and_sum_over_valid_tokens():
    s = torch.tensor([1.0, 3.0, 2.0, 6.0, 10.0])
    torch.testing.assert_close(page_scores(s, 2), torch.tensor([2.0, 4.0, 10.0]))  # last page: 1 token
    torch.testing.assert_close(page_scores(s, 2, "sum"), torch.tensor([4.0, 8.0, 10.0]))
    torch.testing.assert_close(page_scores(s, 5), torch.tensor([4.4]))
    assert page_scores(torch.zeros(0), 4).shape == (0,)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((torch.zeros(2, 2), 2), ValueError, "1-D"),
        ((torch.zeros(4), 0), ValueError, "page_size must be >= 1"),
        ((torch.zeros(4), 2.0), TypeError, "page_size must be an int"),
        ((torch.zeros(4), 2, "max"), ValueError, "reduce must be one of"),
    ],
)
def test_page_scores_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        page_scores(*args)


def test_sequence_scores_average_over_layers():
    cache = make_cache(num_layers=2, num_kv_heads=1)
    s = cache.add_sequence()
    slots = cache.reserve(s, 2)
    k, v0 = kv_with_norms([[1.0], [1.0]], [[2.0], [4.0]])
    _, v1 = kv_with_norms([[1.0], [1.0]], [[6.0], [0.0]])
    cache.write(0, slots, k, v0)
    cache.write(1, slots, k, v1)
    torch.testing.assert_close(sequence_scores(cache, s, "value_key_ratio"), torch.tensor([4.0, 2.0]))


# ----------------------------------------------------------------------------- paged_eviction
def test_prefill_keeps_top_budget_tokens_in_original_order():
    cache = make_cache(page_size=4, num_kv_heads=1)
    s = cache.add_sequence()
    scores = [5, 1, 7, 2, 9, 3, 8, 0.5, 6, 4]  # top 6: positions 0, 2, 4, 6, 8, 9
    append_scored(cache, s, scores)
    before = cache.gather(0, s)[1]
    policy = PagedEviction(6, protect_first_page=False, protect_last_page=False)
    policy.after_prefill(cache, s)
    assert policy.positions(s).tolist() == [0, 2, 4, 6, 8, 9]
    torch.testing.assert_close(cache.gather(0, s)[1], before[[0, 2, 4, 6, 8, 9]])
    assert cache.seq_len(s) == 6 and len(cache.pages(s)) == 2
    assert policy.stats(s).tokens_evicted == 4 and policy.stats(s).compactions == 1


def test_prefill_protects_first_and_last_tokens():
    cache = make_cache(page_size=2, num_kv_heads=1)
    s = cache.add_sequence()
    append_scored(cache, s, [0.1, 0.2, 9, 8, 7, 6, 0.3, 0.4])
    policy = PagedEviction(4, protect_first_page=True, protect_last_page=True)
    policy.after_prefill(cache, s)
    assert policy.positions(s).tolist() == [0, 1, 6, 7]  # the protected pages beat every score


def test_decode_evicts_the_page_with_the_lowest_mean():
    # page 1 holds the lowest single token (0.1) but a high mean; page 2 has the lowest mean
    cache = make_cache(page_size=4, num_kv_heads=1)
    s = cache.add_sequence()
    append_scored(cache, s, [5, 5, 5, 5, 0.1, 9, 9, 9, 2, 2, 2, 2])
    policy = PagedEviction(12)
    policy.after_prefill(cache, s)  # at budget: nothing to do
    free_before = cache.allocator.num_free
    append_scored(cache, s, [1, 1, 1])
    policy.after_append(cache, s)  # 15 tokens: newest page not full yet
    assert cache.seq_len(s) == 15 and policy.stats(s).pages_dropped == 0
    append_scored(cache, s, [1])
    policy.after_append(cache, s)  # 16 tokens, over budget 12: drop page 2 (mean 2)
    assert policy.positions(s).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]
    assert cache.allocator.num_free == free_before  # the dropped page went back at once
    # the newest page (mean 1, the lowest) was protected; without protection it goes
    cache2 = make_cache(page_size=4, num_kv_heads=1)
    s2 = cache2.add_sequence()
    append_scored(cache2, s2, [5, 5, 5, 5, 0.1, 9, 9, 9, 2, 2, 2, 2])
    p2 = PagedEviction(12, protect_last_page=False)
    p2.after_prefill(cache2, s2)
    for _ in range(4):
        append_scored(cache2, s2, [1])
        p2.after_append(cache2, s2)
    assert p2.positions(s2).tolist() == list(range(12))


def test_protect_first_page_skips_page_zero():
    cache = make_cache(page_size=2, num_kv_heads=1)
    s = cache.add_sequence()
    append_scored(cache, s, [0.1, 0.1, 5, 5, 3, 3])
    policy = PagedEviction(6, protect_first_page=True)
    policy.after_prefill(cache, s)
    append_scored(cache, s, [4, 4])
    policy.after_append(cache, s)
    assert policy.positions(s).tolist() == [0, 1, 2, 3, 6, 7]  # page 0 (lowest) kept, page 2 (3, 3) dropped


def test_default_reserves_first_and_last_page_literal_does_not():
    # the authors' code keeps the first and the last block; the literal text keeps only the newest
    for name, expected in (("paged_eviction", [0, 1, 2, 3, 6, 7]), ("paged_eviction_literal", [2, 3, 4, 5, 6, 7])):
        cache = make_cache(page_size=2, num_kv_heads=1)
        s = cache.add_sequence()
        append_scored(cache, s, [0.1, 0.1, 5, 5, 3, 3])
        policy = make_policy(name, 6)
        policy.after_prefill(cache, s)
        append_scored(cache, s, [4, 4])
        policy.after_append(cache, s)
        assert policy.positions(s).tolist() == expected, name
    assert make_policy("paged_eviction", 8).reserved == Reserved(first_pages=1, last_page=True)
    assert make_policy("paged_eviction_literal", 8).reserved == Reserved(first_pages=0, last_page=True)
    assert make_policy("token_topk", 8).reserved == Reserved(first_pages=1, last_page=True)
    with pytest.raises(ValueError, match="fixes protect_first_page"):
        make_policy("paged_eviction_literal", 8, protect_first_page=True)


def test_key_value_ratio_is_the_swapped_score_and_reverses_the_choice():
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(12, 2, 4, generator=g), torch.randn(12, 2, 4, generator=g)
    one_head = (k[:, :1], v[:, :1])
    torch.testing.assert_close(
        token_scores(*one_head, "key_value_ratio"), 1 / token_scores(*one_head, "value_key_ratio")
    )
    torch.testing.assert_close(token_scores(k, v, "key_value_ratio"), token_scores(v, k, "value_key_ratio"))
    cache = make_cache(page_size=2, num_kv_heads=1)
    s = cache.add_sequence()
    append_scored(cache, s, [1, 1, 5, 5, 3, 3, 0.5, 0.5])
    policy = make_policy("key_value_ratio", 6, protect_first_page=False)
    policy.after_prefill(cache, s)
    assert policy.positions(s).tolist() == [0, 1, 4, 5, 6, 7]  # the ratio's best (5, 5) goes first


def test_reserved_pages_and_tokens():
    r = Reserved(first_pages=2, last_page=False)
    assert r.tokens(9, 2).tolist() == [True] * 4 + [False] * 5
    assert r.candidate_pages(5) == [2, 3, 4] and r.min_budget(2) == 6
    assert Reserved(0, True).tokens(3, 4).all()  # a sequence shorter than a page is all "newest"
    # token_topk may run with exactly the reserved tokens as its budget
    cache = make_cache(page_size=4, num_kv_heads=1)
    s = cache.add_sequence()
    append_scored(cache, s, list(range(1, 13)))
    policy = TokenTopK(8)
    policy.after_prefill(cache, s)
    append_scored(cache, s, [0.5])
    policy.after_append(cache, s)
    assert policy.positions(s).tolist() == [0, 1, 2, 3, 9, 10, 11, 12]


def test_mean_and_sum_choose_the_same_page_at_decode_time():
    # at a decode eviction every page is full, so mean and sum rank pages alike
    g = torch.Generator().manual_seed(1)
    picks = []
    for reduce in ("mean", "sum"):
        cache = make_cache(page_size=4)
        s = cache.add_sequence()
        gg = torch.Generator().manual_seed(5)
        append(cache, s, *random_kv(cache, 30, gg))
        policy = PagedEviction(16, reduce=reduce)
        policy.after_prefill(cache, s)
        for _ in range(40):
            append(cache, s, *random_kv(cache, 1, gg))
            policy.after_append(cache, s)
        picks.append(policy.positions(s).tolist())
    assert picks[0] == picks[1]
    del g


# ----------------------------------------------------------------------------- all policies: bound, allocator
BOUND_CASES = [
    (name, budget, page_size)
    for name in POLICY_NAMES
    if name != "full"
    for budget, page_size in [(16, 4), (21, 4), (24, 8), (33, 8)]
]


@pytest.mark.parametrize("name, budget, page_size", BOUND_CASES)
def test_page_bound_and_allocator_all_free(name, budget, page_size):
    g = torch.Generator().manual_seed(budget * page_size)
    cache = make_cache(page_size=page_size, num_pages=64)
    policy = make_policy(name, budget)
    bound = max_pages_held(budget, page_size)
    seqs = []
    for prompt_len in (5, 40, budget):
        s = cache.add_sequence()
        append(cache, s, *random_kv(cache, prompt_len, g))
        policy.after_prefill(cache, s)
        assert len(cache.pages(s)) <= bound and cache.seq_len(s) <= budget
        seqs.append(s)
    for _ in range(3 * page_size + 5):
        for s in seqs:
            append(cache, s, *random_kv(cache, 1, g))
            assert len(cache.pages(s)) <= bound  # the new token's page included
            policy.after_append(cache, s)
            assert len(cache.pages(s)) <= bound
            assert cache.seq_len(s) < budget + page_size
            assert policy.positions(s).shape == (cache.seq_len(s),)
            assert policy.stats(s).max_pages_held <= bound
    held = sum(len(cache.pages(s)) for s in seqs)
    assert cache.allocator.num_free == cache.num_pages - held  # evicted pages are back in the pool
    for s in seqs:
        cache.free(s)
        policy.release(s)
    assert cache.allocator.num_free == cache.num_pages
    cache.allocator.check()


def test_full_policy_never_evicts():
    cache = make_cache()
    s = cache.add_sequence()
    policy = make_policy("full")
    append(cache, s, *random_kv(cache, 30, torch.Generator().manual_seed(0)))
    policy.after_prefill(cache, s)
    for _ in range(10):
        append(cache, s, *random_kv(cache, 1, torch.Generator().manual_seed(1)))
        policy.after_append(cache, s)
    assert cache.seq_len(s) == 40 and policy.positions(s).tolist() == list(range(40))


def test_budget_at_least_length_changes_nothing():
    for name in POLICY_NAMES[1:]:
        cache = make_cache(page_size=4)
        s = cache.add_sequence()
        g = torch.Generator().manual_seed(0)
        k, v = random_kv(cache, 10, g)
        append(cache, s, k, v)
        policy = make_policy(name, 20)
        policy.after_prefill(cache, s)
        for _ in range(10):
            append(cache, s, *random_kv(cache, 1, g))
            policy.after_append(cache, s)
        assert policy.positions(s).tolist() == list(range(20)), name
        torch.testing.assert_close(cache.gather(1, s)[0][:10], k)


# ----------------------------------------------------------------------------- determinism
def run_random_policy(seed):
    cache = make_cache(page_size=4)
    s = cache.add_sequence()
    g = torch.Generator().manual_seed(0)
    append(cache, s, *random_kv(cache, 30, g))
    policy = make_policy("random", 16, seed=seed)
    policy.after_prefill(cache, s)
    for _ in range(24):
        append(cache, s, *random_kv(cache, 1, g))
        policy.after_append(cache, s)
    return policy.positions(s).tolist()


def test_random_policy_is_deterministic_with_a_seed():
    assert run_random_policy(0) == run_random_policy(0)
    assert run_random_policy(0) != run_random_policy(1)


# ----------------------------------------------------------------------------- streaming_llm and token_topk
def test_streaming_llm_keeps_sinks_and_recent_window():
    cache = make_cache(page_size=4)
    s = cache.add_sequence()
    g = torch.Generator().manual_seed(0)
    append(cache, s, *random_kv(cache, 30, g))
    policy = StreamingLLM(12, sink_tokens=2)
    policy.after_prefill(cache, s)
    assert policy.positions(s).tolist() == [0, 1] + list(range(20, 30))
    for _ in range(4):  # 12 -> 16 tokens: the oldest page after the sink page goes
        append(cache, s, *random_kv(cache, 1, g))
        policy.after_append(cache, s)
    assert policy.positions(s).tolist() == [0, 1, 20, 21] + list(range(26, 34))


def test_token_topk_drops_one_lowest_token_per_step_and_counts_copies():
    cache = make_cache(page_size=4, num_kv_heads=1)
    s = cache.add_sequence()
    append_scored(cache, s, [5, 6, 7, 8, 9, 10, 11, 12])
    policy = TokenTopK(8, protect_first_page=False, protect_last_page=False)
    policy.after_prefill(cache, s)
    append_scored(cache, s, [1])  # the newest token is the lowest: it goes, nothing moves
    policy.after_append(cache, s)
    assert policy.positions(s).tolist() == list(range(8)) and policy.stats(s).tokens_moved == 0
    append_scored(cache, s, [20])  # now token 0 (score 5) goes: 8 tokens shift down by one slot
    policy.after_append(cache, s)
    assert policy.positions(s).tolist() == [1, 2, 3, 4, 5, 6, 7, 9]
    st = policy.stats(s)
    assert st.tokens_moved == 8 and st.tokens_evicted == 2 and st.compactions == 2
    # uncompacted, token 0's slot is a hole on page 0 and token 8's slot a hole on page 2:
    # pages 0, 1, 2 are held with 2 holes -> 2/3 per page
    assert math.isclose(st.max_holes_per_page, 2 / 3)


def test_token_topk_stays_within_budget_every_step():
    cache = make_cache(page_size=4)
    s = cache.add_sequence()
    g = torch.Generator().manual_seed(2)
    append(cache, s, *random_kv(cache, 25, g))
    policy = TokenTopK(10)
    policy.after_prefill(cache, s)
    for _ in range(20):
        append(cache, s, *random_kv(cache, 1, g))
        policy.after_append(cache, s)
        assert cache.seq_len(s) == 10
        assert policy.positions(s)[-4:].tolist() == list(
            range(policy.stats(s).tokens_seen - 4, policy.stats(s).tokens_seen)
        )


# ----------------------------------------------------------------------------- chunked feeding
@pytest.mark.parametrize("name", ["paged_eviction", "streaming_llm", "token_topk", "value_norm"])
def test_chunks_of_tokens_until_action_match_token_by_token(name):
    g = torch.Generator().manual_seed(4)
    cache = make_cache(page_size=4, num_pages=128)
    prompt = random_kv(cache, 20, g)
    steps = [random_kv(cache, 1, g) for _ in range(30)]
    results = []
    for chunked in (False, True):
        s = cache.add_sequence()
        append(cache, s, *prompt)
        policy = make_policy(name, 12)
        policy.after_prefill(cache, s)
        i = 0
        while i < len(steps):
            n = min(len(steps) - i, policy.tokens_until_action(cache, s)) if chunked else 1
            k = torch.cat([steps[j][0] for j in range(i, i + n)])
            v = torch.cat([steps[j][1] for j in range(i, i + n)])
            append(cache, s, k, v)
            policy.after_append(cache, s)
            i += n
        results.append((policy.positions(s).tolist(), cache.gather(0, s)[0]))
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1])


# ----------------------------------------------------------------------------- errors
def test_policy_construction_errors():
    with pytest.raises(ValueError, match="name must be one of"):
        make_policy("h2o", 64)
    with pytest.raises(ValueError, match="needs budget"):
        make_policy("paged_eviction")
    with pytest.raises(ValueError, match="takes no budget"):
        make_policy("full", 64)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        make_policy("paged_eviction", 0)
    with pytest.raises(TypeError, match="budget must be an int"):
        make_policy("paged_eviction", 64.0)
    with pytest.raises(ValueError, match="fixes method"):
        make_policy("value_norm", 64, method="key_norm")
    with pytest.raises(ValueError, match="reduce must be one of"):
        PagedEviction(64, reduce="max")
    with pytest.raises(TypeError, match="protect_first_page must be True or False"):
        PagedEviction(64, protect_first_page=1)
    with pytest.raises(ValueError, match="sink_tokens must be < budget"):
        StreamingLLM(4, sink_tokens=4)


def test_budget_too_small_for_protected_pages_fails_before_changing_anything():
    cache = make_cache(page_size=8)
    s = cache.add_sequence()
    append(cache, s, *random_kv(cache, 20, torch.Generator().manual_seed(0)))
    policy = PagedEviction(12, protect_first_page=True)
    with pytest.raises(ValueError, match="budget must be >= 16"):
        policy.after_prefill(cache, s)
    assert cache.seq_len(s) == 20
    with pytest.raises(TypeError, match="needs a paged_ref.PagedKVCache"):
        PagedEviction(12).after_prefill("cache", s)


def test_after_append_rejects_skipped_page_boundaries_and_leaves_state():
    cache = make_cache(page_size=4)
    s = cache.add_sequence()
    g = torch.Generator().manual_seed(0)
    append(cache, s, *random_kv(cache, 8, g))
    policy = PagedEviction(8)
    policy.after_prefill(cache, s)
    append(cache, s, *random_kv(cache, 5, g))  # 13 tokens: passed 12, where the policy acts
    with pytest.raises(ValueError, match="tokens_until_action"):
        policy.after_append(cache, s)
    assert cache.seq_len(s) == 13 and policy.positions(s).tolist() == list(range(8))
    with pytest.raises(ValueError, match="has not been seen"):
        policy.positions(99)


def test_a_sequence_id_that_is_not_an_int_names_no_sequence():
    """``True == 1`` as a dict key: release(True) forgot sequence 1's record, positions(True) read it."""
    cache, policy, g = make_cache(page_size=4), StreamingLLM(8), torch.Generator().manual_seed(0)
    for s in (cache.add_sequence(), cache.add_sequence()):
        append(cache, s, *random_kv(cache, 5, g))
        policy.after_prefill(cache, s)
    for bad in (True, 1.0):
        for call in (policy.positions, policy.stats):
            with pytest.raises(ValueError, match=f"seq_id {bad!r} has not been seen"):
                call(bad)
        with pytest.raises(TypeError, match=f"seq_id must be an int, got {bad!r}"):
            policy.release(bad)
    assert policy.positions(1).tolist() == list(range(5))


def test_resolve_policy():
    assert resolve_policy(None, None) is None
    assert isinstance(resolve_policy("full", None), FullCache)
    p = PagedEviction(32)
    assert resolve_policy(p, None) is p and resolve_policy(p, 32) is p
    with pytest.raises(ValueError, match="without eviction"):
        resolve_policy(None, 32)
    with pytest.raises(ValueError, match="disagrees"):
        resolve_policy(p, 64)
    with pytest.raises(TypeError, match="eviction must be None"):
        resolve_policy(3, 32)


# ----------------------------------------------------------------------------- the decode runner
@pytest.fixture(scope="module")
def tiny():
    from paged_ref.models import tiny_llama

    return tiny_llama(seed=0)


def test_session_forks_and_teacher_forced_chunks_match_the_model(tiny):
    """A prompt prefilled once and forked, then fed token by token and in chunks (causal over the
    pages), gives the model's own logits."""
    from paged_ref.hf import PagedSession

    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = tiny(ids).logits[:, 10:]  # [2, 14, vocab]
    for chunks in ([(t, t + 1) for t in range(10, 24)], [(10, 11), (11, 17), (17, 24)]):
        with PagedSession(tiny, num_pages=48, page_size=4) as session:
            seqs = []
            for row in ids:
                root = session.add()
                session.extend([root], [row[:10]])
                seqs.append(session.fork(root, eviction=FullCache()))
                session.finish(root)
            got = [torch.stack(session.extend(seqs, list(ids[:, a:b]), all_logits=True)) for a, b in chunks]
            assert [session.position(s) for s in seqs] == [24, 24]
        torch.testing.assert_close(torch.cat(got, 1), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["paged_eviction", "streaming_llm", "token_topk"])
def test_session_chunks_under_eviction_equal_token_by_token_decode(tiny, name):
    """Chunks of `tokens_until_action` tokens through the session compute exactly what one token
    per forward does, with eviction happening in between (the evaluation relies on it)."""
    from paged_ref.hf import PagedSession

    ids = torch.randint(3, 512, (48,), generator=torch.Generator().manual_seed(1))
    results = []
    for chunked in (False, True):
        policy = make_policy(name, 16)
        with PagedSession(tiny, num_pages=32, page_size=4) as session:
            s = session.add(eviction=policy)
            session.extend([s], [ids[:20]])
            logits, t = [], 20
            while t < 48:
                m = min(48 - t, policy.tokens_until_action(session.kv, s)) if chunked else 1
                logits += session.extend([s], [ids[t : t + m]], all_logits=True)
                assert len(session.kv.pages(s)) <= max_pages_held(16, 4)
                t += m
            results.append((torch.cat(logits), policy.positions(s), policy.stats(s).tokens_evicted))
            assert session.position(s) == 48 and policy.stats(s).tokens_seen == 48
    (a, pos_a, ev_a), (b, pos_b, ev_b) = results
    assert ev_a > 0 and ev_a == ev_b and torch.equal(pos_a, pos_b)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_session_refuses_a_chunk_past_the_policy_action_and_changes_nothing(tiny):
    from paged_ref.hf import PagedSession

    policy = make_policy("paged_eviction", 8)
    with PagedSession(tiny, num_pages=32, page_size=4) as session:
        s = session.add(eviction=policy)
        session.extend([s], [torch.arange(3, 23)])
        held, free = session.kv.seq_len(s), session.kv.allocator.num_free
        limit = policy.tokens_until_action(session.kv, s)
        with pytest.raises(ValueError, match=r"tokens\[0\] has .* must act after"):
            session.extend([s], [torch.arange(3, 3 + limit + 1)])
        assert session.kv.seq_len(s) == held and session.kv.allocator.num_free == free and session.position(s) == 20
        with pytest.raises(TypeError, match="eviction must be an EvictionPolicy"):
            session.add(eviction="paged_eviction")


# ----------------------------------------------------------------------------- the benchmark's pieces
def test_wilson_interval_known_values():
    from paged_ref.lab.stats import wilson

    lo, hi = wilson(6, 10)
    assert math.isclose(lo, 0.3127, abs_tol=1e-4) and math.isclose(hi, 0.8318, abs_tol=1e-4)
    assert wilson(0, 20)[0] == 0.0 and wilson(20, 20)[1] == 1.0 and wilson(0, 0) == (0.0, 1.0)


class _WordTokenizer:
    """Stands in for a tokenizer in the bench's language-modelling task: one id per word."""

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        ids = torch.tensor([[3 + hash(w) % 500 for w in text.split()]])

        class Out:
            input_ids = ids

        return Out()


def test_bench_language_modelling_task_on_the_tiny_model(tiny):
    from paged_ref.lab.bench.eviction import PER_LAYER, TOKEN_LEVEL, lm_task, policy_runs, summarize_lm

    cfg = dict(texts=1, text_stride=150, context=40, continuation=17, budgets=[16], page_sizes=[4, 8])
    rows, check, texts = lm_task(tiny, _WordTokenizer(), cfg, log=lambda msg: None)
    assert check < 1e-4  # the full cache's NLL equals the model's own forward
    assert texts[-1]["used"] and all(t["copied_8grams"] > 0.05 for t in texts[:-1])
    summary = summarize_lm(rows)
    assert len(summary) == 2 * len(policy_runs([16], exclude=TOKEN_LEVEL)) + len(TOKEN_LEVEL)
    per_layer = [r for r in summary if r["policy"] in PER_LAYER]
    assert len(per_layer) == 2 * len(PER_LAYER) and all(r["max_pages_held"] <= r["page_bound"] for r in per_layer)
    for r in summary:
        assert r["page_bound"] is None or r["max_pages_held"] <= r["page_bound"]
        assert r["nll"] > 0 and r["kl_vs_full"] >= -1e-6
    full = [r for r in summary if r["policy"] == "full"]
    assert all(abs(r["kl_vs_full"]) < 1e-5 for r in full)


# ----------------------------------------------------------------------------- pr.hf.generate(eviction=, budget=)
HF_BACKENDS = ["reference", "flex", "triton", "sdpa"]
HF_NEW_TOKENS = {"reference": 14, "flex": 6, "triton": 6, "sdpa": 14}  # eager flex / triton interpreter are slow


@pytest.fixture(scope="module")
def tiny1():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: thread hand-offs cost more than they give
    from paged_ref.models import tiny_llama

    yield tiny_llama(seed=0)
    torch.set_num_threads(threads)


def _tiny_kv(model, num_pages, page_size):
    return PagedKVCache.for_model(model, num_pages=num_pages, page_size=page_size)


@pytest.mark.parametrize("backend", HF_BACKENDS)
@pytest.mark.parametrize("eviction", ["paged_eviction", "streaming_llm", "token_topk"])
def test_hf_generate_with_eviction_keeps_the_page_bound(tiny1, backend, eviction):
    from paged_ref import hf

    page_size, budget = 4, 12
    ids = torch.randint(3, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    kv = _tiny_kv(tiny1, 64, page_size)
    held = []

    def check(step, tokens):
        held.append(max(len(kv.pages(s)) for s in kv.seq_ids))
        assert all(kv.seq_len(s) < budget + page_size for s in kv.seq_ids)

    out = hf.generate(
        tiny1,
        ids,
        max_new_tokens=HF_NEW_TOKENS[backend],
        backend=backend,
        kv_cache=kv,
        eviction=eviction,
        budget=budget,
        callback=check,
        eos_token_id=[],
    )
    assert out.shape == (2, 17 + HF_NEW_TOKENS[backend])
    assert held and max(held) <= max_pages_held(budget, page_size)
    assert kv.allocator.num_free == kv.num_pages and kv.seq_ids == []
    kv.allocator.check()


@pytest.mark.parametrize("backend", HF_BACKENDS)
@pytest.mark.parametrize("eviction", ["paged_eviction", "streaming_llm", "token_topk", "random"])
def test_hf_generate_with_budget_above_length_equals_full_cache(tiny1, backend, eviction):
    from paged_ref import hf

    # two sequences on the pool of the test above: compiled flex reuses that test's decode shapes
    ids = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    new = HF_NEW_TOKENS[backend]
    common = dict(max_new_tokens=new, backend=backend, eos_token_id=[])
    full = hf.generate(tiny1, ids, kv_cache=_tiny_kv(tiny1, 64, 4), **common)
    evicting = hf.generate(tiny1, ids, kv_cache=_tiny_kv(tiny1, 64, 4), eviction=eviction, budget=9 + new, **common)
    assert torch.equal(evicting, full)


def test_hf_generate_eviction_argument_errors(tiny1):
    from paged_ref import hf

    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="without eviction"):
        hf.generate(tiny1, ids, max_new_tokens=2, budget=8)
    with pytest.raises(ValueError, match="needs budget"):
        hf.generate(tiny1, ids, max_new_tokens=2, eviction="paged_eviction")
    with pytest.raises(ValueError, match="name must be one of"):
        hf.generate(tiny1, ids, max_new_tokens=2, eviction="h2o", budget=8)


def test_passkey_answer_must_be_exactly_the_key():
    from paged_ref.lab.bench.eviction import answer_is_correct

    assert answer_is_correct(" 66226.", "66226")
    assert not answer_is_correct(" 662266", "66226")  # an extra digit is a wrong answer
    assert not answer_is_correct(" 16622", "66226")
    assert not answer_is_correct(" I don't know", "66226")
