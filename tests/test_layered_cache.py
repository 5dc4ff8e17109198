"""LayeredKVCache (a block table per layer, one allocator) and per-layer eviction decisions."""

from __future__ import annotations

import pytest
import torch

from paged_ref.allocator import OutOfPagesError
from paged_ref.cache import PageCopy, PagedKVCache
from paged_ref.eviction import PagedEviction, TokenTopK, make_policy, max_pages_held, page_scores, token_scores
from paged_ref.layered_cache import LayeredKVCache

L, HKV, D = 3, 2, 4


def layered(num_pages=16, page_size=4):
    return LayeredKVCache(num_layers=L, num_pages=num_pages, page_size=page_size, num_kv_heads=HKV, head_dim=D)


def append(cache, seq, ks, vs):
    """ks[layer], vs[layer]: [n, Hkv, D], each layer its own."""
    slots = cache.reserve(seq, ks[0].shape[0])  # [L, n]
    for layer in range(cache.num_layers):
        cache.write(layer, slots[layer], ks[layer], vs[layer])


def test_each_layer_keeps_its_own_tokens_and_pages_return_to_one_pool():
    g = torch.Generator().manual_seed(0)
    cache = layered()
    model = {}  # seq -> per layer list of (k, v) rows, the tokens a layer holds in order
    seqs = [cache.add_sequence() for _ in range(2)]
    for s in seqs:
        ks = [torch.randn(9, HKV, D, generator=g) for _ in range(L)]
        vs = [torch.randn(9, HKV, D, generator=g) for _ in range(L)]
        append(cache, s, ks, vs)
        model[s] = [(ks[i], vs[i]) for i in range(L)]
    # layer i keeps its own 5 tokens
    keep = torch.zeros(L, 9, dtype=torch.bool)
    for i in range(L):
        keep[i, torch.randperm(9, generator=g)[:5]] = True
    cache.compact(seqs[0], keep)
    model[seqs[0]] = [(k[keep[i]], v[keep[i]]) for i, (k, v) in enumerate(model[seqs[0]])]
    # then each layer drops a different full page of the other sequence
    cache.drop_pages(seqs[1], [0, 1, 0])
    model[seqs[1]] = [
        (torch.cat([k[: 4 * p], k[4 * p + 4 :]]), torch.cat([v[: 4 * p], v[4 * p + 4 :]]))
        for p, (k, v) in zip([0, 1, 0], model[seqs[1]])
    ]
    held = 0
    for s in seqs:
        for layer in range(L):
            k, v = cache.gather(layer, s)
            torch.testing.assert_close(k, model[s][layer][0], rtol=0, atol=0)
            torch.testing.assert_close(v, model[s][layer][1], rtol=0, atol=0)
            table, lens = cache.block_table([s], layer=layer)
            assert table[0, : len(cache.pages(s, layer))].tolist() == cache.pages(s, layer)
            assert int(lens[0]) == cache.seq_len(s) == model[s][layer][0].shape[0]
            held += len(cache.pages(s, layer))
    assert cache.allocator.num_free + held == L * 16
    assert cache.k_cache[0] is cache.k_cache[2] and cache.k_cache[0].shape == (L * 16, 4, HKV, D)
    one_table = PagedKVCache(num_layers=L, num_pages=1, page_size=4, num_kv_heads=HKV, head_dim=D)
    assert cache.page_bytes == one_table.page_bytes
    for s in seqs:
        cache.free(s)
    assert cache.allocator.num_free == L * 16


def test_bad_calls_change_nothing():
    cache = layered(num_pages=2, page_size=4)
    s = cache.add_sequence()
    append(cache, s, [torch.ones(6, HKV, D)] * L, [torch.ones(6, HKV, D)] * L)
    free = cache.allocator.num_free
    with pytest.raises(OutOfPagesError):
        cache.reserve(s, 8)  # needs 2 pages per layer, the pool has none left
    assert cache.seq_len(s) == 6 and cache.allocator.num_free == free
    with pytest.raises(ValueError, match="same number of tokens"):
        cache.compact(s, torch.tensor([[True] * 6, [True] * 5 + [False], [True] * 6]))
    with pytest.raises(ValueError, match="shape"):
        cache.compact(s, torch.ones(6, dtype=torch.bool))
    with pytest.raises(ValueError, match="partial page"):
        cache.drop_pages(s, [1, 0, 0])  # page 1 holds 2 tokens, page 0 holds 4
    with pytest.raises(ValueError, match="one page per layer"):
        cache.drop_pages(s, [0])
    with pytest.raises(ValueError, match="layer must be in"):
        cache.gather(L, s)
    with pytest.raises(ValueError, match="not a live sequence"):
        cache.seq_len(99)
    assert [len(cache.pages(s, i)) for i in range(L)] == [2, 2, 2] and cache.seq_len(s) == 6


def random_layers(g, n):
    ks = [torch.randn(n, HKV, D, generator=g) for _ in range(L)]
    vs = [torch.randn(n, HKV, D, generator=g) * (1 + i) for i in range(L)]
    return ks, vs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_layer_paged_eviction_decides_from_each_layers_own_scores(seed):
    g = torch.Generator().manual_seed(seed)
    ps, budget = 4, 12
    cache = layered(num_pages=32, page_size=ps)
    s = cache.add_sequence()
    ks, vs = random_layers(g, 30)
    append(cache, s, ks, vs)
    policy = PagedEviction(budget, decision="per_layer")
    policy.after_prefill(cache, s)
    pos = policy.positions(s)  # [L, budget]
    assert pos.shape == (L, budget)
    for layer in range(L):  # prefill: the reserved tokens plus this layer's own best
        score = token_scores(ks[layer], vs[layer])
        score[:ps] = float("inf")
        score[-ps:] = float("inf")
        expected = torch.sort(torch.sort(score, descending=True, stable=True).indices[:budget]).values
        assert pos[layer].tolist() == expected.tolist()
        torch.testing.assert_close(cache.gather(layer, s)[0], ks[layer][pos[layer]], rtol=0, atol=0)
    for step in range(20):  # decode: each layer drops its own lowest candidate page
        before = [token_scores(*cache.gather(layer, s)) for layer in range(L)]
        k1, v1 = random_layers(g, 1)
        append(cache, s, k1, v1)
        pos_before = torch.cat([policy.positions(s), torch.full((L, 1), 30 + step)], dim=1)  # with the new token
        policy.after_append(cache, s)
        n = cache.seq_len(s)
        if policy.positions(s).shape[1] < pos_before.shape[1]:  # an eviction happened
            for layer in range(L):
                scores = page_scores(torch.cat([before[layer], token_scores(k1[layer], v1[layer])]), ps)
                worst = 1 + int(torch.argmin(scores[1:-1]))
                kept = torch.cat([pos_before[layer, : worst * ps], pos_before[layer, (worst + 1) * ps :]])
                assert policy.positions(s)[layer].tolist() == kept.tolist()
        assert len(cache.pages(s, 0)) <= max_pages_held(budget, ps) and n <= budget + ps
    held = sum(len(cache.pages(s, layer)) for layer in range(L))
    assert cache.allocator.num_free + held == L * 32
    assert "decision='per_layer'" in repr(policy)


def test_per_layer_equals_shared_when_every_layer_holds_the_same_kv():
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(40, HKV, D, generator=g), torch.randn(40, HKV, D, generator=g)
    for name in ("paged_eviction", "token_topk"):
        shared = PagedKVCache(num_layers=L, num_pages=32, page_size=4, num_kv_heads=HKV, head_dim=D)
        s0 = shared.add_sequence()
        per = layered(num_pages=32)
        s1 = per.add_sequence()
        p0, p1 = make_policy(name, 12), make_policy(name, 12, decision="per_layer")
        for lo, hi in ((0, 20), *((i, i + 1) for i in range(20, 40))):
            slots = shared.reserve(s0, hi - lo)
            for layer in range(L):
                shared.write(layer, slots, k[lo:hi], v[lo:hi])
            append(per, s1, [k[lo:hi]] * L, [v[lo:hi]] * L)
            (p0.after_prefill if lo == 0 else p0.after_append)(shared, s0)
            (p1.after_prefill if lo == 0 else p1.after_append)(per, s1)
            assert (p1.positions(s1) == p0.positions(s0)).all(), (name, hi)
        assert p0.stats(s0).tokens_moved == p1.stats(s1).tokens_moved


def test_decision_needs_the_matching_cache():
    with pytest.raises(TypeError, match="needs a paged_ref.LayeredKVCache"):
        PagedEviction(8, decision="per_layer").after_prefill(
            PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=2), 0
        )
    with pytest.raises(TypeError, match="needs a paged_ref.PagedKVCache"):
        TokenTopK(8).after_prefill(layered(), 0)
    with pytest.raises(ValueError, match="decision"):
        PagedEviction(8, decision="layer")


@pytest.mark.parametrize("backend", ["sdpa", "reference", "flex", "triton"])
def test_session_on_a_layered_cache_gives_the_same_logits(backend):
    """Every layer attends through its own block table and writes its own slots: with no eviction
    the logits equal those of a PagedKVCache (reading layer 0's table, or writing layer 0's slots,
    in every layer would read another layer's K/V)."""
    from paged_ref.hf import PagedSession
    from paged_ref.models import tiny_llama

    model = tiny_llama(seed=0)
    ids = torch.randint(3, 200, (30,), generator=torch.Generator().manual_seed(0))
    out = []
    for cls in (PagedKVCache, LayeredKVCache):
        kv = cls.for_model(model, num_pages=16, page_size=4)
        with PagedSession(model, kv_cache=kv, backend=backend) as session:
            s = session.add()
            logits = session.extend([s], [ids[:20]], all_logits=True)
            decode = 20 if backend == "flex" else 24  # flex decode compiles (~10 s); its prefill reads the same masks
            for t in range(20, decode):
                logits += session.extend([s], [ids[t : t + 1]], all_logits=True)
            out.append(torch.cat(logits))  # [decode, vocab]
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)


def test_session_with_per_layer_eviction_keeps_each_layer_within_the_bound():
    from paged_ref.hf import PagedSession
    from paged_ref.models import tiny_llama

    model = tiny_llama(seed=0)
    kv = LayeredKVCache.for_model(model, num_pages=16, page_size=4)
    policy = PagedEviction(16, decision="per_layer")
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(1))
    with PagedSession(model, kv_cache=kv) as session:
        root = session.add()
        session.extend([root], [ids[:20]])
        s = session.fork(root, eviction=policy)
        session.finish(root)
        for t in range(20, 40):
            assert torch.isfinite(session.extend([s], [ids[t : t + 1]])).all()
            assert all(len(kv.pages(s, layer)) <= max_pages_held(16, 4) for layer in range(kv.num_layers))
        pos = policy.positions(s)  # [num_layers, seq_len]
        assert pos.shape[0] == 2 and not torch.equal(pos[0], pos[1])  # the layers kept different tokens
    assert kv.allocator.num_free == kv.allocator.num_pages


def test_fork_shares_every_layer_and_truncate_is_the_inverse_of_reserve():
    cache = layered(num_pages=4, page_size=4)
    s = cache.add_sequence()
    slots = cache.reserve(s, 6)
    for layer in range(L):
        cache.write(layer, slots[layer], torch.full((6, HKV, D), float(layer)), torch.ones(6, HKV, D))
    f = cache.fork(s)
    assert cache.seq_len(f) == 6 and all(cache.pages(f, i) == cache.pages(s, i) for i in range(L))
    free = cache.allocator.num_free
    cache.reserve(f, 1)  # the shared partial page is copied in every layer (copy-on-write)
    assert cache.allocator.num_free == free - L and all(cache.pages(f, i)[1] != cache.pages(s, i)[1] for i in range(L))
    assert cache.last_copies == tuple(PageCopy(f, 1, cache.pages(s, i)[1], cache.pages(f, i)[1], i) for i in range(L))
    for layer in range(L):
        assert torch.equal(cache.gather(layer, f)[0][:6], cache.gather(layer, s)[0])
    cache.truncate(f, 3)
    assert cache.seq_len(f) == 4 and cache.allocator.num_free == free and cache.seq_len(s) == 6
    with pytest.raises(ValueError, match="num_tokens must be <= seq_len=4"):
        cache.truncate(f, 5)
    cache.free(f)
    cache.free(s)
    assert cache.allocator.num_free == cache.allocator.num_pages


def test_truncate_that_needs_copies_the_pool_lacks_changes_nothing():
    cache = layered(num_pages=2, page_size=4)  # 6 layer pages
    s = cache.add_sequence()
    cache.reserve(s, 8)  # two full pages in each of the 3 layers: the pool is full
    f = cache.fork(s)
    with pytest.raises(OutOfPagesError):
        cache.truncate(f, 2)  # each layer's kept page 1 is shared and partly kept: 3 copies, 0 free
    assert cache.seq_len(f) == 8 and all(cache.pages(f, i) == cache.pages(s, i) for i in range(L))


def _a_fork_and_one_free_layer_page():
    """Two layers, page_size 2: ``f`` forks ``s`` (3 tokens: a full and a partial page per
    layer, all shared) and the pool has exactly one free layer page left (an uneven count,
    made by dropping a different page in each layer of another fork pair)."""
    cache = LayeredKVCache(num_layers=2, num_pages=4, page_size=2, num_kv_heads=HKV, head_dim=D)
    q = cache.add_sequence()
    append(cache, q, [torch.ones(4, HKV, D)] * 2, [torch.ones(4, HKV, D)] * 2)
    q2 = cache.fork(q)
    cache.drop_pages(q, [0, 1])  # q keeps A1 | B0; q2 alone holds A0 and B1
    cache.drop_pages(q2, [1, 1])  # q2 gives back A1 (q keeps it) and B1 (freed): one page
    s = cache.add_sequence()
    append(cache, s, [torch.randn(3, HKV, D) for _ in range(2)], [torch.randn(3, HKV, D) for _ in range(2)])
    f = cache.fork(s)
    assert cache.allocator.num_free == 1
    return cache, s, f


def test_a_compaction_whose_copies_the_pool_lacks_changes_no_layer():
    from cache_state import snapshot

    cache, s, f = _a_fork_and_one_free_layer_page()
    before = snapshot(cache)
    with pytest.raises(OutOfPagesError):  # one copy per layer of the shared page 0: 2 pages, 1 free
        cache.compact(f, torch.tensor([[True, False, True], [False, True, True]]))
    after = snapshot(cache)
    assert after == before, after.diff(before)
    assert [len(cache.pages(f, i)) for i in range(2)] == [2, 2] and cache.seq_len(f) == 3


def test_a_reserve_whose_copies_the_pool_lacks_changes_no_layer():
    """Writing into a shared partial page copies it in every layer: the copies count too."""
    from cache_state import snapshot

    cache, s, f = _a_fork_and_one_free_layer_page()
    before = snapshot(cache)
    with pytest.raises(OutOfPagesError):
        cache.reserve(f, 1)  # no new page, but one copy per layer: 2 pages, 1 free
    after = snapshot(cache)
    assert after == before, after.diff(before)


def test_a_session_whose_compaction_runs_out_of_pages_keeps_every_layer_alike():
    """A fork under token_topk appends past its budget; compacting it needs a copy of each shared
    page in each layer, more than the pool holds: the compaction changes no layer, the extend
    raises with every layer and the position counting the new tokens, and once the parent is
    finished (its pages no longer shared) the next step evicts as usual."""
    from paged_ref.hf import PagedSession
    from paged_ref.models import tiny_llama

    model = tiny_llama(seed=0)
    kv = LayeredKVCache.for_model(model, num_pages=6, page_size=4)  # 12 layer pages
    ids = torch.randint(3, 200, (14,), generator=torch.Generator().manual_seed(2))
    policy = make_policy("token_topk", 12, decision="per_layer")
    with PagedSession(model, kv_cache=kv) as session:
        root = session.add()
        session.extend([root], [ids[:10]])  # 3 pages in each of 2 layers
        s = session.fork(root, eviction=policy)  # 10 <= 12: nothing evicted, every page shared
        with pytest.raises(OutOfPagesError):  # 13 tokens: 2 copies + 2 new pages; then 4 copies, 2 free
            session.extend([s], [ids[10:13]])
        assert [len(kv.pages(s, i)) for i in range(2)] == [4, 4] and kv.seq_len(s) == 13 == session.position(s)
        assert [int(n) for n in (kv.block_table([s], layer=i)[1][0] for i in range(2))] == [13, 13]
        assert policy.stats(s).compactions == 0 and policy.stats(s).tokens_evicted == 0  # nothing was evicted
        session.finish(root)
        session.extend([s], [ids[13:14]])
        assert kv.seq_len(s) == 12 and session.position(s) == 14 and policy.positions(s).shape == (2, 12)
        assert policy.stats(s).compactions == 1 and policy.stats(s).tokens_evicted == 2


def test_scalars_where_lists_are_expected_are_named():
    from cache_state import snapshot

    cache = layered(num_pages=4, page_size=4)
    s = cache.add_sequence()
    append(cache, s, [torch.ones(6, HKV, D)] * L, [torch.ones(6, HKV, D)] * L)
    before = snapshot(cache)
    with pytest.raises(TypeError, match="logical_pages must be a list of logical page indices, got int"):
        cache.drop_pages(s, 0)
    with pytest.raises(TypeError, match="seq_ids must be a list of sequence ids"):
        cache.block_table(s)
    with pytest.raises(TypeError, match="namespace must be None or a dict"):
        cache.add_sequence(namespace="lora")
    assert snapshot(cache) == before
    cache.free(cache.add_sequence(namespace={"adapter": "lora"}))  # taken like PagedKVCache's (no prefix caching)


def test_seq_ids_layers_and_masks_are_checked_as_the_paged_cache_checks_them():
    """A seq_id must be an int (1.0 equals a live id 1 but is refused, a list is named, not unhashable), a layer
    is checked even for an empty batch, and a keep mask of the wrong dtype is described."""
    from cache_state import snapshot

    cache = layered()
    s = cache.add_sequence()
    cache.reserve(s, 3)
    before = snapshot(cache)
    for bad in (float(s), [s]):
        with pytest.raises(ValueError, match=r"seq_id .* is not a live sequence of this cache \(live: \[0\]\)"):
            cache.seq_len(bad)
        with pytest.raises(ValueError, match="is not a live sequence"):
            cache.reserve(bad, 1)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 3\), got 9"):
        cache.block_table([], layer=9)
    shape = r"got tensor of shape \[3, 3\] and dtype torch.float32"
    with pytest.raises(ValueError, match=r"keep must be a bool tensor .* " + shape):
        cache.compact(s, torch.ones(3, 3))
    assert snapshot(cache) == before


def test_a_rewind_given_another_sequences_mark_for_one_layer_changes_no_layer():
    """Every layer's mark is checked before any layer is rewound (the last layer goes first)."""
    from cache_state import snapshot

    cache = layered()
    a, b = cache.add_sequence(), cache.add_sequence()
    mark_a, mark_b = cache.mark(a), cache.mark(b)
    cache.reserve(a, 3)
    before = snapshot(cache)
    for bad in ((mark_b[0], *mark_a[1:]), (cache.pages(a, 0), *mark_a[1:]), mark_a[:2]):
        with pytest.raises(ValueError, match=r"mark must be the tuple mark\(0\) returned, got tuple"):
            cache.rewind(a, bad)
        assert snapshot(cache) == before, snapshot(cache).diff(before)
    cache.rewind(a, mark_a)
    assert cache.seq_len(a) == 0


@pytest.mark.parametrize("huge", [2**63, 10**30])
def test_huge_sizes_are_refused_by_name(huge):
    """The pool holds num_layers * num_pages pages, each id an int32 of the block tables."""
    sizes = dict(num_layers=2, num_pages=2, page_size=2, num_kv_heads=1, head_dim=1)
    with pytest.raises(ValueError, match=rf"num_layers must be in \[1, 2147483648\], got {huge}"):
        LayeredKVCache(**{**sizes, "num_layers": huge})
    with pytest.raises(ValueError, match=rf"num_pages must be in \[1, 1073741824\], got {huge}"):
        LayeredKVCache(**{**sizes, "num_pages": huge})
    with pytest.raises(ValueError, match=rf"bytes must be < 2\*\*63, got \d+: .*'page_size': {huge}"):
        LayeredKVCache(**{**sizes, "page_size": huge})


def test_write_refuses_k_recorded_by_autograd():
    cache = layered()
    s = cache.add_sequence()
    slots = cache.reserve(s, 2)
    k = torch.randn(2, HKV, D, requires_grad=True)
    with pytest.raises(ValueError, match="k requires grad"):
        cache.write(1, slots[1], k, k.detach())
    assert not cache.k_cache[1].requires_grad and not cache.k_cache[1].any()


def test_a_rewind_to_another_caches_mark_or_after_a_truncate_changes_no_layer():
    from cache_state import snapshot

    cache, other = layered(), layered()
    a, b = cache.add_sequence(), other.add_sequence()
    cache.reserve(a, 6)
    foreign, own = other.mark(b), cache.mark(a)
    cache.truncate(a, 2)
    before = snapshot(cache)
    for mark in (foreign, own, (*own[:1], *cache.mark(a)[1:])):
        with pytest.raises(ValueError, match=r"mark is stale: sequence 0 \(layer 0\) was truncated"):
            cache.rewind(a, mark)
        assert snapshot(cache) == before, snapshot(cache).diff(before)


def test_a_stale_mark_names_the_callers_sequence_and_its_layer():
    """Each layer of sequence 1 is a sequence of the pool with another id: the message names the caller's."""
    cache = layered()
    cache.add_sequence()
    s = cache.add_sequence()
    cache.reserve(s, 6)
    mark = cache.mark(s)
    assert [m.seq_id for m in mark] != [s] * len(mark)  # the pool's ids are not the caller's
    cache.truncate(s, 2)
    with pytest.raises(ValueError, match=rf"mark is stale: sequence {s} \(layer 0\) was truncated"):
        cache.rewind(s, mark)
