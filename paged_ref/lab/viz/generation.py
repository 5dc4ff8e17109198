"""Figures for notebook 08: a real model generating from the paged cache.

Two things are drawn here:

- **the cache while a batch generates.** :class:`PageTracer` is a ``callback`` for
  :func:`paged_ref.hf.generate`; after every step it records how many pages and tokens each
  sequence holds and a :class:`~paged_ref.lab.viz.pages.PageMap` snapshot (optionally redrawing a
  live page map in the notebook every few steps). :meth:`PageTracer.finish`, called after
  ``generate`` returns, adds the final state (every page free again) and returns a
  :class:`GenerationTrace`, which :func:`pages_over_steps_figure` and
  :func:`generation_story_figure` draw.
- **log-likelihood equivalence.** :func:`logprob_figure` plots a text's per-token
  log-probabilities under the plain model and the absolute difference of each paged variant.

Example:
    >>> import torch
    >>> from paged_ref import PagedKVCache, hf
    >>> from paged_ref.models import tiny_llama
    >>> model = tiny_llama()
    >>> kv = PagedKVCache(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=32)
    >>> tracer = PageTracer(kv, names=["A"])
    >>> _ = hf.generate(model, torch.tensor([[1, 5, 9]]), max_new_tokens=6, kv_cache=kv,
    ...                 eos_token_id=[], callback=tracer)
    >>> trace = tracer.finish()
    >>> trace.tokens_held["A"], trace.pages_held["A"]
    ([3, 4, 5, 6, 7, 8, 0], [1, 1, 2, 2, 2, 2, 0])
    >>> fig = pages_over_steps_figure(trace)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.figure import Figure

from ..._validate import check_int
from ...cache import PagedKVCache
from ..provenance import environment
from . import add_note
from .pages import PageMap, page_map, page_map_figure, page_map_story, seq_color

__all__ = [
    "GenerationTrace",
    "PageTracer",
    "pages_over_steps_figure",
    "generation_story_figure",
    "story_indices",
    "logprob_figure",
    "run_note",
]

FINAL = "after generate returned"


@dataclass(frozen=True)
class GenerationTrace:
    """The cache after every step of one generation, as plain data.

    Entry ``i`` of each list is one snapshot: ``steps[i]`` is the step index ``generate`` passed
    to its callback (0 = right after the prefill; at step ``s`` a live sequence holds its prompt
    plus ``s`` generated tokens, since the token just emitted is written by the next forward),
    and the last entry, with step ``None``, is the state after ``generate`` returned.

    Attributes:
        names: display name of each batch row, in row order.
        seq_ids: the cache's sequence id of each row (for colors matching the page maps).
        steps: step index of each snapshot (``None`` for the final one).
        pages_held, tokens_held: name -> pages / tokens the sequence holds at each snapshot
            (0 once it has finished and been freed).
        free_pages: free pages of the pool at each snapshot.
        maps: the page map at each snapshot.
        num_pages, page_size: the pool.
    """

    names: tuple[str, ...]
    seq_ids: tuple[int, ...]
    steps: tuple[int | None, ...]
    pages_held: Mapping[str, list[int]]
    tokens_held: Mapping[str, list[int]]
    free_pages: tuple[int, ...]
    maps: tuple[PageMap, ...]
    num_pages: int
    page_size: int

    def finished_at(self) -> dict[str, int | None]:
        """Name -> first step at which the sequence no longer held pages (None: ran to the end)."""
        out = {}
        for name in self.names:
            held = self.pages_held[name]
            out[name] = next((self.steps[i] for i in range(len(held) - 1) if held[i] == 0), None)
        return out

    def recycled_pages(self) -> list[int]:
        """Physical pages handed out again after an earlier snapshot showed them returned (free list reuse)."""
        returned_before: set[int] = set()
        out: set[int] = set()
        for pm in self.maps:
            out |= {p for p, st in enumerate(pm.status) if st == "used" and p in returned_before}
            returned_before |= {p for p, st in enumerate(pm.status) if st == "returned"}
        return sorted(out)

    def page_holders(self, page: int) -> list[str]:
        """Names of the sequences that held physical ``page``, in the order they first held it."""
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ValueError(f"page must be an int in [0, {self.num_pages}), got {page!r}")
        names = dict(zip(self.seq_ids, self.names))
        out: list[str] = []
        for pm in self.maps:
            out += [names[s] for s in pm.owners[page] if names.get(s) is not None and names[s] not in out]
        return out

    def title(self, index: int) -> str:
        """Caption of snapshot ``index``."""
        step = self.steps[index]
        if step is None:
            return f"{FINAL}: {self.free_pages[index]} of {self.num_pages} pages free"
        live = sum(self.pages_held[n][index] > 0 for n in self.names)
        what = "after the prefill" if step == 0 else f"decode step {step}"
        return f"{what}: {live} live sequence(s), {self.num_pages - self.free_pages[index]} pages held"


class PageTracer:
    """A ``callback`` for :func:`paged_ref.hf.generate` that records the cache after every step.

    Args:
        kv: the `PagedKVCache` passed to ``generate`` as ``kv_cache``.
        names: a display name per batch row (default ``"seq 0"``, ``"seq 1"``, ...).
        live_every: if set, also draw the page map in the notebook every this many steps,
            updating one output in place (a live view while the model generates).

    Sequences already in ``kv`` when the tracer is made are not part of the batch; the batch's
    sequences are the ones ``generate`` adds, in row order.
    """

    def __init__(self, kv: PagedKVCache, names: Sequence[str] | None = None, *, live_every: int | None = None):
        if not isinstance(kv, PagedKVCache):
            raise TypeError(f"kv must be a paged_ref.PagedKVCache, got {type(kv).__name__}")
        if names is not None and (isinstance(names, str) or not all(isinstance(n, str) for n in names)):
            raise TypeError(f"names must be a sequence of str (one per batch row), got {names!r}")
        self.kv = kv
        self.live_every = None if live_every is None else check_int("live_every", live_every, min_value=1)
        self._names = None if names is None else tuple(names)
        self._before = set(kv.seq_ids)
        self._rows: dict[int, str] | None = None  # seq_id -> name, fixed at the first step
        self._steps: list[int | None] = []
        self._pages: list[dict[str, int]] = []
        self._tokens: list[dict[str, int]] = []
        self._free: list[int] = []
        self._maps: list[PageMap] = []
        self._handle = None
        self._finished = False

    def __call__(self, step: int, tokens: torch.Tensor) -> None:
        if self._finished:
            raise RuntimeError("this PageTracer is finished; make a new one for another generation")
        if self._rows is None:
            new = sorted(set(self.kv.seq_ids) - self._before)  # generate adds rows in order
            batch = int(tokens.numel())
            if len(new) != batch:
                raise ValueError(
                    f"expected the {batch} sequences of the batch to be new in kv, found {len(new)}; "
                    "pass the tracer's kv as generate(kv_cache=...)"
                )
            names = self._names or tuple(f"seq {i}" for i in range(batch))
            if len(names) != batch:
                raise ValueError(f"names has {len(names)} entries but the batch has {batch} rows")
            self._rows = dict(zip(new, names))
        self._record(step)
        if self.live_every is not None and step % self.live_every == 0:
            self._show(len(self._maps) - 1)

    def finish(self) -> GenerationTrace:
        """Record the state after ``generate`` returned and give the trace (call once)."""
        if self._rows is None:
            raise RuntimeError("no step was recorded: pass the tracer to generate(callback=...) first")
        if not self._finished:
            self._record(None)
            self._finished = True
            if self.live_every is not None:
                self._show(len(self._maps) - 1)
        names = tuple(self._rows.values())
        return GenerationTrace(
            names=names,
            seq_ids=tuple(self._rows),
            steps=tuple(self._steps),
            pages_held={n: [p[n] for p in self._pages] for n in names},
            tokens_held={n: [t[n] for t in self._tokens] for n in names},
            free_pages=tuple(self._free),
            maps=tuple(self._maps),
            num_pages=self.kv.num_pages,
            page_size=self.kv.page_size,
        )

    def _record(self, step: int | None) -> None:
        live = set(self.kv.seq_ids)
        self._steps.append(step)
        self._pages.append({n: len(self.kv.pages(s)) if s in live else 0 for s, n in self._rows.items()})
        self._tokens.append({n: self.kv.seq_len(s) if s in live else 0 for s, n in self._rows.items()})
        self._free.append(self.kv.allocator.num_free)
        self._maps.append(page_map(self.kv, {s: n for s, n in self._rows.items() if s in live}))

    def _show(self, index: int) -> None:
        from IPython.display import display

        step, free, total = self._steps[index], self._free[index], self.kv.num_pages
        title = (
            f"{FINAL}: {free} of {total} pages free"
            if step is None
            else f"live, step {step}: {total - free} of {total} pages held"
        )
        fig = page_map_figure(self._maps[index], title=title)
        if self._handle is None:
            self._handle = display(fig, display_id=True)
        else:
            self._handle.update(fig)


# --------------------------------------------------------------------------- figures
def pages_over_steps_figure(trace: GenerationTrace, *, note: str | None = None) -> Figure:
    """Pages held per sequence over the generation (stacked), and tokens stored vs slots held.

    Args:
        trace: from :meth:`PageTracer.finish`.
        note: provenance line under the figure (default: what the figure is drawn from).
    """
    _check_trace(trace)
    x = np.arange(len(trace.steps))  # snapshot index; the last one is "after return"
    fig = Figure(figsize=(10.0, 5.6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    stacks = [trace.pages_held[n] for n in trace.names]
    colors = [seq_color(s) for s in trace.seq_ids]
    top.stackplot(x, stacks, labels=trace.names, colors=colors, alpha=0.75, step="post")
    top.axhline(trace.num_pages, color="black", lw=1, ls="--", label=f"pool: {trace.num_pages} pages")
    ended = [(name, step) for name, step in trace.finished_at().items() if step is not None]
    for k, (name, step) in enumerate(ended):
        i = trace.steps.index(step)
        top.axvline(i, color=colors[trace.names.index(name)], lw=1, ls=":")
        top.annotate(
            f"{name} ends: its pages are free",
            (i, trace.num_pages),
            xytext=(3, -6 - 11 * k),
            textcoords="offset points",
            fontsize=7,
            va="top",
        )
    top.set_ylabel("pages held")
    top.set_ylim(0, trace.num_pages * 1.08)
    top.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    top.set_title(f"Pages held while the batch generates ({trace.page_size} tokens per page)", fontsize=10, loc="left")

    tokens = np.sum([trace.tokens_held[n] for n in trace.names], axis=0)
    slots = np.sum(stacks, axis=0) * trace.page_size
    bottom.step(x, slots, where="post", color="0.2", label="slots in held pages")
    bottom.step(x, tokens, where="post", color="tab:green", label="tokens stored")
    bottom.fill_between(
        x, tokens, slots, step="post", color="tab:red", alpha=0.25, label="empty slots (< 1 page per live sequence)"
    )
    bottom.set_ylabel("token slots")
    bottom.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    labels = ["prefill" if s == 0 else ("returned" if s is None else str(s)) for s in trace.steps]
    ticks = sorted(set(np.linspace(0, len(x) - 1, min(len(x), 12)).round().astype(int).tolist()) | {len(x) - 1})
    bottom.set_xticks(ticks, [labels[i] for i in ticks], fontsize=8)
    bottom.set_xlabel("decode step (the cache after each step's forward)")
    add_note(
        fig,
        note or "Recorded from a PagedKVCache after every step of paged_ref.hf.generate (page counts, not timings).",
    )
    return fig


def story_indices(trace: GenerationTrace, max_panels: int = 6) -> list[int]:
    """Which snapshots tell the story: after the prefill, the last decode step, the end, where a
    sequence ended, then evenly spaced steps up to ``max_panels``.

    Example:
        >>> story_indices(GenerationTrace((), (), (0, 1, 2, 3, 4, 5, None), {}, {}, (), (), 1, 1), max_panels=4)
        [0, 2, 5, 6]
    """
    max_panels = check_int("max_panels", max_panels, min_value=3)
    last = len(trace.steps) - 1
    chosen = {0, max(last - 1, 0), last}
    for step in trace.finished_at().values():
        if step is not None and len(chosen) < max_panels:
            chosen.add(trace.steps.index(step))
    for i in np.linspace(0, last, max_panels).round().astype(int).tolist():
        if len(chosen) >= max_panels:
            break
        chosen.add(i)
    return sorted(chosen)


def generation_story_figure(trace: GenerationTrace, indices: Sequence[int] | None = None) -> Figure:
    """Page maps of chosen snapshots stacked top to bottom (default: :func:`story_indices`)."""
    _check_trace(trace)
    indices = story_indices(trace) if indices is None else list(indices)
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(trace.maps):
            raise ValueError(f"indices must be snapshot indices in [0, {len(trace.maps)}), got {i!r}")
    return page_map_story([trace.maps[i] for i in indices], [trace.title(i) for i in indices])


def logprob_figure(
    plain: torch.Tensor,
    paged: Mapping[str, torch.Tensor],
    *,
    tolerance: float,
    floor: float = 1e-9,
    note: str | None = None,
) -> Figure:
    """Per-token log-probabilities of a text (plain model) and each paged variant's |difference|.

    Args:
        plain: float ``[num_tokens]``, the plain model's ``log p(token_t+1 | tokens_<=t)``.
        paged: label -> float ``[num_tokens]``, the same under paged variants (decode path,
            chunked prefill, another backend, ...).
        tolerance: the agreement asserted, drawn as a line.
        floor: exact zeros are drawn at this value (a log axis has no 0).
        note: provenance line under the figure.
    """
    plain = _as_1d("plain", plain)
    if not paged:
        raise ValueError("paged must map at least one label to a tensor")
    diffs = {}
    for label, values in paged.items():
        values = _as_1d(f"paged[{label!r}]", values)
        if values.shape != plain.shape:
            raise ValueError(f"paged[{label!r}] has shape {list(values.shape)}, plain has {list(plain.shape)}")
        diffs[label] = (values.double() - plain.double()).abs().numpy()
    x = np.arange(plain.numel())
    n = len(diffs)
    fig = Figure(figsize=(10.0, 3.0 + 1.25 * n), layout="constrained")
    top, *strips = fig.subplots(1 + n, 1, sharex=True, height_ratios=[2.4] + [1] * n, squeeze=True)
    top.plot(x, plain.numpy(), color="0.3", lw=1, label="plain model (one forward, no cache)")
    first = next(iter(paged))
    top.plot(x, paged[first].numpy(), ls="none", marker=".", ms=3, color="tab:blue", label=f"paged: {first}")
    top.set_ylabel("log p(next token)")
    top.legend(fontsize=8, loc="lower left", frameon=False)
    top.set_title(
        f"Per-token log-probabilities of {plain.numel()} tokens of English text, and "
        "|paged - plain| of each paged variant (one strip each)",
        fontsize=10,
        loc="left",
    )
    high = max(tolerance * 30, max(float(d.max()) for d in diffs.values()) * 3)
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red", "tab:brown")
    for k, (ax, (label, d)) in enumerate(zip(strips, diffs.items())):
        ax.plot(x, np.maximum(d, floor), ls="none", marker=".", ms=2.5, color=colors[k % len(colors)])
        ax.axhline(tolerance, color="black", ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_ylim(floor / 3, high)
        ax.set_yticks([floor, 1e-6, tolerance], [f"{floor:g} (= 0)", "1e-06", f"{tolerance:g}"], fontsize=7)
        ax.set_title(
            f"{label}: max {d.max():.1e}, mean {d.mean():.1e}, {float((d == 0).mean()):.0%} exactly 0",
            fontsize=8,
            loc="left",
        )
    strips[n // 2].set_ylabel("|paged - plain|  (dashed: tolerance)")
    strips[-1].set_xlabel("token position in the text")
    add_note(fig, note or "float32; exact zeros are drawn at the bottom of each strip.")
    return fig


def run_note(what: str) -> str:
    """A provenance line for a figure: ``what``, then the device, the versions and the UTC date.

    Example:
        >>> run_note("SmolLM2-135M-Instruct, float32").startswith("SmolLM2-135M-Instruct, float32; measured on ")
        True
    """
    env = environment()
    device = f"GPU {env['gpu']}" if env["gpu"] else f"CPU ({env['platform']})"
    return (
        f"{what}; measured on {device}, torch {env['torch']}, transformers {env['transformers']}, "
        f"{env['date_utc'][:10]}."
    )


def _as_1d(name: str, values) -> torch.Tensor:
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise TypeError(f"{name} must be a floating torch.Tensor, got {type(values).__name__}")
    if values.dim() == 2 and values.shape[0] == 1:
        values = values[0]  # [1, num_tokens] as log_likelihood returns it for one text
    if values.dim() != 1 or values.numel() < 1:
        raise ValueError(f"{name} must have shape [num_tokens] or [1, num_tokens], got {list(values.shape)}")
    return values.detach().float().cpu()


def _check_trace(trace) -> None:
    if not isinstance(trace, GenerationTrace):
        raise TypeError(f"trace must be a GenerationTrace (from PageTracer.finish()), got {type(trace).__name__}")
