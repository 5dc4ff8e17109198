"""The serving engine, all or nothing: the probes of issue 48, each a named case.

A step that raises (in the forward, in an eviction hook, in an allocation inside a policy) leaves
every request, page, swap entry, count and clock as it was, and the exception names the requests
concerned; running on gives every request the tokens `pr.hf.generate` gives it alone. A request
the admission rule can never admit is refused at the door; the scheduler never stalls.
"""

import functools
import time

import pytest
import torch

import paged_ref as pr
from paged_ref.allocator import OutOfPagesError
from paged_ref.eviction import make_policy
from paged_ref.models import tiny_llama
from paged_ref.serve import VLLM_ADMISSION, Engine, Reservation

PAGE = 4


@functools.cache
def _alone(prompt: tuple, n: int, eviction: str | None = None, budget: int | None = None) -> list[int]:
    out = pr.hf.generate(
        tiny_llama(), torch.tensor([prompt]), max_new_tokens=n, page_size=PAGE, eos_token_id=[], eviction=eviction,
        budget=budget,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _state(engine):
    """Everything a step may change, as plain values."""
    kv, s = engine.kv, engine.scheduler
    seqs = {q: (kv.pages(q), kv.seq_len(q), engine.session.position(q)) for q in kv.seq_ids}
    reqs = [
        (r.request_id, r.status, r.seq_id, r.num_computed, r.high_water, list(r.output_ids), r.num_preemptions)
        for r in engine._requests
    ]
    queues = ([r.request_id for r in s.waiting], [r.request_id for r in s.running], [r.request_id for r in s.swapped])
    pool = [kv.allocator.refcount(p) for p in range(kv.num_pages)], kv.allocator.num_free
    stats = {k: v for k, v in engine.stats().items() if not k.endswith("_s") and k != "overhead_share"}
    swap = sorted((q, s.swap.tokens(q)) for q in list(s.swap._held))
    return seqs, reqs, queues, pool, stats, swap, engine.now, len(engine.history)


class _Failing:
    """Wraps a policy's hook so that its ``times``-th call raises (after the policy acted, if ``after``)."""

    def __init__(self, policy, hook, *, times, after=False, forever=False):
        self.calls = 0
        original = getattr(policy, hook)

        def failing(kv, seq_id):
            self.calls += 1
            hit = self.calls == times or (forever and self.calls >= times)
            if hit and not after:
                raise RuntimeError(f"{hook} failed")
            original(kv, seq_id)
            if hit:
                raise RuntimeError(f"{hook} failed")

        setattr(policy, hook, failing)


def _fail_forward_once(engine, monkeypatch):
    extend = engine.session.extend
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("forward failed")
        return extend(*args, **kwargs)

    monkeypatch.setattr(engine.session, "extend", failing)


# ---------------------------------------------------------------------- a failed step changes nothing
@pytest.mark.parametrize("hook", ["after_append", "after_prefill"])
@pytest.mark.parametrize("after", [False, True])
def test_an_eviction_hook_that_raises_once_changes_nothing(model, hook, after):
    """Issue 48: a hook raising once left the engine's count (18) behind the session's position (19)."""
    engine = Engine(model, num_pages=16, page_size=PAGE, eos_token_id=[], clock="steps")
    prompt = list(range(3, 19))
    policy = make_policy("full")
    _Failing(policy, hook, times=1 if hook == "after_prefill" else 3, after=after)
    a = engine.add_request(prompt, max_new_tokens=8, eviction=policy)
    b = engine.add_request(prompt[:9], max_new_tokens=6)
    for _ in range(100):
        before = _state(engine)
        try:
            engine.step()
        except RuntimeError as e:
            assert f"{hook} failed" in str(e)
            assert any(f"request {a}" in note for note in e.__notes__), e.__notes__
            assert _state(engine) == before
            break
    else:
        raise AssertionError("the hook never ran")
    outs = engine.run()
    assert outs[a].token_ids == _alone(tuple(prompt), 8) and outs[b].token_ids == _alone(tuple(prompt[:9]), 6)
    assert engine.kv.allocator.num_free == 16


def test_a_hook_that_keeps_failing_finishes_its_request_with_an_error(model):
    engine = Engine(model, num_pages=16, page_size=PAGE, eos_token_id=[], clock="steps")
    policy = make_policy("streaming_llm", 8)
    _Failing(policy, "after_append", times=2, forever=True)
    a = engine.add_request(list(range(3, 15)), max_new_tokens=8, eviction=policy)
    b = engine.add_request(list(range(5, 14)), max_new_tokens=6)
    failures, outs = 0, []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        try:
            outs += engine.step()
        except RuntimeError:
            failures += 1
    assert failures == Engine.HOOK_TRIES - 1
    by_id = {o.request_id: o for o in outs}
    assert by_id[a].finish_reason == "error" and "after_append failed" in by_id[a].error
    solo = _alone(tuple(range(3, 15)), 8, "streaming_llm", 8)
    assert by_id[a].token_ids == solo[: len(by_id[a].token_ids)]
    assert by_id[b].token_ids == _alone(tuple(range(5, 14)), 6) and by_id[b].error is None
    assert engine.kv.allocator.num_free == 16


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_forward_that_raises_after_preempting_changes_nothing(model, monkeypatch, preemption):
    engine = Engine(model, num_pages=6, page_size=PAGE, preemption=preemption, eos_token_id=[], clock="steps")
    prompts = [list(range(3 + i, 12 + i)) for i in range(3)]
    for p in prompts:
        engine.add_request(p, max_new_tokens=8)
    extend, schedule = engine.session.extend, engine.scheduler.schedule
    plans, failed = [], []

    def planning():
        plans.append(schedule())
        return plans[-1]

    def failing(seq_ids, tokens, **kw):
        if plans[-1].preempted and not failed:
            failed.append(1)
            raise RuntimeError("forward failed")
        return extend(seq_ids, tokens, **kw)

    monkeypatch.setattr(engine.scheduler, "schedule", planning)
    monkeypatch.setattr(engine.session, "extend", failing)
    for _ in range(100):
        if failed or not engine.has_unfinished_requests():
            break
        before = _state(engine)
        try:
            engine.step()
        except RuntimeError as e:
            assert "forward failed" in str(e) and e.__notes__
            assert _state(engine) == before
    assert failed
    outs = engine.run()
    assert [o.token_ids for o in outs] == [_alone(tuple(p), 8) for p in prompts]


def test_a_failed_step_does_not_count_its_prompt_tokens(model, monkeypatch):
    """Issue 48: stats()["prompt_tokens"] was 20 for one 10-token prompt after a failed step."""
    engine = Engine(model, num_pages=16, page_size=PAGE, eos_token_id=[], clock="steps")
    engine.add_request(list(range(3, 13)), max_new_tokens=4)
    extend = engine.session.extend
    monkeypatch.setattr(engine.session, "extend", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    monkeypatch.setattr(engine.session, "extend", extend)
    engine.run()
    assert engine.stats()["prompt_tokens"] == 10


def test_a_step_that_fails_after_scheduling_gives_back_the_pages_it_took_and_unpublishes_them(model, monkeypatch):
    """Scheduling takes each row's pages and publishes their full ones (B hits A's in the same step);
    a forward that then raises leaves no page taken and none published."""
    prompt = list(range(20, 33))  # 13 tokens: three full pages of 4 and one more
    engine = Engine(model, num_pages=16, page_size=PAGE, max_batched_tokens=64, eos_token_id=[], clock="steps",
                    prefix_caching=True, reservation=VLLM_ADMISSION)  # fmt: skip
    for p in (prompt, prompt + [7, 8]):
        engine.add_request(p, max_new_tokens=3)
    before, seen = _state(engine), {}

    def failing(*args, **kwargs):
        seen.update(free=engine.kv.allocator.num_free, cached=len(engine.kv.cached_prefix(prompt + [1])))
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.session, "extend", failing)
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    assert seen == dict(free=16 - 4 - 1, cached=3)  # A's 4 pages, B's 1 beside the 3 it shares; 3 published
    assert _state(engine) == before and engine.kv.allocator.num_free == 16
    assert engine.kv.cached_prefix(prompt + [1]) == [] and engine.kv.prefix_hits == 0
    monkeypatch.undo()
    outs = engine.run()
    assert engine.history[0].admitted == (0, 1) and engine.stats()["prefix_hit_tokens"] == 12
    assert [o.token_ids for o in outs] == [_alone(tuple(p), 3) for p in (prompt, prompt + [7, 8])]


def test_an_allocation_that_fails_inside_a_policy_changes_nothing(model):
    engine = Engine(model, num_pages=16, page_size=PAGE, eos_token_id=[], clock="steps", prefix_caching=True)
    prompt = list(range(3, 19))
    engine.add_request(prompt, max_new_tokens=4)
    engine.step()
    policy = make_policy("streaming_llm", 8)
    compact = engine.kv.compact
    state = {"armed": True}

    def failing(seq_id, keep):
        if state.pop("armed", False):
            raise OutOfPagesError(1, 0)
        compact(seq_id, keep)

    engine.kv.compact = failing
    c = engine.add_request(prompt, max_new_tokens=4, eviction=policy)
    before = _state(engine)
    with pytest.raises(OutOfPagesError) as info:
        engine.step()
    assert any(f"request {c}" in n for n in info.value.__notes__)
    assert _state(engine) == before
    outs = engine.run()
    assert outs[-1].token_ids == _alone(tuple(prompt), 4, "streaming_llm", 8)


# ---------------------------------------------------------------------- compaction's copies are planned
@pytest.mark.parametrize(
    "preemption, policy", [("recompute", "streaming_llm"), ("swap", "streaming_llm"), ("swap", "paged_eviction")]
)
def test_eviction_beside_a_shared_prompt_has_pages_for_its_copies(model, preemption, policy):
    """Issue 48: OutOfPagesError escaped run() (7 pages of 4; the same 16-token prompt twice)."""
    engine = Engine(
        model, num_pages=7, page_size=PAGE, prefix_caching=True, preemption=preemption, eos_token_id=[], clock="steps"
    )
    prompt = list(range(3, 19))
    engine.add_request(prompt, max_new_tokens=8)
    engine.add_request(prompt, max_new_tokens=4, eviction=make_policy(policy, 8))
    outs = engine.run()
    assert outs[0].token_ids == _alone(tuple(prompt), 8)
    assert outs[1].token_ids == _alone(tuple(prompt), 4, policy, 8)
    assert engine.kv.allocator.num_free == 7


def test_an_observer_that_raises_changes_nothing(model):
    """Observers ran after the step had counted its tokens: one that raised left a request past its
    max_new_tokens still running, never to finish (it decoded on and on)."""
    engine = Engine(model, num_pages=8, page_size=PAGE, eos_token_id=[], clock="steps")
    engine.add_request([5, 6, 7], max_new_tokens=2)
    engine.step()
    engine.observers.append(lambda e: (_ for _ in ()).throw(RuntimeError("observer failed")))
    before = _state(engine)
    with pytest.raises(RuntimeError, match="observer failed") as raised:
        engine.step()
    assert _state(engine) == before and "Engine.step was undone" in raised.value.__notes__[-1]
    engine.observers.clear()
    out = engine.run()[0]
    assert (out.finish_reason, out.token_ids) == ("length", _alone((5, 6, 7), 2))
    assert engine.kv.allocator.num_free == 8


def test_a_request_arriving_during_an_undone_real_clock_step_is_still_to_arrive(model, monkeypatch):
    """On the real clock time passes between the step's checkpoint and its planning: a request arriving
    then was admitted into a step the checkpoint could not undo for it (left "running" on a sequence the
    undo freed, while still due to arrive: abort raised "not a live sequence")."""
    wall = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: wall[0])
    engine = Engine(model, num_pages=16, page_size=PAGE, eos_token_id=[], clock="real")
    a = engine.add_request([5, 6, 7], max_new_tokens=3)
    b = engine.add_request([8, 9], max_new_tokens=3, arrival_s=5.0)
    checkpoint = engine.kv.checkpoint
    monkeypatch.setattr(engine.kv, "checkpoint", lambda: (wall.__setitem__(0, 10.0), checkpoint()))
    monkeypatch.setattr(engine.session, "extend", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    r = engine._requests[b]
    assert (r.status, r.seq_id, engine._pending, engine.kv.seq_ids) == ("pending", None, [(5.0, b)], [])
    assert engine.abort(b).finish_reason == "abort" and not engine._pending
    monkeypatch.undo()
    assert engine.run()[a].token_ids == _alone((5, 6, 7), 3) and engine.kv.allocator.num_free == 16


# ---------------------------------------------------------------------- refused at the door, never stuck
def test_max_model_len_beyond_the_models_positions_is_refused(model):
    with pytest.raises(ValueError, match="max_model_len.*1024"):
        Engine(model, num_pages=8, max_model_len=5000)


@pytest.mark.parametrize(
    "engine_kw, prompt, match",
    [
        (dict(num_pages=100, page_size=1, max_model_len=200), 100, "watermark"),
        (dict(num_pages=10, page_size=1, reservation=Reservation("paged", watermark=0.99)), 8, "watermark"),
        (
            dict(num_pages=10, page_size=1, max_batched_tokens=8, reservation=Reservation("paged", watermark=0.3)),
            9,
            "watermark",
        ),
    ],
)
def test_a_request_the_admission_rule_can_never_admit_is_refused(engine_kw, prompt, match):
    """Issue 48: such a request was queued, then every run() raised 'the scheduler planned no tokens'."""
    engine = Engine(None, **engine_kw)
    with pytest.raises(ValueError, match=f"can never be served.*{match}"):
        engine.add_request(list(range(prompt)), max_new_tokens=1)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(num_pages=41, page_size=1, max_num_seqs=64, max_batched_tokens=512, preemption="swap",
             prefix_caching=True, reservation=Reservation("paged", watermark=0.1)),
        dict(num_pages=20, page_size=2, max_num_seqs=64, max_batched_tokens=512, preemption="swap",
             reservation=Reservation("paged", watermark=0.1)),
    ],
)  # fmt: skip
def test_swap_with_a_watermark_never_stalls(engine_kw):
    """Issue 48: the random test stopped for good here; every request that is accepted now finishes."""
    import random

    rng = random.Random(48)
    engine = Engine(None, **engine_kw)
    accepted = 0
    for _ in range(40):
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, 20))]
        try:
            engine.add_request(prompt, max_new_tokens=rng.randint(1, 20))
            accepted += 1
        except ValueError as e:
            assert "can never be served" in str(e)
    outs = engine.run()
    assert accepted >= 30 and all(o.finish_reason == "length" for o in outs)
    assert engine.kv.allocator.num_free == engine.kv.num_pages
