"""Student-style solutions for `paged_ref.check`, and broken ones each checker must catch.

`SOLUTIONS` maps a checker name to a correct implementation written from scratch (as a student
would: the exercise notebooks' reference solutions); `MUTANTS` maps it to deliberately broken
variants, each named after its mistake.
"""

import math
from pathlib import Path

import torch

from paged_ref.check import load_solutions
from paged_ref.eviction import make_policy

SOLUTIONS_FILE = Path(__file__).resolve().parents[1] / "notebooks" / "exercises" / "solutions" / "solutions.py"
_solutions = load_solutions(SOLUTIONS_FILE)
StudentAllocator = _solutions.StudentAllocator
student_slot_mapping = _solutions.student_slot_mapping
_student_attention = _solutions._student_attention
student_attention = _solutions.student_attention
student_token_scores = _solutions.student_token_scores
student_page_scores = _solutions.student_page_scores


# ------------------------------------------------------------------------------------ allocators
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
def off_by_one_slot_mapping(pages, *, start, num_tokens, page_size):
    return torch.tensor(
        [pages[t // page_size] * page_size + t % page_size for t in range(start + 1, start + num_tokens + 1)]
    )


def logical_slot_mapping(pages, *, start, num_tokens, page_size):
    return torch.arange(start, start + num_tokens)


# ------------------------------------------------------------------------------------ attention
def short_by_one_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    return _student_attention(q, k_cache, v_cache, block_table, seq_lens.clamp(min=2), scale, extra=-1)


def long_by_one_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    return _student_attention(q, k_cache, v_cache, block_table, seq_lens, scale, extra=1)


def no_block_table_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    logical = torch.arange(block_table.shape[1]).repeat(block_table.shape[0], 1)
    return _student_attention(q, k_cache, v_cache, logical, seq_lens, scale)


def unstable_softmax_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    return _student_attention(q, k_cache, v_cache, block_table, seq_lens, scale, stable=False)


def wrong_gqa_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    return _student_attention(q, k_cache, v_cache, block_table, seq_lens, scale, gqa="mod")


# ------------------------------------------------------------------------------------ scores
def inverted_token_scores(k, v):
    return (k.norm(dim=-1) / v.norm(dim=-1)).mean(dim=1)


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
    "eviction_policy": _solutions.StudentPagedEviction,
}
MUTANTS = {
    "allocator": [NoRefcountAllocator, NewestFirstAllocator, NonAtomicAllocator],
    "slot_mapping": [off_by_one_slot_mapping, logical_slot_mapping],
    "paged_attention": [
        short_by_one_attention,
        long_by_one_attention,
        no_block_table_attention,
        unstable_softmax_attention,
        wrong_gqa_attention,
    ],
    "token_scores": [inverted_token_scores],
    "page_scores": [full_page_divisor_page_scores],
    "eviction_policy": [OverBudgetPolicy, LeakyPolicy, DropsNewestPolicy],
}
