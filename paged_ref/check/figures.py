"""Figures drawn from a student's own code, for the exercise notebooks (matplotlib)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from ..cache import PagedKVCache
from ..eviction.policies import max_pages_held
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
    """Page scores of 5.5 pages of random K/V from the student's functions; the lowest is the next to go."""
    gen = torch.Generator().manual_seed(seed)
    n = page_size * 5 + page_size // 2
    k = torch.randn(n, 2, 16, generator=gen) * torch.rand(n, 1, 1, generator=gen) * 3 + 0.01  # [T, Hkv, D]
    v = torch.randn(n, 2, 16, generator=gen) * torch.rand(n, 1, 1, generator=gen) * 3 + 0.01
    pages = torch.as_tensor(page_fn(torch.as_tensor(token_fn(k, v)), page_size))  # [num_pages]
    fig, ax = plt.subplots(figsize=(5, 2.6))
    colors = ["tab:red" if i == int(pages.argmin()) else "tab:blue" for i in range(len(pages))]
    ax.bar(range(len(pages)), pages.tolist(), color=colors)
    ax.set_xlabel(f"logical page ({page_size} tokens each; the last is partial)")
    ax.set_ylabel("page score")
    ax.set_title("red: the page PagedEviction would evict (lowest mean ||V||/||K||)")
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
    fig, ax = plt.subplots(figsize=(6, 2.6))
    ax.plot([h[0] for h in held], label="tokens held")
    ax.plot([h[1] * page_size for h in held], label="pages held x page_size", ls="--")
    ax.axhline(limit * page_size, color="gray", lw=0.8, label="page bound x page_size")
    ax.set_xlabel("decode step (0 = after the prefill)")
    ax.legend(fontsize=8)
    ax.set_title(f"budget {budget}, page size {page_size}")
    fig.tight_layout()
    return fig
