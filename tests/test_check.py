"""paged_ref.lab.check: every checker passes a correct solution and catches every listed mutant."""

import json
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from check_mutants import ALSO_CORRECT, MUTANTS, SOLUTIONS

import paged_ref as pr
from paged_ref.lab import check

EX1 = Path(__file__).resolve().parent.parent / "notebooks" / "exercises" / "ex1_allocator_and_slots.ipynb"
CHECKERS = {
    "allocator": check.check_allocator,
    "slot_mapping": check.check_slot_mapping,
    "paged_attention": check.check_paged_attention,
    "token_scores": check.check_token_scores,
    "page_scores": check.check_page_scores,
    "eviction_policy": check.check_eviction_policy,
    "scheduler": check.check_scheduler,
    "prefix_cache": check.check_prefix_cache,
    "merge_states": check.check_merge_states,
    "quest": check.check_quest,
    "quantize": check.check_quantize,
    "dequantize": check.check_dequantize,
    "page_write": check.check_page_write,
}


@pytest.mark.parametrize("name", sorted(CHECKERS))
def test_a_correct_solution_passes(name):
    report = CHECKERS[name](SOLUTIONS[name])
    assert report.passed and bool(report) and report.failure is None, str(report)
    assert str(report).startswith(f"PASS {name}: {report.cases_run} cases")


@pytest.mark.parametrize(
    "name, attempt", [pytest.param(n, a, id=f"{n}-{a.__name__}") for n, As in sorted(ALSO_CORRECT.items()) for a in As]
)
def test_other_correct_attempts_pass(name, attempt):
    report = CHECKERS[name](attempt)
    assert report.passed, str(report)


def test_a_float32_answer_passes_and_says_to_what_precision():
    import check_mutants

    report = check.check_paged_attention(check_mutants.float32_attention)
    assert report.passed and "checked to float32 precision" in str(report)
    assert "note" not in str(check.check_paged_attention(SOLUTIONS["paged_attention"]))


@pytest.mark.parametrize(
    "name, mutant", [pytest.param(n, m, id=f"{n}-{m.__name__}") for n, ms in sorted(MUTANTS.items()) for m in ms]
)
def test_every_mutant_is_caught_with_a_case_and_a_hint(name, mutant):
    report = CHECKERS[name](mutant)
    assert not report.passed and not report.not_implemented
    text = str(report)
    assert text.startswith(f"FAIL {name}") and "expected:" in text and "got:" in text and "hint:" in text
    assert report.failure.case and report.failure.hint
    with pytest.raises(AssertionError, match=f"FAIL {name}"):
        report.raise_if_failed()


def test_the_allocation_order_hint_says_what_exercise_1_says():
    """The hint for pages handed out in the wrong order quotes the notebook's rule, which names no free list."""
    import check_mutants

    intro = "".join(json.loads(EX1.read_text())["cells"][0]["source"])
    hint = check.check_allocator(check_mutants.SetOrderFreeAllocator).failure.hint
    rule = hint.split("oldest returned first (")[1].split(")")[0]
    assert rule in intro and "then pages that were returned, oldest returned first" in hint
    assert "free list" not in hint


@pytest.mark.parametrize(
    "mutant, words",
    [
        ("NoRefcountAllocator", "free drops one"),
        ("NewestFirstAllocator", "oldest returned first"),
        ("NonAtomicAllocator", "must take nothing"),
        ("NonAtomicFreeAllocator", "a failing free must change nothing"),
        ("AllocateReturnsNoneAllocator", "allocate returned None"),
        ("NumFreeFreshOnlyAllocator", "num_free is wrong although every refcount is right"),
        ("ShareUnheldAllocator", "sharing a page that is not held"),
        ("SetOrderFreeAllocator", "the pages one call frees count as returned in the order listed"),
    ],
)
def test_allocator_failures_shrink_to_a_few_calls(mutant, words):
    import check_mutants

    report = check.check_allocator(getattr(check_mutants, mutant))
    calls = report.failure.case.splitlines()[1:]
    assert 1 <= len(calls) <= 4, report.failure.case
    assert "<- here" in calls[-1] and words in report.failure.hint


@pytest.mark.parametrize(
    "mutant, words",
    [
        ("short_by_one_attention", "one token short"),
        ("long_by_one_attention", "one token too many"),
        ("no_block_table_attention", "through the block table"),
        ("unstable_softmax_attention", "subtract each row's max"),
        ("wrong_gqa_attention", "h // (num_q_heads // num_kv_heads)"),
        ("inverted_token_scores", "inverted"),
        ("full_page_divisor_page_scores", "last page may hold fewer"),
        ("logical_slot_mapping", "logical positions"),
        ("float_slot_mapping", "whole numbers"),
        ("none_slot_mapping", "returned None"),
        ("list_slot_mapping", "return an int64 tensor"),
        ("numpy_slot_mapping", "return an int64 tensor"),
        ("int32_slot_mapping", "return int64 slots"),
        ("no_dtype_slot_mapping", "torch.tensor([]) is a float tensor"),
        ("inplace_scale_attention", "must only read its inputs"),
        ("zero_kv_attention", "changed k_cache, v_cache in place"),
        ("overwrite_table_attention", "changed block_table in place"),
        ("meta_attention", "meta device"),
        ("ignores_scale_attention", "scale argument is ignored"),
        ("unscaled_attention", "not scaled"),
        ("reads_padding_attention", "block table's padding"),
        ("ArgmaxPolicy", "highest-scoring page"),
        ("FifoPolicy", "first in, first out"),
        ("KeepNewestOnlyPolicy", "kept only the newest page"),
        ("PageBudgetPolicy", "budget is in tokens"),
        ("OverBudgetPolicy", "drop the lowest-scoring candidate page in this after_append"),
        ("LeakyPolicy", "back to the allocator"),
        ("DropsNewestPolicy", "never evict the page just written"),
        ("UnreservedSinkPolicy", "attention sink and is reserved"),
        ("ValueNormPolicy", "by ||V|| alone"),
        ("InverseKeyNormPolicy", "by 1/||K|| alone"),
        ("FirstLayerPolicy", "from layer 0 only"),
        ("LastLayerPolicy", "from the last layer only"),
        ("AllHeadsNormPolicy", "one norm over all KV heads together"),
        ("RatioOfMeansPolicy", "a ratio of means"),
        ("FreesSequencePolicy", "never the whole sequence"),
        ("StaleIndicesPolicy", "computed before the first drop_pages call"),
        ("PhysicalIdsPolicy", "you passed physical page ids"),
        ("NewestCandidatePolicy", "if your candidates included the newest page: it is reserved"),
        ("PageRoomPolicy", "counts the tokens held (cache.seq_len), not the room of their pages"),
        ("DecodePagesPolicy", "drop the lowest-scoring candidate page in this after_append"),
        ("LifoScheduler", "arrival order, oldest first, not newest"),
        ("PreemptOldestScheduler", "most recently admitted running request (the end of the running list) goes first"),
        ("SelfVictimScheduler", "not the request that needs the page"),
        ("NoFreeScheduler", "pool.free(req)"),
        ("SkipInsteadOfPreemptScheduler", "preemption: a row needs pages and none are free"),
        ("DecodeOutsideBudgetScheduler", "decode rows count too"),
        ("FirstChunkAdmissionScheduler", "whole-prompt admission"),
        ("ShortChunkScheduler", "chunk size off by one"),
        ("LongChunkScheduler", "more than max_batched_tokens"),
        ("PreemptedToBackScheduler", "back to the front of the waiting queue"),
        ("PreemptedInOrderScheduler", "the one preempted second is first"),
        ("FloorPagesScheduler", "a partly filled last page counts"),
        ("NoChunkedPrefillScheduler", "chunked prefill"),
        ("NoMaxSeqsScheduler", "max_num_seqs"),
        ("SkipAheadScheduler", "blocks the ones behind it"),
        ("PromptOnlyScheduler", "its prompt and the tokens it had generated"),
        ("KeyAlonePrefixCache", "never by the key alone"),
        ("OnePagePerKeyPrefixCache", "take the one published first"),
        ("FirstPageOnlyPrefixCache", "several pages can hold one key"),
        ("LastTokenPrefixCache", "leave the prompt's last token to compute"),
        ("PartialPagePrefixCache", "a partial last page never"),
        ("NoForgetPrefixCache", "forget its key"),
        ("NoRevivePrefixCache", "a freed page keeps its cached prefix"),
        ("StackFreePrefixCache", "least recently freed first"),
        ("CachedFirstPrefixCache", "a plain free page"),
        ("HeadFirstFreePrefixCache", "tail first"),
        ("PromptOnlyPublishPrefixCache", "also one that generated tokens filled"),
        ("ParentlessKeyPrefixCache", "the key chains the parent's key"),
        ("FreePagesFirstPrefixCache", "never-used pages are handed out first"),
        ("NoShareRefcountPrefixCache", "a hit adds a reference"),
        ("PagesNotTokensPrefixCache", "not pages"),
        ("WalksPastMissPrefixCache", "the walk stops at the first miss"),
        ("natural_exp_merge_states", "lse is in base 2"),
        ("unstable_merge_states", "subtract the larger lse first"),
        ("unnormalised_merge_states", "divide by the sum of the weights"),
        ("max_lse_merge_states", "not the larger lse alone"),
        ("sum_lse_merge_states", "not lse_a + lse_b"),
        ("log_lse_merge_states", "not log"),
        ("mean_merge_states", "a plain mean"),
        ("swapped_merge_states", "goes with o_a"),
        ("float32_merge_states", "float64 in, float64 out"),
        ("inplace_merge_states", "must only read its inputs"),
        ("broadcast_merge_states", "unsqueeze it over head_dim"),
        ("output_only_merge_states", "return o, lse"),
        ("nan_empty_merge_states", "an empty part (lse = -inf) must weigh 0"),
        ("ZeroPaddedQuest", "the last page holds only its own tokens"),
        ("ChannelCollapsedQuest", "per channel"),
        ("HeadsCollapsedQuest", "per KV head"),
        ("KmaxBoundQuest", "a negative q_i takes the key's smallest coordinate"),
        ("CentreBoundQuest", "the centre of the box is not an upper bound"),
        ("AbsBoundQuest", "not Quest's tightest one"),
        ("NoNewestQuest", "always read"),
        ("FirstPageQuest", "always read"),
        ("SmallestQuest", "LARGEST bounds"),
        ("MeanGroupQuest", "not their sum or mean"),
        ("SumGroupQuest", "not their sum or mean"),
        ("ModuloHeadsQuest", "not h % num_kv_heads"),
        ("UnsortedQuest", "increasing order"),
        ("ExtraNewestQuest", "the newest page counts in the budget"),
        ("FewPagesQuest", "at most budget pages, every page is read"),
        ("times_scale_quantize", "quantize divides by the scale"),
        ("divided_quantize", "multiply by the reciprocal in float32"),
        ("no_clamp_quantize", "int8 wraps around"),
        ("asymmetric_quantize", "-128 is never written"),
        ("truncating_quantize", "alone truncates toward zero"),
        ("floor_quantize", "not down (floor)"),
        ("half_away_quantize", "ties go to even"),
        ("float_result_quantize", "cast to the format"),
        ("inplace_quantize", "compute new tensors"),
        ("divided_dequantize", "dequantize multiplies by the scale"),
        ("float64_dequantize", "the values in float32"),
        ("unconverted_dequantize", "convert q to float32 first"),
        ("SquaredRatioPolicy", "the squared ratio"),
        ("L1NormPolicy", "you took L1 norms"),
        ("MaxOverHeadsPolicy", "the largest KV head"),
        ("no_requant_page_write", "re-quantize its earlier tokens"),
        ("shrinking_page_write", "the scale never shrinks"),
        ("one_scale_page_write", "one scale per KV head"),
        ("truncating_page_write", "re-quantize to nearest"),
        ("no_nextafter_page_write", "one float32 step up (torch.nextafter)"),
        ("at_zero_page_write", "the new tokens go at offset"),
        ("inplace_page_write", "return a new page and scale"),
        ("last_token_page_write", "over every new token"),
    ],
)
def test_hints_name_the_mistake(mutant, words):
    import check_mutants

    name = next(n for n, ms in MUTANTS.items() if any(m.__name__ == mutant for m in ms))
    assert words in CHECKERS[name](getattr(check_mutants, mutant)).failure.hint


def test_package_reference_passes_its_own_checkers():
    assert check.check_allocator(pr.PageAllocator).passed
    assert check.check_slot_mapping(pr.slot_mapping).passed
    assert check.check_paged_attention(pr.reference_paged_decode).passed


def test_triton_checker_passes_the_kernel_and_catches_a_short_length():
    assert check.check_triton_decode(pr.triton_paged_decode).passed

    def short(q, k_cache, v_cache, block_table, seq_lens, scale=None):
        return pr.triton_paged_decode(q, k_cache, v_cache, block_table, (seq_lens - 1).clamp(min=1), scale=scale)

    report = check.check_triton_decode(short)
    assert not report.passed and "one token short" in report.failure.hint


def test_triton_checker_names_the_interpreter_when_the_call_raises_on_cpu():
    def raises(q, k_cache, v_cache, block_table, seq_lens, scale=None):
        raise RuntimeError("0 active drivers ([]). There should only be one.")  # a compiled-mode kernel on CPU

    report = check.check_triton_decode(raises)
    assert not report.passed and "RuntimeError" in report.failure.got
    if not torch.cuda.is_available():
        assert "TRITON_INTERPRET=1" in report.failure.hint


WRONG_SCORES = {
    "ValueNormPolicy": "by ||V|| alone",
    "FirstLayerPolicy": "from layer 0 only",
    "LastLayerPolicy": "from the last layer only",
    "AllHeadsNormPolicy": "one norm over all KV heads together",
    "RatioOfMeansPolicy": "a ratio of means",
}


@pytest.mark.parametrize("mutant", sorted(WRONG_SCORES))
def test_wrong_page_scores_fail_on_other_seeds_and_budgets(mutant):
    """The checker's K/V make each wrong score rank the pages differently from the task's, whatever the
    seed and budget (seed 0 with budget 24 is the test above), and the hint names the wrong score."""
    import check_mutants

    for seed, budget in ((1, 24), (3, 32), (5, 32)):
        report = check.check_eviction_policy(getattr(check_mutants, mutant), seed=seed, budget=budget)
        assert not report.passed and WRONG_SCORES[mutant] in report.failure.hint, (seed, budget, str(report))


def test_the_solutions_pass_on_other_seeds_and_budgets():
    from check_mutants import SumScoresPolicy

    for seed, budget in ((1, 24), (3, 32), (5, 32)):
        for policy in (SOLUTIONS["eviction_policy"], SumScoresPolicy):
            assert check.check_eviction_policy(policy, seed=seed, budget=budget).passed, (policy, seed, budget)


def test_eviction_policy_matches_a_named_reference():
    from paged_ref.eviction import make_policy

    same = check.check_eviction_policy(lambda c: make_policy("paged_eviction", c), reference="paged_eviction")
    assert same.passed, str(same)
    other = check.check_eviction_policy(lambda c: make_policy("streaming_llm", c), reference="paged_eviction")
    assert not other.passed and "paged_eviction" in other.failure.expected


@pytest.mark.parametrize("page_size", [1, 3, 8])
@pytest.mark.parametrize("seed", [0, 7, 13])
def test_the_decoy_prompt_makes_three_wrong_scores_keep_the_page_the_task_drops(page_size, seed):
    """In the last prompt (C + B tokens, C = 3B) the task's score ranks page 1 lowest of the candidates and
    page 2 next; the squared ratio, L1 norms and the largest KV head each rank page 1 above page 2."""
    from paged_ref.lab.check.eviction import _Driver, _page_scores, _score_variants

    prompt = 4 * page_size
    d = _Driver(None, 3 * page_size, page_size, prompt, 0, 16, seed=seed, sink_lowest=False, decoy=True)
    d.write(0, prompt)
    scores = _page_scores(d.cache, d.seq)  # [4]
    assert torch.allclose(scores.double(), d.levels[:4], rtol=1e-4)
    assert scores[1] < scores[2]  # pages 1 and 2: the only candidates (0 and 3 are reserved)
    variants = _score_variants(d.cache, d.seq)
    for name in ("squared_ratio", "l1_norms", "max_over_heads"):
        assert variants[name][1] > variants[name][2], name


def test_the_reference_mode_says_what_the_reference_does():
    """The exercise's own policy (page-level prefill) is not the package's paged_eviction (token-level
    prefill): asked to equal it, the hint says what the reference does at prefill and that page 0 is kept."""
    report = check.check_eviction_policy(SOLUTIONS["eviction_policy"], reference="paged_eviction")
    assert not report.passed
    assert "top-budget tokens" in report.failure.hint and "page 0 and the newest page reserved" in report.failure.hint


def test_the_constructed_kv_make_the_scores_decide():
    """The task's page score is the level drawn per page (distinct levels); in the last prompt page 0
    scores lowest (the task keeps it: the sink); every wrong score of the hints orders the pages
    differently, and ||K|| alone does not give the order."""
    from paged_ref.lab.check.eviction import _Driver, _page_scores, _score_variants

    for sink_lowest in (False, True):
        d = _Driver(None, 24, 8, 160, 0, 24, seed=5, sink_lowest=sink_lowest)
        d.write(0, 160)
        scores = _page_scores(d.cache, d.seq)  # [20]
        assert torch.allclose(scores.double(), d.levels[:20], rtol=1e-4)
        assert len(set(scores.tolist())) == 20 and (int(scores.argmin()) == 0) == sink_lowest
        assert d.kept() == list(range(160))
        for name, wrong in _score_variants(d.cache, d.seq).items():
            assert wrong.argsort().tolist() != scores.argsort().tolist(), name


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: check.check_allocator(SOLUTIONS["allocator"], cases=0), "cases must be >= 1"),
        (lambda: check.check_allocator(SOLUTIONS["allocator"], cases=-3), "cases must be >= 1"),
        (lambda: check.check_allocator(SOLUTIONS["allocator"], ops_per_case=0), "ops_per_case must be >= 1"),
        (lambda: check.check_slot_mapping(SOLUTIONS["slot_mapping"], cases=0), "cases must be >= 3"),
        (lambda: check.check_paged_attention(SOLUTIONS["paged_attention"], repeats=0), "repeats must be >= 1"),
        (lambda: check.check_eviction_policy(SOLUTIONS["eviction_policy"], steps=0), "steps must be >= 1"),
        (lambda: check.check_eviction_policy(SOLUTIONS["eviction_policy"], budget=8), "budget must be >= 2 * page"),
        (lambda: check.check_eviction_policy(SOLUTIONS["eviction_policy"], reference="bogus"), "reference must be"),
        (lambda: check.check_page_scores(SOLUTIONS["page_scores"], time_limit=0), "time_limit must be"),
        (lambda: check.check_scheduler(SOLUTIONS["scheduler"], streams=0), "streams must be >= 1"),
        (lambda: check.check_prefix_cache(SOLUTIONS["prefix_cache"], cases=0), "cases must be >= 1"),
    ],
)
def test_a_graders_wrong_argument_raises_instead_of_judging_the_student(call, words):
    with pytest.raises((ValueError, TypeError), match=re.escape(words)):
        call()


def test_an_endless_loop_fails_its_case_at_the_time_limit():
    import check_mutants

    start = time.perf_counter()
    report = check.check_allocator(check_mutants.LoopingAllocator, time_limit=0.3)
    assert time.perf_counter() - start < 5
    assert not report.passed and "time limit of 0.3 s" in report.failure.expected and "<- here" in report.failure.case

    def stubborn(q, k_cache, v_cache, block_table, seq_lens, scale=None):
        while True:  # a loop whose own `except Exception` swallows everything it can
            try:
                time.sleep(0.01)
            except Exception:
                pass

    report = check.check_paged_attention(stubborn, time_limit=0.3)
    assert not report.passed and "still running" in report.failure.got


def test_a_graders_own_alarm_reaches_the_grader():
    """A grader's timer that fires inside a looping attempt: its exception propagates (the old checker
    took it for the student's failure and then ran the looping attempt again, forever)."""
    import check_mutants

    class GraderAlarm(Exception):
        pass

    def on_alarm(signum, frame):
        raise GraderAlarm()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    start = time.perf_counter()
    try:
        with pytest.raises(GraderAlarm):
            check.check_allocator(check_mutants.LoopingAllocator)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.perf_counter() - start < 5


def test_off_the_main_thread_a_slow_case_is_measured_after_it_returns():
    def slow(k, v):
        time.sleep(0.3)
        return SOLUTIONS["token_scores"](k, v)

    reports = []
    worker = threading.Thread(target=lambda: reports.append(check.check_token_scores(slow, time_limit=0.1)))
    worker.start()
    worker.join()
    assert not reports[0].passed and "time limit of 0.1 s" in reports[0].failure.expected


def test_a_slow_attempt_shows_a_progress_line(monkeypatch, capsys):
    import check_mutants

    from paged_ref.lab.check import report as report_module

    monkeypatch.setattr(report_module, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(check_mutants.SlowAllocator, "delay", 0.001)
    assert check.check_allocator(check_mutants.SlowAllocator, cases=5).passed
    err = capsys.readouterr().err
    assert "allocator: case 1 of 5" in err and err.rstrip().endswith("allocator: PASS after 0 s")
    monkeypatch.undo()  # the default threshold: a fast attempt prints nothing
    assert check.check_allocator(SOLUTIONS["allocator"], cases=5).passed
    assert capsys.readouterr().err == ""


def test_token_score_cases_show_values():
    import check_mutants

    case = check.check_token_scores(check_mutants.inverted_token_scores).failure.case
    assert "k = [[[" in case and "v = [[[" in case


@pytest.mark.parametrize("name", sorted(CHECKERS))
def test_a_skeleton_reports_not_implemented_yet(name):
    class Skeleton:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError

    def skeleton(*args, **kwargs):
        raise NotImplementedError

    classes = ("allocator", "eviction_policy", "scheduler", "prefix_cache", "quest")
    report = CHECKERS[name](Skeleton if name in classes else skeleton)
    assert report.not_implemented and not report.passed
    assert str(report) == f"TODO {name}: not implemented yet (the function raised NotImplementedError)"


def test_a_meta_tensor_is_a_wrong_return_not_a_missing_implementation():
    import check_mutants

    report = check.check_paged_attention(check_mutants.meta_attention)
    assert not report.not_implemented and "meta device" in report.failure.got


def test_other_exceptions_are_failures_of_a_case():
    def broken(q, k_cache, v_cache, block_table, seq_lens, scale=None):
        return q @ k_cache  # wrong shapes: raises

    report = check.check_paged_attention(broken)
    assert not report.passed and "RuntimeError" in report.failure.got and "batch=1" in report.failure.case


def test_reports_display_in_notebooks():
    report = check.check_page_scores(SOLUTIONS["page_scores"])
    shown = []

    class Printer:
        def text(self, s):
            shown.append(s)

    report._repr_pretty_(Printer(), False)
    assert shown == [str(report)]
    assert torch.is_tensor(SOLUTIONS["page_scores"](torch.rand(5), 2))
