"""The paged_ref side of the "When you outgrow it" table (README and notebook 08): each structure has
the layout, dtype and values the table says, so the mapping to vLLM and FlashInfer cannot silently
go stale. The vLLM and FlashInfer names themselves are not importable here; only our side is checked."""

import torch

import paged_ref as pr


def _cache(**options):
    """Notebook 08's example: prompts of 5, 8 and 1 tokens, then 4 decode steps of the batch."""
    cache = pr.PagedKVCache(num_layers=2, num_pages=12, page_size=4, num_kv_heads=2, head_dim=8, **options)
    seqs = [cache.add_sequence() for _ in range(3)]
    for seq, n in zip(seqs, (5, 8, 1)):
        slots = cache.reserve(seq, n)
        for layer in range(2):
            cache.write(layer, slots, torch.randn(n, 2, 8), torch.randn(n, 2, 8))
    steps = []
    for _ in range(4):
        step = torch.cat([cache.reserve(seq, 1) for seq in seqs])
        for layer in range(2):
            cache.write(layer, step, torch.randn(3, 2, 8), torch.randn(3, 2, 8))
        steps.append(step)
    return cache, seqs, steps


def test_one_layer_is_nhd_pages_and_stacks_into_vllms_flash_layout():
    cache, _, _ = _cache()
    k, v = cache.k_cache[0], cache.v_cache[0]
    assert len(cache.k_cache) == len(cache.v_cache) == 2  # one K and one V tensor per layer
    assert k.shape == v.shape == (12, 4, 2, 8)  # [num_pages, page_size, num_kv_heads, head_dim]: FlashInfer NHD
    assert k.is_contiguous() and k.stride(1) == 2 * 8  # token-major within a page
    stacked = torch.stack([k, v])  # vLLM FlashAttention backend: [2, num_blocks, block_size, Hkv, head_size]
    assert stacked.shape == (2, 12, 4, 2, 8) and torch.equal(stacked[1], v)
    assert k.transpose(1, 2).shape == (12, 2, 4, 8)  # FlashInfer HND: [pages, Hkv, page_size, D]


def test_pool_size_from_a_byte_budget():
    cache, _, _ = _cache()
    total = sum(t.numel() * t.element_size() for t in (*cache.k_cache, *cache.v_cache))
    assert total == cache.num_pages * cache.page_bytes
    per_token = pr.memory.kv_bytes_per_token(**cache.geometry.kv_shape, bytes_per_elem=4)  # float32
    assert cache.page_bytes == cache.page_size * per_token == 1024
    budget = 64 * 2**10
    pages = budget // cache.page_bytes
    assert pages * cache.page_bytes <= budget < (pages + 1) * cache.page_bytes
    # the notebook's Llama-3-8B line: 16-token bfloat16 blocks of 2 MiB
    llama = pr.lab.sizing.model_preset("Llama-3-8B")
    assert 16 * pr.memory.kv_bytes_per_token(**llama.kv_shape, bytes_per_elem=2) == 2 * 2**20


def test_slot_mapping_is_page_times_page_size_plus_offset():
    cache, seqs, steps = _cache()
    last = steps[-1]
    assert last.dtype == torch.int64 and last.shape == (3,)  # one slot per sequence in a decode step
    positions = [cache.seq_len(s) - 1 for s in seqs]
    want = [cache.pages(s)[t // 4] * 4 + t % 4 for s, t in zip(seqs, positions)]
    assert last.tolist() == want == [24, 23, 28]  # the notebook's printed values
    for s, t, slot in zip(seqs, positions, want):
        assert pr.slot_mapping(cache.pages(s), start=t, num_tokens=1, page_size=4).tolist() == [slot]
    grown = cache.reserve(seqs[1], 2)  # tokens 12 and 13: a new page for request 1
    pages = cache.pages(seqs[1])
    assert grown.tolist() == [pages[3] * 4, pages[3] * 4 + 1]
    assert pr.slot_mapping(pages, start=12, num_tokens=2, page_size=4).tolist() == grown.tolist()


def test_block_table_is_padded_int32():
    cache, seqs, _ = _cache()
    table, lens = cache.block_table(seqs)
    assert table.dtype == lens.dtype == torch.int32
    assert table.tolist() == [[0, 1, 6], [2, 3, 5], [4, 7, 0]] and lens.tolist() == [9, 12, 5]
    assert table[2, 2] == 0  # padding: page 0, masked by seq_lens
    padded, plens = pr.pad_block_tables([cache.pages(s) for s in seqs], lens.tolist(), page_size=4)
    assert torch.equal(padded, table) and torch.equal(plens, lens)


def test_csr_triple_follows_flashinfer_and_round_trips():
    cache, seqs, _ = _cache()
    indptr, indices, last = cache.csr(seqs)
    assert all(t.dtype == torch.int32 and t.dim() == 1 for t in (indptr, indices, last))
    assert indptr.shape == (4,) and indices.shape == (int(indptr[-1]),) and last.shape == (3,)
    assert indptr.tolist() == [0, 3, 6, 8] and indices.tolist() == [0, 1, 6, 2, 3, 5, 4, 7]
    assert last.tolist() == [1, 4, 1] and all(1 <= x <= cache.page_size for x in last.tolist())
    again = pr.to_csr([cache.pages(s) for s in seqs], [cache.seq_len(s) for s in seqs], page_size=4)
    assert all(torch.equal(a, b) for a, b in zip(again, (indptr, indices, last)))
    tables, back = pr.lab.csr.from_csr(indptr, indices, last, page_size=4)
    assert back == [9, 12, 5] and tables == [cache.pages(s) for s in seqs]


def test_prefix_sharing_and_fork_share_pages():
    cache = pr.PagedKVCache(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=4, prefix_caching=True)
    ids = list(range(9))
    a = cache.add_sequence(ids)
    cache.write(0, cache.reserve(a, 9, ids), torch.randn(9, 1, 4), torch.randn(9, 1, 4))
    b = cache.add_sequence(ids)  # the same prompt finds a's two full pages
    assert cache.pages(b)[:2] == cache.pages(a)[:2] and cache.seq_len(b) == 8
    c = cache.add_sequence([99, *ids[1:]])  # another first token: another hash chain, nothing shared
    assert cache.pages(c) == [] and cache.seq_len(c) == 0
    d = cache.fork(a)
    assert cache.pages(d) == cache.pages(a) and cache.allocator.refcount(cache.pages(a)[2]) == 2
