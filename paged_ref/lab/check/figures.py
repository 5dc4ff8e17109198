"""Figures drawn from a student's own code, for the exercise notebooks (matplotlib)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from ...cache import PagedKVCache
from ...eviction.base import max_pages_held
from .attention import _reference, make_attention_cases

__all__ = ["allocator_figure", "attention_figure", "policy_figure", "scores_figure"]

# a short story: three requests arrive, one forks (shares its pages), one finishes, one more arrives
ALLOCATOR_STORY = [
    ("A takes 3", "allocate", 3),
    ("B takes 4", "allocate", 4),
    ("A forks: share A's pages", "share", "A"),
    ("B finishes: free B", "free", "B"),
    ("C takes 5", "allocate", 5),
    ("A's fork finishes", "free", "A"),
]


def allocator_figure(cls, num_pages: int = 12):
    """Refcount of every page after each step of `ALLOCATOR_STORY`, run on ``cls(num_pages)``."""
    alloc, owners, rows, labels = cls(num_pages), {}, [], []
    for label, op, arg in ALLOCATOR_STORY:
        if op == "allocate":
            owners[label[0]] = list(alloc.allocate(arg))
        else:
            getattr(alloc, op)(owners[arg])
        rows.append([alloc.refcount(p) for p in range(num_pages)])
        labels.append(label)
    fig, ax = plt.subplots(figsize=(7, 2.6))
    image = ax.imshow(rows, cmap="Blues", vmin=0, vmax=2, aspect="auto")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xticks(range(num_pages))
    ax.set_xlabel("page id")
    fig.colorbar(image, ax=ax, label="refcount", ticks=[0, 1, 2])
    ax.set_title(f"{getattr(cls, '__name__', 'allocator')}: refcounts after each step")
    fig.tight_layout()
    return fig


def attention_figure(fn, seed: int = 0):
    """The student's decode output against the reference's, element by element, on one case."""
    case = make_attention_cases(seed, torch.float64, repeats=1)[5]
    got = fn(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, scale=case.scale)
    want = _reference(case)
    fig, ax = plt.subplots(figsize=(4, 4))
    ax.scatter(want.flatten(), got.detach().double().flatten(), s=6)
    lo, hi = float(want.min()), float(want.max())
    ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8)
    ax.set_xlabel("reference output")
    ax.set_ylabel("your output")
    ax.set_title(f"seq_lens {case.seq_lens.tolist()}: max error {float((got.double() - want).abs().max()):.1e}")
    fig.tight_layout()
    return fig


def scores_figure(token_fn, page_fn, page_size: int = 8, seed: int = 0):
    """Page scores of 5.5 pages of random K/V from the student's functions, and the page that goes next.

    Page 0 (the attention sink) and the newest page are reserved, as in notebook 07 and exercise
    4: the page evicted next is the lowest-scoring of the others (red); reserved pages are grey.
    """
    gen = torch.Generator().manual_seed(seed)
    n = page_size * 5 + page_size // 2
    k = torch.randn(n, 2, 16, generator=gen) * torch.rand(n, 1, 1, generator=gen) * 3 + 0.01  # [T, Hkv, D]
    v = torch.randn(n, 2, 16, generator=gen) * torch.rand(n, 1, 1, generator=gen) * 3 + 0.01
    pages = torch.as_tensor(page_fn(torch.as_tensor(token_fn(k, v)), page_size)).float()  # [num_pages]
    candidates = list(range(1, len(pages) - 1))
    evict = candidates[int(pages[candidates].argmin())]
    colors = ["0.7" if i in (0, len(pages) - 1) else "tab:red" if i == evict else "tab:blue" for i in range(len(pages))]
    fig, ax = plt.subplots(figsize=(5.5, 2.8))
    ax.bar(range(len(pages)), pages.tolist(), color=colors)
    for i in (0, len(pages) - 1):
        ax.annotate("reserved", (i, float(pages[i])), ha="center", va="bottom", fontsize=7, color="0.35")
    ax.set_xlabel(f"logical page ({page_size} tokens each; the last is partial)")
    ax.set_ylabel("page score")
    ax.set_title(
        "red: the page PagedEviction evicts next\n(lowest mean ||V||/||K|| among pages 1..n-2; grey: reserved)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def policy_figure(factory, budget: int = 24, page_size: int = 8, steps: int = 48, seed: int = 0):
    """Tokens and pages the student's policy holds over a prefill of 2 x budget and ``steps`` decode steps."""
    gen = torch.Generator().manual_seed(seed)
    limit = max_pages_held(budget, page_size)
    cache = PagedKVCache(num_layers=1, num_pages=4 * limit + 8, page_size=page_size, num_kv_heads=1, head_dim=4)
    s, policy, held = cache.add_sequence(), factory(budget), []
    for step in range(steps + 1):
        n = 2 * budget if step == 0 else 1
        slots = cache.reserve(s, n)
        cache.write(0, slots, torch.randn(n, 1, 4, generator=gen), torch.randn(n, 1, 4, generator=gen))
        (policy.after_prefill if step == 0 else policy.after_append)(cache, s)
        held.append((cache.seq_len(s), len(cache.pages(s))))
    x = range(len(held))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.5, 4.0), sharex=True)
    top.axhline(budget, color="tab:green", lw=1.2, ls="--", label=f"budget C = {budget}")
    top.plot(x, [h[0] for h in held], color="tab:blue", marker=".", ms=3, label="tokens held")
    top.set_ylim(0, max(max(h[0] for h in held), budget) * 1.3)
    top.set_ylabel("tokens")
    top.legend(fontsize=7, loc="lower right")
    bottom.axhline(limit, color="0.5", lw=1.2, ls="--", label=f"bound ceil(C/B) + 1 = {limit}")
    bottom.step(x, [h[1] for h in held], where="post", color="tab:orange", label="pages held")
    bottom.set_ylim(0, max(max(h[1] for h in held), limit) + 1.5)
    bottom.set_ylabel("pages")
    bottom.set_xlabel("decode step (0 = after the prefill)")
    bottom.legend(fontsize=7, loc="lower right")
    top.set_title(f"budget {budget}, page size {page_size}: a prefill of {2 * budget} tokens, then decode", fontsize=9)
    fig.tight_layout()
    return fig
