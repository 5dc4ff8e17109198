"""The eviction evaluation's speed task: time per output token per policy, against the full cache.

Part of `python -m paged_ref.bench eviction` (its ``speed`` rows).
"""

from __future__ import annotations

import statistics
import time

from ._eviction_runs import PER_LAYER, TOKEN_LEVEL, Batch, make_session, policy_runs, pool_pages, prefill_root

__all__ = ["SPEED_POLICIES", "speed_task"]

# the ablations run paged_eviction's code at the same cost
SPEED_POLICIES = ["full", "paged_eviction", "paged_eviction_per_layer", "streaming_llm", *TOKEN_LEVEL]


def speed_task(model, tok, cfg, log):
    """Time per output token and tokens/s per policy at each context and batch, as ratios to the
    full cache measured in the same run (the paper's speed claim: lower time per output token and
    higher throughput at long context).

    For each (context, batch): ``batch`` forks of one ``context``-token prompt (prefilled once per
    context and cache) decode together under one policy (hooks included); rounds interleave the
    policies; the median of the rounds.
    """
    from ..textdata import english_text

    longest = max(cfg["speed_contexts"])
    steps = cfg["speed_steps"]
    ids = tok(english_text(int(longest * 1.3), start=7), return_tensors="pt", add_special_tokens=False).input_ids[0]
    out = []
    for n in cfg["speed_contexts"]:
        roots = {}  # per_layer -> (session, root): the prompt prefilled once per cache type
        for per_layer in (False, True):
            runs = [_speed_run(x, cfg) for x in SPEED_POLICIES if (x in PER_LAYER) == per_layer]
            pages = max(pool_pages([r] * max(cfg["speed_batches"]), 16, n + steps) for r in runs)
            session = make_session(model, 16, pages, per_layer)
            roots[per_layer] = (session, prefill_root(session, ids[:n]))
        for batch_size in cfg["speed_batches"]:
            times = {name: [] for name in SPEED_POLICIES}
            held = {}
            for _ in range(cfg["speed_rounds"]):
                for name in SPEED_POLICIES:
                    batch = Batch(*roots[name in PER_LAYER], [_speed_run(name, cfg)] * batch_size)
                    batch.step(ids[n : n + 1].expand(batch_size))  # warm-up
                    t0 = time.perf_counter()
                    for j in range(1, steps):
                        batch.step(ids[n + j : n + j + 1].expand(batch_size))
                    times[name].append((time.perf_counter() - t0) / (steps - 1))  # seconds per decode step
                    held[name] = batch.row(0)["kv_bytes_held"]
                    batch.close()
            full = statistics.median(times["full"])
            for name in SPEED_POLICIES:
                step = statistics.median(times[name])
                out.append(
                    dict(
                        policy=name,
                        budget=None if name == "full" else cfg["speed_budget"],
                        page_size=16,
                        context=n,
                        batch=batch_size,
                        ms_per_token=1e3 * step,
                        tokens_per_s=batch_size / step,
                        tokens_per_s_rounds=[batch_size / t for t in times[name]],
                        ratio_vs_full=full / step,
                        time_per_token_vs_full=step / full,
                        kv_bytes_held=held[name],
                    )
                )
            log(f"speed at context {n}, batch {batch_size}: full {batch_size / full:.2f} tokens/s")
        for session, root in roots.values():
            session.finish(root)
            session.close()
            assert session.kv.allocator.num_free == session.kv.allocator.num_pages
    return out


def _speed_run(name: str, cfg):
    """The (label, policy name, budget) of ``name`` in the speed task."""
    return policy_runs([cfg["speed_budget"]], only=(name,))[0]
