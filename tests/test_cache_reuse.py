"""Which free page is reused, and when a cached page may be: vLLM's prefix-caching scenarios.

Ported from vLLM's KV-cache manager tests (`test_prefill`, `test_evict`): page ids differ from
vLLM's (its block 0 is a reserved null block) but the hit counts are theirs.
"""

import pytest
import torch

import paged_ref as pr


def cache(num_pages, page_size=16, layers=1):
    return pr.PagedKVCache(
        num_layers=layers, num_pages=num_pages, page_size=page_size, num_kv_heads=1, head_dim=2, prefix_caching=True
    )


def prefill(c, prompt, namespace=None):
    """Add a sequence for ``prompt`` and write K/V = token id for the tokens not found cached."""
    s = c.add_sequence(token_ids=prompt, namespace=namespace)
    held = c.seq_len(s)
    if held < len(prompt):
        new = prompt[held:]
        slots = c.reserve(s, len(new), token_ids=new)
        kv = torch.tensor(new, dtype=torch.float32).view(-1, 1, 1).expand(-1, 1, 2)
        for layer in range(c.num_layers):
            c.write(layer, slots, kv.contiguous(), kv.contiguous())
    return s


def test_allocator_order_fresh_then_plain_then_cached_lru():
    alloc = pr.PageAllocator(6)
    a, b = alloc.allocate(3), alloc.allocate(3)  # [0, 1, 2], [3, 4, 5]
    alloc.free(a[::-1], cached=a)  # cached, returned 2, 1, 0
    alloc.free(b[::-1], cached=[5])  # 5 cached; 4, 3 plain
    assert alloc.allocate(2) == [4, 3]  # plain pages first
    assert alloc.allocate(3) == [2, 1, 0]  # then cached, least recently returned
    assert alloc.allocate(1) == [5]
    with pytest.raises(TypeError, match="cached must be a list of page ids, got None"):
        alloc.free([0], cached=None)
    alloc.check()


def test_vllm_prefill_scenario_keeps_the_common_prefix():
    """Pages 0-2 hold a cached common prefix, 3-4 unhashed tails, 5-9 were never used."""
    c = cache(10)
    common = list(range(3 * 16))
    a = prefill(c, common + list(range(100, 107)))  # pages 0-2 full, 3 partial
    b = prefill(c, common + list(range(200, 205)))  # hits 0-2, takes 4
    assert c.prefix_hits == 3 and c.pages(a) == [0, 1, 2, 3] and c.pages(b) == [0, 1, 2, 4]
    c.free(a)
    c.free(b)
    # an unrelated request of 7 pages takes the never-used pages and the unhashed tails
    other = prefill(c, list(range(1000, 1000 + 7 * 16)))
    assert sorted(c.pages(other)) == [3, 4, 5, 6, 7, 8, 9]
    c.free(other)
    c.prefix_hits = 0
    prefill(c, common + [7])
    assert c.prefix_hits == 3  # as vLLM: 3


def test_vllm_evict_scenario_evicts_chains_from_the_tail():
    """req0: 5 full pages + 1 partial, req1: 3 full pages, no page to spare; both finish."""
    c = cache(9)
    r0 = list(range(5 * 16 + 7))
    r1 = list(range(500, 500 + 3 * 16))
    s0, s1 = prefill(c, r0), prefill(c, r1)
    assert c.allocator.num_free == 0
    c.free(s0)
    c.free(s1)
    # touch req0's first 2 pages and add 3 tokens: the new page is req0's unhashed tail
    touch = prefill(c, r0[: 2 * 16] + [9, 9, 9])
    assert c.prefix_hits == 2 and c.pages(touch) == [0, 1, 5]
    c.free(touch)
    c.prefix_hits = 0
    prefill(c, r0)
    assert c.prefix_hits == 5  # as vLLM: 5


def test_a_page_is_published_when_reserved_and_a_sharer_reads_what_the_forward_writes():
    """As vLLM caches a block when it allocates it: B, added between A's reserve and A's write, shares
    A's full pages; A's write into them is allowed until its last layer, and B reads it."""
    c = cache(8, page_size=4, layers=2)
    prompt = list(range(9))
    a = c.add_sequence(token_ids=prompt)
    slots = c.reserve(a, 9, token_ids=prompt)  # fills pages 0 and 1, K/V not written yet
    b = c.add_sequence(token_ids=prompt)  # sequence B arrives in between
    assert c.seq_len(b) == 8 and c.prefix_hits == 2 and c.allocator.refcount(0) == 2
    kv = torch.arange(9.0).view(9, 1, 1).expand(9, 1, 2).contiguous()
    for layer in range(2):
        c.write(layer, slots, kv, kv)  # A's forward: into pages B shares, until they are written
    assert torch.equal(c.gather(0, b)[0], kv[:8]) and torch.equal(c.gather(1, b)[1], kv[:8])
    with pytest.raises(ValueError, match="refcount 2"):  # written: a shared page again, refused
        c.write(0, slots[:4], kv[:4], kv[:4])


def test_per_sequence_namespaces_never_share_pages():
    c = cache(8, page_size=4)
    prompt = list(range(9))
    prefill(c, prompt, namespace={"adapter": "lora-1"})
    assert c.seq_len(c.add_sequence(token_ids=prompt, namespace={"adapter": "lora-2"})) == 0
    assert c.seq_len(c.add_sequence(token_ids=prompt)) == 0  # the base model either
    assert c.seq_len(c.add_sequence(token_ids=prompt, namespace={"adapter": "lora-1"})) == 8
    with pytest.raises(TypeError, match="namespace must be None or a dict of str -> str"):
        c.add_sequence(token_ids=prompt, namespace={"adapter": 1})
    assert c.seq_ids == [0, 1, 2, 3]  # the refused one added nothing


def test_pages_come_out_zeroed_and_compact_zeroes_what_it_vacates():
    c = pr.PagedKVCache(num_layers=2, num_pages=2, page_size=4, num_kv_heads=1, head_dim=2)
    a = c.add_sequence()
    slots = c.reserve(a, 8)
    bad = torch.full((8, 1, 2), float("nan"))
    for layer in range(2):
        c.write(layer, slots, bad, bad)
    c.free(a)
    b = c.add_sequence()
    slots = torch.cat([c.reserve(b, 3), c.reserve(b, 3)])  # stale NaN pages handed out again
    assert all(not t.isnan().any() for t in (*c.k_cache, *c.v_cache))
    good = torch.ones(6, 1, 2)
    for layer in range(2):
        c.write(layer, slots, good, good)
    c.compact(b, torch.tensor([True, False, True, False, False, True]))
    page = c.pages(b)[0]
    for t in (*c.k_cache, *c.v_cache):
        assert not t[page, 3:].any()  # the vacated tail holds zeros


@pytest.mark.parametrize("leave", ["free", "truncate", "drop_pages", "compact"])
def test_a_page_whose_last_holder_leaves_before_its_forward_writes_it_is_not_reused(leave):
    """A reservation publishes the page it fills before the forward writes it; if the sequence lets it go
    first (every layer unwritten, or only some), no forward will ever write it: a later prompt with the same
    tokens must compute them, not take a page of zeros (or of layer 0 alone) as their K/V."""
    c = cache(4, page_size=2, layers=2)
    s = c.add_sequence()
    slots = c.reserve(s, 3, token_ids=[5, 6, 7])  # page 0 full: published, unwritten
    k = torch.ones(3, 1, 2)
    c.write(0, slots, k, k)  # layer 0 only: the forward stops here
    {
        "free": lambda: c.free(s),
        "truncate": lambda: c.truncate(s, 3),
        "drop_pages": lambda: c.drop_pages(s, [0]),
        "compact": lambda: c.compact(s, torch.zeros(3, dtype=torch.bool)),
    }[leave]()
    assert c.cached_prefix([5, 6, 7]) == []
    other = c.add_sequence(token_ids=[5, 6, 7])
    assert c.seq_len(other) == 0 and c.prefix_hits == 0
    assert not c.k_cache[0][0].any()  # the page went back as a plain page: zeroed


def test_written_says_a_sequences_pages_hold_their_kv_as_a_last_layer_write_does():
    """`PagedKVCache.written`, the public door a dry run (no K/V to write) uses: the pages it names stay
    cached when their holder goes, as if every layer had been written."""
    c = cache(4, page_size=2, layers=2)
    s = c.add_sequence()
    c.reserve(s, 3, token_ids=[5, 6, 7])  # page 0 full: published, unwritten
    pages = c.pages(s)
    c.written(s)
    c.free(s)
    assert c.cached_prefix([5, 6, 7]) == pages[:1]
    with pytest.raises(ValueError, match="seq_id 0 is not a live sequence"):
        c.written(s)
