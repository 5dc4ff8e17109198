"""``fast=``: one value naming the CPU speed-ups, checked as a whole, resolved against the model and the engine."""

import json
import warnings
from pathlib import Path

import pytest
import torch

import paged_ref as pr
from paged_ref.fast import Fast, prepack, resolve
from paged_ref.fast.prepack import KERNEL_ROWS, PackedLinears, cannot_pack, kernel_rows, vector_floats
from paged_ref.models import tiny_llama
from paged_ref.serve import Engine

EVERYTHING = Fast(backend="cpu_paged", prepack=True, few_rows=True, flat=True, cpu_ops=True)


def test_true_is_every_part_the_model_allows(model):
    assert resolve(True, model) == EVERYTHING
    assert resolve(True, model, rows=6) == Fast(backend="cpu_paged", prepack=True, few_rows=6, flat=True, cpu_ops=True)
    # bfloat16: packed weights where this CPU packs them, and the flat loop; the kernels and C++ ops take float32
    packs = cannot_pack(torch.bfloat16) is None
    assert resolve(True, tiny_llama().to(torch.bfloat16)) == Fast(prepack=packs, flat=True)


def test_true_names_only_parts_that_run_here(monkeypatch):
    """``fast=True`` runs with no warning: a part this CPU cannot run (oneDNN packs bfloat16 weights only with
    AVX-512 or AVX-NE-CONVERT) is left out, not turned on to warn and stay eager."""
    model = tiny_llama().to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pr.hf.PagedSession(model, num_pages=4, page_size=4, fast=True) as s:
            packed = getattr(s._linears, "packed", False)
    assert resolve(True, model).prepack == packed == (cannot_pack(torch.bfloat16) is None)
    monkeypatch.setattr(prepack, "cannot_pack", lambda dtype: f"this CPU cannot pack {dtype} weights: no AVX-512")
    assert resolve(True, model) == Fast(flat=True)
    with pytest.warns(RuntimeWarning, match=r"prepack: the linear layers stay eager \(this CPU cannot pack torch"):
        assert not PackedLinears(model).packed  # asked for by name: a warning says why it stays eager


def test_true_on_another_architecture_keeps_its_own_forward():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    assert resolve(True, Qwen2ForCausalLM(config)) == Fast(backend="cpu_paged", prepack=True, few_rows=True)


@pytest.mark.parametrize("off", [None, False, Fast()])
def test_nothing_is_the_eager_step(model, off):
    assert resolve(off, model) is None


def test_a_value_of_another_kind_is_refused_naming_the_argument(model):
    expected = r"fast must be True, False, None or a paged_ref.fast.Fast, got \{'flat': True\}"
    with pytest.raises(TypeError, match=expected):
        resolve({"flat": True}, model)
    with pytest.raises(TypeError, match="fast.backend must be a backend's name or None, got 3"):
        Fast(backend=3)
    with pytest.raises(ValueError, match="fast.backend must be a backend's name or None, got ''"):
        Fast(backend="")
    # a name no backend has: named as the argument it came in, in a session and in an engine
    with pytest.raises(ValueError, match=r"fast.backend must be one of \[.*'cpu_paged'.*\], got 'nope'"):
        pr.hf.PagedSession(model, num_pages=4, page_size=4, fast=Fast(backend="nope"))
    with pytest.raises(ValueError, match=r"fast.backend must be one of \[.*\], got 'nope'"):
        Engine(model, num_pages=8, page_size=4, fast=Fast(backend="nope", prepack=True))
    with pytest.raises(ValueError, match=r"^backend must be one of \[.*\], got 'nope'"):  # and backend= as backend
        pr.hf.PagedSession(model, num_pages=4, page_size=4, backend="nope", fast=Fast(prepack=True))


def test_options_are_the_fields_set_and_give_the_value_back():
    assert Fast().options() == {}
    assert EVERYTHING.options() == dict(backend="cpu_paged", prepack=True, few_rows=True, flat=True, cpu_ops=True)
    assert Fast(**EVERYTHING.options()) == EVERYTHING


def test_a_decode_steps_rows_are_not_one_row():
    """``few_rows=True`` (an engine's ``max_num_seqs``) and ``few_rows=1`` differ though ``1 == True``; 0 is off."""
    rows, one = Fast(prepack=True, few_rows=True), Fast(prepack=True, few_rows=1)
    assert rows != one and len({rows, one}) == 2 and rows == Fast(prepack=True, few_rows=True)
    assert Fast(few_rows=0) == Fast() and Fast(few_rows=0).few_rows is False


def test_the_backend_is_named_once(model):
    with pytest.raises(ValueError, match=r"backend='sdpa' and fast.backend='cpu_paged': name the backend once"):
        pr.hf.PagedSession(model, num_pages=4, page_size=4, backend="sdpa", fast=Fast(backend="cpu_paged"))
    with pr.hf.PagedSession(model, num_pages=4, page_size=4, backend="cpu_paged", fast=EVERYTHING) as s:
        assert s.backend == "cpu_paged"
    with pr.hf.PagedSession(model, num_pages=4, page_size=4, backend="reference", fast=Fast(prepack=True)) as s:
        assert s.backend == "reference"


def _kernel_ran(linears, layer, rows: int) -> bool:
    with linears, torch.no_grad(), torch.profiler.profile() as prof:  # packed layers compute no gradients
        layer(torch.randn(rows, layer.in_features))
    return "paged_ref_linear::few_rows" in {e.key for e in prof.key_averages()}


def test_an_engine_sends_the_few_rows_kernel_its_decode_steps(model):
    """``few_rows=True`` in an engine: products of at most ``max_num_seqs`` rows (a decode step's)."""
    seqs = kernel_rows() - 1  # within what this CPU runs the kernel at
    engine = Engine(model, num_pages=8, page_size=4, max_num_seqs=seqs, fast=True)
    layer = model.model.layers[0].mlp.down_proj
    assert engine.session.backend == "cpu_paged"
    linears = engine.session._linears
    assert _kernel_ran(linears, layer, seqs) and not _kernel_ran(linears, layer, seqs + 1)
    with pr.hf.PagedSession(model, num_pages=4, page_size=4, fast=EVERYTHING) as s:  # no engine: kernel_rows()
        assert _kernel_ran(s._linears, layer, kernel_rows()) and not _kernel_ran(s._linears, layer, kernel_rows() + 1)


def test_an_engine_runs_the_kernel_no_further_than_this_cpu_runs_it_ahead(model):
    """An engine's ``max_num_seqs`` past `kernel_rows`: products of more rows go to oneDNN."""
    rows = kernel_rows()
    engine = Engine(model, num_pages=8, page_size=4, max_num_seqs=rows + 8, fast=True)
    layer = model.model.layers[0].mlp.down_proj
    linears = engine.session._linears
    assert _kernel_ran(linears, layer, rows) and not _kernel_ran(linears, layer, rows + 1)


def test_a_dry_engine_refuses_fast():
    with pytest.raises(ValueError, match=r"fast needs a model: a dry run \(Engine\(None, ...\)\) computes no token"):
        Engine(None, num_pages=8, page_size=4, fast=True)


def _rows_ahead(name: str) -> tuple[int, dict]:
    from paged_ref.lab.bench._serve_profile import rows_ahead

    data = json.loads((Path(__file__).parents[1] / "figures" / "data" / name).read_text())
    return rows_ahead(data["few_rows"]), data


@pytest.mark.parametrize("floats, name", [(16, "serve_profile_cpu.json"), (8, "few_rows_256bit.json")])
def test_kernel_rows_are_the_measured_rows_of_each_vector_width(floats, name):
    """`KERNEL_ROWS` is, for each tile the kernel has, the most rows up to which the committed few_rows table
    has it at least as fast as oneDNN at every row count it measures. The 256-bit table records its width and
    the CPU's extensions; the AVX-512 one predates that record."""
    ahead, data = _rows_ahead(name)
    assert ahead and KERNEL_ROWS[floats] == ahead, data["few_rows"]["rows"]
    if floats == 8:
        assert data["vector_floats"] == 8 and data["rows_ahead"] == ahead and data["torch_threads"] == 1
        assert "avx512f" not in data["environment"]["cpu_features"] and "avx2" in data["environment"]["cpu_features"]


def test_the_kernel_tile_is_the_cpu_vector_width():
    """The kernel's build has AVX-512's tile exactly where the CPU lists avx512f (Linux's /proc/cpuinfo)."""
    from paged_ref.lab.provenance import cpu_features

    features = cpu_features()
    if features is None or vector_floats() is None:
        pytest.skip("no /proc/cpuinfo flags, or no kernel build here")
    assert vector_floats() == (16 if "avx512f" in features else 8) and kernel_rows() == KERNEL_ROWS[vector_floats()]
