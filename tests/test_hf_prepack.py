"""Linear layers through prepacked oneDNN weights: the same logits and tokens, the model untouched outside."""

import warnings

import pytest
import torch

import paged_ref as pr
from paged_ref.hf.prepack import PackedLinears


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_packed_session_gives_the_eager_logits_and_leaves_the_model_as_it_was(model):
    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 1, 12)]
    logits = []
    for prepack in (False, True):
        with pr.hf.PagedSession(model, num_pages=16, page_size=4, prepack=prepack) as s:
            seqs = [s.add() for _ in prompts]
            first = s.extend(seqs, prompts, packed=True)  # [3, vocab]: prompts of different lengths
            logits.append((first, s.extend(seqs, [t.argmax(-1, keepdim=True) for t in first])))  # a decode step
    for eager, packed in zip(*logits):
        torch.testing.assert_close(packed, eager, rtol=1e-4, atol=1e-4)
    assert all("forward" not in m.__dict__ for m in _linears(model))  # nothing left patched


def test_the_layers_are_restored_when_the_forward_raises(model):
    packs = PackedLinears(model)
    assert packs.packed
    with pytest.raises(ZeroDivisionError), packs:
        assert all("forward" in m.__dict__ for m in _linears(model))
        raise ZeroDivisionError
    assert all("forward" not in m.__dict__ for m in _linears(model))


def test_unpackable_weights_stay_eager_with_one_warning():
    from paged_ref.models import tiny_llama

    model = tiny_llama().double()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        packs = PackedLinears(model)
    assert not packs.packed
    assert len(caught) == 1 and "float64" in str(caught[0].message) and "stay eager" in str(caught[0].message)
    x = torch.randn(2, model.config.hidden_size, dtype=torch.float64)
    layer = _linears(model)[0]
    with packs:
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))


def test_prepack_must_be_a_bool(model):
    with pytest.raises(TypeError, match="prepack must be True or False, got 'yes'"):
        pr.hf.PagedSession(model, num_pages=4, page_size=4, prepack="yes")


def test_fused_projections_give_each_layer_its_own_product_and_recompute_for_another_input():
    from paged_ref.models import tiny_llama

    model = tiny_llama(attention_bias=True)  # q/k/v with a bias, as Qwen2's: the bias is fused too
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x, y = torch.randn(2, 5, model.config.hidden_size), torch.randn(2, 5, model.config.hidden_size)
    layers = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj, attn.o_proj]
    eager = {(id(m), id(t)): m(t) for m in layers for t in (x, y)}
    with PackedLinears(model):
        # transformers' order (q, k, v on one tensor), then out of order and on another tensor
        calls = [(attn.q_proj, x), (attn.k_proj, x), (attn.v_proj, x), (attn.k_proj, y), (attn.q_proj, x)]
        calls += [(attn.v_proj, y), (mlp.up_proj, y), (mlp.gate_proj, y), (mlp.gate_proj, x), (attn.o_proj, x)]
        for m, t in calls:
            torch.testing.assert_close(m(t), eager[(id(m), id(t))], rtol=1e-5, atol=1e-5)
