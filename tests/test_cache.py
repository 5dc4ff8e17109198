import numpy as np
import pytest
import torch

import paged_ref as pr
from paged_ref.cache import PageCopy
from paged_ref.quant import KVFormat

H, D = 2, 4


def make(num_pages=8, page_size=4, layers=2, **kw):
    return pr.PagedKVCache(
        num_layers=layers, num_pages=num_pages, page_size=page_size, num_kv_heads=H, head_dim=D, **kw
    )


def kv(n, start=0.0):
    k = torch.arange(n * H * D, dtype=torch.float32).view(n, H, D) + start  # [n, H, D]
    return k, -k


def fill(cache, seq, n, start=0.0, token_ids=None):
    slots = cache.reserve(seq, n, token_ids=token_ids)
    k, v = kv(n, start)
    for layer in range(cache.num_layers):
        cache.write(layer, slots, k + layer, v - layer)
    return k, v


def test_layout_and_reserve_write_gather():
    cache = make()
    assert cache.k_cache[0].shape == (8, 4, H, D) and len(cache.v_cache) == 2
    s = cache.add_sequence()
    slots = cache.reserve(s, 6)
    assert slots.tolist() == [0, 1, 2, 3, 4, 5] and cache.pages(s) == [0, 1]
    k, v = kv(6)
    cache.write(1, slots, k, v)
    gk, gv = cache.gather(1, s)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert cache.reserve(s, 3).tolist() == [6, 7, 8]  # fills page 1, then page 2
    assert cache.seq_len(s) == 9 and cache.pages(s) == [0, 1, 2]


def test_block_table_and_csr_for_ragged_batch():
    cache = make(num_pages=10)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.reserve(a, 5)
    cache.reserve(b, 4)
    cache.reserve(a, 4)
    bt, lens = cache.block_table([a, b])
    assert bt.tolist() == [[0, 1, 3], [2, 0, 0]] and lens.tolist() == [9, 4]
    indptr, indices, last = cache.csr([a, b])
    assert indptr.tolist() == [0, 3, 4] and indices.tolist() == [0, 1, 3, 2] and last.tolist() == [1, 4]


def test_out_of_pages_leaves_sequence_unchanged():
    cache = make(num_pages=2)
    s = cache.add_sequence()
    fill(cache, s, 5)
    with pytest.raises(pr.OutOfPagesError):
        cache.reserve(s, 4)
    assert cache.seq_len(s) == 5 and cache.pages(s) == [0, 1] and cache.allocator.num_free == 0
    cache.allocator.check()


def test_fork_copy_on_write():
    cache = make()
    a = cache.add_sequence()
    ka, _ = fill(cache, a, 6)  # pages [0, 1]; page 1 half full
    b = cache.fork(a)
    assert cache.pages(b) == [0, 1] and cache.allocator.refcount(1) == 2
    kb, _ = fill(cache, b, 1, start=100.0)
    assert cache.pages(b)[0] == 0 and cache.pages(b)[1] not in (0, 1)  # page 1 copied
    assert cache.last_copies == (PageCopy(seq_id=b, logical_page=1, source=1, page=cache.pages(b)[1]),)
    assert cache.allocator.refcount(1) == 1 and cache.allocator.refcount(0) == 2
    assert torch.equal(cache.gather(0, a)[0], ka)  # the parent is untouched
    assert torch.equal(cache.gather(0, b)[0], torch.cat([ka, kb]))
    with pytest.raises(ValueError, match="refcount 2"):
        cache.write(0, torch.tensor([0]), *kv(1))  # page 0 is still shared
    cache.free(a)
    cache.free(b)
    assert cache.allocator.num_free == 8
    cache.allocator.check()


def test_pow2_growth_reserves_ahead():
    cache = make(num_pages=16, page_size=2, growth="pow2")
    s = cache.add_sequence()
    held = []
    for _ in range(9):
        cache.reserve(s, 1)
        held.append(len(cache.pages(s)))
    assert held == [1, 1, 2, 2, 4, 4, 4, 4, 8]
    assert cache.block_table([s])[0].shape == (1, 5)  # only pages holding tokens are listed


def test_pow2_falls_back_to_exact_need():
    cache = make(num_pages=3, page_size=1, growth="pow2")
    s = cache.add_sequence()
    cache.reserve(s, 3)
    assert len(cache.pages(s)) == 3


def test_prefix_caching_shares_and_revives_pages():
    cache = make(num_pages=8, page_size=2, prefix_caching=True)
    prompt = [5, 6, 7, 8, 9]
    a = cache.add_sequence(token_ids=prompt)
    assert cache.seq_len(a) == 0
    ka, _ = fill(cache, a, 5, token_ids=prompt)
    b = cache.add_sequence(token_ids=prompt + [1, 2])
    assert cache.seq_len(b) == 4 and cache.pages(b) == cache.pages(a)[:2] and cache.prefix_hits == 2
    c = cache.add_sequence(token_ids=[5, 6, 0, 0, 0])  # first page matches, second does not
    assert cache.seq_len(c) == 2 and cache.prefix_hits == 3
    d = cache.add_sequence(token_ids=[5, 6, 7, 8])  # leaves the last token to compute
    assert cache.seq_len(d) == 2
    for s in (a, b, c, d):
        cache.free(s)
    assert cache.allocator.num_free == 8
    e = cache.add_sequence(token_ids=prompt)  # pages were returned but not reused: revived
    assert cache.seq_len(e) == 4
    assert torch.equal(cache.gather(0, e)[0], ka[:4])
    cache.allocator.check()


def test_prefix_cache_entry_dies_when_page_is_reused():
    cache = make(num_pages=2, page_size=2, prefix_caching=True)
    a = cache.add_sequence(token_ids=[1, 2, 3])
    fill(cache, a, 3, token_ids=[1, 2, 3])
    cache.free(a)
    b = cache.add_sequence()
    fill(cache, b, 4)  # takes both returned pages, overwriting them
    c = cache.add_sequence(token_ids=[1, 2, 3])
    assert cache.seq_len(c) == 0


def test_prefix_caching_off_by_default():
    cache = make(page_size=2)
    a = cache.add_sequence(token_ids=[1, 2, 3])
    fill(cache, a, 3, token_ids=[1, 2, 3])
    assert cache.seq_len(cache.add_sequence(token_ids=[1, 2, 3])) == 0 and cache.prefix_hits == 0


def test_drop_pages():
    cache = make(num_pages=8, page_size=2)
    s = cache.add_sequence()
    k, _ = fill(cache, s, 7)  # pages [0,1,2,3], last holds 1 token
    cache.drop_pages(s, [1])
    assert cache.seq_len(s) == 5 and cache.pages(s) == [0, 2, 3] and cache.allocator.refcount(1) == 0
    assert torch.equal(cache.gather(0, s)[0], torch.cat([k[:2], k[4:]]))
    cache.drop_pages(s, [2])  # the partial last page
    assert cache.seq_len(s) == 4
    with pytest.raises(ValueError, match=r"logical_pages must be in \[0, 2\)"):
        cache.drop_pages(s, [2])
    cache.allocator.check()


def test_compact_keeps_tokens_in_order_and_frees_pages():
    cache = make(num_pages=8, page_size=2)
    s = cache.add_sequence()
    k, v = fill(cache, s, 7)
    other = cache.fork(s)  # pages shared: compact must copy, not corrupt the fork
    keep = torch.tensor([1, 0, 0, 1, 1, 0, 1], dtype=torch.bool)
    cache.compact(s, keep)
    assert cache.seq_len(s) == 4 and len(cache.pages(s)) == 2
    for layer in range(2):
        gk, gv = cache.gather(layer, s)
        assert torch.equal(gk, k[keep] + layer) and torch.equal(gv, v[keep] - layer)
    assert torch.equal(cache.gather(0, other)[0], k)
    cache.free(other)
    cache.free(s)
    assert cache.allocator.num_free == 8


@pytest.mark.parametrize(
    "call, exc, msg",
    [
        (lambda c, s: c.reserve(s, 0), ValueError, "num_tokens must be >= 1, got 0"),
        (lambda c, s: c.reserve(99, 1), ValueError, r"seq_id 99 is not a live sequence"),
        (lambda c, s: c.reserve(s, 2, token_ids=[1]), ValueError, "token_ids must have num_tokens=2"),
        (lambda c, s: c.write(2, torch.tensor([0]), *kv(1)), ValueError, r"layer must be in \[0, 2\), got 2"),
        (lambda c, s: c.write(0, [0], *kv(1)), TypeError, "slots must be a 1-D int32/int64 tensor"),
        (
            lambda c, s: c.write(0, torch.tensor([0]), *kv(2)),
            ValueError,
            r"k must have shape .* = \[1, 2, 4\], got \[2, 2, 4\]",
        ),
        (
            lambda c, s: c.write(0, torch.tensor([0]), kv(1)[0].double(), kv(1)[1]),
            TypeError,
            "k must have the cache dtype",
        ),
        (lambda c, s: c.write(0, torch.tensor([32]), *kv(1)), ValueError, r"slots must be in \[0, 32\)"),
        (lambda c, s: c.write(0, torch.tensor([20]), *kv(1)), ValueError, "page 5 with refcount 0"),
        (lambda c, s: c.gather(0, 7), ValueError, "seq_id 7 is not a live sequence"),
        (
            lambda c, s: c.compact(s, torch.ones(3)),
            ValueError,
            r"keep must be a bool tensor of shape \[seq_len\] = \[1\]",
        ),
        (lambda c, s: c.block_table(s), TypeError, "seq_ids must be a list"),
        (
            lambda c, s: pr.PagedKVCache(num_layers=1, num_pages=1, page_size=0, num_kv_heads=1, head_dim=1),
            ValueError,
            "page_size must be >= 1, got 0",
        ),
        (
            lambda c, s: pr.PagedKVCache(
                num_layers=1, num_pages=1, page_size=1, num_kv_heads=1, head_dim=1, growth="x"
            ),
            ValueError,
            "growth must be one of",
        ),
        (
            lambda c, s: pr.PagedKVCache(num_layers=1, num_pages=1, page_size=1, num_kv_heads=1, head_dim=1, dtype="f"),
            TypeError,
            "dtype must be a floating torch.dtype",
        ),
    ],
)
def test_errors_name_argument_and_leave_state(call, exc, msg):
    cache = make()
    s = cache.add_sequence()
    fill(cache, s, 1)
    before = (cache.seq_len(s), cache.pages(s), cache.allocator.num_free, cache.k_cache[0].clone())
    with pytest.raises(exc, match=msg):
        call(cache, s)
    assert (cache.seq_len(s), cache.pages(s), cache.allocator.num_free) == before[:3]
    assert torch.equal(cache.k_cache[0], before[3])


def test_freed_sequence_is_unknown():
    cache = make()
    s = cache.add_sequence()
    cache.free(s)
    with pytest.raises(ValueError, match="not a live sequence"):
        cache.free(s)


def test_write_can_skip_the_slot_check_but_not_the_shape_check():
    cache = make()
    s = cache.add_sequence()
    slots = cache.reserve(s, 2)
    k, v = kv(2)
    cache.write(0, slots, k, v, check_values=False)
    assert torch.equal(cache.gather(0, s)[0], k)
    with pytest.raises(ValueError, match="k must have shape"):
        cache.write(0, slots, k[:1], v, check_values=False)


# --- prefix-cache keys: collision-resistant, namespaced, confirmed by the tokens ---------------
def _cached(cache, prompt):
    """Prefill ``prompt`` into a fresh sequence (K/V = token id) and return the sequence id."""
    s = cache.add_sequence(token_ids=prompt)
    n = len(prompt) - cache.seq_len(s)
    slots = cache.reserve(s, n, token_ids=prompt[cache.seq_len(s) :])
    kv = torch.tensor(prompt[-n:], dtype=torch.float32).view(n, 1, 1)
    cache.write(0, slots, kv, kv)
    return s


def _prefix_cache(**kw):
    return pr.PagedKVCache(
        num_layers=1, num_pages=16, page_size=16, num_kv_heads=1, head_dim=1, prefix_caching=True, **kw
    )


@pytest.mark.parametrize(
    "first, second",
    [
        ([-1] * 16 + [3], [-2] * 16 + [3]),  # hash(-1) == hash(-2) in CPython
        ([7] * 16 + [3], [7 + 2**61 - 1] * 16 + [3]),  # hash(x) == hash(x + 2**61 - 1)
    ],
)
def test_colliding_python_hashes_do_not_share_pages(first, second):
    cache = _prefix_cache()
    _cached(cache, first)
    s = cache.add_sequence(token_ids=second)
    assert cache.seq_len(s) == 0 and cache.prefix_hits == 0


def test_equal_tokens_hit_within_a_namespace_and_miss_across():
    prompt = list(range(40))
    a = _prefix_cache(prefix_namespace={"model": "m1"})
    _cached(a, prompt)
    assert a.seq_len(a.add_sequence(token_ids=prompt)) == 32 and a.prefix_hits == 2
    # another model (or adapter) writes different K/V for the same tokens: no reuse
    b = _prefix_cache(prefix_namespace={"model": "m1", "adapter": "lora-7"})
    _cached(b, prompt)
    keys_b = set(b._prefix.page_of)
    assert not keys_b & set(a._prefix.page_of)
    # fields are tagged: moving text between fields gives another namespace
    c1 = _prefix_cache(prefix_namespace={"model": "ab", "adapter": "c"})
    c2 = _prefix_cache(prefix_namespace={"model": "a", "adapter": "bc"})
    assert c1._prefix_root != c2._prefix_root


def test_a_key_alone_is_not_trusted():
    cache = _prefix_cache()
    _cached(cache, list(range(17)))
    page = next(iter(next(iter(cache._prefix.page_of.values()))))
    cache._prefix.tokens_of[page] = tuple(range(100, 116))  # as if another prefix sat there
    assert cache.seq_len(cache.add_sequence(token_ids=list(range(17)))) == 0


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(prefix_caching="no"), TypeError, "prefix_caching must be True or False, got 'no'"),
        (dict(dtype=torch.int32), TypeError, "dtype must be a floating torch.dtype"),
        (dict(dtype=torch.bool), TypeError, "dtype must be a floating torch.dtype"),
        (dict(dtype=torch.complex64), TypeError, "dtype must be a floating torch.dtype"),
        (dict(device="meta"), ValueError, "device must hold real memory"),
        (dict(prefix_namespace={"model": 3}), TypeError, "prefix_namespace must be None or a dict"),
    ],
)
def test_constructor_rejects(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        pr.PagedKVCache(num_layers=1, num_pages=2, page_size=2, num_kv_heads=1, head_dim=1, **kwargs)


def test_token_ids_must_be_ints_and_free_none_is_refused():
    cache = _prefix_cache()
    with pytest.raises(TypeError, match=r"token_ids\[0\] must be an int, got float"):
        cache.add_sequence(token_ids=[1.5, 2])
    s = cache.add_sequence()
    with pytest.raises(TypeError, match=r"token_ids\[1\] must be an int, got bool"):
        cache.reserve(s, 2, token_ids=[1, True])
    assert cache.seq_len(s) == 0 and cache.allocator.num_free == 16  # nothing changed
    with pytest.raises(ValueError, match="seq_id None is not a live sequence"):
        cache.free(None)


# --------------------------------------------------------------------------- truncate
def _filled(cache, seq, n, seed, token_ids=None):
    """Reserve and write ``n`` random tokens; returns their K/V per layer ([n, Hkv, D] each)."""
    g = torch.Generator().manual_seed(seed)
    slots = cache.reserve(seq, n, token_ids=token_ids)
    kvs = []
    for layer in range(cache.num_layers):
        k = torch.randn(n, cache.num_kv_heads, cache.head_dim, generator=g)
        v = torch.randn(n, cache.num_kv_heads, cache.head_dim, generator=g)
        cache.write(layer, slots, k, v)
        kvs.append((k, v))
    return kvs


@pytest.mark.parametrize("page_size, before, added", [(4, 5, 7), (4, 4, 4), (1, 3, 2), (8, 0, 13), (16, 9, 1)])
def test_truncate_undoes_reserve(page_size, before, added):
    cache = pr.PagedKVCache(num_layers=2, num_pages=8, page_size=page_size, num_kv_heads=2, head_dim=4)
    seq = cache.add_sequence()
    kept = _filled(cache, seq, before, seed=1) if before else None
    pages, free = cache.pages(seq), cache.allocator.num_free
    _filled(cache, seq, added, seed=2)
    cache.truncate(seq, added)
    assert cache.seq_len(seq) == before and cache.pages(seq) == pages and cache.allocator.num_free == free
    for layer in range(2):
        k, v = cache.gather(layer, seq)
        if kept:
            assert torch.equal(k, kept[layer][0]) and torch.equal(v, kept[layer][1])
        if before % page_size:  # the vacated slots of the last page are zero again
            page = pages[-1]
            assert not cache.k_cache[layer][page, before % page_size :].any()
    for page in range(cache.num_pages):  # pages given back hold nothing
        if cache.allocator.refcount(page) == 0:
            assert not cache.k_cache[0][page].any() and not cache.v_cache[1][page].any()


def test_truncate_checks_its_argument_and_changes_nothing_on_error():
    cache = pr.PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=2)
    seq = cache.add_sequence()
    cache.reserve(seq, 6)
    with pytest.raises(ValueError, match=r"num_tokens must be <= seq_len=6 for sequence 0, got 7"):
        cache.truncate(seq, 7)
    with pytest.raises(ValueError, match="num_tokens"):
        cache.truncate(seq, -1)
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        cache.truncate(seq, 1.0)
    assert cache.seq_len(seq) == 6 and len(cache.pages(seq)) == 2
    cache.truncate(seq, 0)
    assert cache.seq_len(seq) == 6


def test_truncate_keeps_prefix_caching_and_never_touches_a_shared_page():
    cache = pr.PagedKVCache(num_layers=1, num_pages=12, page_size=4, num_kv_heads=1, head_dim=2, prefix_caching=True)
    prompt = list(range(10, 22))  # 12 tokens: 3 full pages
    a = cache.add_sequence(token_ids=prompt)
    kv_a = _filled(cache, a, 12, seed=3, token_ids=prompt)
    b = cache.add_sequence(token_ids=prompt + [99])  # shares a's first 3 pages (the last token is computed)
    assert cache.pages(b) == cache.pages(a)[:3] and cache.seq_len(b) == 12
    cache.truncate(b, 2)  # into a's third page: shared, so b gets its own copy of it
    assert cache.seq_len(b) == 10 and cache.pages(b)[:2] == cache.pages(a)[:2]
    assert cache.pages(b)[2] != cache.pages(a)[2] and not cache.k_cache[0][cache.pages(b)[2], 2:].any()
    k_a, _ = cache.gather(0, a)
    k_b, _ = cache.gather(0, b)
    assert torch.equal(k_a, kv_a[0][0]) and torch.equal(k_b, kv_a[0][0][:10])  # a untouched, b its prefix
    _filled(cache, b, 3, seed=4, token_ids=[7, 8, 9])
    # b's own tail goes and comes back with other tokens; b's first two pages stay findable
    cache.truncate(b, 5)
    c = cache.add_sequence(token_ids=prompt[:8] + [1, 2])
    assert cache.pages(c)[:2] == cache.pages(a)[:2] and cache.seq_len(c) == 8


def test_truncate_into_a_shared_page_without_a_free_page_changes_nothing():
    cache = pr.PagedKVCache(num_layers=1, num_pages=2, page_size=4, num_kv_heads=1, head_dim=2)
    a = cache.add_sequence()
    _filled(cache, a, 6, seed=5)
    b = cache.fork(a)  # shares both pages; the pool is empty
    with pytest.raises(pr.OutOfPagesError):
        cache.truncate(b, 1)  # the second page would need a private copy
    assert cache.seq_len(b) == 6 and cache.pages(b) == cache.pages(a)
    cache.truncate(b, 2)  # the shared first page is kept whole: no copy needed
    assert cache.seq_len(b) == 4 and cache.pages(b) == cache.pages(a)[:1]


def test_an_empty_namespace_is_no_namespace():
    cache = _prefix_cache()
    prompt = list(range(40))
    _cached(cache, prompt)
    assert cache.seq_len(cache.add_sequence(token_ids=prompt, namespace={})) == 32
    assert cache.seq_len(cache.add_sequence(token_ids=prompt, namespace=None)) == 32
    assert cache.seq_len(cache.add_sequence(token_ids=prompt, namespace={"adapter": "x"})) == 0


@pytest.mark.parametrize(
    "call, exc, msg",
    [
        (lambda c, s: c.drop_pages(s, 0), TypeError, "logical_pages must be a list of logical page indices, got int"),
        (
            lambda c, s: c.add_sequence(token_ids=5),
            TypeError,
            "token_ids must be a list of ints or a 1-D integer tensor, got int",
        ),
        (lambda c, s: c.reserve(s, 1, token_ids=5), TypeError, "token_ids must be a list"),
        (lambda c, s: c.block_table(np.int64(0)), TypeError, "seq_ids must be a list of sequence ids"),
        (lambda c, s: c.csr(s), TypeError, "seq_ids must be a list of sequence ids"),
    ],
)
def test_scalars_where_lists_are_expected_are_named(call, exc, msg):
    from cache_state import snapshot

    cache = make()
    s = cache.add_sequence()
    fill(cache, s, 5)
    before = snapshot(cache)
    with pytest.raises(exc, match=msg):
        call(cache, s)
    assert snapshot(cache) == before


def test_rewind_takes_only_the_sequences_own_mark():
    cache = make()
    a, b = cache.add_sequence(), cache.add_sequence()
    mark = cache.mark(a)
    cache.reserve(a, 3)
    with pytest.raises(ValueError, match="mark must be a SequenceMark of sequence 1"):
        cache.rewind(b, mark)
    with pytest.raises(ValueError, match="mark must be a SequenceMark of sequence 0, got tuple"):
        cache.rewind(a, ())
    assert cache.seq_len(a) == 3
    cache.rewind(a, mark)
    assert cache.seq_len(a) == 0 and cache.pages(a) == [] and cache.allocator.num_free == 8


@pytest.mark.parametrize("kv_format", [None, KVFormat(torch.int8, scales="page")], ids=["float", "int8-page"])
def test_rollback_undoes_a_rewind_to_a_mark_taken_before_the_checkpoint(kv_format):
    """A mark stays valid while its sequence only reserves and writes, so a step may rewind to one taken
    before its checkpoint; rolling the step back must then bring back the tokens' ids and prefix keys (the
    rewind shortened them) and, with 8-bit pages scaled per page, the last page it restored."""
    from cache_state import snapshot

    cache = make(page_size=2, prefix_caching=True, kv_format=kv_format)
    s = cache.add_sequence()
    fill(cache, s, 1, token_ids=[5])
    mark = cache.mark(s)
    fill(cache, s, 3, start=100.0, token_ids=[6, 7, 8])  # the last page's scale grows: its token re-quantized
    cache.checkpoint()
    before = snapshot(cache)
    cache.rewind(s, mark)
    cache.rollback()
    assert snapshot(cache) == before, snapshot(cache).diff(before)
    other = cache.add_sequence(token_ids=[5, 6, 7, 8, 9])  # the keys are back: both full pages hit
    assert cache.pages(other) == cache.pages(s)[:2]


def test_seq_ids_choices_and_token_ids_are_checked_at_every_door():
    """A list where a seq_id or a choice is expected is named (not Python's "unhashable type"), and
    cached_prefix checks its token ids with prefix caching off as on."""
    from cache_state import snapshot

    cache = make()
    s = cache.add_sequence()
    fill(cache, s, 5)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"seq_id \[0\] is not a live sequence"):
        cache.reserve_batch([[s]], [1])
    with pytest.raises(TypeError, match="token_ids must be a list of ints"):
        cache.cached_prefix("abc")
    with pytest.raises(TypeError, match=r"token_ids\[0\] must be an int, got float"):
        cache.cached_prefix([1.5])
    assert snapshot(cache) == before
    with pytest.raises(ValueError, match=r"growth must be one of \['page', 'pow2'\], got \['page'\]"):
        make(growth=["page"])


def test_block_table_and_csr_take_device_0_as_cuda_0():
    """``device=0`` names cuda:0 as it does for torch, not "the cache's device" (it is falsy)."""
    cache = make()
    s = cache.add_sequence()
    fill(cache, s, 5)
    for call in (lambda: cache.block_table([s], device=0)[0], lambda: cache.csr([s], device=0)[0]):
        if torch.cuda.is_available():
            assert call().device == torch.device("cuda", 0)
        else:
            with pytest.raises((RuntimeError, AssertionError), match="(?i)cuda|accelerator"):
                call()


@pytest.mark.parametrize("huge", [2**63, 10**30])
@pytest.mark.parametrize("arg", ["num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim"])
def test_sizes_beyond_what_torch_holds_are_refused_by_name(arg, huge):
    """Page ids are int32 in block tables (num_pages <= 2**31); K and V of every layer must take fewer than
    2**63 bytes (torch's sizes are int64): a ValueError naming the sizes, not torch's overflow."""
    sizes = dict(num_layers=1, num_pages=2, page_size=2, num_kv_heads=1, head_dim=1)
    if arg == "num_pages":
        words = rf"num_pages must be in \[1, 2147483648\], got {huge}$"
    else:
        words = r"2 \* num_layers \* num_pages \* page_size \* num_kv_heads \* head_dim \* 4 bytes must be < 2\*\*63, "
        words += rf"got {2 * 2 * 2 * huge * 4 // (2 if arg == 'page_size' else 1)}: .*'{arg}': {huge}"
    with pytest.raises(ValueError, match=words):
        pr.PagedKVCache(**{**sizes, arg: huge})


def test_sizes_that_fit_one_by_one_but_not_together_are_refused():
    """2 (K and V) * 2**31 pages * 2**30 tokens * 2 bytes = 2**63: one byte too many."""
    with pytest.raises(ValueError, match=rf"2 bytes must be < 2\*\*63, got {2**63}: "):
        pr.PagedKVCache(num_layers=1, num_pages=2**31, page_size=2**30, num_kv_heads=1, head_dim=1, dtype=torch.float16)


@pytest.mark.parametrize("kv_format", [None, KVFormat(torch.int8, scales="page")], ids=["float", "int8-page"])
def test_write_refuses_k_or_v_recorded_by_autograd_and_stores_values_under_no_grad(kv_format):
    """As the native ops: a tensor requiring grad while autograd records is refused (the cache would start
    tracking gradients, its pages part of a graph), naming it; under no_grad its values are stored."""
    from cache_state import snapshot

    cache = make(kv_format=kv_format)
    s = cache.add_sequence()
    fill(cache, s, 3)
    slots = cache.reserve(s, 2)
    before = snapshot(cache)
    w = torch.randn(2, H, D, requires_grad=True)
    for k, v, name in [(w, w.detach(), "k"), (w.detach(), w * 2, "v")]:
        with pytest.raises(ValueError, match=rf"^{name} requires grad: write under torch.no_grad\(\), or pass {name}"):
            cache.write(0, slots, k, v)
        assert snapshot(cache) == before
    with torch.no_grad():
        cache.write(0, slots, w, w * 2)
    assert not any(t.requires_grad for t in (*cache.k_cache, *cache.v_cache, *cache.kv_scales(0)) if t is not None)
    k, v = cache.gather(0, s)
    tol = dict(atol=0, rtol=0) if kv_format is None else dict(atol=0.1, rtol=0)  # int8: half a step of amax / 127
    torch.testing.assert_close(k[3:], w.detach(), **tol)
    torch.testing.assert_close(v[3:], 2 * w.detach(), **tol)


def _rewound_then_shared():
    """a rewinds to its first mark, giving back the page its later mark holds; b takes that page."""
    cache = make(num_pages=2, page_size=2, layers=1)
    a = cache.add_sequence()
    fill(cache, a, 1)
    first = cache.mark(a)
    fill(cache, a, 2)  # into page 1
    later = cache.mark(a)
    cache.rewind(a, first)
    fill(cache, cache.add_sequence(), 1)  # b holds page 1 now
    return cache, a, later


def _another_caches():
    cache, other = make(), make()
    for c in (cache, other):
        fill(c, c.add_sequence(), 3)
    mark = other.mark(0)
    fill(cache, 0, 2)
    return cache, 0, mark


def _shrunk(how):
    def build():
        cache = make()
        a = cache.add_sequence()
        fill(cache, a, 6)
        mark = cache.mark(a)
        how(cache, a)
        return cache, a, mark

    return build


@pytest.mark.parametrize(
    "build",
    [
        _rewound_then_shared,
        _another_caches,
        _shrunk(lambda c, a: c.truncate(a, 3)),
        _shrunk(lambda c, a: (c.truncate(a, 3), fill(c, a, 3))),  # as long as at the mark again
        _shrunk(lambda c, a: c.compact(a, torch.tensor([True, False, True, True, True, True]))),
        _shrunk(lambda c, a: c.drop_pages(a, [0])),
        _shrunk(lambda c, a: c.rewind(a, c.mark(a))),  # a rewind gives the sequence a new page list
    ],
    ids=["later-mark-after-rewind", "another-cache", "truncated", "truncated-grown", "compacted", "dropped", "rewound"],
)
def test_a_stale_mark_is_refused_and_changes_nothing(build):
    """A mark undoes only reserves and writes, once: after a truncate, compact, drop_pages or rewind of its
    sequence, or from another cache, rewinding to it would share pages another sequence holds now (a rewind to
    a mark taken after the one just rewound to), or put back a length the pages no longer hold."""
    from cache_state import snapshot

    cache, seq, mark = build()
    before = snapshot(cache)
    with pytest.raises(ValueError, match=rf"mark is stale: sequence {seq} was truncated, .* or .* another cache's"):
        cache.rewind(seq, mark)
    assert snapshot(cache) == before, snapshot(cache).diff(before)
    cache.allocator.check()
    fresh = cache.mark(seq)
    cache.reserve(seq, 1)
    cache.rewind(seq, fresh)
    assert snapshot(cache) == before, snapshot(cache).diff(before)


def test_write_takes_check_values_as_true_or_false_only():
    cache = pr.PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8)
    s = cache.add_sequence()
    slots = cache.reserve(s, 2)
    k = torch.randn(2, 2, 8)
    with pytest.raises(TypeError, match="check_values must be True or False, got 'no'"):
        cache.write(0, slots, k, k, check_values="no")
    assert not cache.k_cache[0].any()


def test_an_upper_bound_alone_is_stated_as_one():
    from paged_ref._validate import check_int

    with pytest.raises(ValueError, match=r"^x must be <= 3, got 4$"):
        check_int("x", 4, max_value=3)
    with pytest.raises(ValueError, match=r"^x must be in \[0, 3\], got 4$"):
        check_int("x", 4, min_value=0, max_value=3)
