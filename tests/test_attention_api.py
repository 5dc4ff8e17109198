"""The attention package's front door: one naming scheme, one name per function, checks once."""

import pytest
import torch
from attention_cases import valid_inputs

import paged_ref as pr
from paged_ref import attention
from paged_ref.attention import _checks, flex, reference, triton_decode

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def test_every_name_of_the_front_door_resolves():
    for name in attention.__all__:
        assert callable(getattr(attention, name)), name


def test_one_name_per_backend_function():
    """Every entry point is ``<backend>_paged_decode`` / ``<backend>_paged_prefill``; no second name."""
    assert not {"paged_decode", "paged_attention_reference", "paged_prefill_reference"} & set(dir(attention))
    assert not {"paged_decode", "paged_attention_reference", "paged_prefill_reference"} & set(pr.__all__)
    assert pr.triton_paged_decode is attention.triton_paged_decode is triton_decode.triton_paged_decode
    with pytest.raises(ImportError):
        from paged_ref.hf import sdpa  # noqa: F401  (its one home is paged_ref.attention.sdpa)


def test_triton_kernels_are_jit_functions_at_definition():
    from triton.runtime.jit import JITFunction

    assert isinstance(triton_decode._paged_decode_split_kernel, JITFunction)
    assert isinstance(triton_decode._reduce_splits_kernel, JITFunction)
    assert triton_decode.compiled_kernels()["_paged_decode_split_kernel"] is triton_decode._paged_decode_split_kernel


@pytest.mark.parametrize("check_values", [True, False])
def test_a_flex_call_checks_the_block_table_once(monkeypatch, check_values):
    """check_paged_inputs reads the used entries when check_values is on; the mask builder then
    trusts them. With check_values off, the mask builder's page-range check is the one check."""
    calls = {"inputs": 0, "pages": 0}
    inputs, pages = _checks.check_paged_inputs, _checks.check_table_pages

    def count_inputs(*args, **kwargs):
        calls["inputs"] += 1
        return inputs(*args, **kwargs)

    def count_pages(*args, **kwargs):
        calls["pages"] += 1
        return pages(*args, **kwargs)

    monkeypatch.setattr(flex, "check_paged_inputs", count_inputs)
    monkeypatch.setattr(flex, "check_table_pages", count_pages)
    args = valid_inputs(decode=True)
    out = flex.flex_paged_decode(*args.values(), check_values=check_values)
    torch.testing.assert_close(out, reference.reference_paged_decode(*args.values()), atol=1e-5, rtol=1e-5)
    assert calls == {"inputs": 1, "pages": 0 if check_values else 1}


def test_flex_without_value_checks_still_rejects_a_page_outside_the_cache():
    args = valid_inputs(decode=True)
    args["block_table"] = args["block_table"].clone()
    args["block_table"][0, 0] = args["k_cache"].shape[0]
    with pytest.raises(ValueError, match="block_table: the pages sequences use must be in"):
        flex.flex_paged_decode(*args.values(), check_values=False)


@pytest.mark.parametrize(
    "name", ["reference_paged_decode", "flex_paged_decode", "sdpa_paged_decode", "cpu_paged_decode"]
)
@pytest.mark.parametrize("value", ["no", 0, None])
def test_check_values_takes_true_or_false_only(name, value):
    """A truthy or falsy stand-in ("no" would turn the value checks on, 0 off) is refused by name."""
    args = valid_inputs(decode=True)
    with pytest.raises(TypeError, match=f"check_values must be True or False, got {value!r}"):
        getattr(attention, name)(*args.values(), check_values=value)
