"""The serve benchmark's report: its goals computed from a run, the text tables, eviction's cost.

`check_goals` turns a run's numbers into the benchmark's goals (each met or not, with the
numbers); `format_rate_table` is the table ``bench serve`` prints per request rate (notebook 09
prints it too); `eviction_quality` reads PagedEviction's measured cost from ``bench eviction``'s JSON.
"""

from __future__ import annotations

from ..runmode import data_dir
from ..texttable import format_table

__all__ = ["POLICIES", "check_goals", "eviction_quality", "format_rate_table", "print_rate"]

#: The reservation policies every rate runs, in the order the goals read them.
POLICIES = ("paged", "exact", "max_len", "paged_eviction")


def check_goals(data: dict) -> dict:
    """The benchmark's goals, from this run's numbers: each ``{"met": bool, ...the numbers}``."""
    goals = {}
    top = data["rates"][-1]["policies"] if data.get("rates") else None
    if top:
        p, ex, ml, ev = (top[k] for k in POLICIES)
        goals["paged_vs_max_len_throughput_2x"] = {
            "ratio": p["tokens_per_s"] / ml["tokens_per_s"],
            "met": p["tokens_per_s"] >= 2 * ml["tokens_per_s"],
        }
        goals["paged_vs_exact_throughput_1.2x"] = {
            "ratio": p["tokens_per_s"] / ex["tokens_per_s"],
            "met": p["tokens_per_s"] >= 1.2 * ex["tokens_per_s"],
        }
        goals["paged_p90_ttft_no_worse"] = {
            "paged_s": p["ttft_p90_s"],
            "exact_s": ex["ttft_p90_s"],
            "max_len_s": ml["ttft_p90_s"],
            "met": p["ttft_p90_s"] <= min(ex["ttft_p90_s"], ml["ttft_p90_s"]),
        }
        goals["eviction_admits_more"] = {
            "mean_running": [ev["mean_running"], p["mean_running"]],
            "peak_running": [ev["peak_running"], p["peak_running"]],
            "throughput_ratio": ev["tokens_per_s"] / p["tokens_per_s"],
            "requests_with_paged_tokens": ev["requests_with_paged_tokens"],
            "met": ev["mean_running"] > p["mean_running"],
        }
    if "peer" in data:
        peer = data["peer"]
        goals["peer_throughput_1x_identical_tokens"] = {
            "ratio_median": peer["throughput_ratio_median"],
            "identical": f"{peer['requests_with_identical_tokens']}/{peer['requests']}",
            "met": peer["throughput_ratio_median"] >= 1.0
            and peer["requests_with_identical_tokens"] == peer["requests"],
        }
    if "overhead" in data:
        o = data["overhead"]
        goals["overhead_5pct_at_batch_16"] = {
            "share": o["overhead_share_median"],
            "met": o["overhead_share_median"] <= 0.05,
        }
    return goals


def eviction_quality(budget: int) -> dict | None:
    """Notebook 07's measured cost of PagedEviction at ``budget`` (`bench eviction`'s JSON), if present."""
    import json

    path = data_dir() / "eviction_full.json"
    if not path.exists():
        return None
    rows = json.loads(path.read_text())["language_modelling"]
    pick = {
        r["policy"]: r
        for r in rows
        if r["page_size"] == 16 and r["budget"] in (None, budget) and r["policy"] in ("full", "paged_eviction")
    }
    if len(pick) < 2:
        return None
    return {
        "source": "figures/data/eviction_full.json (bench eviction: continuation of 2048-token texts)",
        "budget": budget,
        "ppl_full": pick["full"]["ppl"],
        "ppl_paged_eviction": pick["paged_eviction"]["ppl"],
        "ppl_paged_eviction_ci95": pick["paged_eviction"]["ppl_ci95"],
    }


def print_rate(row: dict) -> None:
    load = f"load {row['load_before'][0]:.1f} -> {row['load_after'][0]:.1f}"
    print(f"\nrate {row['rate']:g} req/s ({row['wall_s']:.0f} s wall, {load})")
    print(format_rate_table(row["policies"]))


def format_rate_table(results: dict) -> str:
    """One rate's results (policy -> numbers) as the text table ``bench serve`` prints."""
    ms = lambda x: "-" if x is None else f"{x * 1e3:.0f}"  # noqa: E731
    headers = ["policy", "tok/s", "TTFT p50/p90 ms", "TPOT p50/p90 ms", "norm lat s/tok", "running mean/peak"]
    headers += ["preempt", "recomputed", "peak pages"]
    rows = []
    for name, r in results.items():
        committed = r["peak_committed_pages"]
        rows.append(
            [
                name,
                f"{r['tokens_per_s']:.1f}",
                f"{ms(r['ttft_p50_s'])}/{ms(r['ttft_p90_s'])}",
                f"{ms(r['tpot_p50_s'])}/{ms(r['tpot_p90_s'])}",
                f"{r['normalized_latency_s']:.3f}",
                f"{r['mean_running']:.1f}/{r['peak_running']}",
                r["preemptions"],
                r["recomputed_tokens"],
                f"{r['peak_pages']}" + (f" ({committed} committed)" if committed != r["peak_pages"] else ""),
            ]
        )
    return format_table(headers, rows)
