"""Allocator cost per page operation, paged_ref vs PyTorch's experimental PagedAttention.

    python -m paged_ref.lab.bench alloc [--quick] [--out DIR]

``num_seqs`` sequences (seeded lognormal lengths up to ``max_len``) grow one page at a time in
round-robin order, as decode does, then are released; each call timed with ``perf_counter_ns``:
``PageAllocator.allocate(1)`` / ``free(pages)``, ``PagedKVCache.reserve(seq, page_size)`` /
``free(seq)`` (block tables included), torch ``PagedAttention.reserve(batch_idx, seq_len)`` /
``erase(batch_idx)``. Each repeat runs every implementation in turn (the order reversed every other
repeat, so that a drift of the machine favours none). Reported: ns per page operation (total / pages,
median over repeats, and each repeat's), median and p99 of single calls (all repeats), and peer /
paged_ref as the median of the per-repeat ratios; and ``zeroing``: zeroing one page in every layer (as
`PagedKVCache` does for a freed page) vs writing its tokens once, on SmolLM2-135M's geometry (30 layers,
3 KV heads, head_dim 64, float32), the two taking turns, their ratio the median of the per-repeat ratios.
JSON: ``figures/data/alloc_cpu.json``.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from ...allocator import PageAllocator
from ...block_table import pages_needed
from ...cache import PagedKVCache
from .common import bench_parser, command_line, environment, paired_ratio, print_table, result_file


def workload(num_seqs: int, max_len: int, page_size: int, seed: int = 0) -> list[int]:
    """Pages each sequence grows to (lognormal lengths, median ~max_len/4)."""
    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(np.log(max_len / 4), 0.8, num_seqs).astype(int), 1, max_len)
    return [pages_needed(int(n), page_size) for n in lens]


def _round_robin(pages_per_seq):
    """(seq, logical page) in the order decode would ask for them."""
    for step in range(max(pages_per_seq)):
        for seq, n in enumerate(pages_per_seq):
            if step < n:
                yield seq, step


def run_allocator(pages_per_seq, page_size):
    alloc = PageAllocator(sum(pages_per_seq))
    held = [[] for _ in pages_per_seq]
    grow, release = [], []
    for seq, _ in _round_robin(pages_per_seq):
        t = time.perf_counter_ns()
        held[seq] += alloc.allocate(1)
        grow.append(time.perf_counter_ns() - t)
    for pages in held:
        t = time.perf_counter_ns()
        alloc.free(pages)
        release.append(time.perf_counter_ns() - t)
    return grow, release


def run_cache(pages_per_seq, page_size):
    cache = PagedKVCache(num_layers=1, num_pages=sum(pages_per_seq), page_size=page_size, num_kv_heads=1, head_dim=1)
    ids = [cache.add_sequence() for _ in pages_per_seq]
    grow, release = [], []
    for seq, _ in _round_robin(pages_per_seq):
        t = time.perf_counter_ns()
        cache.reserve(ids[seq], page_size)
        grow.append(time.perf_counter_ns() - t)
    for seq in ids:
        t = time.perf_counter_ns()
        cache.free(seq)
        release.append(time.perf_counter_ns() - t)
    return grow, release


def run_torch(pages_per_seq, page_size):
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    pa = PagedAttention(sum(pages_per_seq), page_size, len(pages_per_seq), device="cpu")
    grow, release = [], []
    for seq, page in _round_robin(pages_per_seq):
        b, n = torch.tensor([seq]), torch.tensor([(page + 1) * page_size])
        t = time.perf_counter_ns()
        pa.reserve(b, n)
        grow.append(time.perf_counter_ns() - t)
    for seq in range(len(pages_per_seq)):
        b = torch.tensor([seq])
        t = time.perf_counter_ns()
        pa.erase(b)
        release.append(time.perf_counter_ns() - t)
    return grow, release


IMPLEMENTATIONS = {
    "paged_ref.PageAllocator": run_allocator,
    "paged_ref.PagedKVCache": run_cache,
    "torch PagedAttention": run_torch,
}


PEER = "torch PagedAttention"


def measure(num_seqs=64, max_len=2048, page_size=16, repeats=5, seed=0) -> dict:
    pages_per_seq = workload(num_seqs, max_len, page_size, seed)
    total = sum(pages_per_seq)
    per_page = {name: [] for name in IMPLEMENTATIONS}
    calls = {name: [] for name in IMPLEMENTATIONS}
    names = list(IMPLEMENTATIONS)
    for r in range(repeats):  # every implementation in turn, the order reversed every other repeat
        for name in names if r % 2 == 0 else names[::-1]:
            grow, release = IMPLEMENTATIONS[name](pages_per_seq, page_size)
            per_page[name].append((sum(grow) + sum(release)) / total)
            calls[name] += grow + release
    results = {}
    for name in names:
        results[name] = {
            "ns_per_page_op": float(np.median(per_page[name])),
            "ns_per_page_op_repeats": per_page[name],
            "call_median_ns": float(np.median(calls[name])),
            "call_p99_ns": float(np.percentile(calls[name], 99)),
            # the median of the ratios of runs of the same repeat, not the ratio of the medians
            "torch_over_this": paired_ratio(per_page[PEER], per_page[name]),
        }
    sizes = dict(num_seqs=num_seqs, max_len=max_len, page_size=page_size, total_pages=total, repeats=repeats)
    return {"workload": dict(sizes, seed=seed), "results": results}


def zeroing_cost(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, pages=64, repeats=5) -> dict:
    """Median ns to zero one page in every layer vs to write its ``page_size`` tokens."""
    geometry = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size)
    cache = PagedKVCache(num_pages=pages, **geometry)
    seq = cache.add_sequence()
    slots = cache.reserve(seq, pages * page_size).view(pages, page_size)  # [pages, page_size]
    k = torch.randn(page_size, num_kv_heads, head_dim)  # one page of tokens
    zero, write = [], []
    for _ in range(repeats):  # a pair per repeat: write every page, then zero every page
        t = time.perf_counter_ns()
        for page in range(pages):
            for layer in range(num_layers):
                cache.write(layer, slots[page], k, k, check_values=False)
        write.append((time.perf_counter_ns() - t) / pages)
        t = time.perf_counter_ns()
        for page in range(pages):
            cache._zero_pages([page])
        zero.append((time.perf_counter_ns() - t) / pages)
    return {
        "geometry": dict(geometry, dtype="float32"),
        "zero_page_ns": float(np.median(zero)),
        "write_page_ns": float(np.median(write)),
        "zero_page_ns_repeats": zero,
        "write_page_ns_repeats": write,
        "zero_over_write": paired_ratio(zero, write),
    }


COLUMNS = [  # (header, cell of a results row)
    ("ns/page op", "{ns_per_page_op:.0f}"),
    ("call median ns", "{call_median_ns:.0f}"),
    ("call p99 ns", "{call_p99_ns:.0f}"),
    ("torch / this", "{torch_over_this:.2f}x"),
]


def main(argv=None):
    parser = bench_parser("alloc", __doc__)
    parser.add_argument("--quick", action="store_true", help="a small workload (seconds)")
    args = parser.parse_args(argv)
    result = result_file(parser, args.out, "alloc_cpu.json")  # checked before anything is measured
    data = {"command": command_line("alloc", argv), "torch_threads": torch.get_num_threads()}
    data["load_before"] = list(os.getloadavg())
    data.update(measure(**(dict(num_seqs=16, max_len=512, repeats=3) if args.quick else {})))
    result.save(data)
    data["zeroing"] = zeroing_cost(repeats=3 if args.quick else 5)
    data["load_after"] = list(os.getloadavg())
    data["environment"] = environment()
    print(f"workload: {data['workload']}; load average {data['load_before'][0]:.1f} -> {data['load_after'][0]:.1f}")
    rows = [[name] + [cell.format(**r) for _, cell in COLUMNS] for name, r in data["results"].items()]
    print_table(["implementation"] + [header for header, _ in COLUMNS], rows)
    z = data["zeroing"]
    print(
        f"zeroing a page in all {z['geometry']['num_layers']} layers: {z['zero_page_ns']:.0f} ns; "
        f"writing its tokens: {z['write_page_ns']:.0f} ns; ratio {z['zero_over_write']:.2f}"
    )
    path = result.save(data, complete=True)
    print(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()
