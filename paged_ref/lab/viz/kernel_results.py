"""The Triton decode kernel's measurements as figures and tables (notebook 05).

* :func:`bandwidth_figure`: measured bandwidth of each implementation against the copy
  ceiling, from the JSON ``python -m paged_ref.lab.bench decode`` writes (``decode_gpu.json``).
* :func:`compile_rows` / :func:`compile_report_figure`: what the compiler made of the kernel per
  GPU target (registers, spills, occupancy), from ``python -m paged_ref.lab.bench kernels``
  (``kernels.json``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from ..provenance import describe
from . import add_note

__all__ = ["provenance", "bandwidth_figure", "COMPILE_HEADERS", "compile_rows", "compile_report_figure"]

IMPL_COLORS = {
    "paged_decode": "tab:red",
    "paged_decode (again)": "#f4a3a3",
    "paged_decode contiguous": "tab:purple",
    "flex_paged_decode": "tab:orange",
    "sdpa contiguous": "tab:blue",
}


def provenance(data: dict) -> str:
    """One line: where, with what and when a decode benchmark result was measured."""
    return describe({"command": "python -m paged_ref.lab.bench decode", **data})


def bandwidth_figure(data: dict, *, impls: Sequence[str] | None = None) -> Figure:
    """Achieved K/V bandwidth of each implementation per (batch, length, page size), with the
    device-to-device copy bandwidth measured in the same run as the ceiling.

    Args:
        data: the dict ``python -m paged_ref.lab.bench decode`` writes to
            ``figures/data/decode_gpu.json`` (``copy``, ``results``, ``environment``).
        impls: implementations to draw, in order (default: those present, paged first).
    """
    if not isinstance(data, dict) or "results" not in data or "copy" not in data:
        raise ValueError("data must be a decode benchmark result with 'copy' and 'results' keys")
    rows = [r for r in data["results"] if r.get("bandwidth_GBps") is not None]
    if not rows:
        raise ValueError("data['results'] holds no bandwidth measurement")
    present = list(dict.fromkeys(r["impl"] for r in rows))
    impls = (
        [i for i in IMPL_COLORS if i in present] + [i for i in present if i not in IMPL_COLORS]
        if impls is None
        else list(impls)
    )
    shapes = sorted({(r["batch"], r["seq_len"]) for r in rows})
    pages = sorted({r["page_size"] for r in rows if r["page_size"] is not None})
    cases = [
        (b, n, p)
        for b, n in shapes
        for p in pages
        if any((r["batch"], r["seq_len"], r["page_size"]) == (b, n, p) for r in rows)
    ]
    by = {(r["batch"], r["seq_len"], r["page_size"], r["impl"]): r for r in rows}
    fig = Figure(figsize=(max(7.0, 0.9 * len(cases) + 3), 3.8), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(impls))
    x = np.arange(len(cases))
    for j, impl in enumerate(impls):
        vals = []
        for b, n, p in cases:
            r = by.get((b, n, p, impl)) or by.get((b, n, None, impl))  # SDPA has no page
            vals.append(r["bandwidth_GBps"] if r else np.nan)
        ax.bar(x + (j - (len(impls) - 1) / 2) * width, vals, width, label=impl, color=IMPL_COLORS.get(impl))
    copy = data["copy"]["bandwidth_GBps"]
    ax.axhline(copy, color="k", ls="--", lw=1, label=f"device copy {copy:,.0f} GB/s")
    ax.axhline(0.85 * copy, color="k", ls=":", lw=1, label="85% of copy")
    ax.set_xticks(x, [f"{b}×{n:,}\npage {p}" for b, n, p in cases], fontsize=7)
    ax.set_ylabel("K+V bytes read / median time, GB/s")
    ax.set_xlabel("batch × length, page size")
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    ax.grid(True, axis="y", alpha=0.3)
    dtype = (data.get("config") or {}).get("dtype", "")
    ax.set_title(f"decode attention {dtype}: achieved bandwidth vs the copy ceiling", fontsize=10)
    add_note(fig, provenance(data))
    return fig


# --- what the compiler made of the kernel (figures/data/kernels.json) -------------------------
def compile_rows(data: dict, *, head_dim: int = 128, group: int = 4) -> list[list]:
    """Table rows of the compile report for one head_dim and GQA group: per target, dtype,
    page size and split, what ``python -m paged_ref.lab.bench kernels`` read from the machine code."""
    rows = []
    for e in data["split_kernel"]:
        if e["head_dim"] != head_dim or e["group"] != group or not e["hints"]:
            continue
        if "error" in e:
            rows.append([f"sm_{e['arch']}", e["dtype"], e["page_size"], e["split"], "ERROR", "", "", "", "", "", ""])
            continue
        path = "one page" if e["page_size"] >= e["tile"]["BLOCK_N"] else "gather"
        rows.append(
            [
                f"sm_{e['arch']}",
                e["dtype"],
                e["page_size"],
                "yes" if e["split"] else "no",
                path,
                e["registers"],
                e["spill_stores"],
                f"{e['shared_bytes'] / 1024:.1f} KB",
                e["async_copies"],
                "x".join(map(str, e["kv_buffers"])) or "-",
                e["programs_per_sm"],
                f"{e['kv_bytes_in_flight_per_sm'] / 1024:.0f} / {e['littles_law_bytes_per_sm'] / 1024:.0f} KB",
            ]
        )
    return rows


COMPILE_HEADERS = [
    "target",
    "dtype",
    "page",
    "split",
    "tile from",
    "registers",
    "spill stores",
    "shared",
    "async copies",
    "K/V buffers",
    "programs/SM",
    "in flight / Little (per SM)",
]


def compile_report_figure(data: dict) -> Figure:
    """Registers and K/V bytes in flight per SM of every compiled 16-bit configuration, per
    target, against Little's law (left: registers, spilling ones in red; right: bytes in flight).
    fp32 is left out: it is not a model path on GPUs (its spills are in the report's table)."""
    entries = [e for e in data["split_kernel"] if e["hints"] and "error" not in e]
    archs = sorted({e["arch"] for e in entries}, reverse=True)
    fig = Figure(figsize=(10.5, 3.6), layout="constrained")
    ax_reg, ax_fly = fig.subplots(1, 2)
    rng = np.random.default_rng(0)
    for i, arch in enumerate(archs):
        mine = [e for e in entries if e["arch"] == arch and e["dtype"] != "fp32"]
        jitter = rng.uniform(-0.25, 0.25, len(mine))
        spill = np.array([e["spill_stores"] + e["spill_loads"] > 0 for e in mine], dtype=bool)
        regs = np.array([e["registers"] for e in mine])
        fly = np.array([e["kv_bytes_in_flight_per_sm"] / 1024 for e in mine])
        ax_reg.scatter(
            i + jitter[~spill], regs[~spill], s=8, color="tab:blue", alpha=0.6, label="no spill" if i == 0 else None
        )
        ax_reg.scatter(
            i + jitter[spill], regs[spill], s=14, color="red", marker="x", label="spills" if i == 0 else None
        )
        ax_fly.scatter(i + jitter, fly, s=8, color="tab:green", alpha=0.6)
        law = mine[0]["littles_law_bytes_per_sm"] / 1024
        ax_fly.plot(
            [i - 0.4, i + 0.4],
            [law, law],
            color="k",
            lw=1.5,
            label="Little's law (datasheet bandwidth x 1 us / SMs)" if i == 0 else None,
        )
    labels = [
        data["assumptions"]["targets"][str(a)]["name"] if str(a) in data["assumptions"]["targets"] else f"sm_{a}"
        for a in archs
    ]
    for ax in (ax_reg, ax_fly):
        ax.set_xticks(range(len(archs)), labels, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    ax_reg.set_ylabel("registers per thread")
    ax_reg.set_title("16-bit configurations: registers (255 = the limit)", fontsize=9)
    ax_reg.legend(fontsize=7)
    ax_fly.set_ylabel("K/V KB in flight per SM")
    ax_fly.set_yscale("log")
    ax_fly.set_title("16-bit: K/V bytes in flight per SM vs what memory needs", fontsize=9)
    ax_fly.legend(fontsize=7)
    add_note(
        fig,
        f"Compiled without a GPU by `{data.get('command')}`, triton {data.get('triton')}, "
        f"{data['environment']['date_utc'][:10]}; read with cuobjdump "
        "(no hardware measured).",
    )
    return fig
