"""A real model over 8-bit pages (`paged_ref.kv_pages`): the glue passes each layer's ``k_scale`` /
``v_scale`` to the backend, the logits are those of float32 pages holding the same rounded values, and
close to the float32 cache's; `serve.Engine(kv_format=...)` serves from 8-bit pages."""

from __future__ import annotations

import pytest
import torch

from paged_ref import PagedKVCache, quant
from paged_ref.hf._checks import reads_8bit
from paged_ref.hf.attention import BACKENDS
from paged_ref.hf.session import PagedSession
from paged_ref.quant import KVFormat
from paged_ref.serve import Engine

STEPS = 6


def _prompt(model, n=19, seed=0):
    return torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


class _RoundedWrites(PagedKVCache):
    """float32 pages holding what a per-layer-scaled 8-bit cache stores: each write rounded through ``fmt``."""

    def __init__(self, fmt: KVFormat, **kw):
        super().__init__(**kw)
        self.fmt = fmt

    def write(self, layer, slots, k, v, **options):
        f = self.fmt
        k_scale, v_scale = (float(s[layer]) for s in f.layer_scales(self.num_layers))
        k = quant.dequantize(quant.quantize(k, k_scale, f.dtype, rounding=f.rounding), k_scale)
        v = quant.dequantize(quant.quantize(v, v_scale, f.dtype, rounding=f.rounding), v_scale)
        super().write(layer, slots, k, v, **options)


def _logits(model, kv, tokens=None, backend="reference"):
    """Prefill logits of every prompt token, then ``STEPS`` decodes fed ``tokens`` (default: greedy);
    returns ``([tokens, vocab] logits, the tokens fed)``."""
    with PagedSession(model, kv_cache=kv, backend=backend) as session:
        s = session.add()
        out = [session.extend([s], [_prompt(model)], all_logits=True)[0]]  # [prompt_len, vocab]
        fed = []
        for i in range(STEPS):
            fed.append(int(out[-1][-1].argmax()) if tokens is None else tokens[i])
            out.append(session.extend([s], [torch.tensor([fed[-1]])]))
        assert session.backend == backend
    return torch.cat(out), fed


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fmt", list(quant.FORMATS), ids=str)
def test_logits_from_8bit_pages_are_those_of_float_pages_holding_the_rounded_values(model, fmt):
    """Exact: the reference dequantizes the bytes (one float32 product) before attention, so the 8-bit
    cache's logits equal those of float32 pages into which each K/V was written already rounded."""
    int8 = fmt == torch.int8  # a scale per layer, K and V apart (1.0 for fp8, vLLM's default)
    kv_format = KVFormat(
        fmt, k_scale=[0.05, 0.07] if int8 else 1.0, v_scale=[0.03, 0.04] if int8 else 1.0, rounding="zero"
    )
    shape = dict(num_pages=12, page_size=4)
    q8 = PagedKVCache.for_model(model, **shape, kv_format=kv_format)
    rounded = _RoundedWrites(kv_format, **shape, num_layers=2, num_kv_heads=2, head_dim=32)
    got, fed = _logits(model, q8)
    want, _ = _logits(model, rounded, fed)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "kv_format, bound",
    [
        (KVFormat(torch.float8_e4m3fn), 0.15),  # 3 mantissa bits: each value within 2**-4 of itself
        (KVFormat(torch.float8_e4m3fn, scales="page"), 0.15),
        (KVFormat(torch.int8, scales="page"), 0.05),  # 127 steps of each page's largest value
    ],
    ids=["e4m3-layer", "e4m3-page", "int8-page"],
)
def test_logits_from_8bit_pages_are_close_to_the_float_caches(model, kv_format, bound):
    """The model's generated tokens may part from the float32 cache's; the logits stay close: relative
    errors measured on this model 0.068 (e4m3) and 0.017 (int8 per page), the bounds about 2x and 3x those."""
    want, fed = _logits(model, PagedKVCache.for_model(model, num_pages=12, page_size=4))
    got, _ = _logits(model, PagedKVCache.for_model(model, num_pages=12, page_size=4, kv_format=kv_format), fed)
    assert 0 < _rel(got, want) < bound


def test_a_backend_that_cannot_read_8bit_pages_is_refused_and_auto_falls_back(model):
    kv = PagedKVCache.for_model(model, num_pages=4, page_size=4, kv_format="fp8")
    assert not reads_8bit(BACKENDS["cascade"])
    with pytest.raises(
        ValueError, match=r"backend 'cascade' cannot read the cache's 8-bit pages; backends that can: \["
    ):
        PagedSession(model, kv_cache=kv, backend="cascade")
    auto = PagedSession(model, kv_cache=kv)  # "auto" picks a backend that reads them
    assert reads_8bit(BACKENDS[auto.backend])
    floating = PagedSession(model, kv_cache=PagedKVCache.for_model(model, num_pages=4, page_size=4), backend="cascade")
    assert floating.backend == "cascade"  # floating pages: every backend, called as before
    made = PagedSession(model, num_pages=4, page_size=4, kv_format="fp8_e5m2")  # the session makes the cache
    assert made.kv.k_cache[1].dtype == torch.float8_e5m2 and reads_8bit(BACKENDS[made.backend])
    with pytest.raises(ValueError, match="give it to the kv_cache passed"):
        PagedSession(model, kv_cache=kv, kv_format="fp8")


def test_the_engine_serves_from_8bit_pages(model):
    prompts = [_prompt(model, n, seed=n).tolist() for n in (5, 11, 3)]
    runs = {}
    for kv_format in (None, KVFormat(torch.int8, scales="page")):
        engine = Engine(model, num_pages=12, page_size=4, max_num_seqs=3, kv_format=kv_format, eos_token_id=[])
        for p in prompts:
            engine.add_request(p, max_new_tokens=4)
        runs[kv_format] = [o.token_ids for o in engine.run()]
        assert engine.stats()["free_pages"] == 12
        if kv_format is not None:
            assert engine.kv.k_cache[0].dtype == torch.int8 and engine.kv.dtype == torch.float32
    assert all(len(t) == 4 for t in runs[None] + runs[kv_format])
    with pytest.raises(ValueError, match="kv_format needs a model"):
        Engine(None, num_pages=4, kv_format="fp8")


def test_the_fast_step_reads_8bit_pages_or_is_refused_clearly(model):
    """``fast=True`` attends through ``cpu_paged``: it runs on 8-bit pages once that kernel reads them."""
    options = dict(num_pages=12, page_size=4, max_num_seqs=2, kv_format=KVFormat(torch.int8, scales="page"))
    if not reads_8bit(BACKENDS["cpu_paged"]):
        with pytest.raises(ValueError, match="'cpu_paged' cannot read the cache's 8-bit pages"):
            Engine(model, fast=True, **options)
        return
    engine = Engine(model, fast=True, eos_token_id=[], **options)
    engine.add_request(_prompt(model, 6).tolist(), max_new_tokens=3)
    assert len(engine.run()[0].token_ids) == 3


@pytest.mark.parametrize("eviction", ["paged_eviction", "streaming_llm", "token_topk"])
def test_eviction_compacts_and_drops_8bit_pages_under_generation(model, eviction):
    """Eviction reads the keys as stored (``gather``) and moves or drops 8-bit pages with their scales."""
    from paged_ref import hf

    fmt = KVFormat(torch.float8_e4m3fn, scales="page")
    cache = PagedKVCache.for_model(model, num_pages=8, page_size=4, kv_format=fmt)
    ids = _prompt(model, 13)[None]  # [1, 13]
    out = hf.generate(model, ids, max_new_tokens=6, eviction=eviction, budget=8, kv_cache=cache, backend="reference")
    assert out.shape == (1, 19) and cache.allocator.num_free == cache.allocator.num_pages


@pytest.mark.parametrize("backend", ["sdpa", "cpu_paged", "flex"])
def test_every_backend_reading_8bit_pages_gives_the_references_logits(model, backend):
    """The glue hands each backend the pages and their scales: its logits are the reference's, up to float32
    rounding (which may move a later layer's K/V across a rounding boundary of the 8-bit format: a byte apart)."""
    if not reads_8bit(BACKENDS[backend]):
        pytest.skip(f"{backend} does not read 8-bit pages on this branch")
    fmt = KVFormat(torch.float8_e4m3fn, scales="page")
    want, fed = _logits(model, PagedKVCache.for_model(model, num_pages=12, page_size=4, kv_format=fmt))
    got, _ = _logits(model, PagedKVCache.for_model(model, num_pages=12, page_size=4, kv_format=fmt), fed, backend)
    assert _rel(got, want) < 1e-4
