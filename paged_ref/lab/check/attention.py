"""Checkers for slot mapping and paged decode attention, against the package's oracles.

Cases run smallest first: one token, one page, then ragged lengths over shuffled pages with
garbage in every slot a sequence does not own (block-table padding points at other sequences'
pages), GQA and MQA head layouts, a scale other than ``head_dim ** -0.5``, and a case whose
scores are in the thousands (a softmax without the max subtracted overflows there). The oracle
runs first, on the case's own tensors; the student's function gets copies, and changing them
is reported. A wrong answer is compared with the answers of typical mistakes to give a precise
hint.

Precision. An answer is compared element by element with the float64 oracle, to within
``tol x max(1, largest |expected| of the case)``, where ``tol`` follows the dtype the answer is
returned in (`TOLERANCE`), or to within 8x the error of the package's own reference computed in
that dtype on the same case, whichever is larger. A float32 answer to float64 inputs is thus
checked to float32 precision, and says so when it passes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..._arith import cdiv
from ...attention.reference import reference_paged_decode
from ...block_table import slot_mapping
from .cases import scatter_sequences
from .report import DEFAULT_TIME_LIMIT_S, Failure, check_count, run_cases

__all__ = [
    "TOLERANCE",
    "check_paged_attention",
    "check_slot_mapping",
    "check_triton_decode",
    "make_attention_cases",
]

# Element-wise tolerance per dtype of the answer, times max(1, largest |expected|). About 80
# machine epsilons for float32 (the package's own float32 reference stays 16x inside it on
# every case), a few for the 16-bit types (their rounding of the inputs alone costs that much).
TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _returned(value) -> str:
    """What came back, in words, for a failure's "got" line."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}" + (
            " on the meta device (a shape, no values)" if value.device.type == "meta" else ""
        )
    module = type(value).__module__.split(".")[0]
    return f"a {'' if module == 'builtins' else module + '.'}{type(value).__name__}"


# ------------------------------------------------------------------------------------ slot mapping
def _slot_cases(seed: int, count: int):
    rng = random.Random(seed)
    cases = [([3], 0, 1, 1), ([2, 0], 0, 2, 1), ([5, 1], 1, 3, 2)]  # smallest first
    for i in range(count - len(cases)):
        page_size = rng.choice((1, 2, 3, 4, 16))
        start = rng.randint(0, 3 * page_size)
        num_tokens = rng.randint(0, 2 + i // 4)
        needed = (start + num_tokens + page_size - 1) // page_size
        pages = rng.sample(range(needed + 5), max(needed, 1))
        cases.append((pages, start, num_tokens, page_size))
    return cases


def check_slot_mapping(fn, *, seed: int = 0, cases: int = 120, time_limit: float | None = DEFAULT_TIME_LIMIT_S):
    """Check ``fn(pages, *, start, num_tokens, page_size)`` against `paged_ref.slot_mapping`.

    ``fn`` returns the flat slot ``pages[t // page_size] * page_size + t % page_size`` of each
    token ``t`` in ``start .. start + num_tokens - 1``, as an int64 tensor ``[num_tokens]`` (what
    `paged_ref.slot_mapping` returns and a cache's ``index_copy_`` takes).

    Args:
        fn: the student's function.
        seed, cases: the random cases (``cases >= 3``: the first three are fixed small ones).
        time_limit: seconds per case, or None.
    """
    check_count("cases", cases, 3)

    def one(case, run):
        pages, start, num_tokens, page_size = case
        want = slot_mapping(pages, start=start, num_tokens=num_tokens, page_size=page_size)
        out = run.call(fn, list(pages), start=start, num_tokens=num_tokens, page_size=page_size)
        expected = f"int64 tensor {want.tolist()}"
        if not isinstance(out, torch.Tensor) or out.device.type == "meta":
            hint = (
                "the function returned None: does it end without `return`?"
                if out is None
                else "return an int64 tensor, as pr.slot_mapping does: torch.tensor(slots, dtype=torch.int64) "
                "(a cache writes K/V with index_copy_, which takes int64 indices)"
            )
            return Failure(_describe_slots(case), expected, _returned(out), hint)
        if out.is_floating_point() or out.is_complex() or out.dtype == torch.bool:
            hint = "slots are whole numbers: page * page_size + offset with integer // and %, in an int64 tensor"
            if out.numel() == 0 and out.dtype == torch.get_default_dtype():
                hint = (
                    "with num_tokens=0 the list of slots is empty, and torch.tensor([]) is a float tensor: give the "
                    "dtype, torch.tensor(slots, dtype=torch.int64)"
                )
            return Failure(_describe_slots(case), expected, f"{_returned(out)}: {out.tolist()}", hint)
        if out.dtype != torch.int64:
            return Failure(
                _describe_slots(case),
                expected,
                f"{_returned(out)}: {out.tolist()}",
                "return int64 slots, as pr.slot_mapping and vLLM's slot_mapping do "
                "(torch.tensor(..., dtype=torch.int64))",
            )
        got = out.tolist()
        if out.dim() == 1 and got == want.tolist():
            return None
        if got == list(range(start, start + num_tokens)):
            hint = "these are logical positions: look up each token's physical page in pages[t // page_size]"
        elif out.dim() != 1 or len(got) != num_tokens:
            hint = f"one slot per token, a 1-D tensor [{num_tokens}]: {num_tokens} tokens from position {start}"
        else:
            hint = "slot = pages[t // page_size] * page_size + t % page_size, for t = start, start + 1, ..."
        return Failure(_describe_slots(case), expected, f"{_returned(out)}: {got}", hint)

    hint = "token t (start <= t < start + num_tokens) lies on page pages[t // page_size] at offset t % page_size"
    return run_cases("slot_mapping", _slot_cases(seed, cases), one, _describe_slots, hint, time_limit=time_limit)


def _describe_slots(case) -> str:
    pages, start, num_tokens, page_size = case
    return f"pages={pages}, start={start}, num_tokens={num_tokens}, page_size={page_size}"


# ------------------------------------------------------------------------------------ decode attention
@dataclass
class AttentionCase:
    """One decode call: q ``[batch, Hq, D]``, caches ``[num_pages, page_size, Hkv, D]``."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [batch, max_pages]
    seq_lens: torch.Tensor  # int32 [batch]
    scale: float

    INPUTS = ("q", "k_cache", "v_cache", "block_table", "seq_lens")

    def inputs(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.INPUTS]

    def describe(self) -> str:
        num_pages, page_size, num_kv_heads, head_dim = self.k_cache.shape
        return (
            f"batch={self.q.shape[0]}, num_q_heads={self.q.shape[1]}, num_kv_heads={num_kv_heads}, "
            f"head_dim={head_dim}, page_size={page_size}, num_pages={num_pages}, scale={self.scale:g} "
            f"(head_dim ** -0.5 = {head_dim**-0.5:g}), inputs {self.q.dtype}\n"
            f"seq_lens={self.seq_lens.tolist()}\nblock_table={self.block_table.tolist()}"
        )


# (batch, page_size, num_kv_heads, group, head_dim, max_len, scale multiplier), smallest first
_LAYOUTS = [
    (1, 1, 1, 1, 8, 1, 1.0),
    (1, 4, 1, 1, 8, 4, 1.0),
    (2, 4, 1, 1, 8, 9, 0.5),  # a scale other than head_dim ** -0.5
    (3, 3, 2, 1, 8, 10, 1.0),
    (3, 4, 2, 2, 8, 13, 1.0),
    (4, 16, 2, 4, 16, 40, 1.0),
    (3, 8, 1, 4, 16, 30, 1.0),
    (2, 4, 2, 2, 16, 12, 400.0),  # scores in the thousands: exp overflows even in float64
]


def make_attention_cases(
    seed: int = 0, dtype=torch.float64, repeats: int = 2, pow2_pages: bool = False
) -> list[AttentionCase]:
    """Decode cases smallest first: shuffled pages, garbage in unowned slots, padded tables.

    ``pow2_pages``: only page sizes that are powers of two (what a Triton tile needs).
    """
    check_count("repeats", repeats)
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for layout in _LAYOUTS:
        if pow2_pages and layout[1] & (layout[1] - 1):
            continue
        for _ in range(repeats):
            cases.append(_make_case(gen, *layout, dtype=dtype))
    return cases


def _make_case(gen, batch, page_size, num_kv_heads, group, head_dim, max_len, scale_mult, dtype):
    lens = [int(torch.randint(1, max_len + 1, (1,), generator=gen)) for _ in range(batch)]
    lens[0] = max_len  # one full-length sequence (often a page multiple)
    # valid page ids in the two padding columns, other sequences' or spare pages, distinct (a
    # gather that reads padding gets wrong numbers, not an index error, and other numbers than
    # one token too many); garbage of scale 50 in every unowned slot; K/V of scale 3
    k_cache, v_cache, table, _, _ = scatter_sequences(
        lens,
        page_size,
        num_kv_heads,
        head_dim,
        generator=gen,
        dtype=torch.float64,
        spare_pages=2,
        pad_cols=2,
        garbage=50.0,
        value_scale=3.0,
        padding="pages",
    )
    for b, n in enumerate(lens):  # padding: distinct pages, none of them the sequence's own
        used = cdiv(n, page_size)
        own = set(table[b, :used].tolist())
        others = [p for p in torch.randperm(k_cache.shape[0], generator=gen).tolist() if p not in own]
        table[b, used:] = torch.tensor(others[: table.shape[1] - used], dtype=torch.int32)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen, dtype=torch.float64)
    scale = head_dim**-0.5 * scale_mult
    return AttentionCase(
        q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), table, torch.tensor(lens, dtype=torch.int32), scale
    )


def _reference(case: AttentionCase, *, lens=None, table=None, q=None, scale=None) -> torch.Tensor:
    f64 = (case.q if q is None else q).double().cpu(), case.k_cache.double().cpu(), case.v_cache.double().cpu()
    return reference_paged_decode(
        *f64,
        (case.block_table if table is None else table).cpu(),
        (case.seq_lens if lens is None else lens).cpu(),
        scale=case.scale if scale is None else scale,
        check_values=False,
    )


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    return got.shape == want.shape and bool(torch.isfinite(got).all()) and bool(((got - want).abs() <= tol).all())


def _tolerance(case: AttentionCase, dtype: torch.dtype, want: torch.Tensor) -> float:
    """``TOLERANCE[dtype] x max(1, largest |want|)``, or 8x the error of the package's own
    reference computed in ``dtype`` on this case, whichever is larger: where scores are in the
    thousands every float32 softmax loses digits, the reference's own included."""
    tol = TOLERANCE.get(dtype, TOLERANCE[torch.float16]) * max(1.0, float(want.abs().max()))
    if dtype == torch.float64:
        return tol
    inputs = [t.cpu().to(dtype) for t in (case.q, case.k_cache, case.v_cache)]
    own = reference_paged_decode(
        *inputs, case.block_table.cpu(), case.seq_lens.cpu(), scale=case.scale, check_values=False
    )
    return max(tol, 8 * float((own.double() - want).abs().max()))


def _attention_hint(case: AttentionCase, got: torch.Tensor, tol: float, dtype: torch.dtype) -> str:
    """Which typical mistake ``got`` (float64 on the CPU) matches."""
    if not bool(torch.isfinite(got).all()):
        return "inf/nan: subtract each row's max score before exp (large scores overflow exp)"
    want = _reference(case)
    if dtype == torch.float64 and _close(got, want, _tolerance(case, torch.float32, want)):
        err = float((got - want).abs().max())
        return (
            f"right to float32 precision only (max error {err:.2g}), returned as float64: some step computes "
            "in float32 (a torch.zeros/empty/tensor without dtype=, or .float()); compute in q's dtype"
        )
    lens, page_size, max_pages = case.seq_lens.cpu(), case.k_cache.shape[1], case.block_table.shape[1]
    if _close(got, _reference(case, lens=(lens - 1).clamp(min=1)), tol):
        return "one token short: attend to tokens 0 .. seq_len-1, that is all seq_len tokens"
    every_slot = torch.full_like(lens, max_pages * page_size)
    padding = bool((every_slot > lens + 1).any()) and _close(got, _reference(case, lens=every_slot), tol)
    longer = lens + 1
    one_more = bool((longer.long() <= max_pages * page_size).all()) and _close(got, _reference(case, lens=longer), tol)
    if padding and one_more:
        return "you attend past seq_len (one token too many and the whole padded row give the same numbers here)"
    if padding:
        return (
            "you read the block table's padding: row b lists ceil(seq_len / page_size) pages of sequence b, "
            "and the entries after them are not its pages; stop at seq_len tokens"
        )
    if one_more:
        return "one token too many: attend to tokens 0 .. seq_len-1 only"
    whole_pages = (lens + page_size - 1) // page_size * page_size
    if bool((whole_pages != lens).any()) and _close(got, _reference(case, lens=whole_pages), tol):
        return "the last page is read whole: it holds only seq_len - (pages - 1) * page_size tokens; stop at seq_len"
    logical = torch.arange(max_pages, dtype=torch.int32).repeat(case.q.shape[0], 1)
    if int(logical.max()) < case.k_cache.shape[0] and _close(got, _reference(case, table=logical), tol):
        return "read pages through the block table: logical page j of sequence b is block_table[b, j]"
    head_dim = case.q.shape[-1]
    scales = {
        head_dim**-0.5: "the scale argument is ignored: use scale when it is given "
        "(head_dim ** -0.5 only when it is None)",
        1.0: "the scores are not scaled: multiply q . k by scale",
        head_dim**0.5: "the scale is inverted: multiply q . k by scale, do not divide by it",
        case.scale**2: "the scale is applied twice",
    }
    for wrong, hint in scales.items():
        if abs(wrong - case.scale) > 1e-12 * case.scale and _close(got, _reference(case, scale=wrong), tol):
            return hint
    num_q, num_kv = case.q.shape[1], case.k_cache.shape[2]
    if num_q != num_kv:
        group = num_q // num_kv
        order = torch.arange(num_q).view(num_kv, group).t().reshape(-1)  # head h read KV head h % num_kv
        swapped = _reference(case, q=case.q[:, order])
        back = torch.empty_like(swapped)
        back[:, order] = swapped
        if _close(got, back, tol):
            return "query head h reads KV head h // (num_q_heads // num_kv_heads), not h % num_kv_heads"
    return "compare with a dense softmax over each sequence's gathered K/V, one sequence at a time"


def _changed(case: AttentionCase, copies: list[torch.Tensor]) -> list[str]:
    """The inputs the student's call wrote into (its copies no longer equal the case's tensors)."""
    return [
        name
        for name, mine, theirs in zip(AttentionCase.INPUTS, case.inputs(), copies)
        if theirs.shape != mine.shape or theirs.dtype != mine.dtype or not torch.equal(theirs.cpu(), mine.cpu())
    ]


def _attention_checker(name: str, fn, cases: list[AttentionCase], error_hint: str, time_limit):
    lower_precision = set()  # dtypes of passing answers below the inputs' precision

    def one(case, run):
        want = _reference(case)  # the oracle first, on the case's own tensors
        copies = [t.clone() for t in case.inputs()]  # the student works on copies
        got = run.call(fn, *copies, scale=case.scale)
        changed = _changed(case, copies)
        wrote = (
            f"; it also changed {', '.join(changed)} in place (an attention call must only read its inputs)"
            if changed
            else ""
        )
        expected = f"a floating-point tensor of shape {list(want.shape)} (the shape of q)"
        if not isinstance(got, torch.Tensor) or got.device.type == "meta" or not got.is_floating_point():
            hint = (
                "the function returned None: does it end without `return`?"
                if got is None
                else "compute the output from the inputs: a tensor on the meta device has a shape and no numbers"
                if isinstance(got, torch.Tensor) and got.device.type == "meta"
                else "return a floating-point tensor [batch, num_q_heads, head_dim]"
            )
            return Failure(case.describe(), expected, _returned(got), hint + wrote)
        got64 = got.detach().to("cpu", torch.float64)
        if got64.shape != want.shape:
            return Failure(case.describe(), expected, _returned(got), "the output has the shape of q" + wrote)
        tol = _tolerance(case, got.dtype, want)
        if _close(got64, want, tol):
            if changed:
                return Failure(
                    case.describe(),
                    f"the right output, and {', '.join(AttentionCase.INPUTS)} as they were passed in",
                    f"the right output, but {', '.join(changed)} changed in place",
                    "an attention call must only read its inputs: q, the caches and the block table belong to the "
                    "caller (the cache is shared by every later step). Use out-of-place ops: q * scale, not q *= scale",
                )
            if got.dtype != case.q.dtype and TOLERANCE.get(got.dtype, 1.0) > TOLERANCE.get(case.q.dtype, 0.0):
                lower_precision.add(got.dtype)
            return None
        err = (got64 - want).abs().nan_to_num(float("inf"))
        b, h = divmod(int(err.amax(-1).argmax()), want.shape[1])
        return Failure(
            case.describe(),
            f"out[{b}, {h}, :4] = {[round(x, 4) for x in want[b, h, :4].tolist()]} "
            f"(to within {tol:.2g}, the tolerance for a {got.dtype} answer)",
            f"out[{b}, {h}, :4] = {[round(x, 4) for x in got64[b, h, :4].tolist()]} (max error {float(err.max()):.3g})",
            _attention_hint(case, got64, tol, got.dtype) + wrote,
        )

    report = run_cases(name, cases, one, AttentionCase.describe, error_hint, time_limit=time_limit)
    if report.passed and lower_precision:
        kinds = ", ".join(str(d).replace("torch.", "") for d in sorted(lower_precision, key=str))
        report.note = (
            f"your output is {kinds} (the inputs are {str(cases[0].q.dtype).replace('torch.', '')}): "
            f"checked to {kinds} precision, tolerance {TOLERANCE[max(lower_precision, key=TOLERANCE.get)]:g} "
            "x max(1, largest |expected|)"
        )
    return report


def check_paged_attention(fn, *, seed: int = 0, repeats: int = 2, time_limit: float | None = DEFAULT_TIME_LIMIT_S):
    """Check a paged decode attention ``fn(q, k_cache, v_cache, block_table, seq_lens, scale=...)``.

    Same contract as `paged_ref.reference_paged_decode`: q ``[batch, Hq, D]``, caches
    ``[num_pages, page_size, Hkv, D]``, block_table int32 ``[batch, max_pages]`` (entries past
    a sequence's pages are padding), seq_lens int32 ``[batch]``; returns ``[batch, Hq, D]`` and
    changes none of its inputs. Inputs are float64; the answer must match the float64 oracle to
    ``TOLERANCE[its dtype] x max(1, largest |expected|)`` (1e-8 for float64, 1e-5 for float32),
    or to 8x the error of the package's reference computed in that dtype, whichever is larger.

    Args:
        fn: the student's function.
        seed, repeats: the random cases (``repeats`` per layout, 8 layouts).
        time_limit: seconds per case, or None.
    """
    cases = make_attention_cases(seed, torch.float64, repeats)
    return _attention_checker("paged_attention", fn, cases, "the call raised: check shapes and dtypes", time_limit)


def check_triton_decode(fn, *, seed: int = 0, repeats: int = 1, time_limit: float | None = DEFAULT_TIME_LIMIT_S):
    """The same check for a Triton decode launcher, on float32 inputs (float32 tolerance, 1e-5).

    On a CPU a Triton kernel runs only in Triton's interpreter: set ``TRITON_INTERPRET=1`` in
    the environment before ``triton`` is first imported (the interpreter runs float32 only).
    On a GPU the inputs are moved to CUDA and the kernel runs compiled. Page sizes are powers
    of two.
    """
    cases = make_attention_cases(seed, torch.float32, repeats, pow2_pages=True)
    if torch.cuda.is_available():
        for c in cases:
            c.q, c.k_cache, c.v_cache = c.q.cuda(), c.k_cache.cuda(), c.v_cache.cuda()
            c.block_table, c.seq_lens = c.block_table.cuda(), c.seq_lens.cuda()
    hint = "the call raised: check shapes and dtypes"
    if not torch.cuda.is_available():
        hint += (
            "; on a CPU the kernel must run in Triton's interpreter: set TRITON_INTERPRET=1 before triton is "
            "first imported (restart the kernel/process), then define the @triton.jit kernel"
        )
    return _attention_checker("triton_decode", fn, cases, hint, time_limit)
