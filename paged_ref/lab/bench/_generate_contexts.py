"""Prefill and decode apart, at growing prompt lengths: the paged path against transformers'.

At each context length (English prose; random ids without a tokenizer) the methods take turns step by
step (each prefills, then each takes decode step 1, then step 2, ...), all greedy, same tokens expected:
``hf``, the model on ``DynamicCache``; ``paged_<backend>``, a `PagedSession` whose pool just fits (its
pages consecutive), the time spent building each step's plan timed apart; ``paged_<backend>_scattered``,
the same where another sequence holds every other page of a pool twice as large. ``skip_above`` leaves
a method out above a length. Per method: median prefill seconds and decode seconds per token, the
plan's share of decode, and paged / hf ratios (< 1 faster) of the medians and as the median of the
ratios of runs taken back to back: prefills (``prefill_over_hf_paired``) and decode steps
(``decode_over_hf_paired``).
"""

from __future__ import annotations

import time
from statistics import median_high

import torch

from ..._arith import cdiv
from ...hf import PagedSession
from ...hf.session import cache_keyword
from ._model_bench import paired_ratio, prompt_tokens

__all__ = ["measure_contexts"]


def _hf_run(model, prompt, steps):
    """Generator: prefill, then one decode step per ``next``; yields ``(seconds, plan_s, token)``."""
    with torch.inference_mode():
        t = time.perf_counter()
        out = model(prompt[None], use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - t
    key = cache_keyword(model)
    cache = out[key]
    token = out.logits[:, -1].argmax(-1)  # [1]
    yield seconds, None, int(token)
    for i in range(steps):
        position = torch.tensor([[prompt.numel() + i]])
        with torch.inference_mode():
            t = time.perf_counter()
            out = model(token[:, None], use_cache=True, position_ids=position, **{key: cache})
            seconds = time.perf_counter() - t
        cache = out[key]
        token = out.logits[:, -1].argmax(-1)
        yield seconds, None, int(token)


def _paged_run(model, prompt, steps, backend, page_size, scattered=False):
    """The same steps through a `PagedSession`; ``plan_s`` is the time spent building the step's plan."""
    num_pages = cdiv(prompt.numel() + steps + 1, page_size)
    pool = 2 * num_pages if scattered else num_pages
    with PagedSession(model, num_pages=pool, page_size=page_size, backend=backend) as session:
        if scattered:  # another sequence takes the whole pool, then gives back every other page
            other = session.kv.add_sequence()
            session.kv.reserve(other, 2 * num_pages * page_size)
            session.kv.drop_pages(other, range(0, 2 * num_pages, 2))
        s = session.add()
        tokens = [prompt]
        for _ in range(steps + 1):
            before = session.plan_seconds
            t = time.perf_counter()
            logits = session.extend([s], tokens)
            seconds = time.perf_counter() - t
            token = logits.argmax(-1)  # [1]
            tokens = [token]
            yield seconds, session.plan_seconds - before, int(token)


def measure_contexts(
    model, tokenizer, *, contexts, decode_steps, repeats, backends, page_size, scattered=(), skip_above=None
):
    """Prefill and per-token decode of the paged backends vs ``DynamicCache`` at each context."""
    skip_above = dict(skip_above or {})
    out = dict(contexts=list(contexts), decode_steps=decode_steps, repeats=repeats, page_size=page_size)
    out.update(skip_above=skip_above, rows=[])
    methods = {"hf": lambda p: _hf_run(model, p, decode_steps)}
    for b in backends:
        methods[f"paged_{b}"] = lambda p, b=b: _paged_run(model, p, decode_steps, b, page_size)
    for b in scattered:
        methods[f"paged_{b}_scattered"] = lambda p, b=b: _paged_run(model, p, decode_steps, b, page_size, True)
    warm = prompt_tokens(model, tokenizer, 16)
    for run in methods.values():  # one short warm-up of every path
        for _ in run(warm):
            pass
    for n in contexts:
        prompt = prompt_tokens(model, tokenizer, n)
        here = {m: run for m, run in methods.items() if n <= skip_above.get(m, n)}
        prefill, decode, plans = ({m: [] for m in here} for _ in range(3))
        for _ in range(repeats):
            runs = {m: run(prompt) for m, run in here.items()}
            tokens = {m: [] for m in here}
            for step in range(decode_steps + 1):  # the prefill, then each decode step, method after method
                for m, steps in runs.items():
                    seconds, plan, token = next(steps)
                    tokens[m].append(token)
                    (decode if step else prefill)[m].append(seconds)
                    if step and plan is not None:
                        plans[m].append(plan)
            for steps in runs.values():
                steps.close()  # closes the session (its pool goes back)
        row = {"context": n, "methods": {}}
        for m in here:
            r = {
                "prefill_s": median_high(prefill[m]),
                "prefill_times_s": prefill[m],
                "decode_s_per_token": median_high(decode[m]),
                "plan_share_of_decode_step": sum(plans[m]) / sum(decode[m]) if plans[m] else None,
                "tokens_match_hf": tokens[m] == tokens["hf"],
            }
            row["methods"][m] = r
            if m != "hf":
                hf = row["methods"]["hf"]
                r["prefill_over_hf"] = r["prefill_s"] / hf["prefill_s"]
                r["prefill_over_hf_paired"] = paired_ratio(prefill[m], prefill["hf"])
                r["decode_over_hf"] = r["decode_s_per_token"] / hf["decode_s_per_token"]
                r["decode_over_hf_paired"] = paired_ratio(decode[m], decode["hf"])
        out["rows"].append(row)
        summary = []
        for m, r in row["methods"].items():
            summary.append(f"{m} prefill {r['prefill_s']:.3f} s decode {r['decode_s_per_token'] * 1e3:.1f} ms")
            if m != "hf":
                ratios = f"{r['prefill_over_hf']:.2f}x, {r['decode_over_hf']:.2f}x"
                paired = f"{r['prefill_over_hf_paired']:.2f}x, {r['decode_over_hf_paired']:.2f}x"
                summary[-1] += f" ({ratios}, paired {paired})"
        print(f"context {n}: " + ", ".join(summary), flush=True)
    return out
