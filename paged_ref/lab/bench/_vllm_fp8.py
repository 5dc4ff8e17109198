"""Why tokens from vLLM's fp8 cache and from the engine's 8-bit pages part: ``bench serve --peer vllm
--kv-cache-dtype fp8`` (`explain`).

Both sides store K and V as e4m3 bytes written as ``x * (1 / 1.0)`` truncated toward zero (vLLM's CPU write:
`vllm_kv_format`), and attend in float32 over those bytes times the scale (vLLM folds the scales into the
logits and the output: the same values, ``tests/test_vllm_quant.py``). What can still differ is measured here:

* **the bytes, layer by layer** (`page_bytes`): the workload's first prompts through both engines, one token
  each, so the cache holds the prompts only; vLLM's cache read out of its worker (`._vllm_peer.run_vllm`'s
  ``cache_out``), the engine's pages read by an observer before the requests give them back. Per layer:
  values, differing K and V bytes, and how many codes apart they lie. vLLM's float32 cache (``"auto"``) on the
  same prompts, quantized here with `paged_ref.quant.quantize` (``rounding="zero"``), is compared with vLLM's
  own fp8 bytes in layer 0, where both runs feed the write the same values: equal bytes mean the same format,
  rounding and scale, applied at the same point (the write, before attention reads the page);
* **saturation** (`saturation`): how many K and V values of every request (prompt and generated tokens, the
  engine's float32 model) lie beyond e4m3's +-448 at scale 1.0 (`paged_ref.quant.count_saturated`);
* **how close the choice was** (`margins`): where the two engines' tokens first part, how the engine's 8-bit
  model, fed the shared tokens at once, ranks vLLM's token and its own, and the gap between their logits,
  against the usual gap between the top two.
"""

from __future__ import annotations

import os
import statistics

import torch

from ... import quant
from ...serve.reservation import VLLM_ADMISSION

__all__ = [
    "vllm_kv_format",
    "vllm_pages",
    "engine_pages",
    "codes_apart",
    "page_bytes",
    "float_differences",
    "saturation",
    "fp8_logits",
    "margins",
    "explain",
    "finding",
]


def vllm_kv_format(name: str):
    """The engine's `paged_ref.quant.KVFormat` for vLLM's ``kv_cache_dtype=name`` on its CPU build: the format
    it maps the name to, per-layer scales of 1.0 (its default), truncation toward zero (its cache write).

    Example:
        >>> vllm_kv_format("fp8")
        KVFormat(dtype=torch.float8_e4m3fn, scales='layer', k_scale=1.0, v_scale=1.0, rounding='zero')
    """
    if name not in quant.VLLM_FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(quant.VLLM_FORMATS)}, got {name!r}")
    return quant.KVFormat(quant.VLLM_FORMATS[name], scales="layer", k_scale=1.0, v_scale=1.0, rounding="zero")


def vllm_pages(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of vLLM's CPU cache (``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, its ``vec``
    layout: per block and KV head, K column-major ``[head_dim, block_size]`` then V ``[block_size, head_dim]``)
    as ``(k, v)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]`` (this package's page layout)."""
    blocks, heads, size, two_d = cache.shape
    flat = cache.reshape(blocks, heads, size * two_d)
    half = flat.shape[-1] // 2
    k = flat[..., :half].reshape(blocks, heads, two_d // 2, size).permute(0, 3, 1, 2)
    v = flat[..., half:].reshape(blocks, heads, size, two_d // 2).permute(0, 2, 1, 3)
    return k, v


def engine_pages(model, prompts, *, page_size: int, kv_format=None) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each prompt's K and V as the engine stores them (`paged_ref.serve.Engine` with ``kv_format``, one token
    each, all prompts in one step): per prompt, per layer, ``(k, v)`` ``[prompt_len, num_kv_heads, head_dim]``
    (raw bytes as uint8 for 8-bit pages)."""
    from ...serve import Engine

    seen = {}

    def observe(engine):
        kv = engine.kv
        for r in engine.scheduler.running:
            pages, n = kv.pages(r.seq_id), kv.seq_len(r.seq_id)
            layers = []
            for layer in range(kv.num_layers):
                k, v = (c[layer][pages].flatten(0, 1)[:n] for c in (kv.k_cache, kv.v_cache))
                layers.append(tuple(x.view(torch.uint8) if x.dtype in quant.FORMATS else x.clone() for x in (k, v)))
            seen.setdefault(r.request_id, layers)

    total = sum(len(p) for p in prompts)
    pages = {} if kv_format is None else {"kv_format": kv_format}
    e = Engine(model, num_pages=-(-total // page_size) + len(prompts), page_size=page_size, max_num_seqs=len(prompts),
               max_batched_tokens=total, reservation=VLLM_ADMISSION, eos_token_id=[],
               **pages)  # fmt: skip
    e.observers.append(observe)
    ids = [e.add_request(list(p), max_new_tokens=1) for p in prompts]
    e.run()
    return [seen[i] for i in ids]


def codes_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many codes apart on the number line the e4m3 or e5m2 bytes ``a`` and ``b`` (uint8, sign and
    magnitude: the magnitude's codes are in order) lie; +0 and -0 are the same value.

    Example:
        >>> a, b = torch.tensor([0x38, 0x00, 0x01]), torch.tensor([0x39, 0x80, 0x81])  # 1.0 and 1.125, +0 and -0
        >>> codes_apart(a.to(torch.uint8), b.to(torch.uint8))
        tensor([1, 0, 2], dtype=torch.int32)
    """

    def ordinal(x):
        return torch.where(x >= 0x80, -(x & 0x7F).int(), x.int())

    return (ordinal(a) - ordinal(b)).abs()


def _match(blocks: torch.Tensor, target: torch.Tensor) -> int:
    """The block of ``blocks`` (``[num_blocks, block_size, H, D]``) whose first ``len(target)`` rows are nearest
    ``target``: vLLM's block ids are its own, found by content (layer 0, where the two sides agree)."""
    n = len(target)
    if blocks.dtype == torch.uint8:
        return int((blocks[:, :n] != target).sum(dim=(1, 2, 3)).argmin())
    return int((blocks[:, :n] - target).abs().amax(dim=(1, 2, 3)).argmin())


def _vllm_sequences(caches, ours_layer0, block_size: int):
    """Per prompt, per layer, vLLM's ``(k, v)`` ``[prompt_len, H, D]``; blocks matched on layer 0's K."""
    k0, _ = vllm_pages(caches[0])
    out = []
    for ours in ours_layer0:
        n = len(ours)
        ids = [_match(k0, ours[j : j + block_size]) for j in range(0, n, block_size)]
        layers = []
        for cache in caches:
            k, v = vllm_pages(cache)
            layers.append(tuple(x[ids].flatten(0, 1)[:n] for x in (k, v)))
        out.append(layers)
    return out


def page_bytes(ours, theirs) -> list[dict]:
    """Per layer, how the engine's bytes (``ours``, `engine_pages`) and vLLM's (``theirs``) differ."""
    rows = []
    for layer in range(len(ours[0])):
        row = {"layer": layer, "values": 0, "k_differ": 0, "v_differ": 0, "one_code_apart": 0, "codes_apart_max": 0}
        for a, b in zip(ours, theirs):
            for name, x, y in (("k", a[layer][0], b[layer][0]), ("v", a[layer][1], b[layer][1])):
                apart = codes_apart(x, y)
                row["values"] += x.numel() if name == "k" else 0
                row[f"{name}_differ"] += int((apart > 0).sum())
                row["one_code_apart"] += int((apart == 1).sum())
                row["codes_apart_max"] = max(row["codes_apart_max"], int(apart.max()))
        rows.append(row)
    return rows


def float_differences(ours, theirs) -> list[dict]:
    """Per layer, how far the engine's float32 K and V (`engine_pages` without ``kv_format``) lie from vLLM's
    float32 cache: the largest difference, relative to the largest magnitude, and how many values differ."""
    rows = []
    for layer in range(len(ours[0])):
        row = {"layer": layer, "values": 0, "differ": 0, "max_abs_diff": 0.0, "abs_max": 0.0}
        for a, b in zip(ours, theirs):
            for x, y in zip(a[layer], b[layer]):
                row["values"] += x.numel()
                row["differ"] += int((x != y).sum())
                row["max_abs_diff"] = max(row["max_abs_diff"], float((x - y).abs().max()))
                row["abs_max"] = max(row["abs_max"], float(x.abs().max()))
        rows.append(row)
    return rows


@torch.no_grad()
def _model_kv(model, ids: list[int]):
    """The float32 model's K (after RoPE) and V of every layer for ``ids``: ``[(k, v)]``, ``[len, H, D]``."""
    out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    return [(lay.keys[0].transpose(0, 1), lay.values[0].transpose(0, 1)) for lay in cache.layers], out.logits[0]


def saturation(model, sequences, fmt) -> dict:
    """K and V values of ``sequences`` (token ids: what the cache holds) beyond ``fmt``'s range at scale 1.0
    (`paged_ref.quant.count_saturated`), with the largest magnitude seen, per layer and in all."""
    k_sat, v_sat, k_max, v_max, n = [], [], [], [], 0
    for ids in sequences:
        kv, _ = _model_kv(model, ids)
        for layer, (k, v) in enumerate(kv):
            if layer == len(k_sat):
                k_sat.append(0), v_sat.append(0), k_max.append(0.0), v_max.append(0.0)
            k_sat[layer] += quant.count_saturated(k, 1.0, fmt)
            v_sat[layer] += quant.count_saturated(v, 1.0, fmt)
            k_max[layer] = max(k_max[layer], float(k.abs().max()))
            v_max[layer] = max(v_max[layer], float(v.abs().max()))
            n += k.numel()
    return {
        "format_max": quant.FORMATS[fmt],
        "scale": 1.0,
        "values_per_k_or_v": n,
        "k_saturated": sum(k_sat),
        "v_saturated": sum(v_sat),
        "k_saturated_per_layer": k_sat,
        "v_saturated_per_layer": v_sat,
        "k_abs_max_per_layer": k_max,
        "v_abs_max_per_layer": v_max,
    }


@torch.no_grad()
def fp8_logits(model, ids: list[int], kv_format, *, page_size: int = 32) -> torch.Tensor:
    """The logits ``[len(ids), vocab]`` after each token of ``ids``, fed at once through a `PagedSession` on
    8-bit pages in ``kv_format``: what the engine's 8-bit model thinks at every position of a sequence."""
    from ...cache import PagedKVCache
    from ...hf import PagedSession

    kv = PagedKVCache.for_model(model, num_pages=-(-len(ids) // page_size), page_size=page_size, kv_format=kv_format)
    with PagedSession(model, kv_cache=kv) as session:
        return session.extend([session.add()], [torch.tensor(ids)], all_logits=True)[0]


def margins(model, requests, ours_tokens, theirs_tokens, kv_format) -> dict:
    """For each request whose tokens part, at its first differing token: where the engine's 8-bit model
    (`fp8_logits` over the prompt and the shared tokens, in ``kv_format``) ranks vLLM's token and its own (0:
    first), the gap between their logits, and the median gap between the top two over the request's tokens (and
    over every token of those requests: ``top2_gap_median_pooled``)."""
    rows, pooled = [], []
    for i, ((prompt, _), a, b) in enumerate(zip(requests, ours_tokens, theirs_tokens)):
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None:
            continue
        logits = fp8_logits(model, list(prompt) + a[:-1], kv_format)[len(prompt) - 1 :]  # [len(a), vocab]
        top = logits.topk(2, dim=-1).values
        pooled += (top[:, 0] - top[:, 1]).tolist()
        here = logits[at]
        rows.append({
            "request": i,
            "at": at,
            "tokens": len(a),
            "vllm_token_rank": int((here > here[b[at]]).sum()),
            "engine_token_rank": int((here > here[a[at]]).sum()),
            "logit_gap": float(here[a[at]] - here[b[at]]),
            "top2_gap_median": statistics.median((top[:, 0] - top[:, 1]).tolist()),
        })  # fmt: skip
    ranks = [r["vllm_token_rank"] for r in rows]
    return {
        "requests": rows,
        "vllm_token_rank_counts": {str(k): ranks.count(k) for k in sorted(set(ranks))},
        "logit_gap_median": statistics.median([abs(r["logit_gap"]) for r in rows]) if rows else None,
        "top2_gap_median_pooled": statistics.median(pooled) if pooled else None,  # every token of these requests
    }


def explain(model, info, requests, ours_tokens, theirs_tokens, *, kv_cache_dtype: str, python: str, threads: int,
            prompts: int = 8) -> dict:  # fmt: skip
    """The three measurements of the module docstring, on ``requests`` (the first ``prompts`` for the bytes)."""
    import tempfile

    from ._vllm_peer import CPU_BLOCK_MULTIPLE, save_smollm2
    from .serve import _vllm_subprocess

    fmt = vllm_kv_format(kv_cache_dtype)
    few = [list(p) for p, _ in requests[:prompts]]
    page = CPU_BLOCK_MULTIPLE
    ours = engine_pages(model, few, page_size=page, kv_format=fmt)
    limits = dict(page_size=page, num_pages=sum(-(-len(p) // page) for p in few) + len(few), max_num_seqs=len(few))
    limits.update(max_batched_tokens=sum(map(len, few)), max_model_len=limits["num_pages"] * page)
    caches = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "model")
        save_smollm2(folder) if info["name"].startswith("smollm2") else model.save_pretrained(folder)
        for kind in ("auto", kv_cache_dtype):
            out = os.path.join(tmp, f"cache_{kind}.pt")
            job = {"model_dir": folder, "requests": [[p, 1] for p in few], "limits": limits}
            _vllm_subprocess(python, {**job, "kv_cache_dtype": kind, "cache_out": out}, threads)
            caches[kind] = torch.load(out)
    theirs = _vllm_sequences(caches[kv_cache_dtype], [layers[0][0] for layers in ours], page)
    ours_float = engine_pages(model, few, page_size=page)
    floats = _vllm_sequences(caches["auto"], [layers[0][0] for layers in ours_float], page)
    requantized = [[tuple(quant.quantize(x, 1.0, fmt.dtype, rounding="zero").view(torch.uint8) for x in layers[0])]
                   for layers in floats]  # fmt: skip
    layer0 = page_bytes(requantized, [[layers[0]] for layers in theirs])[0]
    sequences = [list(p) + t[:-1] for (p, _), t in zip(requests, ours_tokens)]
    return {
        "engine_kv_format": repr(fmt),
        "prompts_compared": len(few),
        "prompt_tokens_compared": sum(map(len, few)),
        "bytes_per_layer": page_bytes(ours, theirs),
        "float32_per_layer": float_differences(ours_float, floats),
        "vllm_float32_requantized_vs_vllm_fp8_layer0": layer0,
        "saturation": saturation(model, sequences, fmt.dtype),
        "margins": margins(model, requests, ours_tokens, theirs_tokens, fmt),
    }


def finding(why: dict, peer: dict) -> dict:
    """What `explain`'s numbers (``why``) and the token comparison (``peer``: `run_vllm_comparison`'s) say, in
    words built from them: each cause the issue names (format, rounding, when the scale applies, attention
    arithmetic, saturation) with its evidence, and the cause that remains."""
    a, r0, layers = peer["agreement"], why["vllm_float32_requantized_vs_vllm_fp8_layer0"], why["bytes_per_layer"]
    s, m = why["saturation"], why["margins"]
    pooled = m.get("top2_gap_median_pooled")
    usual = "its usual top-2 gap" if pooled is None else f"the median top-2 gap of those requests ({pooled:.2f})"
    close = [r for r in m["requests"] if abs(r["logit_gap"]) < (r["top2_gap_median"] if pooled is None else pooled) / 2]
    grown = next((x["layer"] for x in layers if x["codes_apart_max"] > 1), None)
    last, f0 = layers[-1], why["float32_per_layer"][0]
    own = r0["k_differ"] + r0["v_differ"]
    exceptions = f" but for {own} of {2 * r0['values']} (at most {r0['codes_apart_max']} code apart)" if own else ""
    return {
        "tokens": f"{a['requests_identical']}/{a['requests']} requests identical; {a['tokens_before_first_difference']}"
        f" of {a['tokens']} tokens before each request's first difference",
        "format_rounding_scale": f"vLLM's layer-0 fp8 bytes are its own float32 K/V (from its float32 run) "
        f"truncated to e4m3 at scale 1.0{exceptions}: the engine's format, rounding and scale, applied where the "
        "engine applies them (when a page is written, before attention reads it); another rounding would differ in "
        "about half the bytes (tests/test_vllm_quant.py)",
        "attention_arithmetic": "float32 on both sides (vLLM's fp8 attention equals the reference on the dequantized "
        "pages to 1e-5: tests/test_vllm_quant.py)",
        "saturation": f"{s['k_saturated'] + s['v_saturated']} of {2 * s['values_per_k_or_v']} K/V values beyond "
        f"+-{s['format_max']:g} at scale 1.0 (largest |K| {max(s['k_abs_max_per_layer']):.1f}, "
        f"|V| {max(s['v_abs_max_per_layer']):.1f})",
        "bytes": f"engine vs vLLM bytes of the first {why['prompts_compared']} prompts: layer 0 "
        f"{layers[0]['k_differ'] + layers[0]['v_differ']} of {2 * layers[0]['values']} differ (at most "
        f"{layers[0]['codes_apart_max']} code apart; the two engines' layer-0 float32 K/V differ in {f0['differ']} "
        f"of {f0['values']} values, by at most {f0['max_abs_diff']:.1e}, so a value on a code's edge can fall either "
        "way); "
        f"more each layer (differences of more than one code from layer {grown}), layer {last['layer']} "
        f"{last['k_differ'] + last['v_differ']}",
        "close_calls": f"where tokens part, the engine's 8-bit model gives both tokens logits closer than half "
        f"{usual} in {len(close)} of {len(m['requests'])} requests (|gap| median {m['logit_gap_median']}); "
        f"vLLM's token ranks there {m['vllm_token_rank_counts']}",
        "why": "the same bytes up to float32 rounding, which 8 bits amplify (a flipped code moves a normal e4m3 "
        "value by up to 2^-3 of itself, one below 2^-6 by 2^-9, float32 rounding by 2^-24) layer by layer, until a "
        "greedy choice between two close tokens goes the other way",
    }
