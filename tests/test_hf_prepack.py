"""Linear layers through prepacked oneDNN weights: the same logits and tokens, the model untouched outside."""

import warnings

import pytest
import torch

import paged_ref as pr
from paged_ref.fast import Fast
from paged_ref.fast.prepack import KERNEL_ROWS, PackedLinears, few_rows_kernel, kernel_rows, stream_layout

MOST = max(KERNEL_ROWS.values())  # the kernel itself is checked at every row count any CPU runs it at


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_packed_session_gives_the_eager_logits_and_leaves_the_model_as_it_was(model):
    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 1, 12)]
    logits = []
    for options in ({}, dict(prepack=True), dict(prepack=True, few_rows=True)):
        with pr.hf.PagedSession(model, num_pages=16, page_size=4, fast=Fast(**options)) as s:
            seqs = [s.add() for _ in prompts]
            first = s.extend(seqs, prompts, packed=True)  # [3, vocab]: prompts of different lengths
            logits.append((first, s.extend(seqs, [t.argmax(-1, keepdim=True) for t in first])))  # a decode step
    for eager, *packed in zip(*logits):
        for p in packed:
            torch.testing.assert_close(p, eager, rtol=1e-4, atol=1e-4)
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


def test_prepack_must_be_a_bool():
    with pytest.raises(TypeError, match="fast.prepack must be True or False, got 'yes'"):
        Fast(prepack="yes")


def test_fused_projections_give_each_layer_its_own_product_and_recompute_for_another_input():
    from paged_ref.models import tiny_llama

    model = tiny_llama(attention_bias=True)  # q/k/v with a bias, as Qwen2's: the bias is fused too
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x, y = torch.randn(2, 5, model.config.hidden_size), torch.randn(2, 5, model.config.hidden_size)
    layers = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj, attn.o_proj]
    eager = {(id(m), id(t)): m(t) for m in layers for t in (x, y)}
    with PackedLinears(model), torch.no_grad():  # packed layers compute no gradients
        # transformers' order (q, k, v on one tensor), then out of order and on another tensor
        calls = [(attn.q_proj, x), (attn.k_proj, x), (attn.v_proj, x), (attn.k_proj, y), (attn.q_proj, x)]
        calls += [(attn.v_proj, y), (mlp.up_proj, y), (mlp.gate_proj, y), (mlp.gate_proj, x), (attn.o_proj, x)]
        for m, t in calls:
            torch.testing.assert_close(m(t), eager[(id(m), id(t))], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_few_rows_kernel_matches_a_float64_product(seed):
    g = torch.Generator().manual_seed(seed)
    few = few_rows_kernel()
    for rows in range(MOST + 1):  # 0 to MOST rows: chunks of up to six (three on AVX2), split evenly
        n = int(torch.randint(1, 800, (1,), generator=g))  # any N: up to 13 blocks, the last padded
        k = int(torch.randint(1, 200, (1,), generator=g))
        x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
        y = few(x, stream_layout(w), n)  # [rows, n]
        torch.testing.assert_close(y.double(), x.double() @ w.double().T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
def test_few_rows_kernel_sums_each_row_alike_in_any_batch(threads):
    """A row's outputs do not depend on the rows beside it, bit for bit: one row (four blocks at a time), two or
    three (two blocks at a time) and chunks of up to six (one block) sum each output over k in the same order."""
    g, few, before = torch.Generator().manual_seed(7), few_rows_kernel(), torch.get_num_threads()
    torch.set_num_threads(threads)  # each thread's range of blocks: groups of blocks and the blocks left over
    try:
        for rows in range(1, MOST + 1):
            n, k = int(torch.randint(1, 800, (1,), generator=g)), int(torch.randint(1, 200, (1,), generator=g))
            x, w = torch.randn(rows, k, generator=g), stream_layout(torch.randn(n, k, generator=g))
            alone = torch.cat([few(x[i : i + 1], w, n) for i in range(rows)])  # [rows, n], one row a call
            assert torch.equal(few(x, w, n), alone), (rows, n, k)
    finally:
        torch.set_num_threads(before)


def test_stream_layout_lays_each_block_of_outputs_as_one_stream():
    w = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)  # [N=70, K=3]
    blocks = stream_layout(w)
    assert blocks.shape == (2, 3, 64) and blocks.is_contiguous()
    assert torch.equal(blocks[1, 2, :6], w[64:, 2]) and not blocks[1, :, 6:].any()  # zeros past N
    assert torch.equal(blocks[0].T, w[:64])


def test_few_rows_kernel_refuses_a_layout_that_does_not_fit():
    x, blocks = torch.randn(2, 5), stream_layout(torch.randn(70, 5))
    expected = r"few_rows: w must be \[ceil\(n / 64\), K, 64\] = \[4, 5, 64\] \(n = 200, x's K\), got \[2, 5, 64\]"
    with pytest.raises(RuntimeError, match=expected):
        few_rows_kernel()(x, blocks, 200)  # 200 outputs need 4 blocks, not 2
    with pytest.raises(RuntimeError, match="few_rows"):
        few_rows_kernel()(torch.randn(2, 6), blocks, 70)  # K of 6 against blocks of K 5


@pytest.mark.parametrize("rows", [1, "limit", "past"])
def test_few_rows_runs_products_of_few_rows_and_onednn_the_rest(model, rows):
    limit = kernel_rows()
    rows = {"limit": limit, "past": limit + 1}.get(rows, rows)
    packs = PackedLinears(model, few_rows=MOST)  # past this CPU's limit: kernel_rows() rows at most
    layer = model.model.layers[0].self_attn.o_proj
    x = torch.randn(rows, layer.in_features)
    with packs, torch.no_grad(), torch.profiler.profile() as prof:
        y = layer(x)
    ran = {e.key for e in prof.key_averages()}
    assert packs.few_rows and (("paged_ref_linear::few_rows" in ran) == (rows <= limit))
    assert ("mkldnn::_linear_pointwise" in ran) == (rows > limit)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_few_rows_needs_prepack_and_a_number_of_rows(model):
    with pytest.raises(ValueError, match="fast.few_rows=True reads weights packed by prepack: give prepack=True"):
        Fast(few_rows=True)
    with pytest.raises(TypeError, match="fast.few_rows must be True, False or a number of rows >= 0, got -1"):
        Fast(prepack=True, few_rows=-1)
    with pytest.raises(TypeError, match=r"few_rows must be a number of rows \(an int >= 0\), got True"):
        PackedLinears(model, few_rows=True)  # True is not one row


def test_a_kernel_that_cannot_be_built_leaves_onednn_with_one_warning(model, monkeypatch):
    import torch.utils.cpp_extension as ext

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(ext, "load_inline", no_compiler)
    few_rows_kernel.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            packs = PackedLinears(model, few_rows=MOST)
        assert len(caught) == 1 and "Ninja is required" in str(caught[0].message)
        assert "paged_ref_linear" in str(caught[0].message) and "through oneDNN" in str(caught[0].message)
    finally:
        few_rows_kernel.cache_clear()  # the next caller builds the real kernel again
    assert packs.packed and not packs.few_rows
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.in_features)
    with packs, torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("few_rows", [10**9, 2**63])
def test_a_large_few_rows_packs_at_once(model, few_rows):
    """Packing tries each path on one row: a bound of a billion rows (an engine's ``max_num_seqs``) is no product
    of a billion rows, nor past int64 an overflow."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packs = PackedLinears(model, few_rows=few_rows)
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.in_features)
    with packs, torch.no_grad():
        y = layer(x)
    assert packs.packed and packs.few_rows
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [2, MOST + 1])  # the few-rows kernel's products and oneDNN's
def test_a_packed_layer_refuses_an_input_of_another_dtype_or_size(model, rows):
    attn = model.model.layers[0].self_attn
    with PackedLinears(model, few_rows=MOST), torch.no_grad():
        for layer in (attn.q_proj, attn.o_proj):  # one of a fused product, one alone
            k = layer.in_features
            with pytest.raises(TypeError, match=r"prepack: .* takes x of torch.float32, got torch.float64"):
                layer(torch.randn(rows, k, dtype=torch.float64))
            with pytest.raises(TypeError, match=r"prepack: .* takes x of torch.float32, got torch.bfloat16"):
                layer(torch.randn(rows, k, dtype=torch.bfloat16))
            with pytest.raises(
                ValueError,
                match=rf"prepack: .* of {k} in_features takes x \[\.\.\., {k}\], got \[{rows}, {k + 3}\]",
            ):
                layer(torch.randn(rows, k + 3))
            with pytest.raises(ValueError, match=r"takes x .*, got \[\]"):
                layer(torch.tensor(1.0))


def _session_logits(session, prompts):
    """Each prompt's logits after its prefill, then after one decode step, in one open ``session``."""
    with session as s:
        seqs = [s.add() for _ in prompts]
        first = s.extend(seqs, prompts, packed=True)
        return first, s.extend(seqs, [t.argmax(-1, keepdim=True) for t in first])


def _change_in_place(model):
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(2)  # one of a fused product
        model.model.layers[1].mlp.down_proj.weight.mul_(-3)  # a layer alone


def _load_state_dict(model):
    state = model.state_dict()
    state["model.layers.0.mlp.up_proj.weight"] = -state["model.layers.0.mlp.up_proj.weight"]
    model.load_state_dict(state)


def _replace_parameter(model):
    layer = model.model.layers[0].self_attn.v_proj
    layer.weight = torch.nn.Parameter(layer.weight.detach() * 3)


def _replace_data(model):
    layer = model.lm_head
    layer.weight.data = layer.weight.detach() * 0.5


@pytest.mark.parametrize("change", [_change_in_place, _load_state_dict, _replace_parameter, _replace_data])
@pytest.mark.parametrize(
    "options", [dict(prepack=True), dict(prepack=True, few_rows=True), dict(prepack=True, flat=True)]
)
def test_weights_changed_after_packing_are_packed_again(change, options):
    """A session packs its weights when it is made; one changed later (in place: the version counter moves;
    replaced: another tensor or storage) gives the eager step's logits again, not those of the old weights."""
    from paged_ref.models import tiny_llama

    model = tiny_llama(seed=3)
    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 1, 12)]
    fast = pr.hf.PagedSession(model, num_pages=32, page_size=4, fast=Fast(**options))  # packed now
    before = _session_logits(pr.hf.PagedSession(model, num_pages=32, page_size=4), prompts)
    change(model)
    eager = _session_logits(pr.hf.PagedSession(model, num_pages=32, page_size=4), prompts)
    assert not torch.allclose(eager[0], before[0], atol=1e-2)  # the change matters
    for e, f in zip(eager, _session_logits(fast, prompts)):
        torch.testing.assert_close(f, e, rtol=1e-4, atol=1e-4)
    assert all("forward" not in m.__dict__ for m in _linears(model))


def test_a_weight_replaced_through_data_twice_is_packed_again():
    """Replaced twice between two forwards, the second tensor could take the storage the first replacement freed,
    the packed weight's: the packs keep that storage, so its address is never another weight's."""
    from paged_ref.models import tiny_llama

    model, prompt = tiny_llama(seed=3), [torch.tensor([5, 9, 3, 7])]
    w = model.lm_head.weight
    fast = pr.hf.PagedSession(model, num_pages=16, page_size=4, fast=Fast(prepack=True, few_rows=True))
    for _ in range(10):  # the allocator handed the address back on the first or second try without the kept storage
        packed_at = w.data_ptr()
        first = torch.empty_like(w).copy_(w.detach().roll(1, 0))  # every token's row moved: other greedy tokens
        w.data = first  # the packed weight's storage is no longer the parameter's
        del first
        w.data = torch.empty_like(w).copy_(w.detach())  # the same values, perhaps at the packed weight's address
        assert w.data_ptr() != packed_at
        eager = _session_logits(pr.hf.PagedSession(model, num_pages=16, page_size=4), prompt)
        for e, f in zip(eager, _session_logits(fast, prompt)):
            torch.testing.assert_close(f, e, rtol=1e-4, atol=1e-4)


def test_a_layer_with_its_own_forward_keeps_it_and_runs_as_without_packs():
    """A ``forward`` on the instance (accelerate's hooks, a monkeypatch) runs within the block, and is left there."""
    from paged_ref.models import tiny_llama

    model = tiny_llama(seed=1)
    layer, q = model.model.layers[1].mlp.down_proj, model.model.layers[0].self_attn.q_proj  # alone; fused
    for m in (layer, q):
        m.forward = (lambda m: lambda x: -2 * torch.nn.functional.linear(x, m.weight))(m)
    hooked = [m.forward for m in (layer, q)]
    fast = pr.hf.PagedSession(model, num_pages=32, page_size=4, fast=Fast(prepack=True, few_rows=True))
    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 1, 12)]
    eager = _session_logits(pr.hf.PagedSession(model, num_pages=32, page_size=4), prompts)
    for e, f in zip(eager, _session_logits(fast, prompts)):
        torch.testing.assert_close(f, e, rtol=1e-4, atol=1e-4)
    assert [m.__dict__["forward"] for m in (layer, q)] == hooked
    assert all("forward" not in m.__dict__ for m in _linears(model) if m not in (layer, q))
    with PackedLinears(model):  # k and v, packed with q as one product, stay eager with it
        attn = model.model.layers[0].self_attn
        assert "forward" not in attn.k_proj.__dict__ and "forward" in model.model.layers[0].mlp.up_proj.__dict__


def test_packed_layers_refuse_a_product_autograd_would_record(model):
    """Their weights are packed copies: no gradient reaches the layer's weights or ``x``. Under no_grad, or with
    nothing requiring grad, they run."""
    layer = model.model.layers[0].mlp.down_proj  # a layer alone
    q = model.model.layers[0].self_attn.q_proj  # one of a fused product
    x = torch.randn(2, layer.in_features)
    packs = PackedLinears(model)
    with packs:
        for m in (layer, q):
            with pytest.raises(RuntimeError, match="prepack: packed linear layers compute no gradients"):
                m(torch.randn(2, m.in_features))  # the weights require grad
        with torch.no_grad():
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    try:
        model.requires_grad_(False)
        with packs:
            assert not layer(x).requires_grad  # nothing requires grad: nothing to record
            with pytest.raises(RuntimeError, match="compute no gradients"):
                layer(x.clone().requires_grad_())  # x does
    finally:
        model.requires_grad_(True)


def test_a_changed_weight_that_cannot_be_packed_again_is_refused_leaving_the_model_eager():
    from paged_ref.models import tiny_llama

    model = tiny_llama()
    packs = PackedLinears(model)
    layer = model.model.layers[0].mlp.down_proj
    layer.weight = torch.nn.Parameter(layer.weight.detach().double())  # oneDNN packs float32 and bfloat16
    why = r"cannot be packed again: model.layers.0.mlp.down_proj's weights are torch.float64 on cpu; packing needs"
    with pytest.raises(RuntimeError, match=why), packs:
        pass
    assert all("forward" not in m.__dict__ for m in _linears(model))


def test_a_model_made_under_inference_mode_is_packed():
    """Inference tensors keep no version counter: packing their weights still works, and gives F.linear's values."""
    from paged_ref.models import tiny_llama

    with torch.inference_mode():
        model = tiny_llama(seed=4)
    layer = model.model.layers[0].mlp.down_proj
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "stay eager" warning
        packs = PackedLinears(model)
    x = torch.randn(2, layer.in_features)
    with packs, torch.inference_mode():
        assert packs.packed and "forward" in layer.__dict__
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
