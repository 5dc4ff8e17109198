"""Widget for notebook 07: budget C, page size B and policy against which tokens and pages go.

The K/V are SmolLM2-135M's for a real English passage (`paged_ref.lab.textdata`), computed once per
process by the model's own forward (`real_kv`); every redraw replays the policies over them in
a fresh `PagedKVCache` (`paged_ref.lab.eviction_replay.replay`), so a redraw costs milliseconds for
the page-eviction policies and a few seconds for ``token_topk`` (it rescores after every token).

Example:
    >>> import torch
    >>> ks = [torch.randn(96, 1, 8) for _ in range(2)]; vs = [torch.randn(96, 1, 8) for _ in range(2)]
    >>> fig = kept_pages_view(32, 16, "streaming_llm", kv=(ks, vs), prompt_len=48)
    >>> [ax.get_title().split("\\n")[0] for ax in fig.axes]
    ['paged_eviction', 'streaming_llm']
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from matplotlib.figure import Figure

from ..._validate import check_choice, check_int
from ..eviction_replay import replay
from ..viz.eviction import MAP_POLICIES, page_map_figure
from . import with_static_figure

#: Slider and menu choices. Every budget is >= 2 x the largest page size (StreamingLLM's sink
#: page plus one), so every combination is valid.
BUDGETS = (64, 96, 128, 160, 192, 256, 320, 384)
PAGE_SIZES = (8, 16, 32)
POLICIES = MAP_POLICIES
WIDGET_TOKENS = 512  # tokens of real K/V the panel replays (the first half is the prompt)


@dataclass(frozen=True)
class RealKV:
    """K/V the model cached for a passage: ``ks[layer], vs[layer]: [num_tokens, num_kv_heads, head_dim]``."""

    ks: tuple
    vs: tuple
    token_ids: torch.Tensor  # int64 [num_tokens]
    text: str


@lru_cache(maxsize=2)
def real_kv(num_tokens: int = WIDGET_TOKENS, start: int = 0) -> RealKV:
    """SmolLM2-135M's cached K (after RoPE) and V for ``num_tokens`` tokens of real English.

    Loads the bundled model (`paged_ref.models.load_smollm2`, ~8 s the first time in a
    process) and prefills the passage once through the paged cache; the result is cached per argument pair.

    Args:
        num_tokens: tokens of `paged_ref.lab.textdata.english_text` (from paragraph ``start``).
        start: first paragraph of the passage.
    """
    from ...models import load_smollm2
    from ..likelihood import prompt_kv
    from ..textdata import english_text

    num_tokens = check_int("num_tokens", num_tokens, min_value=2)
    model, tok = load_smollm2()
    text = english_text(num_tokens, start=start)  # more words than tokens is not guaranteed: checked below
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0][:num_tokens]  # [num_tokens]
    if ids.numel() < num_tokens:
        raise ValueError(f"the passage gave only {ids.numel()} tokens, fewer than num_tokens={num_tokens}")
    ks, vs = prompt_kv(model, ids)
    return RealKV(ks=tuple(ks), vs=tuple(vs), token_ids=ids, text=tok.decode(ids))


def kept_pages_view(
    budget: int, page_size: int, policy: str = "paged_eviction", *, kv=None, prompt_len: int | None = None
) -> Figure:
    """The panel's callback: page maps of PagedEviction and ``policy`` at budget C and page size B.

    Args:
        budget: C in tokens.
        page_size: B in tokens.
        policy: one of ``POLICIES``, drawn beside ``"paged_eviction"`` (alone if it is that one).
        kv: ``(ks, vs)`` per-layer lists ``[num_tokens, num_kv_heads, head_dim]``; default: the
            real SmolLM2 K/V of `real_kv` (loads the model on first use).
        prompt_len: tokens prefilled before decoding starts (default: half of them).

    Returns:
        a new Figure (see `paged_ref.lab.viz.eviction.page_map_figure`).
    """
    budget = check_int("budget", budget, min_value=1)
    page_size = check_int("page_size", page_size, min_value=1)
    check_choice("policy", policy, set(POLICIES))
    if kv is None:
        real = real_kv()
        ks, vs = list(real.ks), list(real.vs)
    else:
        if not isinstance(kv, (tuple, list)) or len(kv) != 2 or not all(isinstance(x, (tuple, list)) for x in kv):
            raise TypeError(f"kv must be a pair (ks, vs) of per-layer tensor lists, got {type(kv).__name__}")
        ks, vs = list(kv[0]), list(kv[1])
    n = ks[0].shape[0] if ks else 0
    prompt_len = n // 2 if prompt_len is None else prompt_len
    names = ["paged_eviction"] + ([policy] if policy != "paged_eviction" else [])
    runs = [replay(ks, vs, name, budget=budget, page_size=page_size, prompt_len=prompt_len) for name in names]
    return page_map_figure(
        runs,
        note="K/V: SmolLM2-135M on CPython documentation prose (full-cache forward)"
        if kv is None
        else "K/V: given by the caller",
    )


def eviction_panel(kv=None, prompt_len: int | None = None):
    """Budget, page size and policy controls redrawing `kept_pages_view` (``continuous_update=False``)."""
    import ipywidgets as w
    from IPython.display import display

    style = {"description_width": "initial"}
    budget = w.SelectionSlider(
        options=BUDGETS, value=128, description="budget C (tokens)", continuous_update=False, style=style
    )
    page = w.SelectionSlider(
        options=PAGE_SIZES, value=16, description="page size B", continuous_update=False, style=style
    )
    policy = w.Dropdown(options=POLICIES, value="token_topk", description="compare with", style=style)
    out = w.interactive_output(
        lambda budget, page_size, policy: display(
            kept_pages_view(budget, page_size, policy, kv=kv, prompt_len=prompt_len)
        ),
        {"budget": budget, "page_size": page, "policy": policy},
    )
    return with_static_figure(
        w.VBox([w.HBox([budget, page, policy]), out]),
        kept_pages_view(budget.value, page.value, policy.value, kv=kv, prompt_len=prompt_len),
    )
