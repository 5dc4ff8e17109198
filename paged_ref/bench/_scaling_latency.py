"""Per-token decode latency vs context length, one decoder at a time, on one shared prompt.

A *ladder* of context lengths (e.g. 128, 256, ..., 2048) is climbed by each decoder in turn:

    for each context L (ascending):
        feed prompt[pos:L] in prefill chunks                (untimed: sets the context)
        feed `warmup` single tokens                          (untimed)
        feed `steps` single tokens, timing each one          (decode at context ~L)

Every decoder sees the same tokens (the prompt's own next token is fed, not the prediction),
so the greedy predictions at each position are comparable across decoders; the work per step is
that of free generation. One prefill of the longest context per decoder is enough for the
whole ladder. The no-cache decoder has nothing to prefill (it recomputes the prefix each step),
so it takes fewer timed steps (``nocache_steps``), its cost per step being a full prefill.

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
from dataclasses import dataclass, field

import torch

from ..block_table import pages_needed
from ._scaling_decoders import PagedDecoder, make_decoder, synchronize

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
    """How a ladder is climbed.

    Attributes:
        contexts: context lengths, ascending; consecutive ones must differ by more than
            ``warmup + steps`` (the decode steps themselves add tokens).
        warmup, steps: untimed and timed single-token steps per context.
        nocache_steps: timed steps per context for the no-cache decoder (one warm-up step is
            taken at its first context only).
        prefill_chunk: tokens per prefill forward (bounds prefill memory at long contexts).
        page_size: page size of the paged decoders.
        timed: False for a correctness-only pass (e.g. the Triton interpreter on CPU): the
            steps run and predictions are kept, but no times are reported.
    """

    contexts: list[int]
    warmup: int = 2
    steps: int = 8
    nocache_steps: int = 2
    prefill_chunk: int = 2048
    page_size: int = 16
    timed: bool = True
    extra: dict = field(default_factory=dict)

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


def _peak_reset(device) -> int:
    if device.type != "cuda":
        return 0
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak(device) -> int | None:
    if device.type != "cuda":
        return None
    synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def run_ladder(model, name: str, prompt: torch.Tensor, cfg: LadderConfig, *, deadline: float | None = None) -> dict:
    """Climb the context ladder with one decoder; see the module docstring.

    Args:
        model: a transformers causal LM (eval mode).
        name: decoder short name (``none``, ``dynamic``, ``static``, ``flex``, ``triton``, ``reference``).
        prompt: LongTensor ``[>= cfg.tokens_needed()]`` of token ids.
        cfg: the ladder.
        deadline: ``time.monotonic()`` value after which no further context is started
            (the remaining ones are listed in ``skipped``).

    Returns:
        ``{"backend", "label", "points": [{"context", "tokens_held", "median_s", "times_s", "kv_bytes",
        "peak_bytes", "weights_bytes"}], "predictions": {position: token},
        "alloc_calls": [(op, ns, pages)], "skipped": [contexts], "timed": bool}``.
        ``peak_bytes`` is the device's peak allocated memory during the timed steps (CUDA only,
        weights included); ``kv_bytes`` the K/V storage the decoder holds after them.
    """
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1 or prompt.dtype != torch.long:
        raise TypeError(f"prompt must be a 1-D LongTensor, got {getattr(prompt, 'shape', type(prompt).__name__)}")
    if prompt.numel() < cfg.tokens_needed():
        raise ValueError(
            f"prompt must hold at least {cfg.tokens_needed()} tokens for contexts {cfg.contexts}, got {prompt.numel()}"
        )
    device = next(model.parameters()).device
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    max_len = cfg.tokens_needed()
    dec = make_decoder(
        model, name, max_len=max_len, page_size=cfg.page_size, num_pages=pages_needed(max_len, cfg.page_size)
    )
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
            base = _peak_reset(device)
            times = []
            for _ in range(cfg.nocache_steps if nocache else cfg.steps):
                synchronize(device)
                start = time.perf_counter()
                pred = dec.feed([prompt[pos : pos + 1]])  # argmax copied to the host: waits for the step
                times.append(time.perf_counter() - start)
                result["predictions"][pos] = int(pred[0])
                pos += 1
            peak = _peak(device)
            result["points"].append(
                {
                    "context": context,
                    "tokens_held": pos,
                    "median_s": statistics.median(times) if cfg.timed else None,
                    "times_s": times if cfg.timed else None,
                    "kv_bytes": dec.kv_bytes(),
                    "peak_bytes": peak,
                    "weights_bytes": weights,
                    "allocated_before_bytes": base if device.type == "cuda" else None,
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
    """Greedy predictions compared position by position against the first decoder's.

    Returns ``{label: {"compared": n, "equal": k}}`` for every other decoder (positions both
    decoded).
    """
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
