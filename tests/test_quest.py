"""Quest: page key summaries kept by the cache, the bound, page selection, decode over chosen pages."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_ref import PagedKVCache
from paged_ref.attention.quest import page_bounds, quest_paged_decode, select_pages
from paged_ref.attention.reference import reference_paged_decode

_SETTINGS = settings(
    max_examples=60, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


@st.composite
def cache_histories(draw):
    """A cache with summaries after a random history: prompts, forks (copy-on-write), appends
    one token at a time, compactions, frees (pages handed out again), with random keys."""
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    kv_heads, head_dim = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3, 8]))
    seed = draw(st.integers(0, 2**16))
    ops = draw(
        st.lists(
            st.tuples(st.sampled_from(["add", "fork", "append", "compact", "free"]), st.integers(1, 40)), max_size=12
        )
    )
    return page_size, kv_heads, head_dim, seed, ops


def _run_history(page_size, kv_heads, head_dim, seed, ops):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(
        num_layers=2,
        num_pages=64,
        page_size=page_size,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=torch.float64,
        page_summaries=True,
    )

    def write(s, n):
        slots = cache.reserve(s, n)
        for layer in range(2):
            k = torch.randn(n, kv_heads, head_dim, generator=g, dtype=torch.float64) * 3
            cache.write(layer, slots, k, torch.zeros_like(k))

    for op, n in ops:
        live = cache.seq_ids
        try:
            if op == "add" or not live:
                write(cache.add_sequence(), n)
            elif op == "fork":
                write(cache.fork(live[n % len(live)]), 1 + n % 3)
            elif op == "append":
                write(live[n % len(live)], 1)
            elif op == "compact":  # token-level eviction packs the kept tokens: their pages are summarised again
                s = live[n % len(live)]
                cache.compact(s, torch.rand(cache.seq_len(s), generator=g) < 0.6)
            else:
                cache.free(live[n % len(live)])
        except Exception as e:  # a full pool refuses and changes nothing
            assert type(e).__name__ == "OutOfPagesError"
    return cache


@_SETTINGS
@given(cache_histories())
def test_summaries_are_the_min_and_max_of_each_page(history):
    """Every page a live sequence holds: the summary is exactly its keys' min and max."""
    cache = _run_history(*history)
    for s in cache.seq_ids:
        for layer in range(2):
            k, _ = cache.gather(layer, s)  # [n, Hkv, D]
            for i, page in enumerate(cache.pages(s)[: -(-cache.seq_len(s) // cache.page_size)]):
                keys = k[i * cache.page_size : (i + 1) * cache.page_size]
                assert torch.equal(cache.summaries.k_min[layer][page], keys.amin(0))
                assert torch.equal(cache.summaries.k_max[layer][page], keys.amax(0))


@_SETTINGS
@given(cache_histories(), st.integers(0, 2**16))
def test_the_bound_holds_for_every_key_of_every_page(history, qseed):
    """sum_i max(q_i k_min_i, q_i k_max_i) >= q . k for every key held (exactly, same summation order)."""
    cache = _run_history(*history)
    q = torch.randn(
        cache.num_kv_heads, cache.head_dim, generator=torch.Generator().manual_seed(qseed), dtype=torch.float64
    )
    for s in cache.seq_ids:
        for layer in range(2):
            k, _ = cache.gather(layer, s)  # [n, Hkv, D]
            pages = torch.tensor(cache.pages(s), dtype=torch.long)[
                torch.arange(k.shape[0]) // cache.page_size
            ]  # [n] page of each key
            bound = page_bounds(q, cache.summaries.k_min[layer][pages], cache.summaries.k_max[layer][pages])  # [n, Hkv]
            assert bool((bound >= (q * k).sum(-1)).all())


def test_a_page_handed_out_again_starts_with_an_empty_summary():
    cache = PagedKVCache(num_layers=1, num_pages=2, page_size=2, num_kv_heads=1, head_dim=2, page_summaries=True)
    s = cache.add_sequence()
    cache.write(0, cache.reserve(s, 2), torch.full((2, 1, 2), 9.0), torch.zeros(2, 1, 2))
    cache.free(s)
    t = cache.add_sequence()
    page = cache.reserve(t, 1)[0] // 2
    cache.write(0, torch.tensor([page * 2]), torch.full((1, 1, 2), -1.0), torch.zeros(1, 1, 2))
    assert cache.summaries.k_max[0][page].tolist() == [[-1.0, -1.0]]


def test_summaries_are_off_by_default():
    assert PagedKVCache(num_layers=1, num_pages=2, page_size=2, num_kv_heads=1, head_dim=2).summaries is None


def _quest_case(seed, page_size, num_kv_heads, group, lens, head_dim=16):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in lens]
    num_pages = sum(pages) + 2
    perm = torch.randperm(num_pages, generator=g).tolist()
    kc = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
    vc = torch.randn_like(kc)
    table = torch.full((len(lens), max(pages)), num_pages + 5, dtype=torch.int32)  # garbage padding
    for b, p in enumerate(pages):
        table[b, :p] = torch.tensor([perm.pop() for _ in range(p)])
    lens = torch.tensor(lens, dtype=torch.int32)
    # summaries of what each page holds (the last page's tail holds no token)
    held = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        for t in range(n):
            held[table[b, t // page_size], t % page_size] = True
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    k_min = torch.where(held[..., None, None], kc, inf).amin(1)  # [num_pages, Hkv, D]
    k_max = torch.where(held[..., None, None], kc, -inf).amax(1)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=g, dtype=torch.float64)
    return q, kc, vc, table, lens, k_min, k_max


@pytest.mark.parametrize("page_size", [1, 4, 16, 128])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (1, 3), (2, 8)])
def test_quest_with_every_page_in_budget_is_plain_attention(page_size, num_kv_heads, group):
    q, kc, vc, bt, lens, k_min, k_max = _quest_case(
        0, page_size, num_kv_heads, group, [1, page_size, page_size + 1, 3 * page_size + 2]
    )
    out = quest_paged_decode(q, kc, vc, bt, lens, k_min, k_max, budget=bt.shape[1])
    ref = reference_paged_decode(q, kc, vc, bt, lens)
    assert float((out - ref).norm() / ref.norm()) <= 1e-12


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 4)])
def test_quest_attends_exactly_the_pages_it_chose(page_size, num_kv_heads, group):
    """Per KV head: the chosen pages (the last one always, then the largest group bounds) as a
    block table of their own, through the plain reference."""
    budget = 3
    q, kc, vc, bt, lens, k_min, k_max = _quest_case(
        1, page_size, num_kv_heads, group, [9 * page_size - 1, 2 * page_size]
    )
    out = quest_paged_decode(q, kc, vc, bt, lens, k_min, k_max, budget=budget)
    for b, n in enumerate(lens.tolist()):
        held = -(-n // page_size)
        for h in range(num_kv_heads):
            heads = slice(h * group, (h + 1) * group)
            rows = bt[b, :held].long()
            bound = page_bounds(q[b, heads, None], k_min[rows, h], k_max[rows, h]).amax(0)  # [held]
            chosen = list(range(held)) if held <= budget else select_pages(bound[None], budget)[0].tolist()
            assert chosen[-1] == held - 1  # the newest page is always read
            sub = bt[b, chosen][None].int()
            n_sub = (len(chosen) - 1) * page_size + (n - (held - 1) * page_size)
            ref = reference_paged_decode(
                q[b : b + 1, heads], kc[:, :, h : h + 1], vc[:, :, h : h + 1], sub, torch.tensor([n_sub])
            )
            assert torch.allclose(out[b, heads], ref[0], atol=1e-12)


@pytest.mark.parametrize("budget", [1, 2, 4])
def test_a_nonfinite_unwritten_tail_never_reaches_the_output(budget):
    """The slots past a sequence's end in its last page hold no token, whatever they hold (NaN K, Inf V),
    as for every backend (tests/test_nonfinite_slots.py): the chosen pages' tails are read but weigh nothing."""
    q, kc, vc, bt, lens, k_min, k_max = _quest_case(2, 4, 2, 2, [5, 14, 7, 4])
    clean = quest_paged_decode(q, kc, vc, bt, lens, k_min, k_max, budget=budget)
    for b, n in enumerate(lens.tolist()):  # the partly filled last pages (of 5, 14 and 7 tokens)
        if n % 4:
            kc[bt[b, n // 4], n % 4 :], vc[bt[b, n // 4], n % 4 :] = float("nan"), float("inf")
    out = quest_paged_decode(q, kc, vc, bt, lens, k_min, k_max, budget=budget)
    assert torch.equal(out, clean)


def test_an_empty_summary_has_the_bound_plus_inf():
    """A page holding no key (k_min +inf, k_max -inf: `PageSummaries`' empty page) gets the bound +inf, as
    `page_bounds` says: no key lies in it, so any bound holds; NaN where a coordinate of q is 0."""
    empty_min, empty_max = torch.full((3,), float("inf")), torch.full((3,), float("-inf"))
    assert page_bounds(torch.tensor([1.0, -2.0, 0.5]), empty_min, empty_max).item() == float("inf")
    assert page_bounds(torch.tensor([1.0, 0.0, 0.5]), empty_min, empty_max).isnan()


def test_select_pages_refuses_a_budget_of_zero_or_more_than_held():
    bounds = torch.randn(2, 4)
    with pytest.raises(ValueError, match="budget must be >= 1, got 0"):
        select_pages(bounds, 0)
    with pytest.raises(ValueError, match=r"budget must be at most the pages held \(4\), got 5"):
        select_pages(bounds, 5)
    q, kc, vc, bt, lens, k_min, k_max = _quest_case(2, 4, 1, 2, [10, 3])
    saved = [t.clone() for t in (q, kc, vc, bt, lens, k_min, k_max)]
    with pytest.raises(ValueError, match="budget must be >= 1"):
        quest_paged_decode(q, kc, vc, bt, lens, k_min, k_max, budget=0)
    with pytest.raises(
        ValueError, match=r"budget must be at most the pages a sequence can hold \(max_pages=3\), got 4"
    ):
        quest_paged_decode(q, kc, vc, bt, lens, k_min, k_max, budget=4)
    with pytest.raises(ValueError, match="k_min must be"):
        quest_paged_decode(q, kc, vc, bt, lens, k_min[:1], k_max, budget=1)
    assert all(torch.equal(a, b) for a, b in zip(saved, (q, kc, vc, bt, lens, k_min, k_max)))


def _greedy(model, backend, summaries, steps=8):
    from paged_ref.hf import PagedSession

    kv = PagedKVCache.for_model(model, num_pages=64, page_size=4, page_summaries=summaries)
    with PagedSession(model, kv_cache=kv, backend=backend) as session:
        s = session.add()
        logits, tokens = session.extend([s], [torch.arange(1, 30)]), []
        for _ in range(steps):
            tokens.append(int(logits.argmax(-1)))
            logits = session.extend([s], [logits.argmax(-1)])
    return tokens


def test_quest_backend_in_a_session():
    """With a budget above the pages held Quest reads every page: sdpa's greedy tokens; the
    backend refuses a cache without summaries."""
    from paged_ref.lab.quest_backend import quest_backend
    from paged_ref.models import tiny_llama

    model = tiny_llama()
    assert _greedy(model, quest_backend(64), True) == _greedy(model, "sdpa", False)
    assert len(_greedy(model, quest_backend(2), True)) == 8
    with pytest.raises(ValueError, match="page_summaries=True"):
        _greedy(model, quest_backend(2), False)
