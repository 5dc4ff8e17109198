"""Cascade (shared-prefix) decode attention equals plain paged attention, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from paged_ref.attention.cascade import merge_states, reference_cascade_decode
from paged_ref.attention.reference import reference_paged_decode

GARBAGE = 1e4  # every slot no request owns: reading one by mistake moves the output far off


def make_cascade_case(seed, page_size, num_kv_heads, group, head_dim=32, dtype=torch.float64):
    """Groups of requests sharing whole prefix pages, each with a ragged suffix of its own pages,
    all scattered over a shuffled cache with spare pages; block-table padding is garbage ids."""
    g = torch.Generator().manual_seed(seed)

    def randint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    suffix_choices = [0, 1, page_size, page_size + 1, randint(1, 3 * page_size)]
    groups = []  # (prefix_pages, [suffix_len, ...])
    for _ in range(randint(1, 3)):
        prefix_pages = randint(0, 3)
        n = randint(1, 4)
        suffixes = [suffix_choices[randint(0, len(suffix_choices) - 1)] for _ in range(n)]
        if prefix_pages == 0:
            suffixes = [max(1, s) for s in suffixes]
        groups.append((prefix_pages, suffixes))
    need = sum(p + sum(-(-s // page_size) for s in sfx) for p, sfx in groups)
    num_pages = need + 3
    ids = torch.randperm(num_pages, generator=g).tolist()
    kc = torch.full((num_pages, page_size, num_kv_heads, head_dim), GARBAGE, dtype=dtype)
    vc = torch.full_like(kc, GARBAGE)
    rows, lens, indptr, prefix_lens = [], [], [0], []
    for prefix_pages, suffixes in groups:
        prefix = [ids.pop() for _ in range(prefix_pages)]
        for p in prefix:
            kc[p], vc[p] = (torch.randn(page_size, num_kv_heads, head_dim, generator=g, dtype=dtype) for _ in "kv")
        for s in suffixes:
            own = [ids.pop() for _ in range(-(-s // page_size))]
            for i, p in enumerate(own):
                n = min(page_size, s - i * page_size)
                kc[p, :n], vc[p, :n] = (torch.randn(n, num_kv_heads, head_dim, generator=g, dtype=dtype) for _ in "kv")
            rows.append(prefix + own)
            lens.append(prefix_pages * page_size + s)
        indptr.append(indptr[-1] + len(suffixes))
        prefix_lens.append(prefix_pages * page_size)
    width = max(len(r) for r in rows) + 1
    table = torch.tensor([r + [num_pages + 7] * (width - len(r)) for r in rows], dtype=torch.int32)
    q = torch.randn(len(rows), num_kv_heads * group, head_dim, generator=g, dtype=dtype)
    return q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), torch.tensor(indptr), torch.tensor(prefix_lens)


def rel_error(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("page_size", [1, 8, 16, 64, 128])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3), (1, 4), (2, 8)])
def test_reference_cascade_equals_plain_float64(page_size, num_kv_heads, group):
    for seed in range(3):
        q, kc, vc, bt, lens, indptr, prefix = make_cascade_case(seed, page_size, num_kv_heads, group)
        out = reference_cascade_decode(q, kc, vc, bt, lens, indptr, prefix)
        assert rel_error(out, reference_paged_decode(q, kc, vc, bt, lens)) <= 1e-12


@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (1, 3), (2, 8)])
def test_triton_cascade_equals_plain_float32(page_size, num_kv_heads, group):
    pytest.importorskip("triton")
    from paged_ref.attention.triton_cascade import triton_cascade_decode

    q, kc, vc, bt, lens, indptr, prefix = make_cascade_case(page_size, page_size, num_kv_heads, group)
    ref = reference_paged_decode(q, kc, vc, bt, lens)  # float64
    q, kc, vc = q.float(), kc.float(), vc.float()
    assert rel_error(triton_cascade_decode(q, kc, vc, bt, lens, indptr, prefix), ref) <= 1e-5
    assert rel_error(reference_cascade_decode(q, kc, vc, bt, lens, indptr, prefix), ref) <= 1e-5


def test_triton_decode_returns_its_lse():
    pytest.importorskip("triton")
    from paged_ref.attention.cascade import attend_with_lse
    from paged_ref.attention.reference import gather_sequence
    from paged_ref.attention.triton_decode import triton_paged_decode

    q, kc, vc, bt, lens, _, _ = make_cascade_case(5, 16, 2, 2, dtype=torch.float32)
    for splits in (1, 3):
        out, lse = triton_paged_decode(q, kc, vc, bt, lens, num_splits=splits, return_lse=True)
        for b, n in enumerate(lens.tolist()):
            k, v = gather_sequence(kc, bt[b], n), gather_sequence(vc, bt[b], n)
            o_ref, lse_ref = attend_with_lse(q[b].double().view(2, 2, -1), k.double(), v.double(), 32**-0.5)
            assert torch.allclose(lse[b].double(), lse_ref.flatten(), atol=1e-4)
            assert torch.allclose(out[b].double(), o_ref.flatten(0, 1), atol=1e-5)


def test_merge_states_is_the_softmax_over_the_union():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(5, 40, generator=g, dtype=torch.float64) * 4  # [rows, keys], base 2
    v = torch.randn(40, 8, generator=g, dtype=torch.float64)

    def state(cols):
        p = torch.exp2(s[:, cols] - s[:, cols].amax(1, keepdim=True))
        return (p @ v[cols]) / p.sum(1, keepdim=True), torch.log2(torch.exp2(s[:, cols]).sum(1))

    cut = torch.randperm(40, generator=g)
    o, lse = merge_states(*state(cut[:13]), *state(cut[13:]))
    o_all, lse_all = state(torch.arange(40))
    assert rel_error(o, o_all) <= 1e-12 and torch.allclose(lse, lse_all, rtol=1e-12)
    empty = (torch.zeros(5, 8, dtype=torch.float64), torch.full((5,), float("-inf"), dtype=torch.float64))
    o2, lse2 = merge_states(*state(cut), *empty)  # an empty part weighs nothing
    assert rel_error(o2, o_all) <= 1e-12 and torch.allclose(lse2, lse_all)


def _bad_call(**change):
    q, kc, vc, bt, lens, indptr, prefix = make_cascade_case(1, 4, 1, 2)
    args = dict(q=q, k_cache=kc, v_cache=vc, block_table=bt, seq_lens=lens, group_indptr=indptr, prefix_lens=prefix)
    for name, fn in change.items():
        args[name] = fn(args[name].clone())
    before = {k: v.clone() for k, v in args.items()}
    return args, before


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(prefix_lens=lambda p: p + 1), "prefix_lens\\[0\\] must be a whole number of pages"),
        (dict(group_indptr=lambda i: i.flip(0)), "group_indptr must rise strictly"),
        (dict(prefix_lens=lambda p: p[:-1]), "prefix_lens must have shape"),
    ],
)
def test_bad_groups_are_named(change, message):
    args, before = _bad_call(**change)
    with pytest.raises(ValueError, match=message):
        reference_cascade_decode(**args)
    assert all(torch.equal(args[k], before[k]) for k in args)


def test_requests_that_do_not_share_their_prefix_are_refused():
    q = torch.randn(2, 2, 32, dtype=torch.float64)
    bt = torch.tensor([[0, 1, 2], [0, 3, 4]], dtype=torch.int32)  # page 1 vs page 3 at column 1
    lens = torch.tensor([10, 10], dtype=torch.int32)
    kc, vc = torch.randn(5, 4, 1, 32, dtype=torch.float64), torch.randn(5, 4, 1, 32, dtype=torch.float64)
    saved = bt.clone()
    with pytest.raises(ValueError, match="block_table rows 0 and 1 .* differ at column 1: 1 vs 3"):
        reference_cascade_decode(q, kc, vc, bt, lens, torch.tensor([0, 2]), torch.tensor([8]))
    assert torch.equal(bt, saved)
    out = reference_cascade_decode(q, kc, vc, bt, lens, torch.tensor([0, 2]), torch.tensor([4]))  # one page: shared
    assert rel_error(out, reference_paged_decode(q, kc, vc, bt, lens)) <= 1e-12


def test_shared_prefix_groups_finds_forked_pages():
    from paged_ref import PagedKVCache
    from paged_ref.attention.cascade import shared_prefix_groups

    cache = PagedKVCache(num_layers=1, num_pages=32, page_size=4, num_kv_heads=1, head_dim=2)
    alone = cache.add_sequence()
    cache.reserve(alone, 9)
    root = cache.add_sequence()
    cache.reserve(root, 10)  # 2 full pages and a half one
    forks = [cache.fork(root) for _ in range(3)]
    for i, s in enumerate(forks):
        cache.reserve(s, i + 1)  # copy-on-write of the half page: each fork's own
    tiny = cache.add_sequence()
    cache.reserve(tiny, 2)  # no full page: shares nothing
    seqs = [forks[0], alone, forks[1], tiny, forks[2]]
    table, lens = cache.block_table(seqs)
    order, indptr, prefix = shared_prefix_groups(table, lens, 4)
    groups = [order[a:b].tolist() for a, b in zip(indptr[:-1].tolist(), indptr[1:].tolist())]
    assert sorted(map(sorted, groups)) == [[0, 2, 4], [1], [3]]
    assert prefix[[0 in g for g in groups].index(True)] == 8 and prefix.sum() == 8  # 2 shared pages, others 0


def _record_prefixes(monkeypatch):
    import paged_ref.attention.cascade as cascade

    seen, real = [], cascade.reference_cascade_decode

    def spy(*args, **kwargs):
        seen.append(int(args[6].max()))  # the largest shared prefix of the call
        return real(*args, **kwargs)

    monkeypatch.setattr(cascade, "reference_cascade_decode", spy)
    return seen


@pytest.mark.parametrize("options", [dict(do_sample=True, num_return_sequences=4), dict(num_beams=3)])
def test_cascade_backend_generates_the_same_tokens(monkeypatch, options):
    """Samples and beams fork the prompt's pages: the cascade backend reads them once, same tokens."""
    from paged_ref import hf
    from paged_ref.models import tiny_llama

    model, ids = tiny_llama(), torch.arange(1, 40)[None]
    out = {}
    seen = _record_prefixes(monkeypatch)
    for backend in ("sdpa", "cascade"):
        torch.manual_seed(0)
        result = hf.generate(model, ids, max_new_tokens=10, backend=backend, page_size=4, **options)
        out[backend] = getattr(result, "sequences", result).tolist()
    assert out["cascade"] == out["sdpa"]
    assert seen and max(seen) >= 36  # the prompt's 9 full pages were read once per step


def test_cascade_backend_serves_prefix_cached_requests_unchanged(monkeypatch):
    from paged_ref.fast import Fast
    from paged_ref.models import tiny_llama
    from paged_ref.serve import Engine

    model = tiny_llama()
    system = list(range(100, 116))  # 4 full pages of 4 shared through the prefix cache
    prompts = [system + [7 + i, 9, 11 + i] for i in range(3)]
    tokens = {}
    seen = _record_prefixes(monkeypatch)
    for backend in ("sdpa", "cascade"):
        engine = Engine(
            model,
            num_pages=64,
            page_size=4,
            prefix_caching=True,
            fast=Fast(backend=backend),
            eos_token_id=[],
            clock="steps",
        )
        engine.add_request(prompts[0], max_new_tokens=6)
        done = engine.step()  # its prefill writes the system prompt's pages: cached from now on
        for p in prompts[1:]:
            engine.add_request(p, max_new_tokens=6)
        tokens[backend] = sorted((o.request_id, o.token_ids) for o in done + engine.run())
        engine.close()
    assert tokens["cascade"] == tokens["sdpa"]
    assert max(seen) == 16  # the system prompt's pages, shared by the prefix cache, read once
