"""paged_ref.check: every checker passes a correct solution and catches every listed mutant."""

import pytest
import torch
from check_mutants import MUTANTS, SOLUTIONS

import paged_ref as pr
from paged_ref import check

CHECKERS = {
    "allocator": check.check_allocator,
    "slot_mapping": check.check_slot_mapping,
    "paged_attention": check.check_paged_attention,
    "token_scores": check.check_token_scores,
    "page_scores": check.check_page_scores,
    "eviction_policy": check.check_eviction_policy,
}


@pytest.mark.parametrize("name", sorted(CHECKERS))
def test_a_correct_solution_passes(name):
    report = CHECKERS[name](SOLUTIONS[name])
    assert report.passed and bool(report) and report.failure is None, str(report)
    assert str(report).startswith(f"PASS {name}: {report.cases_run} cases")


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


@pytest.mark.parametrize(
    "mutant, words",
    [
        ("NoRefcountAllocator", "free drops one"),
        ("NewestFirstAllocator", "oldest returned first"),
        ("NonAtomicAllocator", "must take nothing"),
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
    ],
)
def test_hints_name_the_mistake(mutant, words):
    import check_mutants

    name = next(n for n, ms in MUTANTS.items() if any(m.__name__ == mutant for m in ms))
    assert words in CHECKERS[name](getattr(check_mutants, mutant)).failure.hint


def test_package_reference_passes_its_own_checkers():
    assert check.check_allocator(pr.PageAllocator).passed
    assert check.check_slot_mapping(pr.slot_mapping).passed
    assert check.check_paged_attention(pr.paged_attention_reference).passed


def test_triton_checker_passes_the_kernel_and_catches_a_short_length():
    assert check.check_triton_decode(pr.paged_decode).passed

    def short(q, k_cache, v_cache, block_table, seq_lens, scale=None):
        return pr.paged_decode(q, k_cache, v_cache, block_table, (seq_lens - 1).clamp(min=1), scale=scale)

    report = check.check_triton_decode(short)
    assert not report.passed and "one token short" in report.failure.hint


def test_triton_checker_names_the_interpreter_when_the_call_raises_on_cpu():
    def raises(q, k_cache, v_cache, block_table, seq_lens, scale=None):
        raise RuntimeError("0 active drivers ([]). There should only be one.")  # a compiled-mode kernel on CPU

    report = check.check_triton_decode(raises)
    assert not report.passed and "RuntimeError" in report.failure.got
    if not torch.cuda.is_available():
        assert "TRITON_INTERPRET=1" in report.failure.hint


def test_eviction_policy_matches_a_named_reference():
    from paged_ref.eviction import make_policy

    same = check.check_eviction_policy(lambda c: make_policy("paged_eviction", c), reference="paged_eviction")
    assert same.passed, str(same)
    other = check.check_eviction_policy(lambda c: make_policy("streaming_llm", c), reference="paged_eviction")
    assert not other.passed and "paged_eviction" in other.failure.expected


@pytest.mark.parametrize("name", sorted(CHECKERS))
def test_a_skeleton_reports_not_implemented_yet(name):
    class Skeleton:
        def __init__(self, *args):
            raise NotImplementedError

    def skeleton(*args, **kwargs):
        raise NotImplementedError

    report = CHECKERS[name](Skeleton if name in ("allocator", "eviction_policy") else skeleton)
    assert report.not_implemented and not report.passed
    assert str(report) == f"TODO {name}: not implemented yet (the function raised NotImplementedError)"


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
