"""Student-style solutions for `paged_ref.lab.check`, and broken ones each checker must catch.

`SOLUTIONS` maps a checker name to a correct implementation written from scratch (as a student
would: the exercise notebooks' reference solutions); `MUTANTS` maps it to deliberately broken
variants, each named after its mistake.
"""

import math
import time
from collections import OrderedDict
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

StudentScheduler = _solutions.StudentScheduler
StudentPrefixCache = _solutions.StudentPrefixCache
student_merge_states = _solutions.student_merge_states
StudentQuest = _solutions.StudentQuest
student_quantize = _solutions.student_quantize
student_dequantize = _solutions.student_dequantize
student_write_into_page = _solutions.student_write_into_page


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


class SetOrderFreeAllocator(StudentAllocator):
    """free drops the references page by page over set(pages): one call returns its pages in
    increasing id order, not in the order listed."""

    def free(self, pages):
        for p in set(pages):
            if self.refs[p] < pages.count(p):
                raise ValueError(f"page {p} is not held {pages.count(p)} time(s)")
        for p in set(pages):
            self.refs[p] -= pages.count(p)
            if self.refs[p] == 0:
                self.free_list.append(p)


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


def no_dtype_slot_mapping(pages, *, start, num_tokens, page_size):
    """torch.tensor(slots) without a dtype: int64, except a float32 tensor when num_tokens is 0."""
    return torch.tensor([pages[t // page_size] * page_size + t % page_size for t in range(start, start + num_tokens)])


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


class NewestCandidatePolicy(_solutions.StudentPagedEviction):
    """Counts the newest page among the candidates (pages 1 .. n-1): after the prefill it drops the
    same pages as stale logical indices would."""

    def _drop_lowest(self, cache, seq_id):
        candidates = self._page_scores(cache, seq_id)[1:]
        cache.drop_pages(seq_id, [1 + int(candidates.argmin())])


class PageRoomPolicy(_solutions.StudentPagedEviction):
    """Counts the room of the held pages against the budget after the prefill (pages * page_size > budget,
    not seq_len > budget): the same while the budget is a multiple of page_size, one page too many otherwise."""

    def after_prefill(self, cache, seq_id):
        while len(cache.pages(seq_id)) * cache.page_size > self.budget and len(cache.pages(seq_id)) > 2:
            self._drop_lowest(cache, seq_id)


class DecodePagesPolicy(_solutions.StudentPagedEviction):
    """In decode, drops a page when more than ceil(budget / page_size) pages are full, not when more than
    budget tokens are held: the same while the budget is a multiple of page_size."""

    def after_append(self, cache, seq_id):
        n = cache.seq_len(seq_id)
        if n % cache.page_size == 0 and n // cache.page_size > math.ceil(self.budget / cache.page_size):
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


class SquaredRatioPolicy(_ScoredPolicy):
    """Scores tokens by (||V||/||K||)^2, per KV head, averaged over heads."""

    def _score(self, k, v):
        return (v.norm(dim=-1) / k.norm(dim=-1)).square().mean(dim=1)


class L1NormPolicy(_ScoredPolicy):
    """Takes L1 norms: ||V||_1/||K||_1 per KV head, averaged over heads."""

    def _score(self, k, v):
        return (v.abs().sum(dim=-1) / k.abs().sum(dim=-1)).mean(dim=1)


class MaxOverHeadsPolicy(_ScoredPolicy):
    """The largest KV head's ||V||/||K|| instead of the mean over heads."""

    def _score(self, k, v):
        return (v.norm(dim=-1) / k.norm(dim=-1)).amax(dim=1)


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


# ------------------------------------------------------------------------------------ schedulers
class _SchedulerVariant(StudentScheduler):
    """The solution's schedule with one rule changed by a flag (each mutant sets one)."""

    lifo = oldest_victim = no_free = decode_free = whole_check = False
    chunk_delta = 0
    to_back = no_chunking = ignore_max_seqs = admit_after_preempt = skip_blocked = False
    no_reserve = self_victim = prompt_only = floor_pages = False

    def _preempt(self, victim, preempted):
        self.running.remove(victim)
        if not self.no_free:
            self.pool.free(victim)
        else:
            victim.num_computed = 0
        (self.waiting.append if self.to_back else self.waiting.appendleft)(victim)
        preempted.append(victim)

    def schedule(self):
        rows, preempted = [], []
        budget = self.max_batched_tokens
        decodes = 0 if (self.no_reserve or self.decode_free) else sum(r.remaining == 1 for r in self.running)
        i = 0
        while i < len(self.running):
            r = self.running[i]
            if r.remaining == 1:
                decodes = max(0, decodes - 1)
                want = 1
            else:
                want = min(r.remaining, budget - decodes) + self.chunk_delta
            if want > 0 and (budget > 0 or self.decode_free):
                while self.pool.pages_needed(r, want) > self.pool.num_free and r in self.running:
                    victim = self.running[0] if self.oldest_victim else r if self.self_victim else self.running[-1]
                    self._preempt(victim, preempted)
                if r not in self.running:
                    if self.oldest_victim or self.self_victim:
                        continue
                    break
                self.pool.grow(r, want)
                rows.append((r, want))
                if not (self.decode_free and r.remaining == 1):
                    budget -= want
            i += 1
        if preempted and not self.admit_after_preempt:
            return rows
        limit = 10**9 if self.ignore_max_seqs else self.max_num_seqs
        skipped = []
        while self.waiting and len(self.running) < limit and budget > 0:
            r = self.waiting.pop() if self.lifo else self.waiting.popleft()
            tokens = r.prompt_len if self.prompt_only else r.num_tokens
            need = math.ceil((min(tokens, budget) if self.whole_check else tokens) / self.pool.page_size)
            if self.floor_pages:
                need = tokens // self.pool.page_size
            if need > self.pool.num_free or (self.no_chunking and tokens > budget):
                if self.skip_blocked:
                    skipped.append(r)
                    continue
                (self.waiting.append if self.lifo else self.waiting.appendleft)(r)
                break
            self.running.append(r)
            want = min(tokens, budget)
            self.pool.grow(r, want)
            rows.append((r, want))
            budget -= want
        for r in reversed(skipped):
            self.waiting.appendleft(r)
        return rows


def _variant(name, doc, **flags):
    return type(name, (_SchedulerVariant,), {"__doc__": doc, **flags})


LifoScheduler = _variant("LifoScheduler", "Admits the newest waiting request first.", lifo=True)
PreemptOldestScheduler = _variant("PreemptOldestScheduler", "Preempts the oldest running request.", oldest_victim=True)
NoFreeScheduler = _variant("NoFreeScheduler", "Requeues a preempted request without pool.free.", no_free=True)
DecodeOutsideBudgetScheduler = _variant(
    "DecodeOutsideBudgetScheduler", "Decode rows not counted in the budget.", decode_free=True
)
FirstChunkAdmissionScheduler = _variant(
    "FirstChunkAdmissionScheduler", "Admits when the first chunk's pages fit.", whole_check=True
)
ShortChunkScheduler = _variant("ShortChunkScheduler", "Running prefill chunks one token short.", chunk_delta=-1)
PreemptedToBackScheduler = _variant(
    "PreemptedToBackScheduler", "Preempted request to the back of the queue.", to_back=True
)
NoChunkedPrefillScheduler = _variant(
    "NoChunkedPrefillScheduler", "Admits only prompts that fit the budget left.", no_chunking=True
)
NoMaxSeqsScheduler = _variant("NoMaxSeqsScheduler", "Ignores max_num_seqs.", ignore_max_seqs=True)
SkipAheadScheduler = _variant("SkipAheadScheduler", "Skips a waiting request that does not fit.", skip_blocked=True)
SelfVictimScheduler = _variant("SelfVictimScheduler", "Preempts the request that needs the page.", self_victim=True)
PromptOnlyScheduler = _variant(
    "PromptOnlyScheduler", "Readmits a preempted request with its prompt only.", prompt_only=True
)
LongChunkScheduler = _variant("LongChunkScheduler", "Running prefill chunks one token long.", chunk_delta=1)
FloorPagesScheduler = _variant(
    "FloorPagesScheduler", "Admits when num_tokens // page_size pages are free (floor, not ceil).", floor_pages=True
)


class PreemptedInOrderScheduler(StudentScheduler):
    """Puts the requests preempted in one step at the front of the queue in the order they were
    preempted (the newest first), not each at the very front as it is preempted."""

    def _preempt(self, victim, preempted):
        self.running.remove(victim)
        self.pool.free(victim)
        self.waiting.insert(len(preempted), victim)
        preempted.append(victim)


class SkipInsteadOfPreemptScheduler(StudentScheduler):
    """Leaves a running request out of the step when its pages are missing, instead of preempting."""

    def _preempt(self, victim, preempted):
        raise _NoRoom()

    def schedule(self):
        rows, budget = [], self.max_batched_tokens
        for r in list(self.running):
            want = 1 if r.remaining == 1 else min(r.remaining, budget)
            if want > 0 and budget > 0 and self.pool.pages_needed(r, want) <= self.pool.num_free:
                self.pool.grow(r, want)
                rows.append((r, want))
                budget -= want
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            r = self.waiting[0]
            if math.ceil(r.num_tokens / self.pool.page_size) > self.pool.num_free:
                break
            self.running.append(self.waiting.popleft())
            want = min(r.num_tokens, budget)
            self.pool.grow(r, want)
            rows.append((r, want))
            budget -= want
        return rows


class _NoRoom(Exception):
    pass


# ------------------------------------------------------------------------------------ prefix caches
class KeyAlonePrefixCache(StudentPrefixCache):
    """Trusts a key alone: the first page under the key is a hit, whatever its tokens."""

    def _lookup(self, key, tokens):
        pages = self.by_key.get(key, [])
        return pages[0] if pages else None


class OnePagePerKeyPrefixCache(StudentPrefixCache):
    """Keeps one page per key (the latest published replaces the earlier one)."""

    def append(self, seq_id, tokens):
        super().append(seq_id, tokens)
        for pages in self.by_key.values():
            for p in pages[:-1]:
                self.page_info.pop(p, None)
            del pages[:-1]


class FirstPageOnlyPrefixCache(StudentPrefixCache):
    """Publishes a key only once: a later page with the same key is never recorded."""

    def append(self, seq_id, tokens):
        before = {k: list(v) for k, v in self.by_key.items()}
        super().append(seq_id, tokens)
        for key, pages in self.by_key.items():
            if key in before:
                for p in pages[len(before[key]) :]:
                    self.page_info.pop(p, None)
                del pages[len(before[key]) :]


class LastTokenPrefixCache(StudentPrefixCache):
    """Looks up every full page of the prompt, its last token included."""

    def start(self, seq_id, prompt):
        return super().start(seq_id, list(prompt) + [None])


class PartialPagePrefixCache(StudentPrefixCache):
    """Publishes a sequence's partial last page when it is freed, and a lookup may end on a partial page."""

    def free(self, seq_id):
        seq, ps = self.seqs[seq_id], self.page_size
        n = len(seq["tokens"])
        if n % ps:
            part = tuple(seq["tokens"][n - n % ps :])
            key = self._key(seq["keys"][-1] if seq["keys"] else b"", part)
            self.by_key.setdefault(key, []).append(seq["pages"][-1])
            self.page_info[seq["pages"][-1]] = (key, part)
        super().free(seq_id)

    def start(self, seq_id, prompt):
        cached = super().start(seq_id, prompt)
        seq, ps = self.seqs[seq_id], self.page_size
        part = tuple(prompt[cached : len(prompt) - 1])
        if part and len(part) < ps:
            key = self._key(seq["keys"][-1] if seq["keys"] else b"", part)
            page = self._lookup(key, part)
            if page is not None:
                if self.refs[page] == 0:
                    (self.cached if page in self.cached else self.plain).remove(page)
                self.refs[page] += 1
                seq["pages"].append(page)
                seq["tokens"].extend(part)
        return len(seq["tokens"])


class NoForgetPrefixCache(StudentPrefixCache):
    """Never forgets a page's key when the pool hands the page out again."""

    def _forget(self, page):
        pass


class NoRevivePrefixCache(StudentPrefixCache):
    """Drops a page's key as soon as the page is freed: only pages in use can be hits."""

    def free(self, seq_id):
        pages = self.seqs[seq_id]["pages"]
        super().free(seq_id)
        for p in pages:
            if self.refs[p] == 0:
                self._forget(p)


class StackFreePrefixCache(StudentPrefixCache):
    """Hands out the most recently freed page first (stacks, not queues)."""

    def _new_page(self):
        if self.next_fresh < self.num_pages:
            self.next_fresh += 1
            return self.next_fresh - 1
        page = self.plain.pop() if self.plain else self.cached.pop()
        self._forget(page)
        return page


class CachedFirstPrefixCache(StudentPrefixCache):
    """Hands out pages holding a cached prefix before plain free pages."""

    def _new_page(self):
        if self.next_fresh < self.num_pages:
            self.next_fresh += 1
            return self.next_fresh - 1
        page = self.cached.popleft() if self.cached else self.plain.popleft()
        self._forget(page)
        return page


class HeadFirstFreePrefixCache(StudentPrefixCache):
    """Frees a sequence's pages first page first (head first, not tail first)."""

    def free(self, seq_id):
        for page in self.seqs.pop(seq_id)["pages"]:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                (self.cached if page in self.page_info else self.plain).append(page)


class PromptOnlyPublishPrefixCache(StudentPrefixCache):
    """Publishes full pages only while appending a prompt, never the ones generated tokens fill."""

    def append(self, seq_id, tokens):
        if len(tokens) > 1 or not self.seqs[seq_id]["pages"]:
            return super().append(seq_id, tokens)
        seq, ps = self.seqs[seq_id], self.page_size
        for t in tokens:
            if len(seq["tokens"]) % ps == 0:
                page = self._new_page()
                self.refs[page] = 1
                seq["pages"].append(page)
            seq["tokens"].append(t)
            if len(seq["tokens"]) % ps == 0:
                seq["keys"].append(None)


class ParentlessKeyPrefixCache(StudentPrefixCache):
    """Keys a page by its own tokens only, not chained to its parent's key."""

    def _key(self, parent, tokens):
        return self.hash_fn(b"", tuple(tokens))


class FreePagesFirstPrefixCache(StudentPrefixCache):
    """Hands out freed pages before never-used ones."""

    def _new_page(self):
        if self.plain or self.cached:
            page = self.plain.popleft() if self.plain else self.cached.popleft()
            self._forget(page)
            return page
        self.next_fresh += 1
        return self.next_fresh - 1


class NoShareRefcountPrefixCache(StudentPrefixCache):
    """A hit on a page in use adds no reference: the first holder's free returns it to the pool."""

    def start(self, seq_id, prompt):
        held = {p: self.refs[p] for p in range(self.num_pages)}
        cached = super().start(seq_id, prompt)
        for p in self.seqs[seq_id]["pages"]:
            if held[p] > 0:
                self.refs[p] = held[p]
        return cached

    def free(self, seq_id):
        for page in reversed(self.seqs.pop(seq_id)["pages"]):
            if self.refs[page] > 0:
                self.refs[page] -= 1
                if self.refs[page] == 0:
                    (self.cached if page in self.page_info else self.plain).append(page)


class WalksPastMissPrefixCache(StudentPrefixCache):
    """After a miss, walks on through the prompt's full pages and takes the later ones that hit."""

    def start(self, seq_id, prompt):
        ps, parent = self.page_size, b""
        seq = {"pages": [], "tokens": [], "keys": []}
        for i in range((len(prompt) - 1) // ps):
            tokens = tuple(prompt[i * ps : (i + 1) * ps])
            key = parent = self._key(parent, tokens)
            page = self._lookup(key, tokens)
            if page is None:
                continue
            if self.refs[page] == 0:
                (self.cached if page in self.cached else self.plain).remove(page)
            self.refs[page] += 1
            seq["pages"].append(page)
            seq["keys"].append(key)
            seq["tokens"].extend(tokens)
        self.seqs[seq_id] = seq
        return len(seq["tokens"])


class PagesNotTokensPrefixCache(StudentPrefixCache):
    """start returns the number of cached pages instead of tokens."""

    def start(self, seq_id, prompt):
        return super().start(seq_id, prompt) // self.page_size


# ------------------------------------------------------------------------------------ reading fewer pages
def natural_exp_merge_states(o_a, lse_a, o_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (w_a[..., None] * o_a + w_b[..., None] * o_b) / (w_a + w_b)[..., None], m + torch.log(w_a + w_b)


def unstable_merge_states(o_a, lse_a, o_b, lse_b):
    w_a, w_b = torch.exp2(lse_a), torch.exp2(lse_b)
    return (w_a[..., None] * o_a + w_b[..., None] * o_b) / (w_a + w_b)[..., None], torch.log2(w_a + w_b)


def unnormalised_merge_states(o_a, lse_a, o_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp2(lse_a - m), torch.exp2(lse_b - m)
    return w_a[..., None] * o_a + w_b[..., None] * o_b, m + torch.log2(w_a + w_b)


def max_lse_merge_states(o_a, lse_a, o_b, lse_b):
    return student_merge_states(o_a, lse_a, o_b, lse_b)[0], torch.maximum(lse_a, lse_b)


def sum_lse_merge_states(o_a, lse_a, o_b, lse_b):
    return student_merge_states(o_a, lse_a, o_b, lse_b)[0], lse_a + lse_b


def log_lse_merge_states(o_a, lse_a, o_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    return student_merge_states(o_a, lse_a, o_b, lse_b)[0], m + torch.log(torch.exp2(lse_a - m) + torch.exp2(lse_b - m))


def mean_merge_states(o_a, lse_a, o_b, lse_b):
    return (o_a + o_b) / 2, student_merge_states(o_a, lse_a, o_b, lse_b)[1]


def swapped_merge_states(o_a, lse_a, o_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp2(lse_a - m), torch.exp2(lse_b - m)
    return (w_b[..., None] * o_a + w_a[..., None] * o_b) / (w_a + w_b)[..., None], m + torch.log2(w_a + w_b)


def float32_merge_states(o_a, lse_a, o_b, lse_b):
    o, lse = student_merge_states(o_a.float(), lse_a.float(), o_b.float(), lse_b.float())
    return o, lse


def inplace_merge_states(o_a, lse_a, o_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp2(lse_a - m), torch.exp2(lse_b - m)
    o_a *= w_a[..., None]
    o_b *= w_b[..., None]
    return (o_a + o_b) / (w_a + w_b)[..., None], m + torch.log2(w_a + w_b)


def broadcast_merge_states(o_a, lse_a, o_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp2(lse_a - m), torch.exp2(lse_b - m)
    return (w_a * o_a + w_b * o_b) / (w_a + w_b), m + torch.log2(w_a + w_b)


def output_only_merge_states(o_a, lse_a, o_b, lse_b):
    return student_merge_states(o_a, lse_a, o_b, lse_b)[0]


def nan_empty_merge_states(o_a, lse_a, o_b, lse_b):
    d = lse_a - lse_b  # -inf - x fine, but inf when b is empty... weights from the difference
    w_a = 1 / (1 + torch.exp2(-d))
    o = w_a[..., None] * o_a + (1 - w_a)[..., None] * o_b
    return o, lse_b + torch.log2(1 + torch.exp2(d))


class ZeroPaddedQuest(StudentQuest):
    def summaries(self, k, page_size):
        pad = -k.shape[0] % page_size
        k = torch.cat([k, k.new_zeros(pad, *k.shape[1:])])
        return super().summaries(k, page_size)


class ChannelCollapsedQuest(StudentQuest):
    def summaries(self, k, page_size):
        lo, hi = super().summaries(k, page_size)
        return lo.amin(-1, keepdim=True).expand_as(lo), hi.amax(-1, keepdim=True).expand_as(hi)


class HeadsCollapsedQuest(StudentQuest):
    def summaries(self, k, page_size):
        lo, hi = super().summaries(k, page_size)
        return lo.amin(1, keepdim=True).expand_as(lo), hi.amax(1, keepdim=True).expand_as(hi)


class KmaxBoundQuest(StudentQuest):
    def bound(self, q, k_min, k_max):
        return (q * k_max).sum(-1)


class CentreBoundQuest(StudentQuest):
    def bound(self, q, k_min, k_max):
        return (q * (k_min + k_max) / 2).sum(-1)


class AbsBoundQuest(StudentQuest):
    def bound(self, q, k_min, k_max):
        return (q.abs() * torch.maximum(k_min.abs(), k_max.abs())).sum(-1)


class NoNewestQuest(StudentQuest):
    def select(self, q, k_min, k_max, budget):
        num_pages, hkv, _ = k_min.shape
        if num_pages <= budget:
            return torch.arange(num_pages).repeat(hkv, 1)
        g = q.shape[0] // hkv
        b = torch.stack(
            [self.bound(q[h * g : (h + 1) * g, None], k_min[None, :, h], k_max[None, :, h]).amax(0) for h in range(hkv)]
        )
        return b.topk(budget, dim=-1).indices.sort(-1).values


class _Scored(StudentQuest):
    """select with another per-page score: _score(bounds [group, pages]) -> [pages]."""

    def select(self, q, k_min, k_max, budget):
        num_pages, hkv, _ = k_min.shape
        if num_pages <= budget:
            return torch.arange(num_pages).repeat(hkv, 1)
        rows = []
        for h in range(hkv):
            b = self._score(self.bound(self._heads(q, h, hkv)[:, None], k_min[None, :, h], k_max[None, :, h]))
            b[-1] = math.inf
            rows.append(b.topk(budget).indices.sort().values)
        return torch.stack(rows)

    def _heads(self, q, h, hkv):
        g = q.shape[0] // hkv
        return q[h * g : (h + 1) * g]

    def _score(self, b):
        return b.amax(0)


class SmallestQuest(_Scored):
    def _score(self, b):
        return -b.amax(0)


class MeanGroupQuest(_Scored):
    def _score(self, b):
        return b.mean(0)


class SumGroupQuest(_Scored):
    def _score(self, b):
        return b.sum(0)


class ModuloHeadsQuest(_Scored):
    def _heads(self, q, h, hkv):
        return q[h::hkv]


class UnsortedQuest(StudentQuest):
    def select(self, q, k_min, k_max, budget):
        return super().select(q, k_min, k_max, budget).flip(-1)


class ExtraNewestQuest(NoNewestQuest):
    def select(self, q, k_min, k_max, budget):
        sel = super().select(q, k_min, k_max, budget)
        if k_min.shape[0] <= budget:
            return sel
        last = torch.full((sel.shape[0], 1), k_min.shape[0] - 1)
        return torch.cat([sel, last], -1)


class FewPagesQuest(StudentQuest):
    def select(self, q, k_min, k_max, budget):
        num_pages, hkv, _ = k_min.shape
        g = q.shape[0] // hkv
        b = torch.stack(
            [self.bound(q[h * g : (h + 1) * g, None], k_min[None, :, h], k_max[None, :, h]).amax(0) for h in range(hkv)]
        )
        b[:, -1] = math.inf
        return b.topk(budget, dim=-1).indices.sort(-1).values


class FirstPageQuest(_Scored):
    def _score(self, b):
        s = b.amax(0)
        s[0] = math.inf
        s[-1] = s[-1]
        return s

    def select(self, q, k_min, k_max, budget):
        num_pages, hkv, _ = k_min.shape
        if num_pages <= budget:
            return torch.arange(num_pages).repeat(hkv, 1)
        rows = []
        for h in range(hkv):
            b = self._score(self.bound(self._heads(q, h, hkv)[:, None], k_min[None, :, h], k_max[None, :, h]))
            rows.append(b.topk(budget).indices.sort().values)
        return torch.stack(rows)


# ------------------------------------------------------------------------------------ fewer bytes per token
def _top(fmt):
    return 127.0 if fmt == torch.int8 else 448.0


def times_scale_quantize(x, scale, fmt):
    y = (x * scale).clamp(-_top(fmt), _top(fmt))
    return y.round().to(fmt) if fmt == torch.int8 else y.to(fmt)


def divided_quantize(x, scale, fmt):
    y = (x / scale).clamp(-_top(fmt), _top(fmt))
    return y.round().to(fmt) if fmt == torch.int8 else y.to(fmt)


def no_clamp_quantize(x, scale, fmt):
    y = x * (1 / scale)
    return y.round().to(torch.int64).to(fmt) if fmt == torch.int8 else y.to(fmt)


def asymmetric_quantize(x, scale, fmt):
    if fmt != torch.int8:
        return student_quantize(x, scale, fmt)
    return (x * (1 / scale)).clamp(-128, 127).round().to(fmt)


def truncating_quantize(x, scale, fmt):
    return (x * (1 / scale)).clamp(-_top(fmt), _top(fmt)).to(fmt)


def floor_quantize(x, scale, fmt):
    y = (x * (1 / scale)).clamp(-_top(fmt), _top(fmt))
    return y.floor().to(fmt) if fmt == torch.int8 else y.to(fmt)


def half_away_quantize(x, scale, fmt):
    y = (x * (1 / scale)).clamp(-_top(fmt), _top(fmt))
    return (y.sign() * (y.abs() + 0.5).floor()).to(fmt) if fmt == torch.int8 else y.to(fmt)


def float_result_quantize(x, scale, fmt):
    return student_quantize(x, scale, fmt).float()


def inplace_quantize(x, scale, fmt):
    x.mul_(1 / scale)
    return x.clamp(-_top(fmt), _top(fmt)).round().to(fmt) if fmt == torch.int8 else x.clamp(-448, 448).to(fmt)


def divided_dequantize(q, scale):
    return q.float() / scale


def float64_dequantize(q, scale):
    return q.double() * scale.double()


def unconverted_dequantize(q, scale):
    return q * scale


def _needed(x):
    amax = x.abs().amax(dim=(0, 2))
    need = amax / 127
    need = torch.where(amax * (1 / need) > 127, torch.nextafter(need, torch.full_like(need, math.inf)), need)
    return torch.where(amax > 0, need, 0.0)


def _page_write(page, scale, x, offset, *, new, requant=True, rounding="nearest", at=None):
    """A page write with its pieces chosen: the new scale, whether and how old tokens re-quantize, where."""
    page = page.clone()
    safe = torch.where(new > 0, new, 1.0)[None, :, None]
    if requant:
        y = (page.float() * scale[None, :, None]) * (1 / safe)
        y = y.clamp(-127, 127)
        again = (y.round() if rounding == "nearest" else y.trunc()).to(torch.int8)
        page = torch.where((new > scale)[None, :, None], again, page)
    at = offset if at is None else at
    page[at : at + x.shape[0]] = student_quantize(x, safe, torch.int8)
    return page, new


def no_requant_page_write(page, scale, x, offset):
    return _page_write(page, scale, x, offset, new=torch.maximum(scale, _needed(x)), requant=False)


def shrinking_page_write(page, scale, x, offset):
    return _page_write(page, scale, x, offset, new=_needed(x))


def one_scale_page_write(page, scale, x, offset):
    new = torch.maximum(scale.amax(), _needed(x).amax()).expand_as(scale).clone()
    return _page_write(page, scale, x, offset, new=new)


def truncating_page_write(page, scale, x, offset):
    return _page_write(page, scale, x, offset, new=torch.maximum(scale, _needed(x)), rounding="zero")


def no_nextafter_page_write(page, scale, x, offset):
    return _page_write(page, scale, x, offset, new=torch.maximum(scale, x.abs().amax(dim=(0, 2)) / 127))


def at_zero_page_write(page, scale, x, offset):
    return _page_write(page, scale, x, offset, new=torch.maximum(scale, _needed(x)), at=0)


def inplace_page_write(page, scale, x, offset):
    new_page, new = student_write_into_page(page, scale, x, offset)
    page.copy_(new_page)
    return page, new


def last_token_page_write(page, scale, x, offset):
    return _page_write(page, scale, x, offset, new=torch.maximum(scale, _needed(x[-1:])))


# ------------------------------------------------------------------------------------ exercises 5-7 from the
# notebooks' text alone: other names and data structures, each a correct attempt
class QueueScheduler:
    def __init__(self, pool, *, max_num_seqs, max_batched_tokens):
        self.pool = pool
        self.limit = max_num_seqs
        self.budget = max_batched_tokens
        self.queue = []  # waiting, front = index 0
        self.active = []  # running, oldest admitted first

    def add(self, req):
        self.queue.append(req)

    def finish(self, req):
        self.active = [r for r in self.active if r is not req]

    def _evict_newest(self):
        victim = self.active.pop()
        self.pool.free(victim)
        self.queue.insert(0, victim)
        return victim

    def schedule(self):
        left = self.budget
        plan = []
        preempted_any = False
        for req in list(self.active):
            if req not in self.active:  # preempted earlier in this step
                break
            if left == 0:
                break
            n = 1 if req.remaining == 1 else min(req.remaining, left)
            gone = False
            while self.pool.pages_needed(req, n) > self.pool.num_free:
                victim = self._evict_newest()
                preempted_any = True
                if victim is req:
                    gone = True
                    break
            if gone:
                break
            self.pool.grow(req, n)
            plan.append((req, n))
            left -= n
        if preempted_any:
            return plan
        while self.queue and len(self.active) < self.limit and left > 0:
            head = self.queue[0]
            if math.ceil(head.num_tokens / self.pool.page_size) > self.pool.num_free:
                break
            self.queue.pop(0)
            self.active.append(head)
            n = min(head.num_tokens, left)
            self.pool.grow(head, n)
            plan.append((head, n))
            left -= n
        return plan


class Page:
    def __init__(self):
        self.refs = 0
        self.key = None  # set while it holds a published full page
        self.tokens = None


class ChainCache:
    def __init__(self, num_pages, page_size, hash_fn):
        self.ps = page_size
        self.h = hash_fn
        self.page = [Page() for _ in range(num_pages)]
        self.fresh = 0
        self.free_plain = OrderedDict()  # page id -> None, oldest freed first
        self.free_cached = OrderedDict()
        self.index = {}  # key -> list of page ids, publish order
        self.seq = {}  # seq_id -> (pages, tokens, last key)

    def _take(self):
        if self.fresh < len(self.page):
            self.fresh += 1
            pid = self.fresh - 1
        elif self.free_plain:
            pid, _ = self.free_plain.popitem(last=False)
        else:
            pid, _ = self.free_cached.popitem(last=False)
            p = self.page[pid]
            self.index[p.key].remove(pid)
            p.key = p.tokens = None
        self.page[pid].refs = 1
        return pid

    def start(self, seq_id, prompt):
        pages, tokens, parent = [], [], b""
        full = (len(prompt) - 1) // self.ps
        for i in range(full):
            chunk = tuple(prompt[i * self.ps : (i + 1) * self.ps])
            key = self.h(parent, chunk)
            hit = None
            for pid in self.index.get(key, []):
                if self.page[pid].tokens == chunk:
                    hit = pid
                    break
            if hit is None:
                break
            p = self.page[hit]
            if p.refs == 0:
                self.free_cached.pop(hit, None)
                self.free_plain.pop(hit, None)
            p.refs += 1
            pages.append(hit)
            tokens.extend(chunk)
            parent = key
        self.seq[seq_id] = [pages, tokens, parent]
        return len(tokens)

    def append(self, seq_id, new_tokens):
        s = self.seq[seq_id]
        for t in new_tokens:
            if len(s[1]) % self.ps == 0:
                s[0].append(self._take())
            s[1].append(t)
            if len(s[1]) % self.ps == 0:
                chunk = tuple(s[1][-self.ps :])
                key = self.h(s[2], chunk)
                pid = s[0][-1]
                self.page[pid].key, self.page[pid].tokens = key, chunk
                self.index.setdefault(key, []).append(pid)
                s[2] = key

    def pages(self, seq_id):
        return list(self.seq[seq_id][0])

    def free(self, seq_id):
        pages = self.seq.pop(seq_id)[0]
        for pid in reversed(pages):
            p = self.page[pid]
            p.refs -= 1
            if p.refs == 0:
                if p.key is not None:
                    self.free_cached[pid] = None
                else:
                    self.free_plain[pid] = None


def merge_two(o_a, lse_a, o_b, lse_b):
    top = torch.maximum(lse_a, lse_b)
    a = torch.exp2(lse_a - top).unsqueeze(-1)
    b = torch.exp2(lse_b - top).unsqueeze(-1)
    total = a + b
    return (a * o_a + b * o_b) / total, top + torch.log2(total.squeeze(-1))


class PageChooser:
    def summaries(self, k, page_size):
        n = k.shape[0]
        lo, hi = [], []
        for start in range(0, n, page_size):
            page = k[start : start + page_size]
            lo.append(page.min(dim=0).values)
            hi.append(page.max(dim=0).values)
        return torch.stack(lo), torch.stack(hi)

    def bound(self, q, k_min, k_max):
        return torch.where(q >= 0, q * k_max, q * k_min).sum(-1)

    def select(self, q, k_min, k_max, budget):
        num_pages, hkv, d = k_min.shape
        if num_pages <= budget:
            return torch.arange(num_pages, dtype=torch.int64).unsqueeze(0).repeat(hkv, 1)
        per = q.shape[0] // hkv
        out = []
        for h in range(hkv):
            qh = q[h * per : (h + 1) * per]  # [per, D]
            scores = self.bound(qh.unsqueeze(1), k_min[:, h].unsqueeze(0), k_max[:, h].unsqueeze(0))  # [per, P]
            best = scores.max(dim=0).values
            order = best[:-1].argsort(descending=True)[: budget - 1]
            chosen = torch.cat([order, torch.tensor([num_pages - 1])]).sort().values
            out.append(chosen)
        return torch.stack(out)


# ------------------------------------------------------------------------------------ exercise 8 from the
# notebook's text alone: other correct attempts
def where_quantize(x, scale, fmt):
    y = torch.mul(x.to(torch.float32), torch.reciprocal(scale.to(torch.float32)))
    if fmt == torch.int8:
        y = torch.where(y > 127, 127.0, torch.where(y < -127, -127.0, y))
        return torch.round(y).to(torch.int8)
    return torch.clamp(y, min=-448, max=448).to(fmt)


def per_head_page_write(page, scale, x, offset):
    """One KV head at a time, in Python."""
    page, scale = page.clone(), scale.clone()
    for h in range(page.shape[1]):
        amax = x[:, h].abs().max()
        need = torch.zeros(())
        if amax > 0:
            need = amax / 127
            if amax * (1 / need) > 127:
                need = torch.nextafter(need, torch.tensor(math.inf))
        if need > scale[h]:
            if scale[h] > 0:
                old = page[:offset, h].float() * scale[h]
                page[:offset, h] = where_quantize(old, need, torch.int8)
            scale[h] = need
        at = scale[h] if scale[h] > 0 else torch.tensor(1.0)
        page[offset : offset + len(x), h] = where_quantize(x[:, h], at, torch.int8)
    return page, scale


SOLUTIONS = {
    "allocator": StudentAllocator,
    "slot_mapping": student_slot_mapping,
    "paged_attention": student_attention,
    "token_scores": student_token_scores,
    "page_scores": student_page_scores,
    "eviction_policy": _solutions.StudentPagedEviction,
    "scheduler": StudentScheduler,
    "prefix_cache": StudentPrefixCache,
    "merge_states": student_merge_states,
    "quest": StudentQuest,
    "quantize": student_quantize,
    "dequantize": student_dequantize,
    "page_write": student_write_into_page,
}
# other correct attempts, each of which must pass too
ALSO_CORRECT = {
    "paged_attention": [float32_attention],
    "eviction_policy": [SumScoresPolicy],
    "scheduler": [QueueScheduler],
    "prefix_cache": [ChainCache],
    "merge_states": [merge_two],
    "quest": [PageChooser],
    "quantize": [where_quantize],
    "page_write": [per_head_page_write],
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
        SetOrderFreeAllocator,
    ],
    "slot_mapping": [
        off_by_one_slot_mapping,
        logical_slot_mapping,
        float_slot_mapping,
        none_slot_mapping,
        list_slot_mapping,
        numpy_slot_mapping,
        int32_slot_mapping,
        no_dtype_slot_mapping,
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
        SquaredRatioPolicy,
        L1NormPolicy,
        MaxOverHeadsPolicy,
        FreesSequencePolicy,
        StaleIndicesPolicy,
        PhysicalIdsPolicy,
        NewestCandidatePolicy,
        PageRoomPolicy,
        DecodePagesPolicy,
    ],
    "scheduler": [
        LifoScheduler,
        PreemptOldestScheduler,
        NoFreeScheduler,
        DecodeOutsideBudgetScheduler,
        FirstChunkAdmissionScheduler,
        ShortChunkScheduler,
        LongChunkScheduler,
        PreemptedToBackScheduler,
        NoChunkedPrefillScheduler,
        NoMaxSeqsScheduler,
        SkipAheadScheduler,
        SelfVictimScheduler,
        PromptOnlyScheduler,
        SkipInsteadOfPreemptScheduler,
        PreemptedInOrderScheduler,
        FloorPagesScheduler,
    ],
    "prefix_cache": [
        KeyAlonePrefixCache,
        OnePagePerKeyPrefixCache,
        FirstPageOnlyPrefixCache,
        LastTokenPrefixCache,
        PartialPagePrefixCache,
        NoForgetPrefixCache,
        NoRevivePrefixCache,
        StackFreePrefixCache,
        CachedFirstPrefixCache,
        HeadFirstFreePrefixCache,
        PromptOnlyPublishPrefixCache,
        ParentlessKeyPrefixCache,
        FreePagesFirstPrefixCache,
        NoShareRefcountPrefixCache,
        PagesNotTokensPrefixCache,
        WalksPastMissPrefixCache,
    ],
    "merge_states": [
        natural_exp_merge_states,
        unstable_merge_states,
        unnormalised_merge_states,
        max_lse_merge_states,
        sum_lse_merge_states,
        log_lse_merge_states,
        mean_merge_states,
        swapped_merge_states,
        float32_merge_states,
        inplace_merge_states,
        broadcast_merge_states,
        output_only_merge_states,
        nan_empty_merge_states,
    ],
    "quest": [
        ZeroPaddedQuest,
        ChannelCollapsedQuest,
        HeadsCollapsedQuest,
        KmaxBoundQuest,
        CentreBoundQuest,
        AbsBoundQuest,
        NoNewestQuest,
        SmallestQuest,
        MeanGroupQuest,
        SumGroupQuest,
        ModuloHeadsQuest,
        UnsortedQuest,
        ExtraNewestQuest,
        FewPagesQuest,
        FirstPageQuest,
    ],
    "quantize": [
        times_scale_quantize,
        divided_quantize,
        no_clamp_quantize,
        asymmetric_quantize,
        truncating_quantize,
        floor_quantize,
        half_away_quantize,
        float_result_quantize,
        inplace_quantize,
    ],
    "dequantize": [divided_dequantize, float64_dequantize, unconverted_dequantize],
    "page_write": [
        no_requant_page_write,
        shrinking_page_write,
        one_scale_page_write,
        truncating_page_write,
        no_nextafter_page_write,
        at_zero_page_write,
        inplace_page_write,
        last_token_page_write,
    ],
}
