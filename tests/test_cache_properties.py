"""Model-based test: random interleavings of cache operations against a plain contiguous model.

Each token's K/V is a deterministic function of (token id, position, layer, adapter), so a page
reused through prefix caching must hold exactly what the new sequence would have written. Two
adapters (per-sequence namespaces) write different K/V for equal tokens: sharing a page across
them would show up as a wrong gather. Writes sometimes lag behind other sequences' additions
(reserve, add another sequence, then write), which must not hand out pages before their K/V.
"""

import functools
from collections import Counter

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import paged_ref as pr

H, D, LAYERS = 2, 3, 2


ADAPTERS = (None, "a", "b")


def token_kv(tokens, start, layer, adapter=None, positions=None):
    """K, V ``[n, H, D]`` of tokens at ``start, start + 1, ...`` (or at ``positions``)."""
    t = torch.as_tensor(tokens, dtype=torch.float32)[:, None, None]  # [n, 1, 1]
    if positions is None:
        positions = range(start, start + len(tokens))
    pos = torch.as_tensor(positions, dtype=torch.float32)[:, None, None]  # [n, 1, 1]
    grid = torch.arange(H * D, dtype=torch.float32).view(1, H, D)
    k = t * 1000 + pos + grid / 10 + layer * 7 + 100_000 * ADAPTERS.index(adapter)  # [n, H, D]
    return k, -k * 3


@functools.lru_cache(maxsize=4096)
def _expected_kv(tokens: tuple, positions: tuple, layer: int, adapter):
    """`token_kv` of a sequence's (token, position) pairs, remembered: most sequences do not
    change between two checks of the invariants (read only)."""
    return token_kv(tokens, 0, layer, adapter, positions=positions)


class CacheMachine(RuleBasedStateMachine):
    page_size = 2
    growth = "page"
    prefix_caching = False

    def __init__(self):
        super().__init__()
        self.cache = pr.PagedKVCache(
            num_layers=LAYERS,
            num_pages=24,
            page_size=self.page_size,
            num_kv_heads=H,
            head_dim=D,
            growth=self.growth,
            prefix_caching=self.prefix_caching,
        )
        self.model: dict[int, list[tuple[int, int]]] = {}  # seq -> [(token id, original position)]
        self.adapter: dict[int, str | None] = {}
        self.lagging: tuple | None = None  # (seq, slots, tokens, start): reserved, not yet written

    def _write(self, seq, tokens, lag=False):
        self._flush()
        start = self.cache.seq_len(seq)
        positions = range(start, start + len(tokens))
        try:
            slots = self.cache.reserve(seq, len(tokens), token_ids=tokens)
        except pr.OutOfPagesError:
            return
        self.model[seq].extend(zip(tokens, positions))
        self.lagging = (seq, slots, tokens, start)
        if not lag:
            self._flush()

    def _flush(self):
        """Write the K/V of the last reservation (every rule but `add` does this first)."""
        if self.lagging is not None:
            seq, slots, tokens, start = self.lagging
            self.lagging = None
            for layer in range(LAYERS):
                self.cache.write(layer, slots, *token_kv(tokens, start, layer, self.adapter[seq]))

    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=9), adapter=st.sampled_from(ADAPTERS), lag=st.booleans()
    )
    def add(self, prompt, adapter, lag):
        # a lagging write from the previous step stays pending while this sequence looks for
        # cached pages: it must not find the half-written one
        STEPS[0] += 1
        namespace = None if adapter is None else {"adapter": adapter}
        seq = self.cache.add_sequence(token_ids=prompt, namespace=namespace)
        cached = self.cache.seq_len(seq)
        self.model[seq] = list(zip(prompt[:cached], range(cached)))
        self.adapter[seq] = adapter
        self._write(seq, prompt[cached:], lag=lag)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=7))
    def append(self, data, tokens):
        STEPS[0] += 1
        self._flush()
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self._write(seq, tokens)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        STEPS[0] += 1
        self._flush()
        seq = data.draw(st.sampled_from(sorted(self.model)))
        child = self.cache.fork(seq)
        self.model[child], self.adapter[child] = list(self.model[seq]), self.adapter[seq]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        STEPS[0] += 1
        self._flush()
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free(seq)
        del self.model[seq]

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def drop_page(self, data):
        STEPS[0] += 1
        self._flush()
        seq = data.draw(st.sampled_from(sorted(s for s, t in self.model.items() if t)))
        n = len(self.model[seq])
        i = data.draw(st.integers(0, (n - 1) // self.page_size))
        self.cache.drop_pages(seq, [i])
        del self.model[seq][i * self.page_size : (i + 1) * self.page_size]

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def compact(self, data):
        STEPS[0] += 1
        self._flush()
        seq = data.draw(st.sampled_from(sorted(s for s, t in self.model.items() if t)))
        keep = data.draw(st.lists(st.booleans(), min_size=len(self.model[seq]), max_size=len(self.model[seq])))
        try:
            self.cache.compact(seq, torch.tensor(keep, dtype=torch.bool))
        except pr.OutOfPagesError:
            return
        self.model[seq] = [t for t, k in zip(self.model[seq], keep) if k]

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def truncate(self, data):
        STEPS[0] += 1
        self._flush()
        seq = data.draw(st.sampled_from(sorted(s for s, t in self.model.items() if t)))
        n = data.draw(st.integers(0, len(self.model[seq])))
        try:
            self.cache.truncate(seq, n)
        except pr.OutOfPagesError:  # a shared last page needs a private copy and the pool is empty
            return
        del self.model[seq][len(self.model[seq]) - n :]

    @invariant()
    def allocator_consistent(self):
        self.cache.allocator.check()
        holders = Counter(p for s in self.model for p in self.cache.pages(s))
        for page, n in holders.items():  # a page is held by exactly as many sequences as its refcount
            assert self.cache.allocator.refcount(page) == n
        assert self.cache.allocator.num_free == self.cache.num_pages - len(holders)

    @invariant()
    def gather_matches_model(self):
        if self.lagging is not None:
            return  # checked after the write lands
        for seq, toks in self.model.items():
            assert self.cache.seq_len(seq) == len(toks)
            for layer in range(LAYERS):
                k, v = self.cache.gather(layer, seq)
                if toks:
                    tokens, positions = zip(*toks)
                    exp_k, exp_v = _expected_kv(tokens, positions, layer, self.adapter[seq])
                    assert torch.equal(k, exp_k) and torch.equal(v, exp_v)
                else:
                    assert k.shape == (0, H, D)

    @invariant()
    def slots_past_each_length_are_zero(self):
        """What a block-sparse kernel reads past a sequence's end (its last page's tail) is 0,
        unless the page is shared: then the tail holds another live sequence's tokens."""
        for seq in self.model:
            n, ps = self.cache.seq_len(seq), self.page_size
            if n % ps:
                page = self.cache.pages(seq)[n // ps]
                if self.cache.allocator.refcount(page) > 1:
                    continue
                for layer in range(LAYERS):
                    assert not self.cache.k_cache[layer][page, n % ps :].any()
                    assert not self.cache.v_cache[layer][page, n % ps :].any()

    @invariant()
    def free_pages_hold_no_stale_kv(self):
        """A page in the pool is all zeros unless it keeps a cached prefix for reuse."""
        free = [
            page
            for page in range(self.cache.num_pages)
            if self.cache.allocator.refcount(page) == 0 and page not in self.cache._page_hash
        ]
        for layer in range(LAYERS):
            assert not self.cache.k_cache[layer][free].any(), free
            assert not self.cache.v_cache[layer][free].any(), free

    def teardown(self):
        self._flush()
        for seq in list(self.model):
            self.cache.free(seq)
        assert self.cache.allocator.num_free == self.cache.num_pages
        self.cache.allocator.check()


STEPS = [0]  # rule calls across every run of the machine


def test_random_interleavings():
    """Four configurations; at least 10,000 cache operations in all, every invariant after each."""
    STEPS[0] = 0
    for page_size, growth, prefix_caching in [
        (1, "page", False),
        (2, "page", True),
        (3, "pow2", False),
        (4, "pow2", True),
    ]:
        machine = type("M", (CacheMachine,), dict(page_size=page_size, growth=growth, prefix_caching=prefix_caching))
        test = machine.TestCase
        test.settings = settings(
            max_examples=100,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            derandomize=True,
        )
        test("runTest").runTest()
    print(f"{STEPS[0]} cache operations")
    assert STEPS[0] >= 10_000, STEPS[0]
