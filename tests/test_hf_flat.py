"""The flat forward: transformers' Llama operations in one loop, the same logits bit for bit."""

import warnings

import pytest
import torch

import paged_ref as pr
from paged_ref.fast import Fast
from paged_ref.fast.flat import FlatForward


def _logits(model, prompts, **options):
    with pr.hf.PagedSession(model, num_pages=32, page_size=4, fast=Fast(backend="cpu_paged", **options)) as s:
        seqs = [s.add() for _ in prompts]
        first = s.extend(seqs, prompts, packed=True)  # prompts of different lengths in one row
        return first, s.extend(seqs, [t.argmax(-1, keepdim=True) for t in first])  # a decode step


@pytest.mark.parametrize("prepack", [False, True])
def test_flat_logits_are_transformers_logits_bit_for_bit(model, prepack):
    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 1, 12)]
    for eager, flat in zip(
        _logits(model, prompts, prepack=prepack), _logits(model, prompts, prepack=prepack, flat=True)
    ):
        assert torch.equal(flat, eager)
    assert "forward" not in model.model.__dict__  # nothing left patched


def test_another_architecture_keeps_its_forward_with_one_warning():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flat = FlatForward(model)
    assert not flat.flat and len(caught) == 1 and "'qwen2'" in str(caught[0].message)
    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for eager, kept in zip(_logits(model, prompts), _logits(model, prompts, flat=True)):
            assert torch.equal(kept, eager)


@pytest.mark.parametrize("kind", ["gpt2", "phi"])
def test_a_model_without_llamas_modules_keeps_its_forward_with_one_warning(kind):
    """GPT-2 has no ``model.model``, Phi no ``model.model.norm``: refused by the architecture's name, not by them."""
    import transformers as T

    config = dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
    if kind == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128))
    else:
        model = T.PhiForCausalLM(T.PhiConfig(hidden_size=64, intermediate_size=128, **config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flat = FlatForward(model.eval())
        with flat:
            assert "forward" not in vars(getattr(model, "model", model))
    assert not flat.flat and len(caught) == 1 and f"'{kind}'" in str(caught[0].message)


def _own_forward(module):
    """Give ``module`` a forward of its own on the instance (as accelerate's hooks do): three times its output."""
    original = type(module).forward.__get__(module)
    module.forward = lambda *a, **k: 3 * original(*a, **k)
    return lambda: module.__dict__.pop("forward")


def _parametrized(module):
    from torch.nn.utils import parametrize

    class Doubled(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    parametrize.register_parametrization(module, "weight", Doubled())
    return lambda: parametrize.remove_parametrizations(module, "weight")


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda m: m.model.layers[0].mlp.down_proj.register_forward_hook(lambda mod, a, out: out * 3).remove,
         "has a forward hook"),
        (lambda m: m.model.layers[1].input_layernorm.register_forward_pre_hook(lambda mod, a: (a[0] * 0.5,)).remove,
         "has a forward hook"),
        (lambda m: torch.nn.modules.module.register_module_forward_hook(lambda mod, a, out: out).remove,
         "has a forward hook"),
        (lambda m: _own_forward(m.model.layers[0].mlp), "a layer, attention, MLP or norm module has a forward"),
        (lambda m: _own_forward(m.model.norm), "a layer, attention, MLP or norm module has a forward"),
        (lambda m: _parametrized(m.model.layers[1].post_attention_layernorm), "is not a plain parameter"),
    ],
)  # fmt: skip
def test_what_the_loop_would_not_run_runs_the_models_own_forward_with_one_warning(change, why):
    """The loop calls no hooks and does the layers' work itself: while a module has a hook, one whose work it does a
    forward of its own, or a norm a parametrized weight, transformers' forward runs (the eager logits); after, the
    loop runs again."""
    from paged_ref.models import tiny_llama

    model = tiny_llama(seed=1)
    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 1, 12)]
    undo = change(model)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            want, got = _logits(model, prompts), _logits(model, prompts, flat=True)
            flat = FlatForward(model)
            with flat, flat:
                assert "forward" not in model.model.__dict__
        said = [str(w.message) for w in caught if str(w.message).startswith("flat: the model's own forward runs")]
        assert len(said) == 2 and why in said[0], said  # once in the session's loop, once in the one built here
        for w, g in zip(want, got):
            assert torch.equal(g, w)
    finally:
        undo()
    with flat:
        assert "forward" in model.model.__dict__


def test_transformers_output_capturing_hooks_leave_the_loop_running(model):
    """``output_hidden_states=True`` once installs transformers' capturing hooks for good; they collect only inside the
    model's own forward, which the loop replaces."""
    model(torch.tensor([[5, 9, 3]]), output_hidden_states=True)
    assert any(m._forward_hooks for m in model.model.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with FlatForward(model):
            assert "forward" in model.model.__dict__


def test_an_inner_model_with_its_own_forward_keeps_it_with_one_warning(model):
    undo = _own_forward(model.model)
    try:
        mine = model.model.__dict__["forward"]
        with pytest.warns(RuntimeWarning, match="model.model has a forward of its own on the instance"):
            with FlatForward(model):
                assert model.model.__dict__["forward"] is mine
        assert model.model.__dict__["forward"] is mine
    finally:
        undo()


def test_replaced_norm_weights_and_modules_are_looked_up_again():
    """``load_state_dict(assign=True)`` replaces every parameter, a module may be replaced: a loop that ran before
    runs the model as it is now, the eager step's logits bit for bit."""
    from paged_ref.models import tiny_llama

    other = tiny_llama(seed=2)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if "norm" in name:
                p.uniform_(0.2, 2.0)  # a trained checkpoint's norms are not ones
    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 1, 12)]
    outs = []
    for fast in (Fast(backend="cpu_paged"), Fast(backend="cpu_paged", flat=True)):
        model = tiny_llama(seed=1)
        with pr.hf.PagedSession(model, num_pages=32, page_size=4, fast=fast) as s:
            seqs = [s.add() for _ in prompts]
            first = s.extend(seqs, prompts, packed=True)  # the old weights
            model.load_state_dict(other.state_dict(), assign=True)
            model.model.layers[1].mlp.down_proj = other.model.layers[0].mlp.down_proj  # a module replaced
            outs.append(s.extend(seqs, [t.argmax(-1, keepdim=True) for t in first]))
    for eager, flat in zip(*outs):
        assert torch.equal(flat, eager)


def test_flat_must_be_a_bool():
    with pytest.raises(TypeError, match="fast.flat must be True or False, got 1"):
        Fast(flat=1)


@pytest.mark.parametrize(
    "options",
    [dict(), dict(prepack=True), dict(flat=True), dict(flat=True, cpu_ops=True), dict(prepack=True, flat=True)],
)
def test_a_model_in_training_mode_runs_as_the_eager_step_does(options):
    """``model.train()``: without attention dropout the eager step's logits; with it, paged attention's
    NotImplementedError, as in the eager step (the flat loop passes the dropout as LlamaAttention does)."""
    from paged_ref.models import tiny_llama

    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 1, 12)]
    model = tiny_llama().train()
    fast = Fast(backend="cpu_paged", **options)
    for eager, trained in zip(_logits(model.eval(), prompts), _logits(model.train(), prompts, **options)):
        torch.testing.assert_close(trained, eager, rtol=1e-4, atol=1e-4)
    model = tiny_llama(attention_dropout=0.5).train()
    with pr.hf.PagedSession(model, num_pages=32, page_size=4, fast=fast) as s:
        seq = s.add()
        with pytest.raises(NotImplementedError, match="paged attention is inference-only, got dropout=0.5"):
            s.extend([seq], [prompts[0]])
        assert s.kv.seq_len(seq) == 0 and s.position(seq) == 0


def test_cpu_ops_must_be_a_bool(model):
    with pytest.raises(TypeError, match="cpu_ops must be True or False, got 'no'"):
        FlatForward(model, cpu_ops="no")
