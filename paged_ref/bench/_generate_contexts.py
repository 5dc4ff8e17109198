"""Prefill and decode apart, at growing prompt lengths: the paged path against transformers'.

For each context length ``n`` (a prompt of ``n`` tokens of real English from pydoc_data; random
ids without a tokenizer), in one run, methods interleaved in each repeat:

* ``hf``: the plain model with transformers' ``DynamicCache`` (SDPA attention): prefill is one
  ``model(prompt, use_cache=True)``; decode is ``decode_steps`` single-token forwards on that cache.
* ``paged_<backend>``: a `PagedSession` with a pool just large enough: prefill is one
  ``session.extend`` over the prompt; decode the same single-token steps. The time the session
  spends building each step's plan (slots, block table, attention inputs) is timed apart. A
  fresh pool hands one sequence consecutive pages, which the ``sdpa`` decoder reads in place;
* ``paged_<backend>_scattered``: the same on a pool twice as large where another sequence holds
  every other page, so no two of the sequence's pages are neighbours (the general case: pages
  gathered a page at a time).

``skip_above``: a method left out at contexts above a length (the reference's prefill at 8192
tokens alone takes minutes on 2 cores).

Both decode greedily and must produce the same tokens. Reported per method: median prefill
seconds, median decode seconds per token, the plan's share of a decode step, and the ratios
paged / hf (1.0 = as fast; < 1 faster).
"""

from __future__ import annotations

import time
from statistics import median_high as _median  # the upper middle value, as the other benchmarks

import torch

from .. import textdata
from .._arith import cdiv
from ..hf import PagedSession

__all__ = ["measure_contexts"]


def _prompt(model, tokenizer, n: int) -> torch.Tensor:
    """LongTensor ``[n]``: real text when a tokenizer is given, else seeded random ids."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(n)
        return torch.randint(3, model.config.vocab_size, (n,), generator=g)
    words = n
    while True:  # pydoc prose tokenizes to ~1.3 tokens per word: grow until long enough
        ids = tokenizer(textdata.english_text(words)).input_ids
        if len(ids) >= n:
            return torch.tensor(ids[:n])
        words = int(words * 1.5) + 8


@torch.inference_mode()
def _hf_run(model, prompt, steps):
    t = time.perf_counter()
    out = model(prompt[None], use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - t
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    token = out.logits[:, -1].argmax(-1)
    tokens, times = [int(token)], []
    for i in range(steps):
        position = torch.tensor([[prompt.numel() + i]])
        t = time.perf_counter()
        out = model(
            token[:, None],
            use_cache=True,
            position_ids=position,
            **{"cache" if "cache" in out else "past_key_values": cache},
        )
        times.append(time.perf_counter() - t)
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        token = out.logits[:, -1].argmax(-1)
        tokens.append(int(token))
    return prefill, times, [], tokens


def _paged_run(model, prompt, steps, backend, page_size, scattered=False):
    num_pages = cdiv(prompt.numel() + steps + 1, page_size)
    with PagedSession(
        model, num_pages=2 * num_pages if scattered else num_pages, page_size=page_size, backend=backend
    ) as session:
        if scattered:  # another sequence takes the whole pool, then gives back every other page
            other = session.kv.add_sequence()
            session.kv.reserve(other, 2 * num_pages * page_size)
            session.kv.drop_pages(other, range(0, 2 * num_pages, 2))
        s = session.add()
        t = time.perf_counter()
        logits = session.extend([s], [prompt])
        prefill = time.perf_counter() - t
        token = logits.argmax(-1)
        tokens, times, plans = [int(token)], [], []
        for _ in range(steps):
            before = session.plan_seconds
            t = time.perf_counter()
            logits = session.extend([s], [token])
            times.append(time.perf_counter() - t)
            plans.append(session.plan_seconds - before)
            token = logits.argmax(-1)
            tokens.append(int(token))
    return prefill, times, plans, tokens


def measure_contexts(
    model, tokenizer, *, contexts, decode_steps, repeats, backends, page_size, scattered=(), skip_above=None
):
    """Prefill and per-token decode of the paged backends vs ``DynamicCache`` at each context."""
    skip_above = dict(skip_above or {})
    out = {
        "contexts": list(contexts),
        "decode_steps": decode_steps,
        "repeats": repeats,
        "page_size": page_size,
        "skip_above": skip_above,
        "rows": [],
    }
    methods = {"hf": lambda p: _hf_run(model, p, decode_steps)}
    for b in backends:
        methods[f"paged_{b}"] = lambda p, b=b: _paged_run(model, p, decode_steps, b, page_size)
    for b in scattered:
        methods[f"paged_{b}_scattered"] = lambda p, b=b: _paged_run(
            model, p, decode_steps, b, page_size, scattered=True
        )
    warm = _prompt(model, tokenizer, 16)
    for run in methods.values():  # one short warm-up of every path
        run(warm)
    for n in contexts:
        prompt = _prompt(model, tokenizer, n)
        here = {m: run for m, run in methods.items() if n <= skip_above.get(m, n)}
        prefill = {m: [] for m in here}
        decode = {m: [] for m in here}
        plan_share = {m: [] for m in here}
        tokens = {}
        for _ in range(repeats):
            for m, run in here.items():
                p, times, plans, toks = run(prompt)
                prefill[m].append(p)
                decode[m].extend(times)
                if plans:
                    plan_share[m].append(sum(plans) / sum(times))
                tokens[m] = toks
        row = {"context": n, "methods": {}}
        for m in here:
            row["methods"][m] = {
                "prefill_s": _median(prefill[m]),
                "prefill_times_s": prefill[m],
                "decode_s_per_token": _median(decode[m]),
                "plan_share_of_decode_step": _median(plan_share[m]) if plan_share[m] else None,
                "tokens_match_hf": tokens[m] == tokens["hf"],
            }
        hf = row["methods"]["hf"]
        for m in here:
            if m != "hf":
                r = row["methods"][m]
                r["prefill_over_hf"] = r["prefill_s"] / hf["prefill_s"]
                r["decode_over_hf"] = r["decode_s_per_token"] / hf["decode_s_per_token"]
        out["rows"].append(row)
        print(
            f"context {n}: "
            + ", ".join(
                f"{m} prefill {r['prefill_s']:.3f} s decode {r['decode_s_per_token'] * 1e3:.1f} ms"
                + (f" ({r['prefill_over_hf']:.2f}x, {r['decode_over_hf']:.2f}x)" if m != "hf" else "")
                for m, r in row["methods"].items()
            ),
            flush=True,
        )
    return out
