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
    zero case keeps one head at scale 0 through its first write."""
    for name, ps, hkv, d, writes in fewer_bytes._page_write_cases():
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
