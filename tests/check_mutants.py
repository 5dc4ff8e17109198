"""Student-style solutions for `paged_ref.check`, and broken ones each checker must catch.

`SOLUTIONS` maps a checker name to a correct implementation written from scratch (as a student
would); `MUTANTS` maps it to deliberately broken variants, each named after its mistake.
"""

import math
from collections import deque

import torch

from paged_ref.eviction import make_policy


# ------------------------------------------------------------------------------------ allocators
class StudentAllocator:
    """Bump pointer, then a FIFO free list; reference counts; all-or-nothing allocation."""

    def __init__(self, num_pages):
        self.num_pages = num_pages
        self.next_fresh = 0
        self.free_list = deque()
        self.refs = [0] * num_pages

    @property
    def num_free(self):
        return self.num_pages - self.next_fresh + len(self.free_list)

    def allocate(self, n):
        if n > self.num_free:
            raise MemoryError(f"asked for {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self.next_fresh < self.num_pages:
                page, self.next_fresh = self.next_fresh, self.next_fresh + 1
            else:
                page = self.free_list.popleft()
            self.refs[page] = 1
            pages.append(page)
        return pages

    def share(self, pages):
        for p in pages:
            if self.refs[p] == 0:
                raise ValueError(f"page {p} is not allocated")
        for p in pages:
            self.refs[p] += 1

    def free(self, pages):
        counts = {}
        for p in pages:
            counts[p] = counts.get(p, 0) + 1
        for p, c in counts.items():
            if self.refs[p] < c:
                raise ValueError(f"page {p} is not held {c} time(s)")
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_list.append(p)

    def refcount(self, page):
        return self.refs[page]


class NoRefcountAllocator(StudentAllocator):
    """free returns a page at once, ignoring other references (no copy-on-write safety)."""

    def free(self, pages):
        for p in pages:
            if self.refs[p] == 0:
                raise ValueError(f"page {p} is not allocated")
        for p in pages:
            if self.refs[p]:
                self.refs[p] = 0
                self.free_list.append(p)


class NewestFirstAllocator(StudentAllocator):
    """Reuses the most recently returned page first (a stack, not a queue)."""

    def allocate(self, n):
        if n > self.num_free:
            raise MemoryError("out of pages")
        pages = []
        for _ in range(n):
            if self.free_list:
                page = self.free_list.pop()
            else:
                page, self.next_fresh = self.next_fresh, self.next_fresh + 1
            self.refs[page] = 1
            pages.append(page)
        return pages


class NonAtomicAllocator(StudentAllocator):
    """Takes pages one by one and raises when it runs out, keeping those it took."""

    def allocate(self, n):
        pages = []
        for _ in range(n):
            if self.num_free == 0:
                raise MemoryError("out of pages")
            pages += super().allocate(1)
        return pages


# ------------------------------------------------------------------------------------ slot mapping
def student_slot_mapping(pages, *, start, num_tokens, page_size):
    return torch.tensor(
        [pages[t // page_size] * page_size + t % page_size for t in range(start, start + num_tokens)],
        dtype=torch.int64,
    )


def off_by_one_slot_mapping(pages, *, start, num_tokens, page_size):
    return torch.tensor(
        [pages[t // page_size] * page_size + t % page_size for t in range(start + 1, start + num_tokens + 1)]
    )


def logical_slot_mapping(pages, *, start, num_tokens, page_size):
    return torch.arange(start, start + num_tokens)


# ------------------------------------------------------------------------------------ attention
def _student_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None, *, extra=0, stable=True, gqa="div"):
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    for b in range(batch):
        n = int(seq_lens[b]) + extra
        pages = block_table[b, : math.ceil(n / page_size)].long()
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:n]  # [n, Hkv, D]
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:n]
        for h in range(num_q_heads):
            kv = h // (num_q_heads // num_kv_heads) if gqa == "div" else h % num_kv_heads
            s = (k[:, kv] @ q[b, h]) * scale  # [n]
            e = torch.exp(s - s.max()) if stable else torch.exp(s)
            out[b, h] = (e / e.sum()) @ v[:, kv]
    return out


def student_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    return _student_attention(q, k_cache, v_cache, block_table, seq_lens, scale)


def short_by_one_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    return _student_attention(q, k_cache, v_cache, block_table, seq_lens.clamp(min=2), scale, extra=-1)


def no_block_table_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    logical = torch.arange(block_table.shape[1]).repeat(block_table.shape[0], 1)
    return _student_attention(q, k_cache, v_cache, logical, seq_lens, scale)


def unstable_softmax_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    return _student_attention(q, k_cache, v_cache, block_table, seq_lens, scale, stable=False)


def wrong_gqa_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    return _student_attention(q, k_cache, v_cache, block_table, seq_lens, scale, gqa="mod")


# ------------------------------------------------------------------------------------ scores
def student_token_scores(k, v):
    return (v.norm(dim=-1) / k.norm(dim=-1)).mean(dim=1)


def inverted_token_scores(k, v):
    return (k.norm(dim=-1) / v.norm(dim=-1)).mean(dim=1)


def student_page_scores(scores, page_size):
    return torch.stack([chunk.mean() for chunk in scores.split(page_size)])


def full_page_divisor_page_scores(scores, page_size):
    return torch.stack([chunk.sum() / page_size for chunk in scores.split(page_size)])


# ------------------------------------------------------------------------------------ policies
class OverBudgetPolicy:
    """Evicts at prefill but never during decode: the sequence grows past the budget."""

    def __init__(self, budget):
        self.inner = make_policy("paged_eviction", budget)

    def after_prefill(self, cache, seq_id):
        self.inner.after_prefill(cache, seq_id)

    def after_append(self, cache, seq_id):
        pass


class LeakyPolicy:
    """Keeps the newest pages but 'evicts' by forgetting pages in the sequence's own list: they
    never go back to the allocator."""

    def __init__(self, budget):
        self.budget = budget

    def after_prefill(self, cache, seq_id):
        self.after_append(cache, seq_id)

    def after_append(self, cache, seq_id):
        seq = cache._seqs[seq_id]
        while len(seq.pages) > math.ceil(self.budget / cache.page_size) + 1:
            seq.pages.pop(0)
            seq.length -= cache.page_size


class DropsNewestPolicy:
    """Evicts the newest page instead of the lowest-scoring one."""

    def __init__(self, budget):
        self.budget = budget

    def after_prefill(self, cache, seq_id):
        self.after_append(cache, seq_id)

    def after_append(self, cache, seq_id):
        while len(cache.pages(seq_id)) > math.ceil(self.budget / cache.page_size) + 1:
            cache.drop_pages(seq_id, [len(cache.pages(seq_id)) - 1])


SOLUTIONS = {
    "allocator": StudentAllocator,
    "slot_mapping": student_slot_mapping,
    "paged_attention": student_attention,
    "token_scores": student_token_scores,
    "page_scores": student_page_scores,
    "eviction_policy": lambda budget: make_policy("paged_eviction", budget),
}
MUTANTS = {
    "allocator": [NoRefcountAllocator, NewestFirstAllocator, NonAtomicAllocator],
    "slot_mapping": [off_by_one_slot_mapping, logical_slot_mapping],
    "paged_attention": [
        short_by_one_attention,
        no_block_table_attention,
        unstable_softmax_attention,
        wrong_gqa_attention,
    ],
    "token_scores": [inverted_token_scores],
    "page_scores": [full_page_divisor_page_scores],
    "eviction_policy": [OverBudgetPolicy, LeakyPolicy, DropsNewestPolicy],
}
