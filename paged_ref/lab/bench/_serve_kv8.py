"""8-bit pages at the same pool bytes: ``bench serve --kv-format fp8_e4m3 --same-bytes`` (`run_same_bytes`).

A float32 pool of the profile's ``num_pages`` pages takes ``num_pages * page_size * bytes_per_token`` bytes. The
8-bit pool gets as many pages as fit in those bytes once its scales are counted (`same_bytes_pages`, from
`paged_ref.quant.page_bytes`: one byte a value, plus a float32 per page, KV head, K/V and layer with
``scales="page"``; with ``scales="layer"`` the per-layer scales, ``2 * num_layers`` float32s, belong to the pool
and are taken off it once), about 4x the pages. At each rate both pools serve the same requests under ``paged``
admission (the profile's watermark, the same share of each pool), taking turns step by step on their simulated
clocks (`paged_ref.lab.bench.serve`): tokens/s, TTFT and TPOT, requests running (mean, peak), preemptions,
recomputed tokens, peak pages; and how many requests the 8-bit pool gives the float32 pool's tokens. Then once
more offline, every request arriving at 0 (``rate`` None): there the schedule, and so every count, does not
depend on how long the steps took; at a rate, arrivals fall between steps timed on this machine.
"""

from __future__ import annotations

import os
import time

import torch

from ... import quant

__all__ = ["KV_FORMATS", "kv_format", "same_bytes_pages", "run_same_bytes", "check_kv8_goal"]

#: ``--kv-format`` names: the 8-bit formats of `paged_ref.quant.FORMATS`.
KV_FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}


def kv_format(name: str, scales: str = "layer"):
    """The `paged_ref.quant.KVFormat` of ``--kv-format name --kv-scales scales``: per-layer scales of 1.0
    (vLLM's default) or per-page scales, rounding to nearest."""
    if name not in KV_FORMATS:
        raise ValueError(f"kv format must be one of {sorted(KV_FORMATS)}, got {name!r}")
    return quant.KVFormat(KV_FORMATS[name], scales=scales)


def same_bytes_pages(geometry, *, num_pages: int, page_size: int, fmt) -> dict:
    """The 8-bit pool (`paged_ref.quant.KVFormat` ``fmt``) that fits in the bytes of ``num_pages`` pages of
    ``page_size`` tokens in ``geometry``'s dtype (`paged_ref.memory.KVGeometry` read from the model).

    Example (SmolLM2-135M in float32: 30 layers, 3 KV heads, head_dim 64; 64 pages of 16 tokens):
        >>> from paged_ref.memory import KVGeometry
        >>> g = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32)
        >>> p = same_bytes_pages(g, num_pages=64, page_size=16, fmt=quant.KVFormat(torch.float8_e4m3fn))
        >>> p["pool_bytes"], p["kv8_page_bytes"], p["kv8_pages"], p["kv8_pool_bytes"] <= p["pool_bytes"]
        (47185920, 184320, 255, True)
    """
    page_float = page_size * geometry.bytes_per_token
    pool = num_pages * page_float
    pool_scales = 2 * geometry.num_layers * quant.SCALE_BYTES if fmt.scales == "layer" else 0
    page8 = quant.page_bytes(fmt.dtype, page_size=page_size, **geometry.kv_shape, scales=fmt.scales)
    pages8 = (pool - pool_scales) // page8
    return {
        "float_dtype": str(geometry.dtype).removeprefix("torch."),
        "float_pages": num_pages,
        "float_page_bytes": page_float,
        "pool_bytes": pool,
        "kv8_format": str(fmt.dtype).removeprefix("torch."),
        "kv8_scales": fmt.scales,
        "kv8_page_bytes": page8,
        "kv8_pool_scale_bytes": pool_scales,
        "kv8_pages": pages8,
        "kv8_pool_bytes": pages8 * page8 + pool_scales,
        "pages_ratio": pages8 / num_pages,
    }


def run_same_bytes(model, cfg, requests, arrivals, fmt, *, save=None) -> dict:
    """Both pools (`same_bytes_pages`) at each of ``cfg["rates"]``, ``paged`` admission, in lockstep.

    Returns ``{"pools": same_bytes_pages's dict, "rates": [{"rate", "wall_s", "load_before", "load_after",
    "float32": numbers, "kv8": numbers}]}``; each rate's numbers as ``bench serve``'s rate table keeps them,
    ``requests_with_paged_tokens`` counting requests with the float32 pool's tokens; the last row offline
    (``rate`` None: every request at 0). ``save(part)`` after each row."""
    from ...memory import model_geometry
    from .serve import _engine, _lockstep, _result

    pools = same_bytes_pages(model_geometry(model), num_pages=cfg["num_pages"], page_size=cfg["page_size"], fmt=fmt)
    out = {"pools": pools, "kv_format": repr(fmt), "rates": []}
    for rate in (*cfg["rates"], None):
        engines = {
            "float32": _engine(model, cfg, "paged"),
            "kv8": _engine(model, cfg, "paged", num_pages=pools["kv8_pages"], kv_format=fmt),
        }
        for name, e, pages, page in (("float32", engines["float32"], "float_pages", "float_page_bytes"),
                                     ("kv8", engines["kv8"], "kv8_pages", "kv8_page_bytes")):  # fmt: skip
            if (e.kv.num_pages, e.kv.page_bytes) != (pools[pages], pools[page]):
                raise RuntimeError(
                    f"the {name} pool holds {e.kv.num_pages} pages of {e.kv.page_bytes} bytes, "
                    f"expected {pools[pages]} of {pools[page]}"
                )
            for (prompt, new), t in zip(requests, arrivals):
                e.add_request(prompt, max_new_tokens=new, arrival_s=0.0 if rate is None else t / rate)
        load = os.getloadavg()
        start = time.perf_counter()
        outs = _lockstep(engines, "same bytes, " + ("offline" if rate is None else f"rate {rate:g}/s"))
        row = {"rate": rate, "wall_s": time.perf_counter() - start, "load_before": load, "load_after": os.getloadavg()}
        float_tokens = [o.token_ids for o in outs["float32"]]
        row.update({n: _result(e, outs[n], float_tokens) for n, e in engines.items()})
        out["rates"].append(row)
        if save is not None:
            save(out)
    return out


def check_kv8_goal(row: dict, max_num_seqs: int) -> dict:
    """Issue 61's goal on one row of `run_same_bytes`: the 8-bit pool runs at least 1.8x the float32 pool's peak
    of requests (or ``max_num_seqs``), with fewer preemptions (none where the float32 pool had none)."""
    f, q = row["float32"], row["kv8"]
    target = min(1.8 * f["peak_running"], max_num_seqs)
    fewer = q["preemptions"] < f["preemptions"] or q["preemptions"] == f["preemptions"] == 0
    return {
        "rate": row["rate"],
        "peak_running": [f["peak_running"], q["peak_running"]],
        "peak_running_ratio": q["peak_running"] / f["peak_running"],
        "target_peak_running": target,
        "preemptions": [f["preemptions"], q["preemptions"]],
        "met": q["peak_running"] >= target and fewer,
    }
