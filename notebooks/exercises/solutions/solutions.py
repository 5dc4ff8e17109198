"""Reference solutions of the exercise notebooks (instructors: keep this file out of the handout).

Each exercise notebook calls ``paged_ref.lab.check.use_solution(name, mine)``: with
``PAGED_REF_SOLUTIONS`` pointing at this file the notebook runs these instead of the student's
skeleton (CI does, so the notebooks keep working). Written the way a student would, from scratch.
"""

import math
from collections import deque

import torch


# ------------------------------------------------------------------ exercise 1: allocator, slot mapping
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


def student_slot_mapping(pages, *, start, num_tokens, page_size):
    return torch.tensor(
        [pages[t // page_size] * page_size + t % page_size for t in range(start, start + num_tokens)],
        dtype=torch.int64,
    )


# ------------------------------------------------------------------ exercise 2: paged decode attention
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


# ------------------------------------------------------------------ exercise 3: PagedEviction scores
def student_token_scores(k, v):
    return (v.norm(dim=-1) / k.norm(dim=-1)).mean(dim=1)


def student_page_scores(scores, page_size):
    return torch.stack([chunk.mean() for chunk in scores.split(page_size)])


# ------------------------------------------------------------------ exercise 4: an eviction policy
class StudentPagedEviction:
    """PagedEviction at page granularity, as exercise 4 defines it. A page's score is the mean
    ||V||/||K|| of its tokens, averaged over layers. Page 0 (the attention sink) and the newest
    page are reserved; the other pages are the candidates. After the prefill, the lowest-scoring
    candidate goes, one page at a time, while the sequence holds more than ``budget`` tokens;
    during decode, each time the newest page fills while the sequence holds more than ``budget``
    tokens, the lowest-scoring candidate goes. So at most ceil(budget / page_size) + 1 pages are
    ever held."""

    def __init__(self, budget):
        self.budget = budget

    def _page_scores(self, cache, seq_id):
        scores = 0
        for layer in range(cache.num_layers):
            k, v = cache.gather(layer, seq_id)  # [T, Hkv, D]
            scores = scores + student_token_scores(k, v) / cache.num_layers
        return student_page_scores(scores, cache.page_size)  # [num_pages]

    def _drop_lowest(self, cache, seq_id):
        candidates = self._page_scores(cache, seq_id)[1:-1]  # pages 1 .. n-2
        cache.drop_pages(seq_id, [1 + int(candidates.argmin())])

    def after_prefill(self, cache, seq_id):
        while cache.seq_len(seq_id) > self.budget and len(cache.pages(seq_id)) > 2:
            self._drop_lowest(cache, seq_id)

    def after_append(self, cache, seq_id):
        n = cache.seq_len(seq_id)
        if n > self.budget and n % cache.page_size == 0:
            self._drop_lowest(cache, seq_id)
