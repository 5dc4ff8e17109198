"""Exercise 8's checkers: their cases hold what the exercise promises, the rule as written is the cache's,
and bad attempts get a report that names them."""

import inspect
import json
import math
import time
from pathlib import Path

import pytest
import torch

from paged_ref import quant
from paged_ref.lab import check
from paged_ref.lab.check import fewer_bytes


def _exercise_text() -> str:
    path = Path(__file__).parents[1] / "notebooks" / "exercises" / "ex8_fewer_bytes.ipynb"
    return "\n".join(
        "".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"
    )


def test_the_quantize_cases_hold_saturation_ties_and_reciprocal_traps():
    cases = {name: (x, scale, fmt) for name, x, scale, fmt in fewer_bytes._quantize_cases()}
    for fmt in (torch.int8, torch.float8_e4m3fn):
        top = fewer_bytes.TOP[fmt]
        (x, scale, _), *_ = [c for n, c in cases.items() if n.startswith(fewer_bytes._NAMES[fmt] + ", values that sat")]
        y = x * (1 / scale)
        assert (y > top).any() and (y < -top).any()
        (x, scale, _), *_ = [c for n, c in cases.items() if "round apart" in n and c[2] == fmt]
        divided = (x / scale).clamp(-top, top)
        divided = divided.round().to(fmt) if fmt == torch.int8 else divided.to(fmt)
        assert len(x) == 8 and (quant.quantize(x, scale, fmt).float() != divided.float()).all()
        (x, scale, _), *_ = [c for n, c in cases.items() if "per page and head" in n and c[2] == fmt]
        assert scale.shape[1] == 1 and scale.shape[3] == 1 and scale.shape[2] == x.shape[2] > 1
    x, scale, _ = cases["int8, exact ties (x.5 at scale 1)"]
    assert (x * (1 / scale) % 1 == 0.5).all()


def test_every_page_write_case_grows_a_scale_and_rewrites_earlier_bytes():
    """Each case makes a page's scale grow after its first write and changes a byte written before; the
    zero case keeps one head at scale 0 through its first write. The step up's edge case alone is one write:
    its scales are what it checks."""
    for name, ps, hkv, d, writes in fewer_bytes._page_write_cases():
        if "the step up's edge" in name:
            assert len(writes) == 1
            continue
        cache = fewer_bytes.PagedKVCache(
            num_layers=1, num_pages=1, page_size=ps, num_kv_heads=hkv, head_dim=d,
            kv_format=quant.KVFormat(torch.int8, scales="page"),
        )  # fmt: skip
        seq, grew, rewrote, offset = cache.add_sequence(), False, False, 0
        for k, v in writes:
            before = fewer_bytes._page_state(cache, 0)
            cache.write(0, cache.reserve(seq, k.shape[0]), k, v)
            after = fewer_bytes._page_state(cache, 0)
            if offset:
                grew |= bool((after[1] > before[1]).any() or (after[3] > before[3]).any())
                rewrote |= any(not torch.equal(after[i][:offset], before[i][:offset]) for i in (0, 2))
            if "all 0" in name and offset == 0:
                assert after[1][1] == 0 and after[3][1] == 0
            offset += k.shape[0]
        assert grew and rewrote, name


def test_the_need_as_written_is_calibrates_and_the_text_says_it():
    g = torch.Generator().manual_seed(0)
    amax = torch.rand(100000, generator=g) * 10 + 1e-6
    need = amax / 127
    need = torch.where(amax * (1 / need) > 127, torch.nextafter(need, torch.full_like(need, math.inf)), need)
    assert torch.equal(need, quant.calibrate(amax[:, None], torch.int8, dim=-1))
    assert (need != amax / 127).any()  # the step up matters
    text = _exercise_text()
    assert "torch.nextafter" in text and "`amax * (1 / need)` still comes out above 127" in text
    assert "`y = x * (1 / scale)` in float32" in text and "ties to even" in text


def _write_returns_page_only(page, scale, x, offset):
    return check_solutions().student_write_into_page(page, scale, x, offset)[0]


def _quantize_raises(x, scale, fmt):
    raise ValueError("no format")


def _quantize_loops(x, scale, fmt):
    while True:
        pass


def _dequantize_list(q, scale):
    return (q.float() * scale).tolist()


def _write_float64_scale(page, scale, x, offset):
    page, scale = check_solutions().student_write_into_page(page, scale, x, offset)
    return page, scale.double()


def check_solutions():
    from check_mutants import _solutions

    return _solutions


@pytest.mark.parametrize(
    "checker, attempt, words",
    [
        (check.check_page_write, _write_returns_page_only, "return both: return page, scale"),
        (check.check_page_write, _write_float64_scale, "one float32 scale per KV head"),
        (check.check_quantize, _quantize_raises, "ValueError: no format"),
        (check.check_quantize, _quantize_loops, "time limit"),
        (check.check_dequantize, _dequantize_list, "a float32 tensor"),
    ],
)
def test_a_bad_attempt_fails_with_a_report_that_names_it(checker, attempt, words):
    start = time.perf_counter()
    report = checker(attempt, time_limit=0.5)
    assert time.perf_counter() - start < 10
    assert not report.passed and not report.not_implemented
    assert str(report).startswith("FAIL") and words in str(report), str(report)


def test_a_raise_in_the_students_own_code_is_shown_at_its_line():
    report = check.check_quantize(_quantize_raises)
    source, first = inspect.getsourcelines(_quantize_raises)
    line = f"in _quantize_raises, line {first + 1}: {source[1].strip()}"
    assert report.failure.hint.startswith(f"your own code raised it {line}"), report.failure.hint


def test_a_page_write_failure_names_the_write_the_side_and_the_byte():
    from check_mutants import no_requant_page_write

    failure = check.check_page_write(no_requant_page_write).failure
    assert "write 2 of 4, the K side: 1 token(s) at offset 1" in failure.case
    assert (
        failure.expected == "page[0, 0, 0] = 50 (an earlier token; it was 127)" and failure.got == "page[0, 0, 0] = 127"
    )


def test_a_0d_scale_divides_like_a_full_one_and_neither_like_the_reciprocal():
    """What `_reciprocal_traps`' comment says: ``x / scale`` is one division per value whatever the scale's shape."""
    x, scale = fewer_bytes._reciprocal_traps(torch.int8, 8)
    s = scale[0]  # the traps share one scale value
    assert (scale == s).all()
    assert torch.equal(x / s, x / scale) and not torch.equal(x / s, x * (1 / s))


def test_float8_casts_saturate_on_this_torch_as_the_text_says():
    """torch 2.13's CPU cast saturates at +-448 by itself, so a float8 answer without the clamp passes here."""
    text = _exercise_text()
    assert "torch 2.13's cast on the CPU already saturates at ±448 by itself" in text
    if torch.__version__.startswith("2.13") and not torch.cuda.is_available():
        y = torch.tensor([448.0, 480.0, 1e4, -1e4, math.inf])
        assert y.to(torch.float8_e4m3fn).float().tolist() == [448.0, 448.0, 448.0, -448.0, 448.0]

        def no_clamp(x, scale, fmt):
            if fmt == torch.int8:
                return check_solutions().student_quantize(x, scale, fmt)
            return (x * (1 / scale)).to(fmt)

        assert check.check_quantize(no_clamp).passed


def test_the_nextafter_step_keeps_amax_from_saturating_as_the_text_says():
    """Without the step ``amax`` is stored as 127 all the same (the clamp), but it saturates."""
    g = torch.Generator().manual_seed(0)
    amax = torch.rand(100000, generator=g) * 10 + 1e-6
    a = amax[amax * (1 / (amax / 127)) > 127][:1]  # [1]: one that needs the step
    plain, stepped = a / 127, quant.calibrate(a, torch.int8)
    assert quant.quantize(a, plain, torch.int8).item() == quant.quantize(a, stepped, torch.int8).item() == 127
    assert quant.count_saturated(a, plain, torch.int8) == 1 and quant.count_saturated(a, stepped, torch.int8) == 0
    text = _exercise_text()
    assert "`amax` is stored as 127 either way" in text and "counts 1 without it" in text and "0 with it" in text


def _page_write(page, scale, x, offset, *, need=None, requant="reciprocal", shift=0):
    """The reference page write with one piece swapped for a wrong one (each a mistake the checker names)."""
    amax = x.abs().amax(dim=(0, 2))  # [Hkv]
    new = torch.maximum(scale, need(amax, x) if need else _stepped(amax, amax / 127, lambda y: y > 127))
    page, grew = page.clone(), new > scale
    old, safe = scale[None, :, None], torch.where(new > 0, new, 1.0)[None, :, None]  # [1, Hkv, 1]
    if requant == "reciprocal":
        again = check_solutions().student_quantize(page.float() * old, safe, torch.int8)
    elif requant == "divided":
        again = (page.float() * old / safe).clamp(-127, 127).round().to(torch.int8)
    else:  # the ratio
        again = (page.float() * (old / safe)).clamp(-127, 127).round().to(torch.int8)
    page = torch.where(grew[None, :, None], again, page)
    page[offset + shift : offset + shift + x.shape[0]] = check_solutions().student_quantize(x, safe, torch.int8)
    return page, new


def _stepped(amax, need, step, *, divided=False):
    y = amax / need if divided else amax * (1 / need)
    need = torch.where(step(y), torch.nextafter(need, torch.full_like(need, math.inf)), need)
    return torch.where(amax > 0, need, 0.0)


WRONG_PAGE_WRITES = {
    "divided requant": (dict(requant="divided"), "(q * old) / new rounds a few codes the other way", "every code"),
    "ratio requant": (dict(requant="ratio"), "q * (old / new) rounds a few codes the other way", "every code"),
    "at least 127": (
        dict(need=lambda a, x: _stepped(a, a / 127, lambda y: y >= 127)),
        "only where the product is strictly above 127",
        "",
    ),
    "always": (
        dict(need=lambda a, x: _stepped(a, a / 127, lambda y: torch.ones_like(y, dtype=torch.bool))),
        "only where the product is strictly above 127",
        "",
    ),
    "divided step test": (
        dict(need=lambda a, x: _stepped(a, a / 127, lambda y: y > 127, divided=True)),
        "amax / need rounds apart from it for some amax",
        "the step up's edge",
    ),
    "times 1/127": (
        dict(need=lambda a, x: _stepped(a, a * (1 / 127), lambda y: y > 127)),
        "need = amax / 127, a division",
        "",
    ),
    "calibrate": (
        dict(need=lambda a, x: quant.calibrate(x, torch.int8, dim=(0, 2))),
        "0 where amax is 0; calibrate returns 1.0 there",
        "all 0",
    ),
    "offset + 1": (dict(shift=1), "the first new token goes at offset itself", ""),
}


def test_the_reference_page_write_passes_with_each_piece_as_written():
    assert check.check_page_write(check_solutions().student_write_into_page).passed
    assert check.check_page_write(_page_write).passed  # the helper below, nothing swapped


@pytest.mark.parametrize("mistake", sorted(WRONG_PAGE_WRITES))
def test_a_wrong_page_write_fails_with_its_hint(mistake):
    kwargs, words, case = WRONG_PAGE_WRITES[mistake]
    report = check.check_page_write(lambda page, scale, x, offset: _page_write(page, scale, x, offset, **kwargs))
    assert not report.passed and words in report.failure.hint, str(report)
    assert case in report.failure.case.splitlines()[0], str(report)


def _unfinished_quantize(x, scale, fmt):
    raise NotImplementedError


def _write_calling_unfinished(page, scale, x, offset):
    page = page.clone()
    page[offset : offset + x.shape[0]] = _unfinished_quantize(x, scale[None, :, None], torch.int8)
    return page, scale


def test_a_not_implemented_quantize_is_named_where_the_page_write_calls_it():
    report = check.check_page_write(_write_calling_unfinished)
    assert report.not_implemented and str(report) == (
        "TODO page_write: not implemented yet (the NotImplementedError came from _unfinished_quantize, "
        "which _write_calling_unfinished calls)"
    )
    assert str(check.check_quantize(_unfinished_quantize)) == (
        "TODO quantize: not implemented yet (the function raised NotImplementedError)"
    )


def _dequantize_float64(q, scale):
    return q.double() * scale


def test_a_wrong_dtype_is_named_alike_on_both_sides():
    failure = check.check_dequantize(_dequantize_float64).failure
    assert (failure.expected, failure.got) == ("torch.float32 (5,)", "torch.float64 (5,)")


# Each checker case is of one kind; the exercise's text names every kind, in these words.
QUANTIZE_KINDS = [
    "one scale",
    "a scale per page and head",
    "values that saturate",
    "zeros",
    "exact ties",
    "round apart, a scale per value",
    "random scales per page and head",
]
PAGE_WRITE_KINDS = [
    "one token per KV head, at the step up's edge",
    "4 tokens one by one, the second needing a larger scale",
    "random magnitudes per KV head",
    "a KV head whose first tokens are all 0",
    "an outlier 1000 times larger",
    "a scale that grows by 1%",
    "every code -127 .. 127, then a token 6 times larger",
    "32 tokens in 9 writes, head_dim 64",
]


def test_the_text_lists_the_kinds_of_cases_the_checkers_run():
    text = _exercise_text()
    quantize = text[text.index("`pr.lab.check.check_quantize` compares") :]
    quantize = quantize[: quantize.index("\n")]
    page_write = text[text.index("`pr.lab.check.check_page_write` makes") :]
    for kinds, names, said in (
        (QUANTIZE_KINDS, [c[0] for c in fewer_bytes._quantize_cases()], quantize),
        (PAGE_WRITE_KINDS, [c[0] for c in fewer_bytes._page_write_cases()], page_write),
    ):
        for name in names:
            assert any(kind in name for kind in kinds), f"case {name!r} is of no kind the text names"
        for kind in kinds:
            assert any(kind in name for name in names), f"no case is of the kind {kind!r}"
            assert kind in said, f"the text does not name {kind!r}"


def test_the_demos_print_the_numbers_the_text_reads_and_need_both_checks():
    """With the reference solutions, the page demo prints every number the note after it quotes."""
    import contextlib
    import io
    import re

    import nbformat

    path = Path(__file__).parents[1] / "notebooks" / "exercises" / "ex8_fewer_bytes.ipynb"
    cells = nbformat.read(path, as_version=4).cells
    demo = next(i for i, c in enumerate(cells) if "token 0 reads" in c.source and c.cell_type == "code")
    assert cells[demo].source.startswith("if report.passed and report_dq.passed:")
    note = cells[demo + 1].source
    solutions = check_solutions()
    passed = check.CheckReport("x", True, 1)
    namespace = {"torch": torch, "pr": __import__("paged_ref"), "report": passed, "report_dq": passed}
    namespace |= {"my_write_into_page": solutions.student_write_into_page}
    namespace |= {"my_dequantize": solutions.student_dequantize}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(cells[demo].source, namespace)
    printed = out.getvalue()
    quoted = re.findall(r"`(\[[^`]+\])`", note)
    assert len(quoted) == 3 and all(f"token 0 reads {q}" in printed for q in quoted), (quoted, printed)
    for grown in re.findall(r"grows to ([\d.]+)/127", note):
        assert f"scale * 127 = {float(grown):6.3f}" in printed, (grown, printed)
    namespace["report_dq"] = check.CheckReport("dequantize", False, 1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(cells[demo].source, namespace)
    assert out.getvalue().startswith("Pass the check first (and the dequantize check above)")


def test_the_edge_case_tells_the_step_tests_apart_per_head():
    """K's heads: amax * (1 / need) at 127 exactly (only >= steps), above 127 while amax / need is not (only the
    division misses the step), above by both, below by both: the right test, the division, >= 127, no step and
    a step everywhere give five different scales."""
    ((k, v),) = next(c for c in fewer_bytes._page_write_cases() if "the step up's edge" in c[0])[4]
    amax = k.abs().amax(dim=(0, 2))  # [4]
    need = amax / 127
    y = amax * (1 / need)
    assert (y == 127).tolist() == [True, False, False, False]
    assert (y > 127).tolist() == [False, True, True, False]
    assert (amax / need > 127).tolist() == [False, False, True, False]
    scales = [
        _stepped(amax, need, lambda y: y > 127),
        _stepped(amax, need, lambda y: y > 127, divided=True),
        _stepped(amax, need, lambda y: y >= 127),
        need,
        _stepped(amax, need, lambda y: torch.ones_like(y, dtype=torch.bool)),
    ]
    assert len({tuple(s.tolist()) for s in scales}) == 5
    assert torch.equal(scales[0], quant.calibrate(k, torch.int8, dim=(0, 2)))
    assert torch.equal(v, k.flip(1))


def test_the_ladder_case_holds_every_int8_code_before_its_scale_grows():
    (ladder, _), (big, _) = next(c for c in fewer_bytes._page_write_cases() if c[0].startswith("every code"))[4]
    scale = quant.calibrate(ladder, torch.int8, dim=(0, 2))  # [1]
    codes = quant.quantize(ladder, scale[None, :, None], torch.int8)
    assert torch.equal(codes.unique(), torch.arange(-127, 128, dtype=torch.int8))
    assert big.abs().amax() == 6 * ladder.abs().amax()


def _write_at_scale_0(page, scale, x, offset):
    """The reference without the 1.0 at scale 0: a head at scale 0 quantizes its zeros as 0 * inf = NaN."""
    new = check_solutions().student_write_into_page(page, scale, x, offset)[1]
    page = _page_write(page, scale, x, offset)[0]
    page[offset : offset + x.shape[0]] = check_solutions().student_quantize(x, new[None, :, None], torch.int8)
    return page, new


def test_a_nan_cast_at_scale_0_fails_although_its_bytes_are_right_here(monkeypatch):
    report = check.check_page_write(_write_at_scale_0)
    assert not report.passed and "quantize with 1.0 there" in report.failure.hint, str(report)
    assert report.failure.case.startswith("a KV head whose first tokens are all 0")
    assert "the checker watches your torch calls for a NaN cast to int8" in _exercise_text()
    with fewer_bytes._NanCasts() as casts:
        torch.tensor([0.0, 1.0]).to(torch.int8)
        assert not (torch.tensor([math.nan]) > 127).any()  # a comparison is no cast
        torch.where(torch.tensor([math.nan]) > 0, torch.tensor([1]), torch.tensor([0]))
    assert not casts.seen
    with fewer_bytes._NanCasts() as casts:
        page = torch.zeros(2, dtype=torch.int8)
        page[:] = torch.tensor([0.0]) * (1 / torch.tensor(0.0))  # a write of NaN into int8
    assert casts.seen
    monkeypatch.setattr(fewer_bytes, "_NanCasts", _NoWatch)
    assert check.check_page_write(_write_at_scale_0).passed  # NaN became 0 in int8: only the watch tells


class _NoWatch:
    seen = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
