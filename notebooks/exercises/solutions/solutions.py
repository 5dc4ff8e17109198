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


# ------------------------------------------------------------------ exercise 5: the scheduler
class StudentScheduler:
    """vLLM's decision, as exercise 5 states it: running requests first (decodes 1 token, prefills a
    chunk that leaves a token for each later decode), the newest preempted when a row's pages are
    missing (recompute: back to the front of the queue), then FCFS admission of whole sequences."""

    def __init__(self, pool, *, max_num_seqs, max_batched_tokens):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting = deque()
        self.running = []  # admission order, oldest first

    def add(self, req):
        self.waiting.append(req)

    def finish(self, req):
        self.running.remove(req)

    def _preempt(self, victim, preempted):
        self.running.remove(victim)
        self.pool.free(victim)
        self.waiting.appendleft(victim)
        preempted.append(victim)

    def schedule(self):
        rows, preempted = [], []
        budget = self.max_batched_tokens
        decodes = sum(r.remaining == 1 for r in self.running)  # counted once, at the start of the step
        i = 0
        while i < len(self.running):
            r = self.running[i]
            if r.remaining == 1:
                decodes -= 1
                want = 1
            else:
                want = min(r.remaining, budget - decodes)
            if want > 0 and budget > 0:
                while self.pool.pages_needed(r, want) > self.pool.num_free and r in self.running:
                    self._preempt(self.running[-1], preempted)
                if r not in self.running:  # it was the newest: it preempted itself
                    break
                self.pool.grow(r, want)
                rows.append((r, want))
                budget -= want
            i += 1
        if preempted:
            return rows
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            r = self.waiting[0]
            if math.ceil(r.num_tokens / self.pool.page_size) > self.pool.num_free:
                break
            self.waiting.popleft()
            self.running.append(r)
            want = min(r.num_tokens, budget)
            self.pool.grow(r, want)
            rows.append((r, want))
            budget -= want
        return rows


# ------------------------------------------------------------------ exercise 6: the prefix cache
class StudentPrefixCache:
    """Full pages keyed by a chain of hashes, confirmed by their tokens; freed pages reused fresh
    first, then plain ones oldest first, then those holding a cached prefix, least recently freed first."""

    def __init__(self, num_pages, page_size, hash_fn):
        self.page_size, self.hash_fn = page_size, hash_fn
        self.num_pages, self.next_fresh = num_pages, 0
        self.plain, self.cached = deque(), deque()  # free pages, oldest freed first
        self.refs = [0] * num_pages
        self.by_key = {}  # key -> [page, ...], first published first
        self.page_info = {}  # page -> (key, tokens) while it holds a published full page
        self.seqs = {}  # seq_id -> {"pages", "tokens", "keys"}

    def _key(self, parent, tokens):
        return self.hash_fn(parent, tuple(tokens))

    def _new_page(self):
        if self.next_fresh < self.num_pages:
            self.next_fresh += 1
            return self.next_fresh - 1
        page = self.plain.popleft() if self.plain else self.cached.popleft()
        self._forget(page)
        return page

    def _forget(self, page):
        if page in self.page_info:
            key, _ = self.page_info.pop(page)
            self.by_key[key].remove(page)
            if not self.by_key[key]:
                del self.by_key[key]

    def _lookup(self, key, tokens):
        for page in self.by_key.get(key, []):
            if self.page_info[page][1] == tokens:
                return page
        return None

    def start(self, seq_id, prompt):
        ps, parent = self.page_size, b""
        seq = {"pages": [], "tokens": [], "keys": []}
        for i in range((len(prompt) - 1) // ps):
            tokens = tuple(prompt[i * ps : (i + 1) * ps])
            key = self._key(parent, tokens)
            page = self._lookup(key, tokens)
            if page is None:
                break
            if self.refs[page] == 0:  # freed but not yet reused: take it back
                (self.cached if page in self.cached else self.plain).remove(page)
            self.refs[page] += 1
            seq["pages"].append(page)
            seq["keys"].append(key)
            seq["tokens"].extend(tokens)
            parent = key
        self.seqs[seq_id] = seq
        return len(seq["tokens"])

    def append(self, seq_id, tokens):
        seq, ps = self.seqs[seq_id], self.page_size
        for t in tokens:
            if len(seq["tokens"]) % ps == 0:
                page = self._new_page()
                self.refs[page] = 1
                seq["pages"].append(page)
            seq["tokens"].append(t)
            if len(seq["tokens"]) % ps == 0:  # the page is full: publish it
                i = len(seq["tokens"]) // ps - 1
                full = tuple(seq["tokens"][i * ps :])
                key = self._key(seq["keys"][-1] if seq["keys"] else b"", full)
                seq["keys"].append(key)
                page = seq["pages"][i]
                self.by_key.setdefault(key, []).append(page)
                self.page_info[page] = (key, full)

    def pages(self, seq_id):
        return list(self.seqs[seq_id]["pages"])

    def free(self, seq_id):
        for page in reversed(self.seqs.pop(seq_id)["pages"]):  # tail first
            self.refs[page] -= 1
            if self.refs[page] == 0:
                (self.cached if page in self.page_info else self.plain).append(page)


# ------------------------------------------------------------------ exercise 7: reading fewer pages
def student_merge_states(o_a, lse_a, o_b, lse_b):
    m = torch.maximum(lse_a, lse_b)  # each row has one finite lse
    w_a, w_b = torch.exp2(lse_a - m), torch.exp2(lse_b - m)  # an empty part (-inf) weighs 0
    o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / (w_a + w_b)[..., None]
    return o, m + torch.log2(w_a + w_b)


class StudentQuest:
    """Quest's page summaries, its bound, and its per-KV-head page choice."""

    def summaries(self, k, page_size):
        pages = k.split(page_size)  # the last page may be shorter
        return torch.stack([p.amin(dim=0) for p in pages]), torch.stack([p.amax(dim=0) for p in pages])

    def bound(self, q, k_min, k_max):
        return torch.maximum(q * k_min, q * k_max).sum(dim=-1)

    def select(self, q, k_min, k_max, budget):
        num_pages, num_kv_heads, head_dim = k_min.shape
        if num_pages <= budget:
            return torch.arange(num_pages).repeat(num_kv_heads, 1)
        group = q.shape[0] // num_kv_heads
        chosen = []
        for h in range(num_kv_heads):
            heads = q[h * group : (h + 1) * group]  # [group, D]
            b = self.bound(heads[:, None, :], k_min[None, :, h], k_max[None, :, h]).amax(dim=0)  # [num_pages]
            b[-1] = math.inf  # the newest page is always read
            chosen.append(b.topk(budget).indices.sort().values)
        return torch.stack(chosen)


# ------------------------------------------------------------------ exercise 8: fewer bytes per token
def student_quantize(x, scale, fmt):
    top = 127.0 if fmt == torch.int8 else 448.0
    y = (x.float() * (1 / scale.float())).clamp(-top, top)  # the reciprocal in float32, as vLLM
    return y.round().to(fmt) if fmt == torch.int8 else y.to(fmt)  # round: ties to even


def student_dequantize(q, scale):
    return q.float() * scale


def student_write_into_page(page, scale, x, offset):
    """One int8 page with a scale per KV head receives the tokens ``x`` at ``offset``."""
    amax = x.abs().amax(dim=(0, 2))  # [num_kv_heads]
    need = amax / 127
    need = torch.where(amax * (1 / need) > 127, torch.nextafter(need, torch.full_like(need, math.inf)), need)
    need = torch.where(amax > 0, need, 0.0)
    new = torch.maximum(scale, need)
    page = page.clone()
    grew = new > scale
    if grew.any():  # dequantize with the old scale, quantize with the new one (to nearest)
        safe = torch.where(new > 0, new, 1.0)
        again = student_quantize(student_dequantize(page, scale[None, :, None]), safe[None, :, None], torch.int8)
        page = torch.where(grew[None, :, None], again, page)
    safe = torch.where(new > 0, new, 1.0)  # a head at scale 0 holds only zeros
    page[offset : offset + x.shape[0]] = student_quantize(x, safe[None, :, None], torch.int8)
    return page, new
