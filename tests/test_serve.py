"""The serving engine: every request gets the tokens it would get alone, and the pool stays sound.

Tiny random Llama (milliseconds per forward). Each request's greedy tokens are compared with
`pr.hf.generate` on that request alone, under every arrival pattern, chunk size, preemption mode,
prefix caching and eviction tried here; after every step the allocator's invariant holds and
every page's refcount equals the number of live sequences listing it; at the end every page is free.
"""

import functools
import random

import pytest
import torch

import paged_ref as pr
from paged_ref.eviction import make_policy
from paged_ref.fast import Fast
from paged_ref.models import tiny_llama
from paged_ref.serve import VLLM_ADMISSION, Engine, Reservation, Scheduler
from paged_ref.serve.dry import DrySession
from paged_ref.serve.request import Request

PAGE = 4


@functools.cache
def _alone(prompt: tuple, n: int, eviction: str | None = None, budget: int | None = None) -> list[int]:
    model = tiny_llama()  # the same seeded weights as the fixture's
    out = pr.hf.generate(
        model,
        torch.tensor([prompt]),
        max_new_tokens=n,
        page_size=PAGE,
        eos_token_id=[],
        eviction=eviction,
        budget=budget,
    )
    return out[0, len(prompt) :].tolist()


def _workload(n, *, seed, rate, max_prompt=40, max_new=24, shared_prefix=()):
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate) if rate else 0.0
        prompt = list(shared_prefix) + [rng.randrange(3, 512) for _ in range(rng.randint(1, max_prompt))]
        reqs.append((tuple(prompt), rng.randint(1, max_new), t))
    return reqs


def _check_pool(engine):
    """The allocator's invariant, and every page's refcount = the live sequences that list it."""
    kv = engine.kv
    kv.allocator.check()
    holders = [0] * kv.num_pages
    for s in kv.seq_ids:
        for p in set(kv.pages(s)):
            holders[p] += 1
    assert holders == [kv.allocator.refcount(p) for p in range(kv.num_pages)]
    for h in engine.history[-1:]:
        assert h.tokens <= engine.scheduler.max_batched_tokens and h.rows <= engine.scheduler.max_num_seqs


def _drive(engine):
    """Step to the end, checking the pool after every step; returns the outputs in submission order."""
    while engine.has_unfinished_requests():
        engine.step()
        _check_pool(engine)
    outs = engine.run()
    assert engine.kv.allocator.num_free == engine.kv.num_pages and engine.kv.seq_ids == []
    return outs


CASES = {  # name -> (engine options, workload options)
    "all_at_once_small_chunks": (dict(max_batched_tokens=5), dict(rate=None)),
    "poisson_recompute": (dict(max_batched_tokens=16), dict(rate=2.0)),
    "poisson_swap": (dict(max_batched_tokens=16, preemption="swap"), dict(rate=2.0)),
    "prefix_caching_recompute": (dict(max_batched_tokens=12, prefix_caching=True), dict(rate=4.0)),
    "prefix_caching_swap": (dict(max_batched_tokens=64, prefix_caching=True, preemption="swap"), dict(rate=None)),
    "exact": (dict(max_batched_tokens=16, reservation="exact"), dict(rate=2.0)),
    "max_len": (dict(max_batched_tokens=16, reservation="max_len", max_model_len=64), dict(rate=2.0)),
    "fast_paths": (dict(max_batched_tokens=16, fast=True), dict(rate=2.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_request_gets_the_tokens_it_gets_alone(model, case):
    options, load = CASES[case]
    prefix = tuple(range(100, 110)) if options.get("prefix_caching") else ()
    reqs = _workload(12, seed=len(case), shared_prefix=prefix, **load)
    admission = Reservation(options.get("reservation", "paged"), watermark=0.0)
    engine = Engine(model, num_pages=20, page_size=PAGE, max_num_seqs=6, eos_token_id=[], clock="steps",
                    **{**options, "reservation": admission})  # fmt: skip
    for prompt, n, t in reqs:
        engine.add_request(list(prompt), max_new_tokens=n, arrival_s=t)
    outs = _drive(engine)
    assert [o.request_id for o in outs] == list(range(len(reqs)))
    for o, (prompt, n, t) in zip(outs, reqs):
        assert o.token_ids == _alone(prompt, n), f"request {o.request_id}"
        assert o.finish_reason == "length" and o.first_token_s >= t and o.ttft_s >= 0
    stats = engine.stats()
    if options.get("reservation", "paged") == "paged":
        assert stats["preemptions"] > 0  # the pool binds: preemption is exercised
    else:
        assert stats["preemptions"] == 0 and stats["peak_committed_pages"] <= 20
    if options.get("prefix_caching"):
        assert stats["prefix_hit_tokens"] > 0
    if options.get("preemption") == "swap":
        assert stats["swapped_out_tokens"] == stats["swapped_in_tokens"] > 0 and stats["recomputed_tokens"] == 0
    elif stats["preemptions"]:
        assert stats["recomputed_tokens"] > 0


def test_cpu_paged_attends_a_mixed_step_in_one_call_per_layer(model, monkeypatch):
    """Decode rows and prefill chunks of one step go to the kernel together (`cpu_paged_packed`)."""
    from paged_ref.attention import cpu_paged

    calls = []

    def counted(q, *args, **kwargs):
        calls.append(q.shape[0])
        return packed(q, *args, **kwargs)

    packed = cpu_paged.cpu_paged_packed
    monkeypatch.setattr(cpu_paged, "cpu_paged_packed", counted)
    reqs = _workload(6, seed=11, rate=None, max_prompt=20, max_new=6)
    engine = Engine(model, num_pages=40, page_size=PAGE, max_num_seqs=4, max_batched_tokens=12, eos_token_id=[],
                    clock="steps", fast=Fast(backend="cpu_paged"))  # fmt: skip
    for prompt, n, t in reqs:
        engine.add_request(list(prompt), max_new_tokens=n, arrival_s=t)
    outs = _drive(engine)
    mixed = [h for h in engine.history if h.tokens > h.rows > h.decode_rows > 0]
    assert mixed and len(calls) >= len(mixed) * model.config.num_hidden_layers
    assert all(o.token_ids == _alone(prompt, n) for o, (prompt, n, _) in zip(outs, reqs))


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_eviction_requests_match_generate_with_the_same_policy(model, preemption):
    reqs = _workload(8, seed=3, rate=3.0, max_prompt=30, max_new=24)
    policy = make_policy("paged_eviction", 8)  # one policy object serves every request
    engine = Engine(
        model, num_pages=12, page_size=PAGE, max_num_seqs=6, max_batched_tokens=10, eos_token_id=[], clock="steps"
    )
    for i, (prompt, n, t) in enumerate(reqs):  # every other request keeps its whole cache
        engine.add_request(list(prompt), max_new_tokens=n, arrival_s=t, eviction=policy if i % 2 == 0 else None)
    outs = _drive(engine)
    assert engine.stats()["preemptions"] > 0
    for i, (o, (prompt, n, _)) in enumerate(zip(outs, reqs)):
        expected = _alone(prompt, n, "paged_eviction", 8) if i % 2 == 0 else _alone(prompt, n)
        assert o.token_ids == expected, f"request {i}"
    assert engine.scheduler.evictions.hooks == {}  # every request's policy was released


def test_eviction_lets_more_requests_run_at_once(model):
    reqs = [(tuple(range(3, 3 + 24)), 24, 0.0)] * 6
    peaks = {}
    for name, policy in (("full", None), ("paged_eviction", make_policy("paged_eviction", 8))):
        engine = Engine(model, num_pages=24, page_size=PAGE, max_batched_tokens=64, eos_token_id=[], clock="steps")
        for prompt, n, _ in reqs:
            engine.add_request(list(prompt), max_new_tokens=n, eviction=policy)
        _drive(engine)
        peaks[name] = max(h.running for h in engine.history), engine.stats()["steps"]
    assert peaks["paged_eviction"][0] > peaks["full"][0]
    assert peaks["paged_eviction"][1] < peaks["full"][1]


def test_a_full_prompt_prefix_hit_still_computes_the_last_prompt_token(model):
    prompt = list(range(20, 29))  # 9 tokens: two full pages of 4, and one more
    engine = Engine(model, num_pages=16, page_size=PAGE, prefix_caching=True, eos_token_id=[], clock="steps")
    engine.add_request(prompt, max_new_tokens=3)
    first = engine.run()[0]
    engine.add_request(prompt, max_new_tokens=3)
    second_steps = len(engine.history)
    second = engine.run()[0]
    assert engine.stats()["prefix_hit_tokens"] == 8  # both full pages reused
    assert engine.history[second_steps].tokens == 1  # the last prompt token, computed for its logits
    assert first.token_ids == second.token_ids == _alone(tuple(prompt), 3)
    # the same prompt, page aligned: the cache leaves the last page to compute
    aligned = list(range(40, 48))
    for _ in range(2):
        engine.add_request(aligned, max_new_tokens=2)
        out = engine.run()[0]
        assert out.token_ids == _alone(tuple(aligned), 2)
    assert engine.stats()["prefix_hit_tokens"] == 8 + 4


def test_a_dry_run_keeps_a_finished_requests_full_pages_cached():
    """A dry run writes no K/V but plays the forward that would: the full pages of a request that finished
    stay cached (a published page no forward wrote leaves the prefix index when its last holder goes)."""
    prompt = list(range(20, 29))  # 9 tokens: two full pages of 4, and one more
    engine = Engine(None, num_pages=16, page_size=PAGE, prefix_caching=True)
    for _ in range(2):
        engine.add_request(prompt, max_new_tokens=3)
        engine.run()
    assert engine.stats()["prefix_hit_tokens"] == 8


def test_a_dry_extend_of_rows_not_reserved_exactly_is_refused_as_a_sessions_is():
    dry = DrySession(num_pages=4, page_size=2)
    a, b = dry.add(), dry.add()
    dry.extend([a], [[7, 8, 9]])
    dry.kv.reserve(b, 2)

    def state():
        return [(dry.kv.pages(s), dry.kv.seq_len(s), dry.position(s)) for s in (a, b)], dry.kv.allocator.num_free

    before = state()
    for seq_ids, rows in (([b, a], [[1, 2], [3]]), ([b], [[4]]), ([b], [[4, 5, 6]])):  # a: none; b: 2 reserved
        with pytest.raises(ValueError, match=r"reserved=True: tokens\[\d\] has \d tokens, but sequence \d has \d"):
            dry.extend(seq_ids, rows, reserved=True)
        assert state() == before
    dry.extend([b], [[4, 5]], reserved=True)
    assert dry.position(b) == dry.kv.seq_len(b) == 2


@pytest.mark.parametrize("backend", [None, "reference"])
def test_a_hit_on_pages_an_earlier_row_of_the_step_fills_reads_that_forwards_kv(model, backend):
    """As in vLLM, scheduling A publishes the full pages its prompt fills, so B (admitted next in the same
    step) shares them and computes only its rest: every layer writes A's K/V before B attends there."""
    prompt = list(range(20, 33))  # 13 tokens: three full pages of 4 and one more
    engine = Engine(model, num_pages=16, page_size=PAGE, max_batched_tokens=64, prefix_caching=True,
                    fast=Fast(backend=backend), eos_token_id=[], clock="steps",
                    reservation=VLLM_ADMISSION)  # fmt: skip
    for p in (prompt, prompt + [7, 8], prompt):
        engine.add_request(p, max_new_tokens=5)
    outs = engine.run()
    first = engine.history[0]
    assert first.admitted == (0, 1, 2) and first.tokens == 13 + 3 + 1  # B and C compute past A's 3 full pages
    assert engine.stats()["prefix_hit_tokens"] == 24
    assert [o.token_ids for o in outs] == [_alone(tuple(p), 5) for p in (prompt, prompt + [7, 8], prompt)]


def test_eos_stops_a_request_like_generate(model):
    eos = _alone(tuple(range(60, 70)), 6)[2]  # its third token: call it the end
    engine = Engine(model, num_pages=16, page_size=PAGE, eos_token_id=eos, clock="steps")
    engine.add_request(list(range(60, 70)), max_new_tokens=6)
    out = engine.run()[0]
    expected = pr.hf.generate(model, torch.tensor([list(range(60, 70))]), max_new_tokens=6, eos_token_id=eos)
    assert out.finish_reason == "stop" and out.token_ids == expected[0, 10:13].tolist()


def test_an_impossible_request_is_refused_and_nothing_changes(model):
    engine = Engine(model, num_pages=8, page_size=PAGE, max_model_len=64, clock="steps")
    engine.add_request([5, 6, 7], max_new_tokens=2)
    before = (engine.stats(), list(engine.scheduler.waiting), engine.kv.allocator.num_free)
    with pytest.raises(ValueError, match="can never be served.*needs 9 pages.*pool has 8"):
        engine.add_request(list(range(3, 36)), max_new_tokens=1)  # 33 tokens: 9 pages of 4
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        engine.add_request(list(range(3, 30)), max_new_tokens=40)
    for bad, kind, match in (
        ([], ValueError, "at least one token"),
        ([1, 512], ValueError, r"token ids in \[0, vocab_size=512\)"),
        (torch.ones(2, 3, dtype=torch.long), TypeError, "1-D integer tensor"),
        (torch.tensor([True, False]), TypeError, "1-D integer tensor"),
        ([1.5], TypeError, r"prompt_ids\[0\] must be an int"),
    ):
        with pytest.raises(kind, match=match):
            engine.add_request(bad, max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.add_request([1], max_new_tokens=0)
    with pytest.raises(TypeError, match="arrival_s must be a finite number"):
        engine.add_request([1], max_new_tokens=1, arrival_s=float("nan"))
    with pytest.raises(TypeError, match=r"eviction must be an EvictionPolicy \(from make_policy\) or None, got str"):
        engine.add_request([1], max_new_tokens=1, eviction="paged_eviction")
    assert (engine.stats(), list(engine.scheduler.waiting), engine.kv.allocator.num_free) == before
    assert [o.request_id for o in engine.run()] == [0]  # the refused ones took no id
    exact = Engine(model, num_pages=8, page_size=PAGE, reservation="max_len", max_model_len=64, clock="steps")
    with pytest.raises(ValueError, match="16 pages.*committed up front.*pool has 8"):
        exact.add_request([5], max_new_tokens=1)


def test_a_policy_the_pool_cannot_run_is_refused_at_the_door(model):
    """A budget too small for the page size, or per-layer decisions on one block table: refused by
    add_request, not queued to make every later step raise from the policy's hook."""
    engine = Engine(model, num_pages=16, page_size=PAGE, eos_token_id=[], clock="steps")
    engine.add_request([5, 6, 7], max_new_tokens=2)
    before = (engine.stats(), list(engine.scheduler.waiting), engine.kv.allocator.num_free)
    for policy, kind, match in (
        (make_policy("paged_eviction", 2), ValueError, "budget must be >= 8 tokens with page_size=4.*got budget=2"),
        (make_policy("streaming_llm", 5), ValueError, "budget must be >= 8 tokens with page_size=4.*got budget=5"),
        (make_policy("paged_eviction", 8, decision="per_layer"), TypeError, "per_layer.*got PagedKVCache"),
    ):
        with pytest.raises(kind, match=match):
            engine.add_request(list(range(3, 15)), max_new_tokens=4, eviction=policy)
    assert (engine.stats(), list(engine.scheduler.waiting), engine.kv.allocator.num_free) == before
    assert [o.token_ids for o in engine.run()] == [_alone((5, 6, 7), 2)]


def test_abort_frees_pages_wherever_the_request_is(model):
    engine = Engine(model, num_pages=10, page_size=PAGE, max_num_seqs=2, eos_token_id=[], clock="steps")
    running = engine.add_request(list(range(3, 20)), max_new_tokens=10)
    waiting = engine.add_request(list(range(3, 20)), max_new_tokens=10)
    queued = engine.add_request([7, 8], max_new_tokens=10)  # max_num_seqs=2: it waits
    later = engine.add_request([7, 8], max_new_tokens=10, arrival_s=100.0)
    engine.step()
    engine.step()
    held = engine.kv.num_pages - engine.kv.allocator.num_free
    out = engine.abort(running)
    assert out.finish_reason == "abort" and len(out.token_ids) == 2
    assert engine.kv.num_pages - engine.kv.allocator.num_free < held
    for rid in (queued, later):
        assert engine.abort(rid).token_ids == []
    with pytest.raises(ValueError, match="already finished"):
        engine.abort(running)
    with pytest.raises(ValueError, match="request_id must be one that add_request returned"):
        engine.abort(99)
    outs = _drive(engine)
    assert [o.finish_reason for o in outs] == ["abort", "length", "abort", "abort"]
    assert outs[waiting].token_ids == _alone(tuple(range(3, 20)), 10)


def test_swap_abort_frees_the_host_copy(model):
    engine = Engine(
        model, num_pages=8, page_size=PAGE, preemption="swap", max_batched_tokens=64, eos_token_id=[], clock="steps"
    )
    ids = [engine.add_request(list(range(3, 14)), max_new_tokens=12) for _ in range(3)]
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0]
    engine.abort(victim.request_id)
    assert victim.seq_id is None and engine.scheduler.swap.bytes == 0
    outs = _drive(engine)
    assert all(o.token_ids == _alone(tuple(range(3, 14)), 12) for o in outs if o.request_id != victim.request_id)
    assert len(outs) == len(ids)


def test_arrivals_and_clocks(model):
    engine = Engine(model, num_pages=16, page_size=PAGE, eos_token_id=[], clock="steps")
    engine.add_request([5, 6], max_new_tokens=3, arrival_s=10.0)
    engine.step()  # nothing has arrived: the clock jumps to 10 and the step serves it
    assert engine.history[0].now == 11.0 and engine.history[0].admitted == (0,)
    out = engine.run()[0]
    assert (out.first_token_s, out.finish_s, out.ttft_s, out.tpot_s) == (11.0, 13.0, 1.0, 1.0)
    sim = Engine(model, num_pages=16, page_size=PAGE, eos_token_id=[])  # simulated: measured step times
    assert sim.stats()["clock"] == "simulated"
    sim.add_request([5, 6], max_new_tokens=3, arrival_s=2.0)
    out = sim.run()[0]
    busy = sum(h.step_s for h in sim.history)
    assert out.finish_s == pytest.approx(2.0 + busy) and 0 < out.ttft_s < busy + 1e-9
    assert sim.stats()["tokens_per_s"] == pytest.approx(3 / (out.finish_s - 2.0))


def test_step_returns_what_finished_and_run_the_rest_in_order(model):
    engine = Engine(model, num_pages=16, page_size=PAGE, eos_token_id=[], clock="steps")
    engine.add_request([5, 6, 7], max_new_tokens=4)
    engine.add_request([8], max_new_tokens=1)
    first = engine.step()  # both prefill; the one-token request is done at once
    assert [o.request_id for o in first] == [1] and first[0].tpot_s is None
    assert [o.request_id for o in engine.run()] == [0, 1]
    assert engine.run() == [] and engine.step() == []


def test_reservation_changes_admission_only(model):
    reqs = _workload(10, seed=7, rate=None, max_prompt=20, max_new=12)
    running = {}
    for reservation in ("paged", "exact", "max_len"):
        engine = Engine(
            model,
            num_pages=24,
            page_size=PAGE,
            reservation=Reservation(reservation, watermark=0.0),
            max_model_len=48,
            eos_token_id=[],
            clock="steps",
        )
        for prompt, n, _ in reqs:
            engine.add_request(list(prompt), max_new_tokens=n)
        outs = _drive(engine)
        assert [o.token_ids for o in outs] == [_alone(p, n) for p, n, _ in reqs]
        running[reservation] = engine.stats()["peak_running"]
    assert running["max_len"] == 24 // 12 < running["exact"] <= running["paged"]


@pytest.mark.parametrize("backend", ["reference", "sdpa", "triton"])
def test_a_packed_forward_gives_the_rectangles_logits(model, backend):
    """The engine's forward: rows of different lengths packed into one row (no padding computed)."""
    logits = {}
    for packed in (False, True):
        with pr.hf.PagedSession(model, num_pages=32, page_size=PAGE, backend=backend) as s:
            a, b, c, d = (s.add() for _ in range(4))
            first = s.extend([a, b], [torch.arange(3, 13), torch.arange(20, 27)], packed=packed)  # two prompts
            decodes = list(first.argmax(-1)[:, None])
            mixed = s.extend(
                [a, c, b, d], [decodes[0], torch.arange(40, 49), decodes[1], torch.arange(60, 62)], packed=packed
            )
            every = s.extend([c, d], [mixed[1].argmax()[None], torch.arange(70, 75)], packed=packed, all_logits=True)
            logits[packed] = (first, mixed, *every)
            assert s.kv.seq_len(c) == 10 and s.kv.seq_len(d) == 7
    for x, y in zip(logits[False], logits[True]):
        assert x.shape == y.shape
        torch.testing.assert_close(y, x, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------- the scheduler alone (dry)
def _sched(num_pages, budget, **kw):
    session = DrySession(num_pages=num_pages, page_size=PAGE)
    kw.setdefault("reservation", VLLM_ADMISSION)
    return Scheduler(session, max_num_seqs=kw.pop("max_num_seqs", 8), max_batched_tokens=budget, **kw)


def _req(i, prompt, new=4):
    return Request(request_id=i, prompt_ids=list(range(prompt)), max_new_tokens=new, arrival_s=0.0)


def _run_step(sched):
    plan = sched.schedule()
    rows = [torch.zeros(n, dtype=torch.long) for _, n in plan.rows]
    sched.session.extend([r.seq_id for r, _ in plan.rows], rows, reserved=True)  # the plan took the pages
    for r, n in plan.rows:
        r.num_computed += n
        if r.num_computed == r.num_tokens:
            r.output_ids.append(0)
    return plan


def test_decodes_are_served_before_prefill_chunks_and_nobody_overtakes():
    sched = _sched(64, 6)
    a, b, c = _req(0, 3), _req(1, 30), _req(2, 1)
    for r in (a, b, c):
        sched.add(r)
    plan = _run_step(sched)
    assert [(r.request_id, n) for r, n in plan.rows] == [(0, 3), (1, 3)]  # c waits behind b
    plan = _run_step(sched)
    assert [(r.request_id, n) for r, n in plan.rows] == [(0, 1), (1, 5)]  # a's decode first, b gets the rest


def test_preemption_takes_the_most_recent_request_first():
    sched = _sched(6, 64)
    reqs = [_req(i, 7, new=12) for i in range(3)]  # 2 pages each at first, 5 at the end
    for r in reqs:
        sched.add(r)
    _run_step(sched)
    while not sched.preemptions:
        plan = _run_step(sched)
    assert [r.request_id for r in plan.preempted] == [2] and sched.waiting[0] is reqs[2]
    assert reqs[2].num_computed == 0 and reqs[2].seq_id is None


def test_the_watermark_holds_admission_back():
    sched = _sched(10, 64, reservation=Reservation("paged", watermark=0.3))
    a, b = _req(0, 16), _req(1, 13)  # 4 pages, then 4 more: with 3 kept free, b must wait
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [r.request_id for r, _ in plan.rows] == [0] and list(sched.waiting) == [b]
    assert sched.kv.seq_ids == [0]  # b's trial sequence was undone


def test_dry_engine_counts_every_recomputed_token():
    engine = Engine(None, num_pages=8, page_size=PAGE, max_batched_tokens=64)
    for _ in range(3):
        engine.add_request(list(range(10)), max_new_tokens=8)
    outs = engine.run()
    s = engine.stats()
    fed = sum(h.tokens for h in engine.history)
    assert s["clock"] == "steps" and s["preemptions"] > 0
    assert fed == s["prompt_tokens"] + s["recomputed_tokens"] + s["tokens"] - len(outs)  # the last token is never fed
    with pytest.raises(ValueError, match="eviction needs a model"):
        engine.add_request([1], max_new_tokens=1, eviction=make_policy("paged_eviction", 8))


def test_engine_arguments_are_checked(model):
    for kw, kind, match in (
        (dict(reservation="contiguous"), ValueError, "reservation must be one of"),
        (dict(preemption="drop"), ValueError, "preemption must be one of"),
        (dict(reservation=Reservation), TypeError, "reservation must be one of"),
        (dict(clock="cpu"), ValueError, "clock must be one of"),
        (dict(clock=""), ValueError, "clock must be one of.*got ''"),  # not taken for None (the default)
        (dict(clock=0), ValueError, "clock must be one of.*got 0"),
        (dict(num_pages=0), ValueError, "num_pages must be >= 1"),
        (dict(max_num_seqs=0), ValueError, "max_num_seqs must be >= 1"),
        (dict(prefix_caching=1), TypeError, "prefix_caching must be True or False"),
        (dict(eos_token_id=[600]), ValueError, r"eos_token_id must be token ids in \[0, vocab_size=512\)"),
    ):
        with pytest.raises(kind, match=match):
            Engine(model, **{"num_pages": 8, **kw})
    for watermark, kind in ((1.0, ValueError), (-0.01, ValueError), (True, TypeError), ("0.1", TypeError)):
        with pytest.raises(kind, match=r"watermark must be a share of the pool in \[0, 1\), got " + repr(watermark)):
            Reservation("paged", watermark=watermark)
    with pytest.raises(TypeError, match=r"reservation must be one of \['paged', 'exact', 'max_len'\] or a Reservation"):
        Engine(model, num_pages=8, reservation=[1])
    for not_a_model in ("gpt2", torch.nn.Linear(2, 2)):  # was an AttributeError on .config, naming no argument
        with pytest.raises(TypeError, match="model must be a transformers decoder model.*got (str|Linear)"):
            Engine(not_a_model, num_pages=8)
