"""vLLM's fp8 KV cache (``kv_cache_dtype="fp8"``) and the engine's 8-bit pages in vLLM's format, side by side
(runs in .venv-vllm: `make test-vllm`).

A few of ``bench serve``'s requests (SmolLM2, float32 weights) go through ``vllm.LLM`` with an fp8 cache (its
own process, `paged_ref.lab.bench._vllm_peer`) and through `paged_ref.serve.Engine` with
``kv_format=_vllm_fp8.vllm_kv_format("fp8")``: e4m3 bytes, one scale of 1.0 per layer for K and for V,
truncated toward zero as vLLM's CPU write does. The bytes are read back from both caches after the prompts
(`paged_ref.lab.bench._vllm_fp8`).
"""

import sys

import pytest
import torch
from vllm_peer import require_vllm

from paged_ref import quant

require_vllm()

PAGE, NEW, COUNT = 32, 12, 6
LIMITS = dict(max_num_seqs=32, max_batched_tokens=512)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        pytest.skip("vLLM's CPU build runs an fp8 cache only on x86 with AVX-512 or AMX")
    from paged_ref.lab.bench._vllm_peer import save_smollm2
    from paged_ref.lab.bench.serve import PROFILES, make_requests
    from paged_ref.models import load_smollm2

    model, tok = load_smollm2()
    cfg = PROFILES["cpu"]
    lengths = {k: cfg[k] for k in ("requests", "mean_prompt", "mean_output", "sigma", "min_prompt", "max_model_len")}
    requests, _ = make_requests(model, tok, **lengths)
    requests = [(p, min(n, NEW)) for p, n in requests[:COUNT]]
    return model, save_smollm2(tmp_path_factory.mktemp("smollm2")), requests


def _vllm(folder, requests, kv_cache_dtype, cache_out=None, pool=None) -> dict:
    """vLLM in its own process (a second ``vllm.LLM`` in this one would find too little memory free); by
    default on a pool where every request fits at once."""
    from paged_ref.lab.bench.serve import _vllm_subprocess

    pool = pool or sum(-(-(len(p) + n) // PAGE) for p, n in requests)
    limits = dict(LIMITS, page_size=PAGE, num_pages=pool, max_model_len=pool * PAGE)
    job = {"model_dir": folder, "requests": [[list(p), n] for p, n in requests], "limits": limits}
    return _vllm_subprocess(sys.executable, {**job, "kv_cache_dtype": kv_cache_dtype, "cache_out": cache_out}, 1)


@pytest.fixture(scope="module")
def prompt_caches(workload, tmp_path_factory):
    """Both sides' caches after the prompts alone (one token each): per prompt, per layer, ``(k, v)``."""
    from paged_ref.lab.bench import _vllm_fp8

    model, folder, requests = workload
    prompts = [list(p) for p, _ in requests]
    tmp = tmp_path_factory.mktemp("caches")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ours = _vllm_fp8.engine_pages(model, prompts, page_size=PAGE, kv_format=_vllm_fp8.vllm_kv_format("fp8"))
        ours_float = _vllm_fp8.engine_pages(model, prompts, page_size=PAGE)
    finally:
        torch.set_num_threads(threads)
    out = {"ours": ours, "ours_float": ours_float}
    for kind in ("auto", "fp8"):
        _vllm(folder, [(p, 1) for p in prompts], kind, cache_out=str(tmp / f"{kind}.pt"))
        caches = torch.load(tmp / f"{kind}.pt")
        anchor = [layers[0][0] for layers in (ours if kind == "fp8" else ours_float)]
        out[kind] = _vllm_fp8._vllm_sequences(caches, anchor, PAGE)
    return out


def _truncated(x):
    return quant.quantize(x, 1.0, torch.float8_e4m3fn, rounding="zero").view(torch.uint8)


def test_vllm_writes_its_float32_values_truncated_at_scale_one(prompt_caches):
    """Layer 0's K and V do not depend on the cache: vLLM's float32 run and its fp8 run compute them alike (to
    the last bits, which may differ between the two runs). Its fp8 bytes are those values truncated to e4m3 at
    scale 1.0 (`quant.quantize`, ``rounding="zero"``) but for rare one-code flips where the last bits cross a
    code: the same format, rounding and scale, applied when the page is written (rounding to nearest instead
    would differ in about half the bytes: tests/test_vllm_quant.py)."""
    from paged_ref.lab.bench import _vllm_fp8

    differ = values = 0
    for theirs_float, theirs in zip(prompt_caches["auto"], prompt_caches["fp8"]):
        for x, q in zip(theirs_float[0], theirs[0]):
            codes = _vllm_fp8.codes_apart(_truncated(x), q)
            assert codes.max() <= 1
            differ, values = differ + int((codes > 0).sum()), values + q.numel()
    assert differ <= values * 1e-4, (differ, values)


def test_the_engine_writes_vllms_bytes_but_where_float32_rounding_crosses_a_code(prompt_caches):
    """The engine's layer-0 bytes are its own float32 values truncated the same way; they differ from vLLM's
    only where the two engines' float32 K or V (equal to a few ulps: other matrix-product kernels) lie on
    either side of an e4m3 code, so a byte differs by one code, and rarely: the codes are 2^-3 apart relative
    to the value, float32's rounding about 2^-23."""
    from paged_ref.lab.bench import _vllm_fp8

    differ = values = 0
    for ours, ours_float, theirs, theirs_float in zip(
        *(prompt_caches[k] for k in ("ours", "ours_float", "fp8", "auto"))
    ):
        for q, x, q_v, x_v in zip(ours[0], ours_float[0], theirs[0], theirs_float[0]):
            assert torch.equal(_truncated(x), q)
            torch.testing.assert_close(x, x_v, rtol=1e-5, atol=1e-5)
            codes = _vllm_fp8.codes_apart(q, q_v)
            assert codes.max() <= 1
            differ, values = differ + int((codes > 0).sum()), values + q.numel()
    assert differ <= values * 1e-3, (differ, values)


def test_tokens_part_only_where_the_8bit_model_has_a_close_call(workload):
    """The requests on a pool about half of what they need (preemption, recompute), greedy on both sides. The
    byte differences above grow layer by layer (each flipped code moves that value by up to 2^-3 of itself, far
    more than float32 rounding), so greedy tokens can part; where they do (if they do), the engine's 8-bit model,
    fed the prompt and the shared tokens, gives both tokens logits closer than half the median gap between its
    top two over those requests' tokens: a close call, not another format, rounding or scale. Preemptions are the
    scheduler's: equal."""
    from paged_ref.lab.bench import _vllm_fp8
    from paged_ref.serve import VLLM_ADMISSION, Engine

    model, folder, requests = workload
    alone = max(-(-(len(p) + n - 1) // PAGE) for p, n in requests)
    pool = max(alone, sum(len(p) + n for p, n in requests) // PAGE // 2)
    theirs = _vllm(folder, requests, "fp8", pool=pool)
    fmt = _vllm_fp8.vllm_kv_format("fp8")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(model, num_pages=pool, page_size=PAGE, reservation=VLLM_ADMISSION,
                        eos_token_id=[], kv_format=fmt, max_model_len=pool * PAGE, **LIMITS)  # fmt: skip
        for prompt, new in requests:
            engine.add_request(prompt, max_new_tokens=new)
        ours = [o.token_ids for o in engine.run()]
        m = _vllm_fp8.margins(model, requests, ours, theirs["tokens"], fmt)
    finally:
        torch.set_num_threads(threads)
    assert [len(t) for t in ours] == [len(t) for t in theirs["tokens"]] == [n for _, n in requests]
    assert engine.stats()["preemptions"] == theirs["preemptions"] > 0
    for r in m["requests"]:
        assert abs(r["logit_gap"]) < m["top2_gap_median_pooled"] / 2, (r, m["top2_gap_median_pooled"])
    print(f"identical: {len(requests) - len(m['requests'])}/{len(requests)}; where tokens part: {m['requests']}")
