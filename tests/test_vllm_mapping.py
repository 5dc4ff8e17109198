"""The paged_ref side of the README's vLLM / FlashInfer table: each structure has the layout,
dtype and values the table says (so the mapping cannot silently go stale)."""

import torch

import paged_ref as pr


def _cache(**options):
    cache = pr.PagedKVCache(num_layers=2, num_pages=12, page_size=4, num_kv_heads=2, head_dim=8, **options)
    seqs = [cache.add_sequence() for _ in range(3)]
    for seq, n in zip(seqs, (5, 8, 1)):
        slots = cache.reserve(seq, n)
        for layer in range(2):
            cache.write(layer, slots, torch.randn(n, 2, 8), torch.randn(n, 2, 8))
    return cache, seqs


def test_one_layer_is_nhd_pages():
    cache, _ = _cache()
    assert cache.k_cache[0].shape == cache.v_cache[0].shape == (12, 4, 2, 8)  # [pages, page_size, Hkv, D]
    stacked = torch.stack([cache.k_cache[0], cache.v_cache[0]])  # vLLM's flash layout for one layer
    assert stacked.shape == (2, 12, 4, 2, 8)


def test_pool_size_from_a_byte_budget():
    cache, _ = _cache()
    total = sum(t.numel() * t.element_size() for t in (*cache.k_cache, *cache.v_cache))
    assert total == cache.num_pages * cache.page_bytes
    budget = 10 * cache.page_bytes + 1
    assert budget // cache.page_bytes == 10


def test_slot_mapping_is_page_times_page_size_plus_offset():
    cache, seqs = _cache()
    pages = cache.pages(seqs[0])
    slots = cache.reserve(seqs[0], 4)  # tokens 5..8
    assert slots.dtype == torch.int64
    grown = cache.pages(seqs[0])  # token 8 needed a third page
    assert grown[:2] == pages and len(grown) == 3
    want = [grown[t // 4] * 4 + t % 4 for t in range(5, 9)]
    assert slots.tolist() == want
    assert pr.slot_mapping(grown, start=5, num_tokens=4, page_size=4).tolist() == want


def test_block_table_and_csr_follow_the_engines_conventions():
    cache, seqs = _cache()
    table, lens = cache.block_table(seqs)
    assert table.dtype == lens.dtype == torch.int32 and table.shape == (3, 2) and lens.tolist() == [5, 8, 1]
    assert table[2, 1] == 0  # padding
    indptr, indices, last = cache.csr(seqs)
    assert all(t.dtype == torch.int32 for t in (indptr, indices, last))
    assert indptr.tolist() == [0, 2, 4, 5] and len(indices) == 5
    assert last.tolist() == [1, 4, 1] and all(1 <= x <= 4 for x in last.tolist())
    tables, back = pr.from_csr(indptr, indices, last, page_size=4)
    assert back == [5, 8, 1] and tables == [cache.pages(s) for s in seqs]
    assert indices.tolist() == [p for s in seqs for p in cache.pages(s)]


def test_prefix_sharing_and_fork_share_pages():
    cache = pr.PagedKVCache(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=4, prefix_caching=True)
    ids = list(range(9))
    a = cache.add_sequence(ids)
    cache.write(0, cache.reserve(a, 9, ids), torch.randn(9, 1, 4), torch.randn(9, 1, 4))
    b = cache.add_sequence(ids)  # the same prompt finds a's two full pages
    assert cache.pages(b)[:2] == cache.pages(a)[:2]
    c = cache.fork(a)
    assert cache.pages(c) == cache.pages(a) and cache.allocator.refcount(cache.pages(a)[2]) == 2
