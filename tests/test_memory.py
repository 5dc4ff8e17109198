"""KV memory arithmetic: the papers' seed numbers exactly, properties, and every error."""

import pytest

from paged_ref.lab.sizing import (
    DTYPE_BYTES,
    MODEL_PRESETS,
    dense_scores_bytes,
    dtype_bytes,
    format_bytes,
    model_preset,
    reservation_report,
)
from paged_ref.memory import kv_bytes_per_token, kv_cache_bytes

LLAMA = dict(num_kv_heads=32, head_dim=128)
GiB, MiB = 2**30, 2**20


def test_llama7b_2048_tokens_per_layer_and_total():
    assert kv_cache_bytes(2048, num_layers=1, **LLAMA) == 33_554_432
    assert kv_cache_bytes(2048, num_layers=32, **LLAMA) == 1_073_741_824
    assert kv_cache_bytes(2048, **MODEL_PRESETS["LLaMA-7B"].kv_shape) == 1_073_741_824
    # the reviewers' decimal rendering, and the claim it refutes (~160 MB per layer)
    assert format_bytes(33_554_432, "MB", 1) == "33.6 MB"
    assert format_bytes(1_073_741_824, "GB") == "1.07 GB"
    assert 160e6 / 33_554_432 > 4.7


def test_kv_bytes_per_token_and_linearity():
    assert kv_bytes_per_token(num_layers=32, **LLAMA) == 512 * 1024
    assert kv_bytes_per_token(num_layers=32, **LLAMA, bytes_per_elem=4) == 1024 * 1024
    for n in (0, 1, 17, 4096):
        assert kv_cache_bytes(n, num_layers=3, num_kv_heads=2, head_dim=8) == n * 2 * 3 * 2 * 8 * 2


def test_presets_size_by_kv_heads():
    smol = model_preset("SmolLM2-135M")
    assert (smol.num_layers, smol.num_kv_heads, smol.head_dim) == (30, 3, 64)
    assert kv_bytes_per_token(**smol.kv_shape) == 2 * 30 * 3 * 64 * 2 == 23_040
    llama3 = model_preset("Llama-3-8B")
    assert llama3.num_q_heads // llama3.num_kv_heads == 4
    # GQA: a quarter of LLaMA-7B's cache at the same layer count and head_dim
    assert kv_bytes_per_token(**llama3.kv_shape) * 4 == kv_bytes_per_token(**MODEL_PRESETS["LLaMA-7B"].kv_shape)


@pytest.mark.parametrize("n, gib", [(4096, 1), (8192, 4), (16384, 16)])
def test_dense_scores_explainer_example(n, gib):
    assert dense_scores_bytes(n, num_heads=32) == gib * GiB


def test_dense_scores_quadratic_and_batch():
    assert dense_scores_bytes(100, num_heads=2, bytes_per_elem=4, batch=3) == 3 * 2 * 100 * 100 * 4
    assert dense_scores_bytes(0, num_heads=1) == 0


def test_seed_reservation_report_exact():
    r = reservation_report([19, 45, 70], page_size=16, reserved_per_request=128, bytes_per_token=128 * 1024)
    assert (r.reserved_slots, r.paged_slots, r.used_slots, r.unused_paged_slots) == (384, 160, 134, 26)
    assert r.unused_reserved_slots == 250
    assert (r.reserved_bytes, r.paged_bytes, r.used_bytes) == (48 * MiB, 20 * MiB, 16.75 * MiB)
    assert [format_bytes(b) for b in (r.reserved_bytes, r.paged_bytes, r.used_bytes)] == [
        "48.00 MiB",
        "20.00 MiB",
        "16.75 MiB",
    ]
    table = r.table()
    assert "384 slots" in table and "48.00 MiB" in table and "26 slots" in table


def test_report_without_bytes_has_none():
    r = reservation_report([5], page_size=4, reserved_per_request=8)
    assert r.reserved_bytes is None and r.paged_bytes is None and r.used_bytes is None
    assert "MiB" not in r.table()


@pytest.mark.parametrize("page_size", [1, 2, 3, 7, 16, 64, 128])
@pytest.mark.parametrize("lengths", [[1], [16], [17], [19, 45, 70], [1, 2, 3, 127, 128]])
def test_report_properties(lengths, page_size):
    r = reservation_report(lengths, page_size=page_size, reserved_per_request=128)
    assert r.used_slots == sum(lengths)
    assert r.reserved_slots >= r.used_slots
    assert r.paged_slots >= r.used_slots
    assert r.paged_slots % page_size == 0
    assert 0 <= r.unused_paged_slots < page_size * len(lengths)
    if page_size == 1:
        assert r.unused_paged_slots == 0


def test_format_bytes_units():
    assert format_bytes(1536, "KiB") == "1.50 KiB"
    assert format_bytes(10**9, "GB", 0) == "1 GB"
    assert format_bytes(0, "B") == "0.00 B"


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(num_layers=0), ValueError, "num_layers must be >= 1, got 0"),
        (dict(num_kv_heads=-2), ValueError, "num_kv_heads must be >= 1, got -2"),
        (dict(head_dim=2.5), TypeError, "head_dim must be an int, got float"),
        (dict(bytes_per_elem=0), ValueError, "bytes_per_elem must be >= 1"),
        (dict(num_tokens=-1), ValueError, "num_tokens must be >= 0, got -1"),
        (dict(num_tokens=True), TypeError, "num_tokens must be an int"),
    ],
)
def test_kv_cache_bytes_errors(kwargs, exc, words):
    args = dict(num_tokens=16, num_layers=2, num_kv_heads=2, head_dim=4) | kwargs
    n = args.pop("num_tokens")
    with pytest.raises(exc, match=words):
        kv_cache_bytes(n, **args)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(num_heads=0), ValueError, "num_heads must be >= 1"),
        (dict(batch=0), ValueError, "batch must be >= 1"),
        (dict(bytes_per_elem="2"), TypeError, "bytes_per_elem must be an int"),
    ],
)
def test_dense_scores_errors(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        dense_scores_bytes(8, **(dict(num_heads=2) | kwargs))
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        dense_scores_bytes(-8, num_heads=2)


@pytest.mark.parametrize(
    "lengths, kwargs, exc, words",
    [
        ([19, 0], {}, ValueError, r"lengths\[1\] must be >= 1, got 0"),
        ([19, 129], {}, ValueError, r"lengths\[1\] = 129 exceeds reserved_per_request = 128"),
        ([], {}, ValueError, "at least one request"),
        ("19", {}, TypeError, "lengths must be a sequence of ints"),
        (19, {}, TypeError, "lengths must be a sequence of ints"),
        ([1.5], {}, TypeError, r"lengths\[0\] must be an int"),
        ([19], dict(page_size=0), ValueError, "page_size must be >= 1, got 0"),
        ([19], dict(reserved_per_request=-1), ValueError, "reserved_per_request must be >= 1"),
        ([19], dict(bytes_per_token=0), ValueError, "bytes_per_token must be >= 1"),
    ],
)
def test_reservation_report_errors(lengths, kwargs, exc, words):
    with pytest.raises(exc, match=words):
        reservation_report(lengths, **(dict(page_size=16, reserved_per_request=128) | kwargs))


def test_lookup_errors_list_the_choices():
    with pytest.raises(ValueError, match="name must be one of .*LLaMA-7B.*got 'GPT-9'"):
        model_preset("GPT-9")
    with pytest.raises(ValueError, match="dtype must be one of .*float16.*got 'fp16'"):
        dtype_bytes("fp16")
    with pytest.raises(ValueError, match="unit must be one of"):
        format_bytes(1, "MB/s")
    assert {dtype_bytes(d) for d in DTYPE_BYTES} == {1, 2, 4}


def test_dense_scores_decode_step_is_linear():
    # a decode step scores one query against N keys: [batch, heads, 1, N]
    assert dense_scores_bytes(16384, num_heads=32, num_queries=1) == 2**20
    assert dense_scores_bytes(200, num_heads=3, num_queries=1) * 2 == dense_scores_bytes(
        400, num_heads=3, num_queries=1
    )
    assert dense_scores_bytes(64, num_heads=2, num_queries=64) == dense_scores_bytes(64, num_heads=2)
    with pytest.raises(ValueError, match="num_queries"):
        dense_scores_bytes(8, num_heads=2, num_queries=-1)


def test_kv_geometry_is_the_one_geometry_type():
    """Presets, a loaded model and a cache all describe their KV shape with one KVGeometry."""
    import torch

    from paged_ref.cache import PagedKVCache
    from paged_ref.memory import KVGeometry, model_geometry
    from paged_ref.models import tiny_llama

    smol = model_preset("SmolLM2-135M")
    assert isinstance(smol, KVGeometry) and smol.num_q_heads // smol.num_kv_heads == 3 and smol.dtype is None
    with pytest.raises(ValueError, match="bytes_per_token needs the geometry's dtype"):
        _ = smol.bytes_per_token
    model = tiny_llama()
    g = model_geometry(model)
    assert (g.num_layers, g.num_kv_heads, g.num_q_heads, g.dtype) == (
        model.config.num_hidden_layers,
        model.config.num_key_value_heads,
        model.config.num_attention_heads,
        torch.float32,
    )
    assert g.bytes_per_token == kv_bytes_per_token(**g.kv_shape, bytes_per_elem=4)
    kv = PagedKVCache.for_model(model, num_pages=3, page_size=4, prefix_caching=True)
    assert kv.geometry.cache_kwargs == g.cache_kwargs and kv.prefix_caching
    assert kv.page_bytes == 4 * g.bytes_per_token


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_layers=0, num_kv_heads=1, head_dim=8), "num_layers"),
        (dict(num_layers=1, num_kv_heads=1, head_dim=8.0), "head_dim"),
        (dict(num_layers=1, num_kv_heads=2, head_dim=8, num_q_heads=3), "multiple of num_kv_heads"),
    ],
)
def test_kv_geometry_rejects_bad_shapes(kwargs, match):
    from paged_ref.memory import KVGeometry

    with pytest.raises((TypeError, ValueError), match=match):
        KVGeometry(**kwargs)
