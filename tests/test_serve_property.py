"""A randomized property test of the serving engine, with faults injected (issue 48).

Random workloads (prompts, shared prefixes, lengths, arrival times, eviction policies) on random
engines (pool, page size, batch limits, every reservation, preemption, prefix caching and
watermark setting), with faults injected at the forward (before, half way through or after its
reserves and writes), in each eviction hook (before or after it acted) and in the allocator.
Properties: every request accepted gets exactly the tokens it gets alone (a request finished
with ``"error"`` after its hook kept failing: a prefix of them); a failed step changes nothing;
the pool's invariants hold after every step and every page is free at the end; the engine never
stalls (no "planned no tokens", and a bounded number of steps).

The model is a toy (`ToySession`, a `DrySession` whose K/V hold each token's id and position and
whose next token is a hash of the K/V a sequence holds, in order): a token fed twice, skipped, fed
at the wrong position, evicted differently or left over from a failed step changes every later
token, as with a real model, at a fraction of its cost. "Alone" is that session fed the prompt in
one forward, its policy's ``after_prefill``, then one token per forward (what
`paged_ref.hf.generate` does).

``PAGED_REF_PROPERTY_SCALE=k`` runs k times the CI's workloads (2,000).
"""

import functools
import os
import random
import time

import pytest
import torch

import paged_ref.serve.engine as engine_module
from paged_ref.allocator import OutOfPagesError
from paged_ref.eviction import make_policy
from paged_ref.serve import Engine
from paged_ref.serve.dry import DrySession
from paged_ref.serve.reservation import Reservation

VOCAB = 64
WORKLOADS = 2000 * int(os.environ.get("PAGED_REF_PROPERTY_SCALE", "1"))
CHUNKS = 20  # workloads per test case: pytest shows progress and a failure names a small range


class Injected(Exception):
    """A fault the test injected."""


class InjectedOutOfPages(OutOfPagesError):
    """An allocation the test made fail."""


class ToySession(DrySession):
    """A session with a toy model: K = (token id, position), V = (position, token id); the next
    token hashes the K it holds in order. Eviction hooks run as `paged_ref.hf.PagedSession` runs them."""

    evicts = True
    faults = None  # a callable(where) -> bool set by the test: raise an injected fault there

    def __init__(self, *, num_pages: int, page_size: int, prefix_caching: bool = False):
        super().__init__(num_pages=num_pages, page_size=page_size, prefix_caching=prefix_caching)
        from paged_ref.cache import PagedKVCache

        self.kv = PagedKVCache(
            num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=1, head_dim=2,
            prefix_caching=prefix_caching,
        )  # fmt: skip
        self._policies, self._prefilled = {}, set()

    def add(self, token_ids=None, *, eviction=None) -> int:
        seq_id = self.kv.add_sequence(token_ids=token_ids)
        self._positions[seq_id] = self.kv.seq_len(seq_id)
        self._policies[seq_id] = eviction
        return seq_id

    def finish(self, seq_id: int) -> None:
        super().finish(seq_id)
        self._prefilled.discard(seq_id)
        policy = self._policies.pop(seq_id)
        if policy is not None:
            policy.release(seq_id)

    def extend(self, seq_ids, tokens, *, packed=False, reserved=False) -> torch.Tensor:
        fault = self.faults or (lambda where: False)
        if fault("forward"):
            raise Injected("forward, before its reserves")
        for b, (s, t) in enumerate(zip(seq_ids, tokens)):
            t = list(t)
            pos = torch.arange(self._positions[s], self._positions[s] + len(t), dtype=torch.float32)
            ids = torch.tensor(t, dtype=torch.float32)
            if reserved:  # the scheduler took the pages
                slots = self.kv.last_slots(s, len(t))
            else:
                slots = self.kv.reserve(s, len(t), token_ids=t if self.kv.prefix_caching else None)
            k = torch.stack([ids + 1, pos + 1], dim=-1)[:, None, :]  # [n, 1, 2]
            v = torch.stack([pos + 1, ids % 7 + 1], dim=-1)[:, None, :]
            self.kv.write(0, slots, k, v, check_values=False)
            if b == 0 and len(seq_ids) > 1 and fault("forward"):
                raise Injected("forward, half way through its writes")
        for s, t in zip(seq_ids, tokens):
            self._positions[s] += len(t)
        if fault("forward"):
            raise Injected("forward, after its writes")
        error = None
        for s in seq_ids:  # the hooks, as PagedSession runs them
            policy, first = self._policies[s], s not in self._prefilled
            self._prefilled.add(s)
            try:
                if policy is not None:
                    (policy.after_prefill if first else policy.after_append)(self.kv, s)
            except Exception as e:
                error = error or e
        if error is not None:
            raise error
        logits = torch.zeros(len(seq_ids), VOCAB)
        for b, s in enumerate(seq_ids):
            logits[b, next_token(self.kv, s)] = 1.0
        return logits


def next_token(kv, seq_id) -> int:
    k, _ = kv.gather(0, seq_id)  # [n, 1, 2]
    h = 0
    for token, pos in k[:, 0].tolist():
        h = (h * 1000003 + int(token) * 131 + int(pos)) % 2**31
    return h % VOCAB


POLICIES = ("full", "streaming_llm", "paged_eviction")


def _policy(name: str, page_size: int):
    return make_policy(name) if name == "full" else make_policy(name, max(8, 3 * page_size))


@functools.cache
def alone(prompt: tuple, n: int, policy: str | None, page_size: int) -> list[int]:
    session = ToySession(num_pages=256, page_size=page_size)
    s = session.add(eviction=None if policy is None else _policy(policy, page_size))
    out = []
    logits = session.extend([s], [list(prompt)])
    for _ in range(n):
        out.append(int(logits.argmax()))
        if len(out) < n:
            logits = session.extend([s], [[out[-1]]])
    return out


def _check_pool(engine):
    kv = engine.kv
    kv.allocator.check()
    holders = [0] * kv.num_pages
    for s in kv.seq_ids:
        for p in set(kv.pages(s)):
            holders[p] += 1
    assert holders == kv.allocator.snapshot()[3]  # every page's refcount


def _fingerprint(engine):
    kv = engine.kv
    return (
        kv.allocator.snapshot(),
        {s: (kv.pages(s), kv.seq_len(s), engine.session.position(s)) for s in kv.seq_ids},
        [(r.status, r.seq_id, r.num_computed, r.high_water, len(r.output_ids)) for r in engine._requests],
        [r.request_id for r in engine.scheduler.waiting],
        [r.request_id for r in engine.scheduler.running],
        [r.request_id for r in engine.scheduler.swapped],
        dict(engine._counts),
        engine.scheduler.preemptions,
        engine.now,
        len(engine.history),
    )


def run_workload(seed: int, counts: dict) -> None:
    rng = random.Random(seed)
    page_size = rng.choice((1, 2, 4))
    engine_kw = dict(
        num_pages=rng.randint(6, 40),
        page_size=page_size,
        max_num_seqs=rng.randint(1, 8),
        max_batched_tokens=rng.choice((1, 2, 3, 5, 8, 16, 64)),
        reservation=rng.choice(("paged", "paged", "exact", "max_len")),
        preemption=rng.choice(("recompute", "swap")),
        prefix_caching=rng.random() < 0.5,
        watermark=rng.choice((0.0, 0.01, 0.1, 0.3)),
    )
    rates = {where: rng.choice((0.0, 0.02, 0.1)) for where in ("forward", "hook", "allocator")}
    if engine_kw["reservation"] == "max_len":
        capacity = engine_kw["num_pages"] * page_size
        engine_kw["max_model_len"] = rng.randint(min(8, capacity), capacity)
    engine_kw["reservation"] = Reservation(engine_kw["reservation"], watermark=engine_kw.pop("watermark"))
    engine = Engine(None, **engine_kw)
    kv = engine.kv
    fault_rng = random.Random(seed + 1)
    ToySession.faults = None

    def fault(where: str) -> bool:
        if fault_rng.random() < rates[where]:
            counts[f"faults_{where}"] += 1
            return True
        return False

    allocate = kv.allocator.allocate

    def failing_allocate(n=1):
        if fault("allocator"):
            raise InjectedOutOfPages(n, kv.allocator.num_free)
        return allocate(n)

    kv.allocator.allocate = failing_allocate
    engine.session.faults = fault
    prefix = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))]
    expected = {}
    for _ in range(rng.randint(1, 8)):
        prompt = (prefix if rng.random() < 0.5 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 16))]
        n = rng.randint(1, 10)
        name = rng.choice(POLICIES) if rng.random() < 0.3 else None
        policy = None if name is None else _policy(name, page_size)
        if policy is not None:
            _faulty_hooks(policy, fault, fault_rng)
        try:
            rid = engine.add_request(prompt, max_new_tokens=n, arrival_s=rng.choice((0, 0, 1, 3, 8)), eviction=policy)
        except ValueError as e:
            assert "can never be served" in str(e), e
            counts["refused"] += 1
            continue
        expected[rid] = (tuple(prompt), n, name)
    outs, steps = {}, 0
    limit = 50 + 20 * sum(len(p) + n for p, n, _ in expected.values())
    while engine.has_unfinished_requests():
        steps += 1
        assert steps <= limit, f"seed {seed}: no progress after {steps} steps ({engine!r})"
        before = _fingerprint(engine)
        try:
            done = engine.step()
        except (Injected, InjectedOutOfPages) as e:
            assert e.__notes__ and "Engine.step was undone" in e.__notes__[-1], f"seed {seed}"
            assert _fingerprint(engine) == before, f"seed {seed}: a failed step changed the engine"
            counts["failed_steps"] += 1
            continue
        outs.update((o.request_id, o) for o in done)
        _check_pool(engine)
    assert kv.allocator.num_free == kv.num_pages and kv.seq_ids == [], f"seed {seed}: pages left"
    assert sorted(outs) == sorted(expected), f"seed {seed}"
    for rid, (prompt, n, name) in expected.items():
        o, solo = outs[rid], alone(prompt, n, name, page_size)
        if o.finish_reason == "error":
            counts["errored_requests"] += 1
            assert o.token_ids == solo[: len(o.token_ids)], f"seed {seed}, request {rid}"
        else:
            assert o.finish_reason == "length" and o.token_ids == solo, f"seed {seed}, request {rid}"
    counts["workloads"] += 1
    counts["requests"] += len(expected)
    counts["steps"] += steps
    counts["tokens"] += sum(len(o.token_ids) for o in outs.values())
    counts["preemptions"] += engine.stats()["preemptions"]


def _faulty_hooks(policy, fault, fault_rng) -> None:
    for hook in ("after_prefill", "after_append"):
        original = getattr(policy, hook)

        def failing(kv, seq_id, original=original, hook=hook):
            after = fault_rng.random() < 0.5
            if not after and fault("hook"):
                raise Injected(f"{hook}, before it acted")
            original(kv, seq_id)
            if after and fault("hook"):
                raise Injected(f"{hook}, after it acted")

        setattr(policy, hook, failing)


COUNTS = {}


@pytest.fixture
def toy_engine(monkeypatch):
    monkeypatch.setattr(engine_module, "DrySession", ToySession)


@pytest.mark.parametrize("first", range(0, WORKLOADS, WORKLOADS // CHUNKS))
def test_random_workloads_with_faults(toy_engine, first):
    counts = COUNTS.setdefault("all", dict.fromkeys(
        ("workloads", "requests", "steps", "tokens", "preemptions", "refused", "failed_steps", "errored_requests",
         "faults_forward", "faults_hook", "faults_allocator"), 0))  # fmt: skip
    started, before = time.perf_counter(), counts["workloads"]
    for seed in range(first, first + WORKLOADS // CHUNKS):
        run_workload(seed, counts)
    counts["seconds"] = counts.get("seconds", 0.0) + time.perf_counter() - started
    assert counts["workloads"] - before == WORKLOADS // CHUNKS
    if first + WORKLOADS // CHUNKS >= WORKLOADS:
        print("\nproperty test counts (this process's chunks):", counts)
