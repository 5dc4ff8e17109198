"""Exercises 5-7's checkers: their oracles, their hand-made cases, and bad student objects.

A student's object that lacks a method, returns the wrong type, raises or loops gets a FAIL report
that names what is wrong, never a traceback out of the checker and never a hang.
"""

import inspect
import json
import time
from pathlib import Path

import pytest
import torch
from check_mutants import SOLUTIONS, _variant

from paged_ref.attention import quest
from paged_ref.attention.cascade import merge_states
from paged_ref.lab import check
from paged_ref.lab.check import prefix_cache, scheduler


def _ref_steps(stream):
    """Per step of the reference: (rows, preempted, holding, finished), and the queues before it."""
    ref = scheduler._Reference(stream)
    steps = []
    for step in range(scheduler.MAX_STEPS):
        for i, (_, _, a) in enumerate(stream.requests):
            if a == step:
                ref.add(i)
        before = ref.queues()
        steps.append((before, *ref.step()))
        if not steps[-1][1] and step >= max(a for _, _, a in stream.requests):
            return steps, ref
    raise AssertionError("the stream did not end")


def test_the_edge_cases_are_what_their_names_say():
    cases = {s.name.split(" (")[0]: s for s in scheduler.EDGE_CASES}
    steps, _ = _ref_steps(cases["a pool exactly full"])
    assert max(sum(h.values()) for _, _, _, h, _ in steps) == 4  # every page held
    steps, _ = _ref_steps(cases["a prompt longer than the budget"])
    assert steps[0][1] == {0: 4}  # 11 tokens fed in chunks of the budget
    steps, _ = _ref_steps(cases["a preemption that cascades over two requests"])
    assert max(len(p) for _, _, p, _, _ in steps) == 2
    steps, _ = _ref_steps(cases["requests that finish in the step they are admitted"])
    assert any(i in done and i not in before[0] for before, _, _, _, done in steps for i in done)
    steps, ref = _ref_steps(cases["a request that can never fit"])
    assert ref.queues() == ([], [1, 2])  # it never runs, and blocks the one behind it


def test_a_stream_of_the_checker_ends_and_random_streams_are_small():
    import random

    rng = random.Random(0)
    for _ in range(20):
        s = scheduler.random_stream(rng)
        assert all(p + m - 1 <= s.num_pages * s.page_size for p, m, _ in s.requests)
        steps, ref = _ref_steps(s)
        assert ref.queues() == ([], [])


def test_the_hostile_prefix_cases_hit_what_they_test():
    hits = {}
    for case in prefix_cache.HOSTILE_CASES:
        ref = prefix_cache._Reference(case)
        found = []
        for op in case.ops:
            if op[0] == "start":
                found.append(ref.start(op[1], op[2]))
                if op[2][found[-1] :]:
                    ref.append(op[1], list(op[2][found[-1] :]), False)
            elif op[0] == "gen":
                ref.append(op[1], list(op[2]), True)
            else:
                ref.free(op[1])
        hits[case.name.split(" (")[0].split(":")[0]] = found
    assert hits["pages freed and handed out again before their cached prefix is found"] == [0, 0, 4]
    assert hits["a partial last page"] == [0, 8, 4]
    assert hits["the same page of tokens after another prefix"] == [0, 0, 2]
    assert hits["pages filled by generated tokens, and one prefix computed twice"] == [0, 4, 0, 2, 4, 0, 4]
    assert hits["a forced key collision"] == [0, 8, 16, 16]
    assert hits["a miss ends the walk"] == [0, 4]  # page 2's key and tokens match seq 0's page 2
    assert prefix_cache.colliding_hash(b"", (1, 2, 3, 4)) == prefix_cache.colliding_hash(b"", (2, 1, 4, 3))
    assert prefix_cache.sha_hash(b"", (1, 2, 3, 4)) != prefix_cache.sha_hash(b"", (2, 1, 4, 3))


def test_the_package_passes_exercise_7s_checkers():
    assert check.check_merge_states(merge_states).passed

    class PackageQuest:
        def summaries(self, k, page_size):
            return SOLUTIONS["quest"]().summaries(k, page_size)

        def bound(self, q, k_min, k_max):
            return quest.page_bounds(q, k_min, k_max)

        def select(self, q, k_min, k_max, budget):
            return SOLUTIONS["quest"]().select(q, k_min, k_max, budget)

    assert check.check_quest(PackageQuest).passed


# ------------------------------------------------------------------ bad student objects
class NoFinish:
    def __init__(self, pool, *, max_num_seqs, max_batched_tokens):
        self.inner = SOLUTIONS["scheduler"](pool, max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens)

    def add(self, req):
        self.inner.add(req)

    def schedule(self):
        return self.inner.schedule()


class ReturnsDict(NoFinish):
    def schedule(self):
        return {r.id: n for r, n in self.inner.schedule()}

    def finish(self, req):
        self.inner.finish(req)


class ReturnsIds(ReturnsDict):
    def schedule(self):
        return [(r.id, n) for r, n in self.inner.schedule()]


class Raises(ReturnsDict):
    def schedule(self):
        raise KeyError("oops")


class Loops(ReturnsDict):
    def schedule(self):
        while True:
            pass


class NoPages(SOLUTIONS["prefix_cache"]):
    pages = None


class PagesAsString(SOLUTIONS["prefix_cache"]):
    def pages(self, seq_id):
        return str(super().pages(seq_id))


class StartReturnsNone(SOLUTIONS["prefix_cache"]):
    def start(self, seq_id, prompt):
        super().start(seq_id, prompt)


class LoopingCache(SOLUTIONS["prefix_cache"]):
    def free(self, seq_id):
        while True:
            pass


class NoHash(SOLUTIONS["prefix_cache"]):
    def _key(self, parent, tokens):
        return (parent, tuple(tokens))


class NoneRootKey(SOLUTIONS["prefix_cache"]):
    def _key(self, parent, tokens):
        return self.hash_fn(parent or None, tuple(tokens))


class QuestNoSelect:
    def summaries(self, k, page_size):
        return SOLUTIONS["quest"]().summaries(k, page_size)

    def bound(self, q, k_min, k_max):
        return SOLUTIONS["quest"]().bound(q, k_min, k_max)


class QuestListSelect(QuestNoSelect):
    def select(self, q, k_min, k_max, budget):
        return SOLUTIONS["quest"]().select(q, k_min, k_max, budget).tolist()


class QuestLoops(QuestNoSelect):
    def select(self, q, k_min, k_max, budget):
        while True:
            pass


def _merge_raises(o_a, lse_a, o_b, lse_b):
    raise ValueError("not today")


def _merge_loops(o_a, lse_a, o_b, lse_b):
    while True:
        pass


@pytest.mark.parametrize(
    "checker, attempt, words",
    [
        (check.check_scheduler, NoFinish, "AttributeError"),
        (check.check_scheduler, ReturnsDict, "returns a list of (req, num_tokens) pairs, got a dict"),
        (check.check_scheduler, ReturnsIds, "must be one of the Req objects"),
        (check.check_scheduler, Raises, "KeyError"),
        (check.check_scheduler, Loops, "time limit"),
        (check.check_prefix_cache, NoPages, "TypeError"),
        (check.check_prefix_cache, PagesAsString, "list of int page ids"),
        (check.check_prefix_cache, StartReturnsNone, "number of cached tokens"),
        (check.check_prefix_cache, LoopingCache, "time limit"),
        (check.check_prefix_cache, NoHash, "hash_fn given to __init__"),
        (check.check_prefix_cache, NoneRootKey, 'parent_key is bytes, b"" for a sequence\'s first page'),
        (check.check_quest, QuestNoSelect, "AttributeError"),
        (check.check_quest, QuestListSelect, "int64 page indices"),
        (check.check_quest, QuestLoops, "time limit"),
        (check.check_merge_states, _merge_raises, "ValueError: not today"),
        (check.check_merge_states, _merge_loops, "time limit"),
    ],
)
def test_a_bad_attempt_fails_with_a_report_that_names_it(checker, attempt, words):
    start = time.perf_counter()
    report = checker(attempt, time_limit=0.5)
    assert time.perf_counter() - start < 10
    assert not report.passed and not report.not_implemented
    text = str(report)
    assert text.startswith("FAIL") and words in text, text


# ------------------------------------------------------------------ a raise inside the student's code
class FreeRaises(SOLUTIONS["prefix_cache"]):
    def free(self, seq_id):
        raise KeyError(seq_id)


class BoundTypo(QuestNoSelect):
    def bound(self, q, k_min, k_max):
        return torch.maximum(q * k_min, q * k_max).sum(-1) + self.offset


class BoundList(QuestNoSelect):
    def bound(self, q, k_min, k_max):
        return SOLUTIONS["quest"]().bound(q, k_min, k_max).tolist()


@pytest.mark.parametrize(
    "checker, attempt, fn",
    [
        (check.check_scheduler, Raises, Raises.schedule),
        (check.check_prefix_cache, FreeRaises, FreeRaises.free),
        (check.check_quest, BoundTypo, BoundTypo.bound),
        (check.check_merge_states, _merge_raises, _merge_raises),
    ],
)
def test_a_raise_in_the_students_own_code_is_shown_at_its_line(checker, attempt, fn):
    report = checker(attempt)
    source, first = inspect.getsourcelines(fn)
    line = f"in {fn.__name__}, line {first + 1}: {source[1].strip()}"  # each raises on its second line
    assert report.failure.hint.startswith(f"your own code raised it {line}"), report.failure.hint
    assert "Traceback" not in str(report)


@pytest.mark.parametrize(
    "checker, attempt, interface",
    [
        (check.check_scheduler, NoFinish, "the class needs __init__(pool, *, max_num_seqs, max_batched_tokens)"),
        (check.check_prefix_cache, NoPages, "the class needs __init__(num_pages, page_size, hash_fn)"),
        (check.check_quest, QuestNoSelect, "select(q [num_q_heads, head_dim]"),
    ],
)
def test_a_missing_method_gets_the_interface_not_a_line(checker, attempt, interface):
    assert checker(attempt).failure.hint.startswith(interface)


def test_a_prefix_cache_that_raises_shows_the_calls_up_to_the_one_that_raised():
    failure = check.check_prefix_cache(FreeRaises).failure
    calls = failure.case.splitlines()
    assert calls[1:] == [
        "c = FreeRaises(4, 4, sha_hash)",
        "c.start(0, [0, 1, 2, 3, 4, 5, 6, 7, 8])   -> 0",
        "c.append(0, [0, 1, 2, 3, 4, 5, 6, 7, 8])   -> pages [0, 1, 2]",
        "c.free(0)   <- here",
    ], failure.case
    failure = check.check_prefix_cache(PagesAsString).failure
    assert failure.case.splitlines()[-2:] == ["c.start(0, [0, 1, 2, 3, 4, 5, 6, 7, 8])", "c.pages(0)   <- here"]


def test_a_bound_that_returns_a_list_is_told_to_return_a_tensor():
    failure = check.check_quest(BoundList).failure
    assert failure.got == "list" and failure.hint.startswith("bound returns a tensor"), failure


# ------------------------------------------------------------------ what the scheduler's text says
def test_rule_3_follows_from_rule_4_as_exercise_5_says():
    """A step that preempted could not admit anyway: the request just preempted is at the front of the
    queue and its whole sequence never fits the pages left. So a scheduler that skips rule 3 passes."""
    admits_anyway = _variant("AdmitsAfterPreemption", "Ignores rule 3.", admit_after_preempt=True)
    assert check.check_scheduler(admits_anyway).passed
    text = _exercise_text("ex5_scheduler.ipynb")
    assert "follows from rules 2 and 4" in text


def test_a_prefill_is_never_ahead_of_a_decode_so_its_chunk_is_min_of_tokens_left_and_budget_left():
    """Rule 1's chunk, min(remaining, budget left), needs no room kept for decodes after it: in the
    checker's streams the one request still feeding its prompt is the newest running one."""
    import random

    rng = random.Random(0)
    for stream in list(scheduler.EDGE_CASES) + [scheduler.random_stream(rng) for _ in range(200)]:
        ref = scheduler._Reference(stream)
        for step in range(scheduler.MAX_STEPS):
            for i, (_, _, a) in enumerate(stream.requests):
                if a == step:
                    ref.add(i)
            left = [r.num_tokens - r.num_computed for r in ref.sched.running]
            assert all(n == 1 for n in left[:-1]), (stream, step, left)
            rows = ref.step()[0]
            if not rows and step >= max(a for _, _, a in stream.requests):
                break
    assert "a prefill min(tokens left, budget left)" in scheduler.RULES
    assert "min(remaining, budget left)" in _exercise_text("ex5_scheduler.ipynb")


def _exercise_text(name: str) -> str:
    """The markdown of an exercise notebook."""
    cells = json.loads((Path(__file__).parents[1] / "notebooks" / "exercises" / name).read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def test_exercise_7s_select_as_written_is_the_packages():
    """The last page, and the budget - 1 other pages with the largest scores: `quest.select_pages`."""
    g = torch.Generator().manual_seed(0)
    for num_pages, budget in ((2, 1), (5, 2), (9, 4), (12, 12)):
        bounds = torch.randn(3, num_pages, generator=g, dtype=torch.float64)
        bounds[0, -1] = 10.0  # the last page among the largest anyway
        others = bounds[:, :-1].topk(budget - 1, dim=-1).indices
        last = torch.full((3, 1), num_pages - 1)
        as_written = torch.cat([others, last], -1).sort(-1).values
        assert torch.equal(quest.select_pages(bounds, budget), as_written)
    assert "the `budget - 1` other pages with the largest scores" in _exercise_text("ex7_reading_fewer_pages.ipynb")


def test_a_scheduler_that_raises_is_shown_the_queues_of_that_step():
    case = check.check_scheduler(Raises).failure.case.splitlines()
    assert case[-1] == (
        "step 0, the one that raised; before it: running [] (oldest admission first), waiting [0, 1] (queue order), "
        "4 free pages"
    ), case
