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
