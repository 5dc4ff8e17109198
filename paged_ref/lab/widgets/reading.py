"""Widget for notebook 10: a Quest page budget against one real query's attention over real pages.

`real_query_pages` runs SmolLM2-135M's own forward over a passage once and keeps, for one layer
and one KV head, the last token's queries (the query heads that share the KV head, after RoPE)
and every token's K (after RoPE, as a paged cache holds them) and V. `budget_view`, the slider's
callback, is a pure function of that data and a budget in pages: which pages Quest reads, how
much of the true softmax weight they hold and how far the output moves.

Example:
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> data = QueryPages(q=torch.randn(3, 8, generator=g), k=torch.randn(40, 8, generator=g),
    ...                   v=torch.randn(40, 8, generator=g), page_size=8, note="random")
    >>> fig, stats = budget_view(data, 5)                  # every page: nothing is lost
    >>> stats["pages_read"], round(stats["attention_mass_read"], 6), stats["output_rel_error"] < 1e-6
    (5, 1.0, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..._arith import cdiv
from ..._validate import check_int
from ...attention.quest import page_bounds, select_pages
from . import with_static_figure

__all__ = ["QueryPages", "budget_panel", "budget_view", "page_statistics", "real_query_pages"]


@dataclass(frozen=True)
class QueryPages:
    """One query group over one KV head's keys: ``q: [group, D]``, ``k, v: [n, D]``, in pages of ``page_size``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    page_size: int
    note: str


def page_statistics(data: QueryPages) -> dict:
    """Per page: Quest's bound (largest over the query heads), the largest true score, and the share of
    the softmax weight (mean over the query heads) on the page; ``[num_pages]`` tensors."""
    n, d = data.k.shape
    num_pages = cdiv(n, data.page_size)
    pad = num_pages * data.page_size - n
    k = torch.cat([data.k, data.k[-1:].expand(pad, d)]).view(num_pages, data.page_size, d)  # [pages, P, D]
    bound = page_bounds(data.q[:, None], k.amin(1)[None], k.amax(1)[None]).amax(0)  # [pages]
    scores = data.q @ data.k.T  # [group, n]
    best = torch.full((num_pages * data.page_size,), float("-inf"))
    best[:n] = scores.amax(0)
    weights = torch.softmax(scores * data.q.shape[1] ** -0.5, -1)  # [group, n]
    mass = torch.zeros(num_pages * data.page_size)
    mass[:n] = weights.mean(0)
    return dict(
        bound=bound,
        max_score=best.view(num_pages, -1).amax(1),
        mass=mass.view(num_pages, -1).sum(1),
        weights=weights,
    )


def budget_view(data: QueryPages, budget: int):
    """The panel's callback: ``(Figure, stats)`` for Quest reading ``budget`` pages of ``data``.

    ``stats``: ``pages_read``, ``pages_held``, ``chosen`` (page indices), ``attention_mass_read``
    (softmax weight on the chosen pages, mean over the query heads) and ``output_rel_error`` (the
    attention output over the chosen pages against the output over all of them).
    """
    from ..viz.reading import bound_figure

    stats = page_statistics(data)
    held = stats["bound"].numel()
    budget = check_int("budget", budget, min_value=1)
    chosen = select_pages(stats["bound"][None], budget)[0]  # [budget]; the last page always
    tokens = (chosen[:, None] * data.page_size + torch.arange(data.page_size)).flatten()
    tokens = tokens[tokens < data.k.shape[0]]
    full = stats["weights"] @ data.v  # [group, D]
    part = torch.softmax((data.q @ data.k[tokens].T) * data.q.shape[1] ** -0.5, -1) @ data.v[tokens]
    summary = dict(
        pages_read=int(chosen.numel()),
        pages_held=held,
        chosen=chosen.tolist(),
        attention_mass_read=float(stats["mass"][chosen].sum()),
        output_rel_error=float((part - full).norm() / full.norm()),
    )
    return bound_figure(stats, chosen, data.page_size, summary, note=data.note), summary


@lru_cache(maxsize=2)
def real_query_pages(num_tokens: int = 512, layer: int = 15, kv_head: int = 0, page_size: int = 16) -> QueryPages:
    """SmolLM2-135M's last-token queries of ``kv_head``'s group in ``layer``, and that head's K, V of
    ``num_tokens`` tokens of English prose (the model's own forward; loads the model on first use)."""
    from ...models import load_smollm2
    from ..textdata import english_text

    model, tok = load_smollm2()
    ids = tok(english_text(int(num_tokens * 1.3)), return_tensors="pt", add_special_tokens=False).input_ids[
        :, :num_tokens
    ]
    attn = model.model.layers[layer].self_attn
    seen = {}

    def capture(module, args, kwargs):
        seen["h"], seen["rope"] = kwargs["hidden_states"], kwargs["position_embeddings"]

    handle = attn.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.inference_mode():
            model(ids, use_cache=False)
    finally:
        handle.remove()
    h, (cos, sin) = seen["h"][0], seen["rope"]  # [n, hidden], [1, n, D] each
    d = model.config.hidden_size // model.config.num_attention_heads
    group = model.config.num_attention_heads // model.config.num_key_value_heads

    def rope(x):  # x: [n, heads, D], rotated as the model rotates its q and k
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos[0][:, None] + rotated * sin[0][:, None]

    with torch.inference_mode():
        q = rope(attn.q_proj(h).view(h.shape[0], -1, d))  # [n, Hq, D]
        k = rope(attn.k_proj(h).view(h.shape[0], -1, d))  # [n, Hkv, D]
        v = attn.v_proj(h).view(h.shape[0], -1, d)  # [n, Hkv, D]
    heads = slice(kv_head * group, (kv_head + 1) * group)
    return QueryPages(
        q=q[-1, heads].clone(),
        k=k[:, kv_head].clone(),
        v=v[:, kv_head].clone(),
        page_size=page_size,
        note=f"SmolLM2-135M layer {layer}, KV head {kv_head}: the last of {num_tokens} tokens of CPython docs prose",
    )


def budget_panel(data: QueryPages):
    """A page-budget slider redrawing `budget_view` (``continuous_update=False``)."""
    import ipywidgets as w
    from IPython.display import display

    held = cdiv(data.k.shape[0], data.page_size)
    slider = w.IntSlider(value=min(8, held), min=1, max=held, description="budget (pages)", continuous_update=False)
    out = w.interactive_output(lambda budget: display(budget_view(data, budget)[0]), {"budget": slider})
    return with_static_figure(w.VBox([slider, out]), budget_view(data, slider.value)[0])
