"""Student-style solutions for `paged_ref.lab.check`, and broken ones each checker must catch.

`SOLUTIONS` maps a checker name to a correct implementation written from scratch (as a student
would: the exercise notebooks' reference solutions); `MUTANTS` maps it to deliberately broken
variants, each named after its mistake.
"""

import math
import time
from pathlib import Path

import torch

from paged_ref.lab.check import load_solutions

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


class NonAtomicFreeAllocator(StudentAllocator):
    """free drops references page by page and raises at the first page that is not held,
    keeping the references it already dropped."""

    def free(self, pages):
        for p in pages:
            if self.refs[p] == 0:
                raise ValueError(f"page {p} is not allocated")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_list.append(p)


class AllocateReturnsNoneAllocator(StudentAllocator):
    """Takes the right pages but forgets to return them."""

    def allocate(self, n):
        super().allocate(n)


class NumFreeFreshOnlyAllocator(StudentAllocator):
    """num_free counts the never-used pages only and forgets the returned ones."""

    @property
    def num_free(self):
        return self.num_pages - self.next_fresh


class ShareUnheldAllocator(StudentAllocator):
    """share adds a reference to any page, held or not."""

    def share(self, pages):
        for p in pages:
            self.refs[p] += 1


class LoopingAllocator(StudentAllocator):
    """Loops forever once it must reuse a returned page (a `while` whose condition never changes)."""

    def allocate(self, n):
        if n > self.num_free:
            raise MemoryError("out of pages")
        pages = []
        while len(pages) < n:
            if self.next_fresh < self.num_pages:
                pages.append(self.next_fresh)
                self.next_fresh += 1
        for p in pages:
            self.refs[p] = 1
        return pages


class SlowAllocator(StudentAllocator):
    """Correct, but every allocate takes `delay` seconds."""

    delay = 0.05

    def allocate(self, n):
        time.sleep(self.delay)
        return super().allocate(n)


# ------------------------------------------------------------------------------------ slot mapping
def off_by_one_slot_mapping(pages, *, start, num_tokens, page_size):
    return torch.tensor(
        [pages[t // page_size] * page_size + t % page_size for t in range(start + 1, start + num_tokens + 1)]
    )


def logical_slot_mapping(pages, *, start, num_tokens, page_size):
    return torch.arange(start, start + num_tokens)


def float_slot_mapping(pages, *, start, num_tokens, page_size):
    return student_slot_mapping(pages, start=start, num_tokens=num_tokens, page_size=page_size) + 0.5


def none_slot_mapping(pages, *, start, num_tokens, page_size):
    [pages[t // page_size] * page_size + t % page_size for t in range(start, start + num_tokens)]  # no return


def list_slot_mapping(pages, *, start, num_tokens, page_size):
    return [pages[t // page_size] * page_size + t % page_size for t in range(start, start + num_tokens)]


def numpy_slot_mapping(pages, *, start, num_tokens, page_size):
    return student_slot_mapping(pages, start=start, num_tokens=num_tokens, page_size=page_size).numpy()


def int32_slot_mapping(pages, *, start, num_tokens, page_size):
    return student_slot_mapping(pages, start=start, num_tokens=num_tokens, page_size=page_size).to(torch.int32)


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


def float32_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    """Correct, computed and returned in float32 (the inputs are float64)."""
    return _student_attention(q.float(), k_cache.float(), v_cache.float(), block_table, seq_lens, scale)


def inplace_scale_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    """Right output, but scales the caller's q in place (q *= scale) and then uses scale 1."""
    q.mul_(q.shape[-1] ** -0.5 if scale is None else scale)
    return _student_attention(q, k_cache, v_cache, block_table, seq_lens, 1.0)


def zero_kv_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    """Zeroes K and V in place and returns zeros: with the oracle run afterwards, on the same
    tensors, the expected output was zeros as well."""
    k_cache.zero_()
    v_cache.zero_()
    return torch.zeros_like(q)


def overwrite_table_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    """Writes logical page ids into the caller's block table, then reads through it."""
    block_table.copy_(torch.arange(block_table.shape[1]).repeat(block_table.shape[0], 1))
    return _student_attention(q, k_cache, v_cache, block_table, seq_lens, scale)


def meta_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    """Returns a tensor with a shape and no data."""
    return torch.empty(q.shape, dtype=q.dtype, device="meta")


def ignores_scale_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    """Always uses head_dim ** -0.5, whatever scale is passed."""
    return _student_attention(q, k_cache, v_cache, block_table, seq_lens, None)


def unscaled_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    """Forgets the scale: softmax(q . k)."""
    return _student_attention(q, k_cache, v_cache, block_table, seq_lens, 1.0)


def reads_padding_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    """Attends to every slot of every block-table entry, padding included."""
    every_slot = torch.full_like(seq_lens, block_table.shape[1] * k_cache.shape[1])
    return _student_attention(q, k_cache, v_cache, block_table, every_slot, scale)


# ------------------------------------------------------------------------------------ scores
def inverted_token_scores(k, v):
    return (k.norm(dim=-1) / v.norm(dim=-1)).mean(dim=1)


def full_page_divisor_page_scores(scores, page_size):
    return torch.stack([chunk.sum() / page_size for chunk in scores.split(page_size)])


# ------------------------------------------------------------------------------------ policies
class OverBudgetPolicy(_solutions.StudentPagedEviction):
    """Evicts at prefill but never during decode: the sequence grows past the budget."""

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


class ArgmaxPolicy(_solutions.StudentPagedEviction):
    """Evicts the highest-scoring candidate page instead of the lowest."""

    def _drop_lowest(self, cache, seq_id):
        scores = self._page_scores(cache, seq_id)
        cache.drop_pages(seq_id, [1 + int(scores[1:-1].argmax())])


class FifoPolicy(_solutions.StudentPagedEviction):
    """First in, first out: drops the oldest page (logical page 0), never looks at a score."""

    def _drop_lowest(self, cache, seq_id):
        cache.drop_pages(seq_id, [0])


class UnreservedSinkPolicy(_solutions.StudentPagedEviction):
    """Lets page 0 (the attention sink) be evicted: the candidates are pages 0 .. n-2."""

    def _drop_lowest(self, cache, seq_id):
        scores = self._page_scores(cache, seq_id)
        cache.drop_pages(seq_id, [int(scores[:-1].argmin())])


class KeepNewestOnlyPolicy:
    """Over budget, drops every page but the newest."""

    def __init__(self, budget):
        self.budget = budget

    def after_prefill(self, cache, seq_id):
        self.after_append(cache, seq_id)

    def after_append(self, cache, seq_id):
        if cache.seq_len(seq_id) > self.budget:
            cache.drop_pages(seq_id, list(range(len(cache.pages(seq_id)) - 1)))


class PageBudgetPolicy(_solutions.StudentPagedEviction):
    """Reads the budget as pages: after the prefill it keeps ceil(budget / page_size) + 1 pages,
    more than budget tokens."""

    def after_prefill(self, cache, seq_id):
        while len(cache.pages(seq_id)) > math.ceil(self.budget / cache.page_size) + 1:
            self._drop_lowest(cache, seq_id)


class _ScoredPolicy(_solutions.StudentPagedEviction):
    """The solution's decisions with another page score: ``_score(k, v)`` per layer, ``[T, Hkv, D]``
    -> token scores ``[T]``, averaged over ``_layers(num_layers)``, page means."""

    def _layers(self, num_layers):
        return range(num_layers)

    def _page_scores(self, cache, seq_id):
        layers = list(self._layers(cache.num_layers))
        scores = sum(self._score(*cache.gather(layer, seq_id)) for layer in layers) / len(layers)
        return student_page_scores(scores, cache.page_size)


class ValueNormPolicy(_ScoredPolicy):
    """Scores pages by ||V|| alone."""

    def _score(self, k, v):
        return v.norm(dim=-1).mean(dim=1)


class InverseKeyNormPolicy(_ScoredPolicy):
    """Scores pages by 1/||K|| alone."""

    def _score(self, k, v):
        return (1 / k.norm(dim=-1)).mean(dim=1)


class FirstLayerPolicy(_ScoredPolicy):
    """Scores from layer 0 only."""

    def _layers(self, num_layers):
        return [0]

    def _score(self, k, v):
        return student_token_scores(k, v)


class LastLayerPolicy(FirstLayerPolicy):
    """Scores from the last layer only."""

    def _layers(self, num_layers):
        return [num_layers - 1]


class AllHeadsNormPolicy(_ScoredPolicy):
    """One norm over all KV heads together: ||V of every head|| / ||K of every head||."""

    def _score(self, k, v):
        return v.flatten(1).norm(dim=-1) / k.flatten(1).norm(dim=-1)


class RatioOfMeansPolicy(_solutions.StudentPagedEviction):
    """A page's mean ||V|| over its mean ||K|| (per head, averaged over heads and layers): a ratio of
    means instead of the mean of the tokens' ratios."""

    def _page_scores(self, cache, seq_id):
        scores = 0
        for layer in range(cache.num_layers):
            k, v = cache.gather(layer, seq_id)  # [T, Hkv, D]
            vn = torch.stack([c.mean(dim=0) for c in v.norm(dim=-1).split(cache.page_size)])  # [pages, Hkv]
            kn = torch.stack([c.mean(dim=0) for c in k.norm(dim=-1).split(cache.page_size)])
            scores = scores + (vn / kn).mean(dim=1) / cache.num_layers
        return scores


class FreesSequencePolicy(_solutions.StudentPagedEviction):
    """Over budget after the prefill, frees the whole sequence instead of dropping pages."""

    def after_prefill(self, cache, seq_id):
        if cache.seq_len(seq_id) > self.budget:
            cache.free(seq_id)


class StaleIndicesPolicy(_solutions.StudentPagedEviction):
    """After the prefill, picks every page to drop from one scoring, then drops them one call at a
    time by those logical indices, lowest index first: each drop shifts the later indices."""

    def after_prefill(self, cache, seq_id):
        scores = self._page_scores(cache, seq_id)
        n, k = len(cache.pages(seq_id)), 0
        while cache.seq_len(seq_id) - k * cache.page_size > self.budget and k < n - 2:
            k += 1
        for j in sorted(1 + int(i) for i in scores[1:-1].argsort()[:k]):
            cache.drop_pages(seq_id, [j])


class PhysicalIdsPolicy(_solutions.StudentPagedEviction):
    """Passes the physical page id of the lowest-scoring candidate to drop_pages."""

    def _drop_lowest(self, cache, seq_id):
        candidates = self._page_scores(cache, seq_id)[1:-1]
        cache.drop_pages(seq_id, [cache.pages(seq_id)[1 + int(candidates.argmin())]])


class SumScoresPolicy:
    """Correct, written with the package's scores: the layer mean of `pr.eviction.token_scores`,
    page sums instead of means (the same order on full pages: candidates are always full)."""

    def __init__(self, budget):
        self.budget = budget

    def _drop_lowest(self, cache, seq_id):
        from paged_ref.eviction import page_scores, sequence_scores

        scores = page_scores(sequence_scores(cache, seq_id, "value_key_ratio"), cache.page_size, "sum")
        cache.drop_pages(seq_id, [1 + int(scores[1:-1].argmin())])

    def after_prefill(self, cache, seq_id):
        while cache.seq_len(seq_id) > self.budget and len(cache.pages(seq_id)) > 2:
            self._drop_lowest(cache, seq_id)

    def after_append(self, cache, seq_id):
        if cache.seq_len(seq_id) > self.budget and cache.seq_len(seq_id) % cache.page_size == 0:
            self._drop_lowest(cache, seq_id)


SOLUTIONS = {
    "allocator": StudentAllocator,
    "slot_mapping": student_slot_mapping,
    "paged_attention": student_attention,
    "token_scores": student_token_scores,
    "page_scores": student_page_scores,
    "eviction_policy": _solutions.StudentPagedEviction,
}
# other correct attempts, each of which must pass too
ALSO_CORRECT = {
    "paged_attention": [float32_attention],
    "eviction_policy": [SumScoresPolicy],
}
MUTANTS = {
    "allocator": [
        NoRefcountAllocator,
        NewestFirstAllocator,
        NonAtomicAllocator,
        NonAtomicFreeAllocator,
        AllocateReturnsNoneAllocator,
        NumFreeFreshOnlyAllocator,
        ShareUnheldAllocator,
    ],
    "slot_mapping": [
        off_by_one_slot_mapping,
        logical_slot_mapping,
        float_slot_mapping,
        none_slot_mapping,
        list_slot_mapping,
        numpy_slot_mapping,
        int32_slot_mapping,
    ],
    "paged_attention": [
        short_by_one_attention,
        long_by_one_attention,
        no_block_table_attention,
        unstable_softmax_attention,
        wrong_gqa_attention,
        inplace_scale_attention,
        zero_kv_attention,
        overwrite_table_attention,
        meta_attention,
        ignores_scale_attention,
        unscaled_attention,
        reads_padding_attention,
    ],
    "token_scores": [inverted_token_scores],
    "page_scores": [full_page_divisor_page_scores],
    "eviction_policy": [
        OverBudgetPolicy,
        LeakyPolicy,
        DropsNewestPolicy,
        ArgmaxPolicy,
        FifoPolicy,
        KeepNewestOnlyPolicy,
        PageBudgetPolicy,
        UnreservedSinkPolicy,
        ValueNormPolicy,
        InverseKeyNormPolicy,
        FirstLayerPolicy,
        LastLayerPolicy,
        AllHeadsNormPolicy,
        RatioOfMeansPolicy,
        FreesSequencePolicy,
        StaleIndicesPolicy,
        PhysicalIdsPolicy,
    ],
}
