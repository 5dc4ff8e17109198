"""The flat loop's C++ operations: each against transformers' own on fresh inputs, the model's tokens, the fallbacks."""

import warnings

import pytest
import torch

import paged_ref as pr
from paged_ref.fast import Fast
from paged_ref.fast import cpu_ops as cpu_ops_module
from paged_ref.fast.flat import EAGER, FlatForward
from paged_ref.models import tiny_llama


@pytest.mark.parametrize("seed", range(3))
def test_each_operation_matches_transformers_on_strided_rows(seed):
    g = torch.Generator().manual_seed(seed)
    b, t, heads, d = 1 + seed, (1, 5, 17)[seed], (3, 9, 4)[seed], (32, 64, 128)[seed]
    ops = cpu_ops_module.cpu_ops()
    h, y = torch.randn(b, t, 96, generator=g), torch.randn(b, t, 96, generator=g)
    weight, eps = torch.randn(96, generator=g), 1e-5
    for residual in (None, y):
        want_h, want_x = EAGER.add_norm(h, residual, weight, eps)
        got_h, got_x = ops.add_norm(h.clone(), residual, weight, eps)
        assert torch.allclose(got_h, want_h) and torch.allclose(got_x, want_x, atol=1e-5)
    # q as the fused q/k/v product hands it over: a slice of a wider row, [b, t, heads, d] by view
    product = torch.randn(b, t, heads * d + 40, generator=g)
    x = product[..., : heads * d].view(b, t, heads, d)
    angles = torch.randn(b, t, 1, d // 2, generator=g).repeat(1, 1, 1, 2)  # both halves alike, as RoPE's
    cos, sin = angles.cos(), angles.sin()
    want, rest = EAGER.rotate(x, cos, sin), product[..., heads * d :].clone()
    assert ops.rotate(x, cos, sin) is x and torch.allclose(x, want, atol=1e-6)
    assert torch.equal(product[..., heads * d :], rest)  # the other columns untouched
    gate_up = torch.randn(b, t, 2 * 48, generator=g)
    gate, up = gate_up.split(48, dim=-1)
    assert torch.allclose(ops.silu_mul(gate, up), EAGER.silu_mul(gate, up), atol=1e-6)


def _run(model, prompts, steps=6, **options):
    """Greedy tokens of ``prompts`` (packed prefill, then decode steps) and the first logits."""
    fast = Fast(backend="cpu_paged", flat=True, **options)
    with pr.hf.PagedSession(model, num_pages=48, page_size=4, fast=fast) as s:
        seqs = [s.add() for _ in prompts]
        logits = s.extend(seqs, prompts, packed=True)
        first, tokens = logits, [[] for _ in prompts]
        for _ in range(steps):
            nxt = [t[-1:].argmax(-1) for t in logits]
            for out, n in zip(tokens, nxt):
                out.append(int(n))
            logits = s.extend(seqs, nxt)
        return tokens, first


@pytest.mark.parametrize("prepack", [False, True])
def test_the_model_gives_the_same_tokens(model, prepack):
    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 1, 14)]
    eager_tokens, eager_logits = _run(model, prompts, prepack=prepack)
    tokens, logits = _run(model, prompts, prepack=prepack, cpu_ops=True)
    assert tokens == eager_tokens
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(logits, eager_logits))


def test_shapes_that_do_not_fit_are_refused_before_memory_is_read():
    ops = cpu_ops_module.cpu_ops()
    x, cos = torch.randn(2, 3, 4, 8), torch.randn(1, 3, 1, 8)  # cos of one row for two: no broadcast here
    with pytest.raises(RuntimeError, match=r"rotate: cos must be \[B, T, 1, D\]"):
        ops.rotate(x, cos, cos)
    with pytest.raises(RuntimeError, match="silu_mul: up must have gate's shape"):
        ops.silu_mul(torch.randn(2, 8), torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="add_norm: y"):
        ops.add_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-6)


def test_a_model_they_cannot_run_keeps_transformers_operations_with_one_warning():
    model = tiny_llama(seed=1).to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flat = FlatForward(model, cpu_ops=True)
    assert flat.ops is EAGER and len(caught) == 1 and "torch.bfloat16" in str(caught[0].message)


def test_operations_that_cannot_be_built_fall_back_with_one_warning(model, monkeypatch):
    import torch.utils.cpp_extension as ext

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (4, 6)]
    monkeypatch.setattr(ext, "load_inline", no_compiler)
    cpu_ops_module.cpu_ops.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fallen = _run(model, prompts, steps=2, cpu_ops=True)
        assert len(caught) == 1 and "Ninja is required" in str(caught[0].message)
        assert "paged_ref_cpu_ops" in str(caught[0].message) and "transformers' operations" in str(caught[0].message)
    finally:
        cpu_ops_module.cpu_ops.cache_clear()  # the next caller builds the real operations again
    eager = _run(model, prompts, steps=2)
    assert fallen[0] == eager[0] and all(torch.equal(a, b) for a, b in zip(fallen[1], eager[1]))


def test_cpu_ops_needs_the_flat_loop_and_a_bool():
    with pytest.raises(ValueError, match="fast.cpu_ops=True runs in the flat loop: give flat=True with it"):
        Fast(cpu_ops=True)
    with pytest.raises(TypeError, match="fast.cpu_ops must be True or False, got 'yes'"):
        Fast(flat=True, cpu_ops="yes")
