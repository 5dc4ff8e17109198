"""Per-token decode latency vs context on one shared prompt, the decoders taking turns step by step.

Decoders: `NoCacheDecoder` (``model(ids, use_cache=False)`` over the whole prefix), `ContiguousDecoder`
(``DynamicCache`` or ``StaticCache``), `PagedDecoder` (`paged_ref.hf.PagedSession`). Each has
``feed(chunks, predict=True)`` (append ``chunks[b]``, LongTensor ``[n_b]``, to sequence ``b`` in one
forward; the greedy token after each row's last one, LongTensor ``[batch]``, or None),
``kv_bytes()`` (K/V storage held now) and ``close()``. Each climbs a ladder of contexts
(`run_ladders`: all of them at once, taking turns; `run_ladder`: one):

    for each context L:
        each decoder: feed prompt[pos:L] in prefill chunks  (untimed: sets the context)
        `warmup` rounds: each decoder feeds one token        (untimed)
        `steps` rounds: each decoder feeds one token, timed  (decode at context ~L; a round's steps pair up)

The prompt's own next token is fed (teacher forcing), so every decoder sees the same history and
their greedy predictions compare position by position. The no-cache decoder pays a whole prefill
per step: it takes ``nocache_steps`` timed steps and one warm-up at its first context only.

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

from ..._arith import cdiv
from ...cache import PagedKVCache
from ...hf import BACKENDS, PagedSession
from ...hf.session import cache_keyword

__all__ = [
    "NoCacheDecoder",
    "ContiguousDecoder",
    "PagedDecoder",
    "AllocationTimer",
    "make_decoder",
    "LadderConfig",
    "run_ladder",
    "run_ladders",
    "agreement",
]


def synchronize(device) -> None:
    """Wait for queued CUDA work: a host clock read after it is meaningful."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device) -> int | None:
    """Reset CUDA's peak-memory counter; returns the bytes allocated now (None off CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_bytes(device) -> int | None:
    """CUDA's peak allocated bytes since `reset_peak` (None off CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def _check_chunks(chunks, batch: int | None) -> list[torch.Tensor]:
    if not isinstance(chunks, (list, tuple)) or not chunks:
        raise TypeError(f"chunks must be a non-empty list of 1-D LongTensors, got {type(chunks).__name__}")
    for i, c in enumerate(chunks):
        if not isinstance(c, torch.Tensor) or c.dim() != 1 or c.numel() < 1 or c.dtype != torch.long:
            raise ValueError(
                f"chunks[{i}] must be a non-empty 1-D LongTensor, got "
                f"{getattr(c, 'shape', type(c).__name__)} {getattr(c, 'dtype', '')}"
            )
    if batch is not None and len(chunks) != batch:
        raise ValueError(f"chunks must have one entry per sequence ({batch}), got {len(chunks)}")
    return list(chunks)


def _predict(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1).cpu()  # [batch, vocab] -> [batch] on the host


class NoCacheDecoder:
    """The whole prefix at every prediction; ``feed(..., predict=False)`` only appends tokens."""

    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        self.ids: torch.Tensor | None = None  # [batch, tokens so far]

    @torch.inference_mode()
    def feed(self, chunks, predict: bool = True):
        chunks = _check_chunks(chunks, None if self.ids is None else self.ids.shape[0])
        if len({c.numel() for c in chunks}) != 1:
            raise ValueError("NoCacheDecoder needs equal-length chunks for every row")
        new = torch.stack(chunks).to(self.device)  # [batch, n]
        self.ids = new if self.ids is None else torch.cat([self.ids, new], dim=1)
        if not predict:
            return None
        out = self.model(input_ids=self.ids, use_cache=False, logits_to_keep=1)
        return _predict(out.logits[:, -1])

    def kv_bytes(self) -> int:
        return 0

    def close(self) -> None:
        self.ids = None


class ContiguousDecoder:
    """``DynamicCache`` (``kind="dynamic"``: grows with ``torch.cat``) or ``StaticCache`` (reserves
    ``max_len`` tokens per row). Rows of different lengths on the first feed only (left padding with
    an attention mask, as ``model.generate`` does)."""

    def __init__(self, model, kind: str = "dynamic", max_len: int | None = None):
        if kind not in ("dynamic", "static"):
            raise ValueError(f"kind must be 'dynamic' or 'static', got {kind!r}")
        if kind == "static" and (not isinstance(max_len, int) or max_len < 1):
            raise ValueError(f"max_len must be a positive int for a static cache, got {max_len!r}")
        self.model, self.kind, self.max_len = model, kind, max_len
        self.device = next(model.parameters()).device
        self.cache = None
        self.mask: torch.Tensor | None = None  # [batch, tokens so far] 1 = real, 0 = left padding
        self.next_pos: torch.Tensor | None = None  # [batch] position of each row's next token
        self._cache_kw = cache_keyword(model)

    @torch.inference_mode()
    def feed(self, chunks, predict: bool = True):
        first = self.cache is None
        chunks = _check_chunks(chunks, None if first else self.mask.shape[0])
        lens = [c.numel() for c in chunks]
        if not first and len(set(lens)) != 1:
            raise ValueError(f"after the first feed every row must get the same number of tokens, got {lens}")
        batch, width = len(chunks), max(lens)
        ids = torch.zeros(batch, width, dtype=torch.long)  # [batch, width], left-padded
        new_mask = torch.zeros(batch, width, dtype=torch.long)  # [batch, width]
        for b, c in enumerate(chunks):
            ids[b, width - c.numel() :] = c
            new_mask[b, width - c.numel() :] = 1
        ids, new_mask = ids.to(self.device), new_mask.to(self.device)
        if first:
            from transformers import DynamicCache, StaticCache

            if self.kind == "dynamic":
                self.cache = DynamicCache(config=self.model.config)
            else:
                self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_len)
            self.mask = new_mask
            self.next_pos = torch.zeros(batch, dtype=torch.long, device=self.device)
        else:
            self.mask = torch.cat([self.mask, new_mask], dim=1)
        # position of each new column: the row's next position plus the real tokens before it
        position_ids = self.next_pos[:, None] + (new_mask.cumsum(1) - 1).clamp(min=0)  # [batch, width]
        self.next_pos = self.next_pos + new_mask.sum(1)
        padded = bool((self.mask == 0).any())
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask if padded else None,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: self.cache},
        )
        return _predict(out.logits[:, -1]) if predict else None

    def kv_bytes(self) -> int:
        layers = getattr(self.cache, "layers", [])
        tensors = [getattr(layer, name, None) for layer in layers for name in ("keys", "values")]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def close(self) -> None:
        self.cache = self.mask = self.next_pos = None


class AllocationTimer:
    """Records ``(op, nanoseconds, pages)`` for every ``allocate``, ``free`` and ``share`` call of
    one `PageAllocator` instance (its methods are wrapped; other allocators are not affected).

    Example:
        >>> from paged_ref.allocator import PageAllocator
        >>> timer = AllocationTimer(PageAllocator(8))
        >>> pages = timer.allocator.allocate(3); timer.allocator.free(pages)
        >>> [op for op, _, _ in timer.calls]
        ['allocate', 'free']
    """

    OPS = ("allocate", "free", "share")

    def __init__(self, allocator):
        self.allocator = allocator
        self.calls: list[tuple[str, int, int]] = []  # (op, nanoseconds, pages)
        for op in self.OPS:
            setattr(allocator, op, self._timed(op, getattr(allocator, op)))

    def _timed(self, op, fn):
        def timed(*args, **kwargs):
            if args and not isinstance(args[0], int):
                args = (list(args[0]),) + args[1:]  # a generator would be used up by counting
            pages = args[0] if args else kwargs.get("n", kwargs.get("pages", 1))
            count = pages if isinstance(pages, int) else len(pages)
            start = time.perf_counter_ns()
            result = fn(*args, **kwargs)
            self.calls.append((op, time.perf_counter_ns() - start, count))
            return result

        return timed


class PagedDecoder:
    """`PagedSession` with one backend on a pool of ``num_pages`` pages, timed by ``self.timer``."""

    def __init__(self, model, *, backend: str = "flex", num_pages: int | None = None, page_size: int = 16):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        self.kv = PagedKVCache.for_model(model, num_pages=num_pages, page_size=page_size)
        self.timer = AllocationTimer(self.kv.allocator)
        # opened at the first feed; the model reads pages only within this session's forwards, so
        # other decoders on the same model can take turns with it
        self.session = PagedSession(model, kv_cache=self.kv, backend=backend)
        self.seq_ids: list[int] | None = None

    def start(self, num_rows: int) -> None:
        """Open the session with ``num_rows`` empty sequences (the first `feed` does it otherwise)."""
        self.session.open()
        self.seq_ids = [self.session.add() for _ in range(num_rows)]

    def feed(self, chunks, predict: bool = True, rows: list[int] | None = None):
        """As the other decoders' `feed`; ``rows`` feeds only those sequences, of any lengths."""
        if self.seq_ids is None:
            self.start(len(chunks))
        rows = list(range(len(self.seq_ids))) if rows is None else list(rows)
        chunks = _check_chunks(chunks, len(rows))
        device = self.kv.device
        logits = self.session.extend([self.seq_ids[r] for r in rows], [c.to(device) for c in chunks])
        return _predict(logits) if predict else None  # logits: [len(rows), vocab]

    def pages_held(self) -> int:
        return self.kv.allocator.num_pages - self.kv.allocator.num_free

    def kv_bytes(self) -> int:
        return self.pages_held() * self.kv.page_bytes

    def close(self) -> None:
        self.session.close()
        self.seq_ids = None


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


def make_decoder(model, name: str, *, max_len: int, page_size: int = 16):
    """``none``, ``dynamic``, ``static`` or a paged backend, with room for ``max_len`` tokens."""
    if name == "none":
        return NoCacheDecoder(model)
    if name in ("dynamic", "static"):
        return ContiguousDecoder(model, name, max_len=max_len)
    if name in BACKENDS:
        return PagedDecoder(model, backend=name, num_pages=cdiv(max_len, page_size), page_size=page_size)
    raise ValueError(
        f"decoder name must be none, dynamic, static or a paged_ref.hf backend {sorted(BACKENDS)}; got {name!r}"
    )


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


def run_ladder(
    model, name: str, prompt: torch.Tensor, cfg: LadderConfig, *, deadline: float | None = None, clock=time.perf_counter
) -> dict:
    """Climb the ladder with decoder ``name`` alone (`run_ladders` with one decoder)."""
    return run_ladders(model, {name: cfg}, prompt, deadline=deadline, clock=clock)[0]


def run_ladders(
    model, cfgs: dict, prompt: torch.Tensor, *, deadline: float | None = None, clock=time.perf_counter
) -> list[dict]:
    """Climb the ladder with every decoder of ``cfgs`` (name -> `LadderConfig`, the same contexts) at
    once, the decoders taking turns: at each context each sets its context, then the warm-up steps and
    the timed steps go round the decoders one step each (round ``r`` starts at decoder ``r mod n``, so
    that none always goes first). Timed step ``r`` of two decoders ran in the same round (at most ``n - 2`` other
    decoders' steps between them): a pair, whose ratio a load that changes during the run touches little
    (`scaling_report.ratios_to` takes the median of the pairs' ratios). Contexts not started by ``deadline`` are
    ``skipped``; ``clock`` is the timer.

    Returns, per decoder in the order of ``cfgs``:
        ``{"backend", "label", "timed", "in_turns_with" (the labels of the decoders it took turns with),
        "points": [{"context", "tokens_held", "median_s", "times_s" (in round order), "kv_bytes" (held
        after the timed steps), "peak_bytes" (CUDA, during them, weights included), "weights_bytes",
        "allocated_before_bytes"}], "predictions": {position: token}, "alloc_calls", "skipped":
        [contexts]}``, and for a paged decoder ``pages_held``, ``page_bytes``, ``pool_bytes``. A decoder
        that raised has ``"error"`` (its message) and no points from the context it failed at; the others
        go on without it.
    """
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1 or prompt.dtype != torch.long:
        raise TypeError(f"prompt must be a 1-D LongTensor, got {getattr(prompt, 'shape', type(prompt).__name__)}")
    if not cfgs or len({tuple(c.contexts) for c in cfgs.values()}) != 1:
        raise ValueError(f"cfgs must give one or more decoders the same contexts, got {cfgs}")
    need = max(c.tokens_needed() for c in cfgs.values())
    contexts = next(iter(cfgs.values())).contexts
    if prompt.numel() < need:
        raise ValueError(f"prompt must hold at least {need} tokens for contexts {contexts}, got {prompt.numel()}")
    device = next(model.parameters()).device
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    names = list(cfgs)
    labels = [LABELS.get(n, n) for n in names]
    results = [
        {
            "backend": n,
            "label": LABELS.get(n, n),
            "timed": cfgs[n].timed,
            "in_turns_with": [x for x in labels if x != LABELS.get(n, n)],
            "points": [],
            "predictions": {},
            "alloc_calls": [],
            "skipped": [],
        }
        for n in names
    ]
    decoders, pos = [None] * len(names), [0] * len(names)

    def guarded(i, fn):
        """``fn(i)`` unless decoder ``i`` failed before; a failure is recorded and ends its turns."""
        if "error" in results[i]:
            return
        try:
            fn(i)
        except Exception as err:  # one decoder failing must not lose the others' ladder
            results[i]["error"] = f"{type(err).__name__}: {err}"

    def make(i):
        cfg = cfgs[names[i]]
        decoders[i] = make_decoder(model, names[i], max_len=cfg.tokens_needed(), page_size=cfg.page_size)

    try:
        for i in range(len(names)):
            guarded(i, make)

        def in_turns(counts, step):
            """Rounds of one step each for decoder i while ``counts[i]`` rounds are not done."""
            for r in range(max(counts, default=0)):
                for k in range(len(names)):
                    i = (r + k) % len(names)
                    if r < counts[i]:
                        guarded(i, step)

        for ci, context in enumerate(contexts):
            if deadline is not None and time.monotonic() > deadline:
                for r in results:
                    r["skipped"] = list(contexts[ci:])
                break

            def prefill(i):  # set the context (untimed)
                while pos[i] < context:
                    end = min(context, pos[i] + cfgs[names[i]].prefill_chunk)
                    decoders[i].feed([prompt[pos[i] : end]], predict=False)
                    pos[i] = end

            for i in range(len(names)):
                guarded(i, prefill)

            def warm(i):  # untimed, but its predictions are compared too
                results[i]["predictions"][pos[i]] = int(decoders[i].feed([prompt[pos[i] : pos[i] + 1]])[0])
                pos[i] += 1

            nocache = [n == "none" for n in names]
            in_turns([(1 if ci == 0 else 0) if nc else cfgs[n].warmup for n, nc in zip(names, nocache)], warm)
            base = reset_peak(device)
            times = [[] for _ in names]

            def timed(i):
                synchronize(device)
                start = clock()
                pred = decoders[i].feed([prompt[pos[i] : pos[i] + 1]])  # argmax copied to the host: waits
                times[i].append(clock() - start)
                results[i]["predictions"][pos[i]] = int(pred[0])
                pos[i] += 1

            in_turns([cfgs[n].nocache_steps if nc else cfgs[n].steps for n, nc in zip(names, nocache)], timed)
            peak = peak_bytes(device)
            for i, n in enumerate(names):
                if "error" in results[i]:
                    continue  # no point at the context it failed in, nor after
                on = cfgs[n].timed
                results[i]["points"].append(
                    {
                        "context": context,
                        "tokens_held": pos[i],
                        "median_s": statistics.median(times[i]) if on else None,
                        "times_s": times[i] if on else None,
                        "kv_bytes": decoders[i].kv_bytes(),
                        "peak_bytes": peak,
                        "weights_bytes": weights,
                        "allocated_before_bytes": base,
                    }
                )
        for r, dec in zip(results, decoders):
            if isinstance(dec, PagedDecoder) and "error" not in r:
                r["pages_held"] = dec.pages_held()
                r["page_bytes"] = dec.kv.page_bytes
                r["pool_bytes"] = dec.kv.num_pages * dec.kv.page_bytes
                r["alloc_calls"] = list(dec.timer.calls)
    finally:
        for r, dec in zip(results, decoders):
            if dec is not None:
                try:
                    dec.close()
                except Exception:
                    if "error" not in r:  # a failed decoder's close may fail too: its error is recorded
                        raise
    return results


def agreement(results: list[dict]) -> dict:
    """``{label: {"against", "compared", "equal"}}``: greedy predictions against the first decoder's."""
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
