"""Model-based test: random interleavings of cache operations against a plain contiguous model.

Each token's K/V is a deterministic function of (token id, position, layer), so a page reused
through prefix caching must hold exactly what the new sequence would have written.
"""

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import paged_ref as pr

H, D, LAYERS = 2, 3, 2


def token_kv(tokens, start, layer):
    t = torch.as_tensor(tokens, dtype=torch.float32)[:, None, None]  # [n, 1, 1]
    pos = torch.arange(start, start + len(tokens), dtype=torch.float32)[:, None, None]
    grid = torch.arange(H * D, dtype=torch.float32).view(1, H, D)
    k = t * 1000 + pos + grid / 10 + layer * 7  # [n, H, D]
    return k, -k * 3


class CacheMachine(RuleBasedStateMachine):
    page_size = 2
    growth = "page"
    prefix_caching = False

    def __init__(self):
        super().__init__()
        self.cache = pr.PagedKVCache(num_layers=LAYERS, num_pages=24, page_size=self.page_size,
                                     num_kv_heads=H, head_dim=D, growth=self.growth,
                                     prefix_caching=self.prefix_caching)
        self.model: dict[int, list[tuple[int, int]]] = {}  # seq -> [(token id, original position)]

    def _write(self, seq, tokens):
        start = self.cache.seq_len(seq)
        positions = range(start, start + len(tokens))
        try:
            slots = self.cache.reserve(seq, len(tokens), token_ids=tokens)
        except pr.OutOfPagesError:
            return
        for layer in range(LAYERS):
            self.cache.write(layer, slots, *token_kv(tokens, start, layer))
        self.model[seq].extend(zip(tokens, positions))

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def add(self, prompt):
        seq = self.cache.add_sequence(token_ids=prompt)
        cached = self.cache.seq_len(seq)
        self.model[seq] = list(zip(prompt[:cached], range(cached)))
        self._write(seq, prompt[cached:])

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=7))
    def append(self, data, tokens):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self._write(seq, tokens)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self.model[self.cache.fork(seq)] = list(self.model[seq])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free(seq)
        del self.model[seq]

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def drop_page(self, data):
        seq = data.draw(st.sampled_from(sorted(s for s, t in self.model.items() if t)))
        n = len(self.model[seq])
        i = data.draw(st.integers(0, (n - 1) // self.page_size))
        self.cache.drop_pages(seq, [i])
        del self.model[seq][i * self.page_size : (i + 1) * self.page_size]

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def compact(self, data):
        seq = data.draw(st.sampled_from(sorted(s for s, t in self.model.items() if t)))
        keep = data.draw(st.lists(st.booleans(), min_size=len(self.model[seq]), max_size=len(self.model[seq])))
        try:
            self.cache.compact(seq, torch.tensor(keep, dtype=torch.bool))
        except pr.OutOfPagesError:
            return
        self.model[seq] = [t for t, k in zip(self.model[seq], keep) if k]

    @invariant()
    def allocator_consistent(self):
        self.cache.allocator.check()
        holders = Counter(p for s in self.model for p in self.cache.pages(s))
        for page, n in holders.items():  # a page is held by exactly as many sequences as its refcount
            assert self.cache.allocator.refcount(page) == n
        assert self.cache.allocator.num_free == self.cache.num_pages - len(holders)

    @invariant()
    def gather_matches_model(self):
        for seq, toks in self.model.items():
            assert self.cache.seq_len(seq) == len(toks)
            for layer in range(LAYERS):
                k, v = self.cache.gather(layer, seq)
                if toks:
                    exp = [token_kv([t], p, layer) for t, p in toks]
                    assert torch.equal(k, torch.cat([e[0] for e in exp]))
                    assert torch.equal(v, torch.cat([e[1] for e in exp]))
                else:
                    assert k.shape == (0, H, D)

    def teardown(self):
        for seq in list(self.model):
            self.cache.free(seq)
        assert self.cache.allocator.num_free == self.cache.num_pages
        self.cache.allocator.check()


@pytest.mark.parametrize(
    "page_size, growth, prefix_caching",
    [(1, "page", False), (2, "page", True), (3, "pow2", False), (4, "pow2", True)],
)
def test_random_interleavings(page_size, growth, prefix_caching):
    machine = type("M", (CacheMachine,), dict(page_size=page_size, growth=growth, prefix_caching=prefix_caching))
    test = machine.TestCase
    test.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                             suppress_health_check=list(HealthCheck))
    test("runTest").runTest()
