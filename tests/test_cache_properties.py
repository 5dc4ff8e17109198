"""Model-based tests: random interleavings of every mutating operation against a plain model.

Three hypothesis state machines, derandomized in CI:

* `CacheMachine` drives a `PagedKVCache`: add (with namespaces), reserve one sequence or a
  batch (`reserve_batch`), write (sometimes lagging behind the next addition), fork, free,
  drop_pages, compact, truncate, a failed forward's rewind (`mark` / `rewind`) and bad calls.
  Each token's K/V is a function of (token id, position, layer, adapter), so a page reused
  through prefix caching must hold exactly what the new sequence would have written, and two
  adapters (namespaces) that shared a page would show up as a wrong gather.
* `LayeredMachine` drives a `LayeredKVCache` the same way, each layer with its own K/V, its own
  page drops and its own compaction mask.
* `SessionMachine` drives a `PagedSession` on the tiny model: batched extends (a forward that
  fails midway now and then), forks under eviction policies, finishes, namespaces, prefix
  caching; at the end of each run every sequence's K/V is compared with the plain model's.

After every step the allocator's invariants hold, every refcount equals its holders, every
sequence holds what the model says (one gather per K/V tensor for all sequences), and the slots
past each sequence's end and the free pages are zero. Every call that raises must leave the state
as it was: `cache_state.snapshot` before and after, compared.

``PAGED_REF_FUZZ_SCALE=N`` runs N times as many examples, not derandomized (a fresh search each
time), e.g. ``PAGED_REF_FUZZ_SCALE=20 pytest -s tests/test_cache_properties.py``.
"""

from __future__ import annotations

import copy
import functools
import os
import random
from collections import Counter

import torch
from cache_state import snapshot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import paged_ref as pr
from paged_ref.eviction import make_policy
from paged_ref.hf import PagedSession
from paged_ref.layered_cache import LayeredKVCache

H, D, LAYERS = 2, 3, 2

# None and "" are both "no namespace" ("" is passed as {}): their K/V are the same
ADAPTERS = (None, "", "a", "b")

SCALE = int(os.environ.get("PAGED_REF_FUZZ_SCALE", "1"))
OPS: Counter = Counter()  # (machine, operation) -> calls to the object under test, failed ones included
FAILED: Counter = Counter()  # (machine, operation) -> of those, the calls that raised (and changed nothing)


def report(machine: str) -> int:
    """Print a machine's operations, each with its failed calls; return how many ran."""
    ops = {op: n for (m, op), n in sorted(OPS.items()) if m == machine}
    print(f"\n{machine}: {sum(ops.values())} operations, {sum(FAILED[machine, op] for op in ops)} failed")
    print("  " + ", ".join(f"{op} {n} ({FAILED[machine, op]} failed)" for op, n in ops.items()))
    kinds = {op: n for (m, op), n in sorted(FAILED.items()) if m == machine and op not in ops}
    if kinds:
        print("  of the failures: " + ", ".join(f"{op} {n}" for op, n in kinds.items()))
    return sum(ops.values())


def _family(adapter) -> int:
    return 0 if adapter in (None, "") else ADAPTERS.index(adapter)


def _namespace(adapter):
    return None if adapter is None else {} if adapter == "" else {"adapter": adapter}


def token_kv(tokens, start, layer, adapter=None, positions=None):
    """K, V ``[n, H, D]`` of tokens at ``start, start + 1, ...`` (or at ``positions``)."""
    t = torch.as_tensor(tokens, dtype=torch.float32)[:, None, None]  # [n, 1, 1]
    if positions is None:
        positions = range(start, start + len(tokens))
    pos = torch.as_tensor(positions, dtype=torch.float32)[:, None, None]  # [n, 1, 1]
    grid = torch.arange(H * D, dtype=torch.float32).view(1, H, D)
    k = t * 1000 + pos + grid / 10 + layer * 7 + 100_000 * _family(adapter)  # [n, H, D]
    return k, -k * 3


@functools.lru_cache(maxsize=8192)
def _expected_kv(pairs: tuple, layer: int, family: int):
    """`token_kv` of a lane's (token, position) pairs, remembered: most lanes do not change
    between two checks of the invariants (read only)."""
    if not pairs:
        return torch.zeros(0, H, D), torch.zeros(0, H, D)
    tokens, positions = zip(*pairs)
    return token_kv(tokens, 0, layer, ADAPTERS[family], positions=positions)


def run(machine, *, examples: int, steps: int) -> None:
    test = machine.TestCase
    test.settings = settings(
        max_examples=examples * SCALE,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=SCALE == 1,
    )
    test("runTest").runTest()


# ------------------------------------------------------------------------------------ checks
def check_refcounts(allocator, page_lists) -> None:
    """Allocator invariants, and each page's refcount equal to the lists holding it."""
    allocator.check()
    holders = Counter(p for pages in page_lists for p in pages)
    assert {p: n for p, n in enumerate(allocator._refcount) if n} == holders
    assert allocator.num_free == allocator.num_pages - len(holders)


def page_lists(cache) -> dict:
    """(sequence, layer) -> its physical pages; layer None in a `PagedKVCache` (one table for all)."""
    if isinstance(cache, LayeredKVCache):
        return {(s, layer): cache.pages(s, layer) for s in cache.seq_ids for layer in range(cache.num_layers)}
    return {(s, None): cache.pages(s) for s in cache.seq_ids}


def check_copies(cache, before: dict) -> None:
    """``last_copies`` names exactly the logical pages whose physical page the call replaced."""
    after = page_lists(cache)
    replaced = {
        (s, layer, i, old, new)
        for (s, layer), pages in before.items()
        for i, (old, new) in enumerate(zip(pages, after.get((s, layer), [])))
        if old != new
    }
    assert {(c.seq_id, c.layer, c.logical_page, c.source, c.page) for c in cache.last_copies} == replaced


COPYING = {"reserve", "reserve_batch", "truncate", "compact"}  # the calls that report their copies


def check_contents(cache, k_tensors, v_tensors, lanes, ps) -> None:
    """``lanes``: ``(tensor index, pages, (token, position) pairs, layer, family)`` per lane.

    Each lane's slots hold its expected K/V; the slots past its end in an unshared last page and
    every free page not kept for prefix reuse are zero. One gather per tensor for all lanes.
    """
    flat, refcount = (-1, H, D), cache.allocator._refcount
    by_tensor: dict[int, list] = {}
    zero = []
    for t, pages, pairs, layer, family in lanes:
        n = len(pairs)
        by_tensor.setdefault(t, []).append(([pages[i // ps] * ps + i % ps for i in range(n)], pairs, layer, family))
        if n % ps and refcount[pages[n // ps]] == 1:
            zero += range(pages[n // ps] * ps + n % ps, (pages[n // ps] + 1) * ps)
    for t, group in by_tensor.items():
        idx = torch.tensor([s for slots, _, _, _ in group for s in slots], dtype=torch.long)
        exp = [_expected_kv(pairs, layer, family) for _, pairs, layer, family in group]
        assert torch.equal(k_tensors[t].view(flat)[idx], torch.cat([k for k, _ in exp]))
        assert torch.equal(v_tensors[t].view(flat)[idx], torch.cat([v for _, v in exp]))
    for page, n in enumerate(refcount):
        if n == 0 and page not in cache._prefix.key_of:
            zero += range(page * ps, (page + 1) * ps)
    if zero:
        idx = torch.tensor(zero, dtype=torch.long)
        for t in (*k_tensors, *v_tensors):
            assert not t.view(flat)[idx].any()


class Checked(RuleBasedStateMachine):
    """`attempt`: one call to the object under test; if it raises one of ``errors``, nothing
    may have changed (exactly, or with ``exact=False`` up to the order of free pages and ids)."""

    name = "machine"

    def state(self, exact: bool):
        return snapshot(self.cache, exact=exact)

    def count(self, op: str) -> None:
        OPS[self.name, op] += 1

    def attempt(self, op: str, call, errors=(pr.OutOfPagesError,), *, exact: bool = True):
        self.count(op)
        before, pages, copies = self.state(exact), page_lists(self.cache), self.cache.last_copies
        try:
            result = call()
        except errors:
            after = self.state(exact)
            assert after == before, after.diff(before)
            assert self.cache.last_copies == copies
            FAILED[self.name, op] += 1
            return False, None
        if op in COPYING:
            check_copies(self.cache, pages)
        return True, result

    def refused(self, op: str, call, errors=(ValueError, TypeError)) -> None:
        """A bad call: it must raise and change nothing."""
        ok, _ = self.attempt(op, call, errors)
        assert not ok, "a bad call was accepted"


def _pick(seqs, i):
    seqs = sorted(seqs)
    return seqs[i % len(seqs)]


# ------------------------------------------------------------------------------------ PagedKVCache
class CacheMachine(Checked):
    name = "PagedKVCache"
    page_size = 2
    growth = "page"
    prefix_caching = False
    page_summaries = False

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
            page_summaries=self.page_summaries,
        )
        self.model: dict[int, list[tuple[int, int]]] = {}  # seq -> [(token id, original position)]
        self.adapter: dict[int, str | None] = {}
        self.lagging: list = []  # [(seq, slots, tokens, start)]: reserved, not yet written

    def _write(self, seqs, token_lists, lag=False) -> bool:
        """Reserve (one sequence, or a batch) and write; False if the pool was short."""
        self._flush()
        starts = [self.cache.seq_len(s) for s in seqs]
        ids = token_lists if self.prefix_caching else None
        if len(seqs) == 1:
            ok, slots = self.attempt(
                "reserve", lambda: [self.cache.reserve(seqs[0], len(token_lists[0]), token_ids=token_lists[0])]
            )
        else:
            ok, slots = self.attempt(
                "reserve_batch", lambda: self.cache.reserve_batch(seqs, [len(t) for t in token_lists], ids)
            )
        if not ok:
            return False
        for seq, tokens, start, s in zip(seqs, token_lists, starts, slots):
            self.model[seq].extend(zip(tokens, range(start, start + len(tokens))))
            self.lagging.append((seq, s, tokens, start))
        if not lag:
            self._flush()
        return True

    def _flush(self, layers=range(LAYERS)):
        """Write the K/V of the last reservation (every rule but `add` does this first)."""
        for seq, slots, tokens, start in self.lagging:
            for layer in layers:
                self.cache.write(layer, slots, *token_kv(tokens, start, layer, self.adapter[seq]))
        self.lagging = []

    def _live(self, i, nonempty=False):
        return _pick([s for s, t in self.model.items() if t or not nonempty], i)

    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=9), adapter=st.sampled_from(ADAPTERS), lag=st.booleans()
    )
    def add(self, prompt, adapter, lag):
        # a lagging write from the previous step: this sequence may share the pages it fills
        # (published when reserved, as vLLM caches a block) and reads them once the write lands
        self.count("add")
        seq = self.cache.add_sequence(token_ids=prompt, namespace=_namespace(adapter))
        cached = self.cache.seq_len(seq)
        self.model[seq] = list(zip(prompt[:cached], range(cached)))
        self.adapter[seq] = adapter
        self._write([seq], [prompt[cached:]], lag=lag)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 63), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=7))
    def append(self, i, tokens):
        self._write([self._live(i)], [tokens])

    @precondition(lambda self: self.cache.allocator.num_free > 2)
    @rule(leave=st.integers(0, 2), token=st.integers(0, 2))
    def fill(self, leave, token):
        """A new sequence takes all but ``leave`` free pages: the next calls run at the edge."""
        self._flush()
        n = (self.cache.allocator.num_free - leave) * self.page_size
        if n > 0:
            self.count("add")
            seq = self.cache.add_sequence()
            self.model[seq], self.adapter[seq] = [], None
            self._write([seq], [[token] * n])

    @precondition(lambda self: len(self.model) >= 2)
    @rule(
        i=st.integers(0, 63),
        j=st.integers(1, 63),
        a=st.lists(st.integers(0, 2), min_size=1, max_size=7),
        b=st.lists(st.integers(0, 2), min_size=1, max_size=7),
    )
    def append_batch(self, i, j, a, b):
        seqs = sorted(self.model)
        first, second = seqs[i % len(seqs)], seqs[(i + j) % len(seqs)]
        if first != second:
            self._write([first, second], [a, b])

    @precondition(lambda self: len(self.model) >= 1)
    @rule(i=st.integers(0, 63), j=st.integers(0, 63), a=st.integers(1, 7), b=st.integers(1, 7))
    def failed_forward(self, i, j, a, b):
        """A batch reserved, layer 0 written, then the forward fails: the rollback a session does."""
        self._flush()
        seqs = sorted({self._live(i), self._live(j)})
        before, kept = snapshot(self.cache, exact=False), set(self.cache.allocator._cached)
        marks = [self.cache.mark(s) for s in seqs]
        tokens = [[(t + k) % 3 for t in range(n)] for k, n in enumerate((a, b)[: len(seqs)])]
        ids = tokens if self.prefix_caching else None
        ok, slots = self.attempt("reserve_batch", lambda: self.cache.reserve_batch(seqs, [len(t) for t in tokens], ids))
        if not ok:
            return
        recycled = kept - set(self.cache.allocator._cached)  # prefix pages the reservation took
        for seq, s, t in zip(seqs, slots, tokens):
            start = len(self.model[seq])
            self.cache.write(0, s, *token_kv(t, start, 0, self.adapter[seq]))
        self.count("rewind")
        for seq, mark in reversed(list(zip(seqs, marks))):
            self.cache.rewind(seq, mark)
        assert self.cache.last_copies == ()
        after, before = snapshot(self.cache, exact=False), before.without_prefix_pages(recycled)
        assert after == before, after.diff(before)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 63))
    def fork(self, i):
        self.count("fork")
        self._flush()
        seq = self._live(i)
        child = self.cache.fork(seq)
        self.model[child], self.adapter[child] = list(self.model[seq]), self.adapter[seq]

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 63))
    def free(self, i):
        self.count("free")
        self._flush()
        seq = self._live(i)
        self.cache.free(seq)
        del self.model[seq]

    @precondition(lambda self: any(self.model.values()))
    @rule(i=st.integers(0, 63), page=st.integers(0, 63))
    def drop_page(self, i, page):
        self.count("drop_page")
        self._flush()
        seq = self._live(i, nonempty=True)
        page %= pr.pages_needed(len(self.model[seq]), self.page_size)
        self.cache.drop_pages(seq, [page])
        del self.model[seq][page * self.page_size : (page + 1) * self.page_size]

    @precondition(lambda self: any(self.model.values()))
    @rule(i=st.integers(0, 63), bits=st.integers(0, 2**40 - 1))
    def compact(self, i, bits):
        self._flush()
        seq = self._live(i, nonempty=True)
        keep = [bool(bits >> t & 1) for t in range(len(self.model[seq]))]
        ok, _ = self.attempt("compact", lambda: self.cache.compact(seq, torch.tensor(keep, dtype=torch.bool)))
        if ok:
            self.model[seq] = [t for t, k in zip(self.model[seq], keep) if k]

    @precondition(lambda self: any(self.model.values()))
    @rule(i=st.integers(0, 63), n=st.integers(0, 63))
    def truncate(self, i, n):
        self._flush()
        seq = self._live(i, nonempty=True)
        n %= len(self.model[seq]) + 1
        ok, _ = self.attempt("truncate", lambda: self.cache.truncate(seq, n))  # a shared last page needs a copy
        if ok:
            del self.model[seq][len(self.model[seq]) - n :]

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 63), kind=st.integers(0, 10))
    def bad_call(self, i, kind):
        self._flush()
        c, seq = self.cache, self._live(i)
        n, held = c.seq_len(seq), pr.pages_needed(c.seq_len(seq), self.page_size)
        calls = [
            lambda: c.reserve(seq, 0),
            lambda: c.truncate(seq, n + 1),
            lambda: c.drop_pages(seq, [held]),
            lambda: c.compact(seq, torch.ones(n + 1, dtype=torch.bool)),
            lambda: c.fork(max(self.model) + 1),
            lambda: c.reserve_batch([seq, seq], [1, 1]),
            lambda: c.reserve_batch([seq], [2], token_ids=[[1]]),
            lambda: c.drop_pages(seq, 0),
            lambda: c.add_sequence(token_ids=5),
            lambda: c.add_sequence(namespace="adapter"),
            lambda: c.write(LAYERS, torch.tensor([0]), torch.zeros(1, H, D), torch.zeros(1, H, D)),
        ]
        self.refused("bad_call", calls[kind])

    @invariant()
    def consistent(self):
        c = self.cache
        check_refcounts(c.allocator, [c.pages(s) for s in self.model])
        if self.lagging:  # K/V checked after the write lands
            return
        lanes = []
        for s, pairs in self.model.items():
            assert c.seq_len(s) == len(pairs)
            for layer in range(LAYERS):
                lanes.append((layer, c.pages(s), tuple(pairs), layer, _family(self.adapter[s])))
        check_contents(c, c.k_cache, c.v_cache, lanes, self.page_size)

    def teardown(self):
        self._flush()
        for seq in list(self.model):
            self.cache.free(seq)
        assert self.cache.allocator.num_free == self.cache.num_pages
        self.cache.allocator.check()


def test_paged_cache_interleavings():
    """Four configurations of `PagedKVCache`; every invariant after each operation."""
    for page_size, growth, prefix_caching in [
        (1, "page", False),
        (2, "page", True),
        (3, "pow2", False),
        (4, "pow2", True),
    ]:
        machine = type("M", (CacheMachine,), dict(page_size=page_size, growth=growth, prefix_caching=prefix_caching))
        run(machine, examples=65, steps=50)
    ops = report(CacheMachine.name)
    assert ops >= 12_500, ops  # a longer run (PAGED_REF_FUZZ_SCALE) reports its own count
    for op in ("reserve", "reserve_batch", "compact", "truncate", "bad_call"):  # each failure was reached
        assert FAILED[CacheMachine.name, op] > 0, op


class UndoMachine(CacheMachine):
    """`CacheMachine` with prefix caching and page summaries, plus a serving step's checkpoint held open across
    rules (then rolled back, the cache exactly as it was, or committed), a rewind inside one to a mark taken
    before it, and reservations whose sequence lets the tokens go before the forward has written them all."""

    name = "PagedKVCache undo"
    prefix_caching = True
    page_summaries = True

    def __init__(self):
        super().__init__()
        self.saved = None  # while a checkpoint is open: (cache snapshot, model, adapters) when it was opened

    @rule(end=st.sampled_from(["rollback", "commit"]))
    def step(self, end):
        """Open a checkpoint, or end the open one."""
        self._flush()
        if self.saved is None:
            self.count("checkpoint")
            self.cache.checkpoint()
            self.saved = (snapshot(self.cache), copy.deepcopy(self.model), dict(self.adapter))
            return
        self.count(end)
        getattr(self.cache, end)()
        if end == "rollback":
            before, self.model, self.adapter = self.saved
            after = snapshot(self.cache)
            assert after == before, after.diff(before)
        self.saved = None

    @precondition(lambda self: self.model and self.saved is None)
    @rule(i=st.integers(0, 63), a=st.integers(1, 5), b=st.integers(1, 5))
    def rewind_across_checkpoint(self, i, a, b):
        """mark; reserve and write; checkpoint; more reserved and written, then rewound to the first mark;
        rolled back: as at the checkpoint."""
        self._flush()
        seq = self._live(i)
        mark = self.cache.mark(seq)
        if not self._write([seq], [[1] * a]):
            return
        self.cache.checkpoint()
        before, n = snapshot(self.cache), len(self.model[seq])
        self._write([seq], [[2] * b])
        self.count("rewind across a checkpoint")
        self.cache.rewind(seq, mark)
        self.cache.rollback()
        del self.model[seq][n:]
        assert snapshot(self.cache) == before, snapshot(self.cache).diff(before)

    @precondition(lambda self: self.model)
    @rule(
        i=st.integers(0, 63),
        tokens=st.lists(st.integers(0, 2), min_size=1, max_size=7),
        layers=st.integers(0, LAYERS - 1),
        leave=st.sampled_from(["free", "truncate", "drop_pages", "compact"]),
    )
    def abandon(self, i, tokens, layers, leave):
        """Tokens reserved (their full pages published), ``layers`` layers written, then let go."""
        self._flush()
        seq = self._live(i)
        start = self.cache.seq_len(seq)
        ok, slots = self.attempt("reserve", lambda: self.cache.reserve(seq, len(tokens), token_ids=tokens))
        if not ok:
            return
        for layer in range(layers):
            self.cache.write(layer, slots, *token_kv(tokens, start, layer, self.adapter[seq]))
        self.count(f"abandon: {leave}")
        held = pr.pages_needed(start + len(tokens), self.page_size)
        if leave == "free":
            self.cache.free(seq)
            del self.model[seq]
        elif leave == "truncate":  # the pages the tokens filled were copied or new: nothing to copy
            self.cache.truncate(seq, len(tokens))
        elif leave == "drop_pages":  # every page the new tokens touched
            first = start // self.page_size
            self.cache.drop_pages(seq, range(first, held))
            del self.model[seq][first * self.page_size :]
        else:  # none kept: nothing to copy
            self.cache.compact(seq, torch.zeros(start + len(tokens), dtype=torch.bool))
            self.model[seq] = []

    @invariant()
    def summaries_bound_the_keys_and_unwritten_pages_have_a_holder(self):
        c = self.cache
        assert all(c.allocator.refcount(p) > 0 for p in c._prefix.unwritten), c._prefix.unwritten
        if self.lagging:
            return
        for s, pairs in self.model.items():
            index = torch.tensor([c.pages(s)[t // self.page_size] for t in range(len(pairs))], dtype=torch.long)
            for layer in range(LAYERS):
                k = c.gather(layer, s)[0]
                assert bool(
                    (c.summaries.k_min[layer][index] <= k).all() and (k <= c.summaries.k_max[layer][index]).all()
                )

    def teardown(self):
        if self.saved is not None:
            self.cache.commit()
        super().teardown()


def test_paged_cache_undo_interleavings():
    """`UndoMachine` with page sizes 1, 2 and 3."""
    for page_size, growth in [(1, "page"), (2, "pow2"), (3, "page")]:
        run(type("U", (UndoMachine,), dict(page_size=page_size, growth=growth)), examples=30, steps=40)
    ops = report(UndoMachine.name)
    assert ops >= 3_000, ops
    for op in ("rollback", "commit", "rewind across a checkpoint", "abandon: free", "abandon: truncate"):
        assert OPS[UndoMachine.name, op] > 0, op


# ------------------------------------------------------------------------------------ LayeredKVCache
LAYERED = 3


class LayeredMachine(Checked):
    name = "LayeredKVCache"
    page_size = 2

    def __init__(self):
        super().__init__()
        self.cache = LayeredKVCache(
            num_layers=LAYERED, num_pages=8, page_size=self.page_size, num_kv_heads=H, head_dim=D
        )
        self.model: dict[int, list[list[tuple[int, int]]]] = {}  # seq -> per layer [(token, position)]

    def _live(self, i, nonempty=False):
        return _pick([s for s, t in self.model.items() if t[0] or not nonempty], i)

    def _write(self, seqs, token_lists) -> bool:
        starts = [self.cache.seq_len(s) for s in seqs]
        if len(seqs) == 1:
            ok, slots = self.attempt("reserve", lambda: [self.cache.reserve(seqs[0], len(token_lists[0]))])
        else:
            ok, slots = self.attempt(
                "reserve_batch", lambda: self.cache.reserve_batch(seqs, [len(t) for t in token_lists])
            )
        if not ok:
            return False
        for seq, tokens, start, s in zip(seqs, token_lists, starts, slots):  # s: [LAYERED, n]
            for layer in range(LAYERED):
                self.cache.write(layer, s[layer], *token_kv(tokens, start, layer))
                self.model[seq][layer].extend(zip(tokens, range(start, start + len(tokens))))
        return True

    @rule(prompt=st.lists(st.integers(0, 2), min_size=0, max_size=9))
    def add(self, prompt):
        self.count("add")
        seq = self.cache.add_sequence()
        self.model[seq] = [[] for _ in range(LAYERED)]
        if prompt:
            self._write([seq], [prompt])

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 63), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=7))
    def append(self, i, tokens):
        self._write([self._live(i)], [tokens])

    @precondition(lambda self: self.cache.allocator.num_free > 2 + LAYERED)
    @rule(leave=st.integers(0, 2), token=st.integers(0, 2))
    def fill(self, leave, token):
        """A new sequence takes all but about ``leave`` free layer pages."""
        n = (self.cache.allocator.num_free - leave) // LAYERED * self.page_size
        if n > 0:
            self.count("add")
            seq = self.cache.add_sequence()
            self.model[seq] = [[] for _ in range(LAYERED)]
            self._write([seq], [[token] * n])

    @precondition(lambda self: len(self.model) >= 2)
    @rule(
        i=st.integers(0, 63),
        j=st.integers(1, 63),
        a=st.lists(st.integers(0, 2), min_size=1, max_size=5),
        b=st.lists(st.integers(0, 2), min_size=1, max_size=5),
    )
    def append_batch(self, i, j, a, b):
        seqs = sorted(self.model)
        first, second = seqs[i % len(seqs)], seqs[(i + j) % len(seqs)]
        if first != second:
            self._write([first, second], [a, b])

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 63), j=st.integers(0, 63), a=st.integers(1, 5), b=st.integers(1, 5))
    def failed_forward(self, i, j, a, b):
        seqs = sorted({self._live(i), self._live(j)})
        before = snapshot(self.cache, exact=False)
        marks = [self.cache.mark(s) for s in seqs]
        ok, slots = self.attempt("reserve_batch", lambda: self.cache.reserve_batch(seqs, [a, b][: len(seqs)]))
        if not ok:
            return
        for seq, s in zip(seqs, slots):  # the forward reached layer 1 only
            start = self.cache.seq_len(seq) - s.shape[1]
            self.cache.write(0, s[0], *token_kv([1] * s.shape[1], start, 0))
            self.cache.write(1, s[1], *token_kv([2] * s.shape[1], start, 1))
        self.count("rewind")
        for seq, mark in reversed(list(zip(seqs, marks))):
            self.cache.rewind(seq, mark)
        after = snapshot(self.cache, exact=False)
        assert after == before, after.diff(before)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 63))
    def fork(self, i):
        self.count("fork")
        seq = self._live(i)
        child = self.cache.fork(seq)
        self.model[child] = [list(lane) for lane in self.model[seq]]

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 63))
    def free(self, i):
        self.count("free")
        seq = self._live(i)
        self.cache.free(seq)
        del self.model[seq]

    @precondition(lambda self: any(t[0] for t in self.model.values()))
    @rule(
        i=st.integers(0, 63), same=st.booleans(), pages=st.lists(st.integers(0, 63), min_size=LAYERED, max_size=LAYERED)
    )
    def drop_pages(self, i, same, pages):
        """The same page in every layer (it may be the partial last one), or a full page each."""
        seq = self._live(i, nonempty=True)
        n, ps = self.cache.seq_len(seq), self.page_size
        if same or n < ps:
            pages = [pages[0] % pr.pages_needed(n, ps)] * LAYERED
        else:
            pages = [p % (n // ps) for p in pages]
        self.count("drop_pages")
        self.cache.drop_pages(seq, pages)
        for lane, page in zip(self.model[seq], pages):
            del lane[page * ps : (page + 1) * ps]

    @precondition(lambda self: any(t[0] for t in self.model.values()))
    @rule(i=st.integers(0, 63), kept=st.integers(0, 63), seed=st.integers(0, 2**16))
    def compact(self, i, kept, seed):
        """Each layer keeps its own ``kept`` tokens."""
        seq = self._live(i, nonempty=True)
        n = self.cache.seq_len(seq)
        kept %= n + 1
        rows = [sorted(random.Random(seed + layer).sample(range(n), kept)) for layer in range(LAYERED)]
        keep = torch.zeros(LAYERED, n, dtype=torch.bool)
        for layer, row in enumerate(rows):
            keep[layer, row] = True
        ok, _ = self.attempt("compact", lambda: self.cache.compact(seq, keep))
        if ok:
            self.model[seq] = [[lane[t] for t in row] for lane, row in zip(self.model[seq], rows)]

    @precondition(lambda self: any(t[0] for t in self.model.values()))
    @rule(i=st.integers(0, 63), n=st.integers(0, 63))
    def truncate(self, i, n):
        seq = self._live(i, nonempty=True)
        n %= self.cache.seq_len(seq) + 1
        ok, _ = self.attempt("truncate", lambda: self.cache.truncate(seq, n))
        if ok:
            for lane in self.model[seq]:
                del lane[len(lane) - n :]

    @precondition(lambda self: any(t[0] for t in self.model.values()))
    @rule(i=st.integers(0, 63), kind=st.integers(0, 8))
    def bad_call(self, i, kind):
        c, seq = self.cache, self._live(i, nonempty=True)
        n, ps = c.seq_len(seq), self.page_size
        held = pr.pages_needed(n, ps)
        uneven = torch.zeros(LAYERED, n, dtype=torch.bool)
        uneven[0, 0] = True
        calls = [
            lambda: c.reserve(seq, 0),
            lambda: c.truncate(seq, n + 1),
            lambda: c.drop_pages(seq, [held] * LAYERED),
            lambda: c.drop_pages(seq, [0] * (LAYERED - 1)),
            lambda: c.compact(seq, uneven),  # layer 0 keeps one token, the others none
            lambda: c.compact(seq, torch.ones(n, dtype=torch.bool)),
            lambda: c.drop_pages(seq, 0),
            lambda: c.add_sequence(namespace="adapter"),
            lambda: c.gather(LAYERED, seq),
        ]
        self.refused("bad_call", calls[kind])

    @invariant()
    def consistent(self):
        c = self.cache
        check_refcounts(c.allocator, [c.pages(s, layer) for s in self.model for layer in range(LAYERED)])
        lanes = []
        for s, per_layer in self.model.items():
            assert c.seq_len(s) == len(per_layer[0])
            for layer, pairs in enumerate(per_layer):
                assert len(pairs) == len(per_layer[0])  # every layer holds as many tokens
                lanes.append((0, c.pages(s, layer), tuple(pairs), layer, 0))
        check_contents(c.pool, c.pool.k_cache, c.pool.v_cache, lanes, self.page_size)

    def teardown(self):
        for seq in list(self.model):
            self.cache.free(seq)
        assert self.cache.allocator.num_free == self.cache.allocator.num_pages


def test_layered_cache_interleavings():
    """`LayeredKVCache` with page sizes 1, 2 and 3: per-layer tables, drops and compaction."""
    for page_size in (1, 2, 3):
        run(type("L", (LayeredMachine,), dict(page_size=page_size)), examples=55, steps=50)
    ops = report(LayeredMachine.name)
    assert ops >= 7_000, ops
    for op in ("reserve", "reserve_batch", "compact", "truncate", "bad_call"):
        assert FAILED[LayeredMachine.name, op] > 0, op


# ------------------------------------------------------------------------------------ PagedSession
class SessionMachine(Checked):
    """A `PagedSession` on the tiny model over a small pool: every extend is one forward for a
    batch; the cache's K/V are compared with the plain model's at the end of each run."""

    name = "PagedSession"
    layered = False
    model_ = None  # the tiny model, loaded once per test

    def __init__(self):
        super().__init__()
        self.kv_ = (
            LayeredKVCache.for_model(self.model_, num_pages=7, page_size=4)
            if self.layered
            else pr.PagedKVCache.for_model(self.model_, num_pages=14, page_size=4, prefix_caching=True)
        )
        self.session = PagedSession(self.model_, kv_cache=self.kv_, backend="sdpa").open()
        decision = "per_layer" if self.layered else "shared"
        self.policies = [
            None,
            make_policy("token_topk", 8, decision=decision),
            make_policy("paged_eviction", 12, decision=decision),
        ]
        if not self.layered:
            self.policies.append(make_policy("streaming_llm", 8))
        self.lanes = self.kv_.num_layers if self.layered else 1  # block tables per sequence
        self.history: dict[int, list[int]] = {}  # seq -> every token fed (the position's worth)
        self.space: dict[int, int] = {}  # seq -> its namespace's family (forks inherit it)
        # seq -> per lane, the index in its history of each token it holds, in cache order
        self.origin: dict[int, list[list[int]]] = {}
        # seq with a policy -> per lane, the history index of each token its policy has seen
        self.seen: dict[int, list[list[int]]] = {}
        # seqs some of whose tokens were computed after an eviction: from layer 1 on, their K/V
        # saw less context than the plain model's (layer 0's K/V depend on the token alone)
        self.evicted: set[int] = set()

    @property
    def cache(self):
        return self.kv_

    def state(self, exact):
        return snapshot(self.kv_, exact=exact), dict(self.session._positions), dict(self.session._held)

    def _live(self, i):
        return _pick(self.history, i)

    def _extend(self, seqs, tokens, fail=False) -> None:
        """One forward; a failure before or in it changes nothing, one in a policy hook leaves
        every sequence fed (checked by the invariants)."""
        kv, session = self.kv_, self.session
        before, kept = self.state(exact=not fail), set(kv.allocator._cached)
        short = [s for s in seqs if kv.seq_len(s) < session.position(s)]
        hook = self.model_.model.layers[1].register_forward_pre_hook(_fail) if fail else None
        self.count("extend")
        try:
            session.extend(seqs, [torch.tensor(t) for t in tokens])
        except (pr.OutOfPagesError, RuntimeError) as e:
            FAILED[self.name, "extend"] += 1
            if session.position(seqs[0]) == before[1][seqs[0]]:  # nothing fed: as it was
                after = self.state(exact=not fail)
                recycled = kept - set(kv.allocator._cached)
                expected = (before[0].without_prefix_pages(recycled), *before[1:])
                assert after == expected, after[0].diff(expected[0])
                assert isinstance(e, pr.OutOfPagesError) or fail, e
                kind = "pool short" if isinstance(e, pr.OutOfPagesError) else "forward failed"
                FAILED[self.name, f"extend: {kind}"] += 1
                return
            assert isinstance(e, pr.OutOfPagesError) and not fail, e  # a policy's compaction ran short
            FAILED[self.name, "extend: fed, then a policy ran short"] += 1
        finally:
            if hook is not None:
                hook.remove()
        self.evicted.update(short)
        for s, t in zip(seqs, tokens):
            start = len(self.history[s])
            self.history[s].extend(t)
            self._held(s, list(range(start, start + len(t))))

    def _held(self, s, new, first=None) -> None:
        """Follow which tokens ``s`` holds: ``new`` history indices appended (or, with ``first``,
        its first lanes), then whatever its policy kept."""
        policy = self.session._policies[s]
        track = self.origin if policy is None else self.seen
        if first is not None:
            track[s] = [list(lane) for lane in first]
        for lane in track[s]:
            lane.extend(new)
        if policy is not None:
            pos = policy._positions[s]  # int64 [lanes, seq_len]: indices among the tokens it saw
            self.origin[s] = [[seen[p] for p in row.tolist()] for seen, row in zip(self.seen[s], pos)]

    @precondition(lambda self: len(self.history) < 6)
    @rule(
        prompt=st.lists(st.integers(3, 40), min_size=0, max_size=10),
        policy=st.integers(0, 3),
        space=st.sampled_from(ADAPTERS),
    )
    def add(self, prompt, policy, space):
        """A prompt given to `add` is matched against the prefix cache, and its rest fed."""
        self.count("add")
        policy = self.policies[policy % len(self.policies)]
        s = self.session.add(prompt or None, eviction=policy, namespace=_namespace(space))
        self.history[s], self.space[s] = list(prompt[: self.session.position(s)]), _family(space)
        hits = list(range(self.session.position(s)))
        self.origin[s] = [list(hits) for _ in range(self.lanes)]
        if policy is not None:
            self.seen[s] = [list(hits) for _ in range(self.lanes)]
        if len(prompt) > self.session.position(s):
            self._extend([s], [prompt[self.session.position(s) :]])

    @precondition(lambda self: self.history)
    @rule(picks=st.lists(st.integers(0, 63), min_size=1, max_size=3), n=st.integers(1, 6), fail=st.integers(0, 9))
    def extend(self, picks, n, fail):
        """A batch, each row at most what its policy allows; one time in ten the forward fails."""
        seqs = sorted({self._live(i) for i in picks})
        tokens = []
        for k, s in enumerate(seqs):
            policy = self.session._policies[s]
            m = n if policy is None or s not in self.session._held else min(n, policy.tokens_until_action(self.kv_, s))
            tokens.append([3 + (7 * k + t + len(self.history[s])) % 37 for t in range(m)])
        self._extend(seqs, tokens, fail=fail == 0)

    @precondition(lambda self: self.history and len(self.history) < 6)
    @rule(i=st.integers(0, 63), policy=st.integers(0, 3))
    def fork(self, i, policy):
        """The fork's policy evicts it at once (its prompt); if that runs short, no fork is left."""
        s = self._live(i)
        policy = self.policies[policy % len(self.policies)]
        ok, child = self.attempt("fork", lambda: self.session.fork(s, eviction=policy), exact=False)
        if ok:
            self.history[child], self.space[child] = list(self.history[s]), self.space[s]
            if s in self.evicted:
                self.evicted.add(child)
            if policy is None:
                self.origin[child] = [list(lane) for lane in self.origin[s]]
            else:
                self._held(child, [], first=self.origin[s])

    @precondition(lambda self: self.history)
    @rule(i=st.integers(0, 63))
    def finish(self, i):
        self.count("finish")
        s = self._live(i)
        self.session.finish(s)
        del self.history[s], self.space[s], self.origin[s]
        self.seen.pop(s, None)
        self.evicted.discard(s)

    @precondition(lambda self: self.history)
    @rule(i=st.integers(0, 63), kind=st.integers(0, 4))
    def bad_call(self, i, kind):
        s, session = self._live(i), self.session
        calls = [
            lambda: session.extend([s], [torch.tensor([1, 10**6])]),
            lambda: session.extend([s, s], [torch.tensor([1]), torch.tensor([2])]),
            lambda: session.extend(s, [torch.tensor([1])]),
            lambda: session.add(namespace="adapter"),
            lambda: session.add(5),
        ]
        self.refused("bad_call", calls[kind])

    @invariant()
    def consistent(self):
        kv, session = self.kv_, self.session
        lanes = [(s, layer) for s in self.history for layer in range(kv.num_layers if self.layered else 1)]
        pages = {lane: kv.pages(*lane) if self.layered else kv.pages(lane[0]) for lane in lanes}
        check_refcounts(kv.allocator, pages.values())
        owners = {}
        for (s, _), held in pages.items():  # a page is shared only within one namespace
            for p in held:
                assert owners.setdefault(p, self.space[s]) == self.space[s], (p, s)
        for s, tokens in self.history.items():
            assert session.position(s) == len(tokens) >= kv.seq_len(s)
            assert all(len(lane) == kv.seq_len(s) for lane in self.origin[s])
            if self.layered:
                assert all(int(kv.block_table([s], layer=i)[1][0]) == kv.seq_len(s) for i in range(kv.num_layers))
        pool = kv.pool if self.layered else kv
        ps = kv.page_size
        zero = []
        refcount = kv.allocator._refcount
        for (s, _), held in pages.items():
            n = kv.seq_len(s)
            if n % ps and refcount[held[n // ps]] == 1:
                zero += range(held[n // ps] * ps + n % ps, (held[n // ps] + 1) * ps)
        zero += [
            p * ps + o for p, n in enumerate(refcount) if n == 0 and p not in pool._prefix.key_of for o in range(ps)
        ]
        if zero:
            idx = torch.tensor(zero, dtype=torch.long)
            for t in (*pool.k_cache, *pool.v_cache):
                assert not t.view(-1, *t.shape[2:])[idx].any()

    def teardown(self):
        """Every sequence's K/V against the plain model's over its whole history, at the tokens
        it holds (only layer 0 where tokens were computed after an eviction), then all freed."""
        from transformers import DynamicCache

        from paged_ref.hf.session import cache_keyword

        kv, session = self.kv_, self.session
        for s, tokens in self.history.items():
            if not tokens:
                continue
            with torch.inference_mode():
                plain = DynamicCache(config=self.model_.config)
                self.model_(input_ids=torch.tensor([tokens]), use_cache=True, **{cache_keyword(self.model_): plain})
            for layer in range(1 if s in self.evicted else kv.num_layers):
                kept = torch.tensor(self.origin[s][layer if self.layered else 0], dtype=torch.long)
                k, v = kv.gather(layer, s)
                want_k = plain.layers[layer].keys[0].transpose(0, 1)[kept]  # [seq_len, Hkv, D]
                want_v = plain.layers[layer].values[0].transpose(0, 1)[kept]
                torch.testing.assert_close(k, want_k, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(v, want_v, atol=1e-4, rtol=1e-4)
        session.close()
        assert kv.allocator.num_free == kv.allocator.num_pages


def _fail(module, args):
    raise RuntimeError("the forward fails at layer 1")


def test_session_interleavings():
    """A `PagedSession` with prefix caching and shared eviction, and one on a `LayeredKVCache`
    with per-layer eviction."""
    from paged_ref.models import tiny_llama

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_llama(seed=0)
        for layered in (False, True):
            run(type("S", (SessionMachine,), dict(layered=layered, model_=model)), examples=22, steps=30)
    finally:
        torch.set_num_threads(threads)
    ops = report(SessionMachine.name)
    assert ops >= 1_400, ops
    for op in ("extend: pool short", "extend: forward failed", "fork", "bad_call"):
        assert FAILED[SessionMachine.name, op] > 0, op
