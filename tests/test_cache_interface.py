"""The one cache interface: both caches implement `KVCache`, and its users never branch on type."""

import inspect

import pytest
import torch

from paged_ref import LayeredKVCache, PagedKVCache
from paged_ref.cache_interface import KVCache
from paged_ref.eviction import make_policy
from paged_ref.hf import PagedSession
from paged_ref.models import tiny_llama

SHAPE = dict(num_layers=2, num_pages=8, page_size=2, num_kv_heads=1, head_dim=4)


@pytest.mark.parametrize("cls", [PagedKVCache, LayeredKVCache])
def test_both_caches_implement_the_interface(cls):
    kv = cls(**SHAPE)
    assert isinstance(kv, KVCache)
    s = kv.add_sequence()
    slots = kv.reserve(s, 3)
    for layer in range(kv.num_layers):
        own = kv.layer_slots(slots, layer)
        assert own.shape == (3,)
        kv.write(layer, own, torch.full((3, 1, 4), float(layer)), torch.zeros(3, 1, 4))
        assert bool((kv.gather(layer, s)[0] == layer).all())
        table, lens = kv.block_table([s], layer=layer)
        assert lens.tolist() == [3] and table.shape[1] == 2
    tables = {tuple(kv.block_table([s], layer=i)[0][0].tolist()) for i in range(kv.num_layers)}
    assert (len(tables) > 1) == kv.tables_per_layer  # one table for every layer, or one each


def test_not_a_cache_is_refused():
    assert not isinstance(object(), KVCache)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\)"):
        PagedKVCache(**SHAPE).block_table(layer=2)


def test_session_takes_the_cache_as_kv_cache_only():
    model = tiny_llama()
    kv = PagedKVCache.for_model(model, num_pages=8, page_size=4)
    with PagedSession(model, kv_cache=kv) as session:
        assert session.kv is kv
    with pytest.raises(TypeError, match="unexpected keyword argument 'kv'"):
        PagedSession(model, kv=kv)
    with pytest.raises(TypeError, match="kv_cache must be a paged_ref.PagedKVCache, a LayeredKVCache or None, got str"):
        PagedSession(model, kv_cache="pages")


def test_tokens_until_action_takes_no_private_keyword():
    for name, budget in (("full", None), ("paged_eviction", 16), ("token_topk", 16)):
        params = inspect.signature(make_policy(name, budget).tokens_until_action).parameters
        assert list(params) == ["kv_cache", "seq_id"], name
