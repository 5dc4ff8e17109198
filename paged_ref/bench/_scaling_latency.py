"""Per-token decode latency vs context length, one decoder at a time, on one shared prompt.

Each decoder climbs a ladder of contexts (ascending) with one prefill in all:

    for each context L:
        feed prompt[pos:L] in prefill chunks                (untimed: sets the context)
        feed `warmup` single tokens                          (untimed)
        feed `steps` single tokens, timing each one          (decode at context ~L)

The prompt's own next token is fed (not the prediction), so every decoder's greedy predictions
compare position by position. The no-cache decoder pays a whole prefill per step, so it takes
``nocache_steps`` timed steps and one warm-up at its first context only.

Example:
    >>> import torch
    >>> from paged_ref.models import tiny_llama
    >>> model = tiny_llama()
    >>> prompt = torch.randint(3, 500, (80,), generator=torch.Generator().manual_seed(0))
    >>> cfg = LadderConfig(contexts=[16, 32], warmup=1, steps=2, nocache_steps=1)
    >>> r = run_ladder(model, "dynamic", prompt, cfg)
    >>> [p["context"] for p in r["points"]], len(r["points"][0]["times_s"])
    ([16, 32], 2)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ._scaling_decoders import PagedDecoder, make_decoder, peak_bytes, reset_peak, synchronize

__all__ = ["LadderConfig", "run_ladder", "agreement"]

#: Short decoder names and how results label them.
LABELS = {
    "none": "no cache (recompute)",
    "dynamic": "contiguous (DynamicCache)",
    "static": "contiguous (StaticCache)",
    "flex": "paged (flex)",
    "triton": "paged (triton)",
    "reference": "paged (reference)",
    "sdpa": "paged (sdpa)",
}


@dataclass
class LadderConfig:
    """How a ladder is climbed: ``warmup`` untimed and ``steps`` timed single-token steps per
    context (``nocache_steps`` for the no-cache decoder), prefill in ``prefill_chunk``-token
    forwards. ``timed=False``: a correctness-only pass (predictions kept, no times reported)."""

    contexts: list[int]
    warmup: int = 2
    steps: int = 8
    nocache_steps: int = 2
    prefill_chunk: int = 2048
    page_size: int = 16
    timed: bool = True

    def __post_init__(self):
        if not self.contexts or any(c < 1 for c in self.contexts):
            raise ValueError(f"contexts must be positive ints, got {self.contexts}")
        gaps = [b - a for a, b in zip(self.contexts, self.contexts[1:])]
        if any(g <= self.warmup + self.steps for g in gaps):
            raise ValueError(
                f"contexts must be ascending with gaps > warmup + steps = {self.warmup + self.steps}, "
                f"got {self.contexts}"
            )

    def tokens_needed(self) -> int:
        """Prompt length the ladder consumes (last context plus its decode steps)."""
        return self.contexts[-1] + self.warmup + max(self.steps, self.nocache_steps + 1) + 1


def run_ladder(model, name: str, prompt: torch.Tensor, cfg: LadderConfig, *, deadline: float | None = None) -> dict:
    """Climb the ladder with decoder ``name`` (`make_decoder`); contexts not started by
    ``deadline`` (``time.monotonic()``) are listed in ``skipped``.

    Returns:
        ``{"backend", "label", "timed", "points": [{"context", "tokens_held", "median_s", "times_s",
        "kv_bytes", "peak_bytes", "weights_bytes", "allocated_before_bytes"}], "predictions":
        {position: token}, "alloc_calls": [(op, ns, pages)], "skipped": [contexts]}``, and for a
        paged decoder ``pages_held``, ``page_bytes``, ``pool_bytes``. ``peak_bytes``: CUDA's peak
        during the timed steps (weights included); ``kv_bytes``: K/V held after them.
    """
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1 or prompt.dtype != torch.long:
        raise TypeError(f"prompt must be a 1-D LongTensor, got {getattr(prompt, 'shape', type(prompt).__name__)}")
    if prompt.numel() < cfg.tokens_needed():
        raise ValueError(
            f"prompt must hold at least {cfg.tokens_needed()} tokens for contexts {cfg.contexts}, got {prompt.numel()}"
        )
    device = next(model.parameters()).device
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    dec = make_decoder(model, name, max_len=cfg.tokens_needed(), page_size=cfg.page_size)
    result = {
        "backend": name,
        "label": LABELS.get(name, name),
        "timed": cfg.timed,
        "points": [],
        "predictions": {},
        "alloc_calls": [],
        "skipped": [],
    }
    pos = 0
    nocache = name == "none"
    try:
        for i, context in enumerate(cfg.contexts):
            if deadline is not None and time.monotonic() > deadline:
                result["skipped"] = list(cfg.contexts[i:])
                break
            while pos < context:  # set the context (untimed)
                end = min(context, pos + cfg.prefill_chunk)
                dec.feed([prompt[pos:end]], predict=False)
                pos = end
            warm = (1 if i == 0 else 0) if nocache else cfg.warmup
            for _ in range(warm):  # untimed, but its predictions are compared too
                result["predictions"][pos] = int(dec.feed([prompt[pos : pos + 1]])[0])
                pos += 1
            base = reset_peak(device)
            times = []
            for _ in range(cfg.nocache_steps if nocache else cfg.steps):
                synchronize(device)
                start = time.perf_counter()
                pred = dec.feed([prompt[pos : pos + 1]])  # argmax copied to the host: waits for the step
                times.append(time.perf_counter() - start)
                result["predictions"][pos] = int(pred[0])
                pos += 1
            result["points"].append(
                {
                    "context": context,
                    "tokens_held": pos,
                    "median_s": statistics.median(times) if cfg.timed else None,
                    "times_s": times if cfg.timed else None,
                    "kv_bytes": dec.kv_bytes(),
                    "peak_bytes": peak_bytes(device),
                    "weights_bytes": weights,
                    "allocated_before_bytes": base,
                }
            )
        if isinstance(dec, PagedDecoder):
            result["pages_held"] = dec.pages_held()
            result["page_bytes"] = dec.kv.page_bytes
            result["pool_bytes"] = dec.kv.num_pages * dec.kv.page_bytes
            result["alloc_calls"] = list(dec.timer.calls)
    finally:
        dec.close()
    return result


def agreement(results: list[dict]) -> dict:
    """``{label: {"against", "compared", "equal"}}``: each decoder's greedy predictions against the
    first's, at the positions both decoded."""
    if not results:
        return {}
    base = results[0]["predictions"]
    out = {}
    for r in results[1:]:
        common = sorted(set(base) & set(r["predictions"]))
        out[r["label"]] = {
            "against": results[0]["label"],
            "compared": len(common),
            "equal": sum(base[p] == r["predictions"][p] for p in common),
        }
    return out
