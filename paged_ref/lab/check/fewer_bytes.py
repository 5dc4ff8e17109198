"""Exercise 8's checkers (notebook 11): `check_quantize`, `check_dequantize` and `check_page_write`.

**quantize.** ``my_quantize(x, scale, fmt) -> q``: float32 ``x`` (any shape) stored in ``fmt``
(``torch.int8`` or ``torch.float8_e4m3fn``) at ``scale`` (a float32 tensor that broadcasts against ``x``):
``y = x * (1 / scale)`` in float32, clamped to +-127 and rounded to nearest, ties to even (int8,
symmetric: -128 is never written), or clamped to +-448 and cast (float8, torch's cast: to nearest).
Checked value for value against `paged_ref.quant.quantize`: one scale, a scale per page and KV head
broadcast over ``[num_pages, page_size, num_kv_heads, head_dim]``, values that saturate, zeros,
negative values, exact ties, and values where ``x / scale`` rounds otherwise than ``x * (1 / scale)``.
torch 2.13's cast to float8_e4m3fn saturates at +-448 by itself on the CPU, so there a float8 answer
without the clamp passes; where a cast gives NaN beyond the range instead, the saturating case fails it.

**dequantize.** ``my_dequantize(q, scale) -> x``: float32 ``q * scale``, against `paged_ref.quant.dequantize`.

**page write.** ``my_write_into_page(page, scale, x, offset) -> (page, scale)``: ``page`` int8
``[page_size, num_kv_heads, head_dim]`` holds tokens ``0 .. offset - 1`` (the rest are 0) stored at
``scale`` float32 ``[num_kv_heads]`` (0 for a head that holds no nonzero value yet); ``x`` float32
``[n, num_kv_heads, head_dim]`` are the new tokens, for ``offset .. offset + n - 1``. A head's scale
becomes ``max(old, need)``, ``need`` = the new tokens' largest ``|x|`` over tokens and head_dim / 127,
one float32 step up where ``amax * (1 / need)`` still exceeds 127, so that nothing saturates
(`paged_ref.quant.calibrate`'s rule), 0 where ``amax`` is 0; where it grew, the old tokens are
dequantized with the old scale and quantized with the new, ``(q * old) * (1 / new)`` (to nearest);
then the new tokens are quantized at the page's scale (a head at scale 0 stores 0, quantized with 1.0:
``0 * (1 / 0)`` is NaN, and what NaN becomes in int8 is platform-defined, 0 on this machine's CPU, so the checker
watches the student's torch calls for a NaN cast to an integer dtype).
Checked write by write against what ``PagedKVCache(kv_format=KVFormat(torch.int8, scales="page"))``
stores for the same writes, K and V: the bytes and the scales equal.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ...cache import PagedKVCache
from ...quant import KVFormat, calibrate, dequantize, quantize
from .report import DEFAULT_TIME_LIMIT_S, CheckReport, Failure, StudentError, raised_hint, run_cases

__all__ = ["check_dequantize", "check_page_write", "check_quantize"]

TOP = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "float8_e4m3fn"}


# ---------------------------------------------------------------------------------------- quantize
def _reciprocal_traps(fmt: torch.dtype, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` values and their scales where ``x / scale`` and ``x * (1 / scale)`` give different codes: values
    a few float32 steps from the midpoints between two codes, where one rounding error decides."""
    if fmt == torch.int8:
        codes = torch.arange(-127.0, 128.0)
    else:
        codes = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(fmt).float()
        codes = codes[codes.isfinite()].unique()  # sorted
    mid = (codes[1:] + codes[:-1]) / 2  # float32, exact
    scale = torch.full_like(mid, 0.0371)  # a scale per value (x / scale: the same division with a 0-d scale)
    near, up, down = [mid * scale], mid * scale, mid * scale
    for _ in range(4):
        up, down = torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)
        near += [up, down]
    x, scale = torch.cat(near), scale.repeat(len(near))
    top = TOP[fmt]
    a, b = quantize(x, scale, fmt), (x / scale).clamp(-top, top)
    b = b.round().to(fmt) if fmt == torch.int8 else b.to(fmt)
    differ = (a.float() != b.float()).nonzero().flatten()
    pick = differ[torch.linspace(0, len(differ) - 1, n).long()]  # spread over the range
    return x[pick], scale[pick]


def _quantize_cases():
    """(name, x, scale, fmt) smallest and plainest first."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for fmt in (torch.int8, torch.float8_e4m3fn):
        f = _NAMES[fmt]
        cases.append((f"{f}, 6 values, one scale 0.05", torch.randn(6, generator=g) * 2, torch.tensor(0.05), fmt))
        cases.append((f"{f}, 4 x 8 values, one scale 0.5", torch.randn(4, 8, generator=g) * 20, torch.tensor(0.5), fmt))
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5])
    cases.append(("int8, exact ties (x.5 at scale 1)", ties, torch.tensor(1.0), torch.int8))
    cases.append(("int8, zeros and -0.0", torch.tensor([0.0, -0.0, 0.0, 1.0]), torch.tensor(0.25), torch.int8))
    for fmt in (torch.int8, torch.float8_e4m3fn):
        f, top = _NAMES[fmt], TOP[fmt]
        big = torch.cat([torch.randn(12, generator=g) * 3, torch.tensor([top * 0.03, -top * 0.05, 1e4, -1e4])])
        cases.append(
            (f"{f}, values that saturate (beyond +-{top:g} * scale, both signs)", big, torch.tensor(0.01), fmt)
        )
        x = torch.randn(3, 4, 2, 8, generator=g) * torch.rand(3, 1, 2, 1, generator=g) * 10  # [pages, ps, Hkv, D]
        scale = calibrate(x, fmt, dim=(1, 3))[:, None, :, None]  # [pages, 1, Hkv, 1]
        scale[1, :, 0] /= 4  # page 1, KV head 0 saturates
        cases.append(
            (f"{f}, x [3, 4, 2, 8] (pages, page_size, Hkv, D), a scale per page and head [3, 1, 2, 1]", x, scale, fmt)
        )
        traps, s = _reciprocal_traps(fmt, 8)
        cases.append((f"{f}, values where x / scale and x * (1 / scale) round apart, a scale per value", traps, s, fmt))
        x = torch.randn(2, 16, 3, 64, generator=g) * 4
        scale = torch.rand(2, 1, 3, 1, generator=g) * 0.05 + 0.001
        cases.append((f"{f}, x [2, 16, 3, 64], random scales per page and head", x, scale, fmt))
    return cases


def _quantize_variants(x, scale, fmt) -> dict[str, torch.Tensor]:
    """Wrong answers with a name: the mistakes the hints name (as float32 values)."""
    top = TOP[fmt]
    y = x.float() * (1.0 / scale)
    out = {"times scale": (x * scale).clamp(-top, top), "divided": (x / scale).clamp(-top, top)}
    if fmt == torch.int8:
        out["times scale"] = out["times scale"].round()
        out["divided"] = out["divided"].round()
        out["no clamp"] = y.round().to(torch.int64).to(torch.int8)
        out["clamp -128"] = y.clamp(-128, 127).round()
        out["truncated"] = y.clamp(-top, top).trunc()
        out["floor"] = y.clamp(-top, top).floor()
        out["half away"] = y.clamp(-top, top).sign() * (y.clamp(-top, top).abs() + 0.5).floor()
    else:
        out = {k: v.to(fmt) for k, v in out.items()}
    return {k: v.float() for k, v in out.items()}


_QUANTIZE_HINTS = {
    "times scale": "store x * (1 / scale): quantize divides by the scale, dequantize multiplies",
    "divided": "multiply by the reciprocal in float32: y = x * (1 / scale), as vLLM does; x / scale rounds a few "
    "values the other way",
    "no clamp": "clamp to +-127 before the cast: int8 wraps around (200 becomes -56)",
    "clamp -128": "int8 here is symmetric: clamp to -127 .. 127 (-128 is never written)",
    "truncated": "round to nearest (torch.round) before the cast: .to(torch.int8) alone truncates toward zero",
    "floor": "round to nearest (torch.round), not down (floor)",
    "half away": "ties go to even (torch.round, like torch's casts): 2.5 -> 2, 3.5 -> 4, not away from zero",
}


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> tuple:
    """The first index where ``got`` and ``want`` (float32 values) differ."""
    where = (got != want).nonzero()[0]
    return tuple(int(i) for i in where)


def check_quantize(fn, *, time_limit: float | None = DEFAULT_TIME_LIMIT_S) -> CheckReport:
    """Check ``fn(x, scale, fmt) -> q`` (see the module docstring) against `paged_ref.quant.quantize`."""

    def check_one(case, run):
        name, x, scale, fmt = case
        want = quantize(x, scale, fmt)
        inputs = (x.clone(), scale.clone())
        where = f"{name}\nx {tuple(x.shape)} = {x.flatten()[:4].tolist()}..., scale {tuple(scale.shape)}"
        try:
            got = run.call(fn, *inputs, fmt)
        except StudentError as raised:
            return Failure(
                where, "a result", f"raised {raised}", raised_hint(raised, "my_quantize(x, scale, fmt) -> q")
            )
        if not isinstance(got, torch.Tensor):
            return Failure(where, f"a {fmt} tensor", type(got).__name__, "return the tensor of codes, q")
        if not (torch.equal(inputs[0], x) and torch.equal(inputs[1], scale)):
            return Failure(
                where,
                "x and scale unchanged",
                "the inputs were changed in place",
                "compute new tensors (no *=, no out=)",
            )
        if got.dtype != fmt:
            hint = "cast to the format: .to(fmt)" + (" after rounding and clamping" if fmt == torch.int8 else "")
            return Failure(where, f"dtype {fmt}", f"dtype {got.dtype}", hint)
        if got.shape != want.shape:
            return Failure(
                where,
                f"shape {tuple(want.shape)}",
                f"shape {tuple(got.shape)}",
                "q has x's shape: the scale broadcasts against x",
            )
        g, w = got.float(), want.float()
        if torch.equal(g, w):
            return None
        i = _mismatch(g, w)
        s = scale.expand_as(x)[i]
        expected = f"q{list(i)} = {w[i].item():g} (x = {x[i].item()!r}, scale = {s.item()!r})"
        shown = f"q{list(i)} = {g[i].item():g}"
        if g.isnan().any():
            shown += " (nan somewhere)"
        hint = f"y = x * (1 / scale) in float32, clamped to +-{TOP[fmt]:g}, then " + (
            "torch.round and .to(torch.int8)" if fmt == torch.int8 else ".to(torch.float8_e4m3fn)"
        )
        variants = _quantize_variants(x, scale, fmt)
        same = [n for n, v in variants.items() if torch.equal(g, v)]
        same = same or [n for n, v in variants.items() if g[i] == v[i] != w[i]]
        if same:
            hint = _QUANTIZE_HINTS[same[0]]
        return Failure(where, expected, shown, hint)

    return run_cases(
        "quantize",
        _quantize_cases(),
        check_one,
        lambda c: c[0],
        "called as my_quantize(x, scale, fmt) with float32 x and scale tensors, fmt torch.int8 or torch.float8_e4m3fn",
        time_limit=time_limit,
    )


# ---------------------------------------------------------------------------------------- dequantize
def _dequantize_cases():
    g = torch.Generator().manual_seed(1)
    cases = []
    for fmt in (torch.int8, torch.float8_e4m3fn):
        f = _NAMES[fmt]
        if fmt == torch.int8:
            q = torch.randint(-127, 128, (2, 4, 3, 8), generator=g, dtype=torch.int8)
            q[0, 0, 0, :2] = torch.tensor([127, -127], dtype=torch.int8)
        else:
            codes = torch.randint(0, 256, (2, 4, 3, 8), generator=g, dtype=torch.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0  # not NaN
            q = codes.view(fmt)
        cases.append((f"{f}, 5 codes, one scale 0.1", q.flatten()[:5].clone(), torch.tensor(0.1), fmt))
        scale = torch.rand(2, 1, 3, 1, generator=g) * 0.1 + 1e-3
        cases.append(
            (f"{f}, q [2, 4, 3, 8] (pages, page_size, Hkv, D), a scale [2, 1, 3, 1] per page and head", q, scale, fmt)
        )
    return cases


def _torch_not_implemented(fn, *args):
    """``fn(*args)``; a NotImplementedError with a message (torch's: no float8 arithmetic on this device) is
    a failure, not a skeleton's bare ``raise NotImplementedError``."""
    try:
        return fn(*args)
    except NotImplementedError as error:
        if not str(error):
            raise
        raise RuntimeError(f"NotImplementedError: {error}").with_traceback(error.__traceback__) from None


def check_dequantize(fn, *, time_limit: float | None = DEFAULT_TIME_LIMIT_S) -> CheckReport:
    """Check ``fn(q, scale) -> x`` (see the module docstring) against `paged_ref.quant.dequantize`."""

    def check_one(case, run):
        name, q, scale, fmt = case
        want = dequantize(q, scale)
        inputs = (q.clone(), scale.clone())
        where = f"{name}\nq = {q.flatten()[:4].float().tolist()}..., scale {tuple(scale.shape)}"
        try:
            got = run.call(_torch_not_implemented, fn, *inputs)
        except StudentError as raised:
            hint = raised_hint(raised, "my_dequantize(q, scale) -> x")
            if "Float8" in str(raised) or "Promotion" in str(raised):
                hint = "convert q to float32 first, then multiply: q.float() * scale (torch does not mix float8 in)"
            return Failure(where, "a result", f"raised {raised}", hint)
        if not isinstance(got, torch.Tensor):
            return Failure(where, "a float32 tensor", type(got).__name__, "return the values, q * scale")
        if not (torch.equal(inputs[0].float(), q.float()) and torch.equal(inputs[1], scale)):
            return Failure(where, "q and scale unchanged", "the inputs were changed in place", "compute a new tensor")
        if got.dtype != torch.float32 or got.shape != want.shape:
            return Failure(
                where,
                f"{torch.float32} {tuple(want.shape)}",
                f"{got.dtype} {tuple(got.shape)}",
                "the values in float32: q.float() * scale (the scale broadcasts against q)",
            )
        if torch.equal(got, want):
            return None
        i = _mismatch(got, want)
        hint = "x = q.float() * scale, one float32 product"
        if torch.allclose(got, q.float() / scale):
            hint = "dequantize multiplies by the scale: x = q * scale (quantize is the one that divides)"
        return Failure(where, f"x{list(i)} = {want[i].item()!r}", f"x{list(i)} = {got[i].item()!r}", hint)

    return run_cases(
        "dequantize",
        _dequantize_cases(),
        check_one,
        lambda c: c[0],
        "called as my_dequantize(q, scale) with an int8 or float8_e4m3fn q and a float32 scale tensor",
        time_limit=time_limit,
    )


# ---------------------------------------------------------------------------------------- page write
def _page_write_cases():
    """(name, page_size, num_kv_heads, head_dim, writes): each write ``(k, v)`` float32 ``[n, Hkv, D]``."""
    g = torch.Generator().manual_seed(2)

    def tokens(n, hkv, d, levels):
        return torch.randn(n, hkv, d, generator=g) * torch.tensor(levels, dtype=torch.float32)[None, :, None]

    edge = torch.tensor([[[0.5, -0.25], [-3.7, 1.5], [1.2, -0.6], [-1.3, 0.9]]])  # [1, 4, 2]: amax 0.5, 3.7, 1.2, 1.3
    cases = [
        (
            "one token per KV head, at the step up's edge: amax * (1 / need) at 127 exactly, above it while "
            "amax / need is not, above both, below both",
            4,
            4,
            2,
            [(edge, edge.flip(1))],
        ),
        (
            "4 tokens one by one, the second needing a larger scale",
            4,
            1,
            2,
            [(torch.tensor([[[1.0, -0.5]]]), torch.ones(1, 1, 2)), (torch.tensor([[[2.54, 0.0]]]), torch.ones(1, 1, 2))]
            + [(tokens(1, 1, 2, [lv]), tokens(1, 1, 2, [1.0])) for lv in (0.5, 3.0)],
        ),
    ]
    for ps, hkv, d, sizes in ((8, 2, 4, (3, 2, 3)), (16, 3, 8, (10, 1, 1, 1, 1, 1, 1)), (8, 2, 8, (1,) * 8)):
        writes = []
        for n in sizes:
            levels = (torch.rand(hkv, generator=g) * 4 + 0.25).tolist()  # each head grows or not on its own
            writes.append((tokens(n, hkv, d, levels), tokens(n, hkv, d, levels[::-1])))
        cases.append(
            (f"writes of {', '.join(map(str, sizes))} tokens, random magnitudes per KV head", ps, hkv, d, writes)
        )
    zero = tokens(3, 2, 4, [1.0, 1.0])
    zero[:, 1] = 0
    cases.append(
        (
            "a KV head whose first tokens are all 0 (its scale stays 0), then not",
            8,
            2,
            4,
            [(zero, zero.clone()), (tokens(2, 2, 4, [3.0, 0.5]), tokens(2, 2, 4, [3.0, 1.0]))],
        )
    )
    cases.append(
        (
            "an outlier 1000 times larger (the earlier tokens re-quantize to about 0)",
            8,
            1,
            4,
            [(tokens(4, 1, 4, [1.0]), tokens(4, 1, 4, [1.0])), (tokens(1, 1, 4, [1000.0]), tokens(1, 1, 4, [1.0]))],
        )
    )
    first = tokens(5, 2, 8, [1.0, 2.0])
    nudge = first.abs().amax(dim=(0, 2), keepdim=True) * 1.01  # [1, Hkv, 1]: 1% past the amax
    cases.append(
        (
            "a scale that grows by 1% (re-quantizing moves the codes above 50 by one)",
            8,
            2,
            8,
            [(first, first.clone()), (nudge.expand(1, 2, 8).clone(), nudge.expand(1, 2, 8).clone())],
        )
    )
    ladder = torch.linspace(-0.5, 0.5, 256).reshape(4, 1, 64)  # [4, 1, 64]: every int8 code, at scale 0.5 / 127
    big = torch.zeros(1, 1, 64)
    big[0, 0, 0] = 3.0
    cases.append(
        (
            "every code -127 .. 127, then a token 6 times larger (where (q * old) / new, q * (old / new) round apart)",
            8,
            1,
            64,
            [(ladder, ladder.clone()), (big, big.clone())],
        )
    )
    sizes = (7, 3, 1, 1, 4, 1, 12, 1, 2)  # 32 tokens
    writes = [
        (tokens(n, 2, 64, [1.0 + i, 4.0 - i / 3]), tokens(n, 2, 64, [0.5 * (i % 3 + 1), 1.0]))
        for i, n in enumerate(sizes)
    ]
    cases.append(("32 tokens in 9 writes, head_dim 64", 32, 2, 64, writes))
    return cases


def _stepped(amax: torch.Tensor, need: torch.Tensor, step) -> torch.Tensor:
    """``need`` one float32 step up where ``step(amax, need)``; 0 where ``amax`` is 0. [Hkv]"""
    up = torch.where(step(amax, need), torch.nextafter(need, torch.full_like(need, torch.inf)), need)
    return torch.where(amax > 0, up, 0.0)


def _page_variants(page, scale, x, offset) -> dict[str, tuple]:
    """Wrong answers (page, scale) with a name: the mistakes the hints name."""
    amax = x.abs().amax(dim=(0, 2))  # [Hkv]
    need = torch.where(amax > 0, calibrate(x, torch.int8, dim=(0, 2)), 0.0)
    new = torch.maximum(scale, need)
    old = scale[None, :, None]  # [1, Hkv, 1]

    def write(old_page, s, at=offset, rounding="nearest"):
        page = old_page.clone()
        safe = torch.where(s > 0, s, 1.0)[None, :, None]
        q = quantize(x, safe, torch.int8, rounding=rounding)
        page[at : at + x.shape[0]] = q[: page.shape[0] - at]
        return page

    def requant(s, rounding="nearest", how="reciprocal"):
        safe = torch.where(s > 0, s, 1.0)[None, :, None]  # a scale may be 0 here
        if how == "reciprocal":
            return quantize(page.float() * old, safe, torch.int8, rounding=rounding)
        y = page.float() * old / safe if how == "divided" else page.float() * (old / safe)
        return torch.where((s > scale)[None, :, None], y.clamp(-127, 127).round().to(torch.int8), page)

    def grown(need):
        return torch.maximum(scale, need)

    one = torch.maximum(scale.amax(), need.amax()).expand_as(scale)
    plain = grown(amax / 127)
    last = grown(torch.where(amax > 0, calibrate(x[-1:], torch.int8, dim=(0, 2)), 0.0))
    at_least = grown(_stepped(amax, amax / 127, lambda a, n: a * (1 / n) >= 127))
    always = grown(_stepped(amax, amax / 127, lambda a, n: torch.ones_like(a, dtype=torch.bool)))
    divided = grown(_stepped(amax, amax / 127, lambda a, n: a / n > 127))
    times = grown(_stepped(amax, amax * (1 / 127), lambda a, n: a * (1 / n) > 127))
    ones = grown(calibrate(x, torch.int8, dim=(0, 2)))
    return {
        "no requant": (write(page, new), new),
        "shrinks": (write(requant(need), need), need),
        "one scale": (write(requant(one), one), one),
        "truncated": (write(requant(new, "zero"), new), new),
        "divided requant": (write(requant(new, how="divided"), new), new),
        "ratio requant": (write(requant(new, how="ratio"), new), new),
        "no nextafter": (write(requant(plain), plain), plain),
        "at least 127": (write(requant(at_least), at_least), at_least),
        "always nextafter": (write(requant(always), always), always),
        "divided step test": (write(requant(divided), divided), divided),
        "times 1/127": (write(requant(times), times), times),
        "calibrate 1.0": (write(requant(ones), ones), ones),
        "at 0": (write(requant(new), new, 0), new),
        "at offset + 1": (write(requant(new), new, offset + 1), new),
        "last token": (write(requant(last), last), last),
    }


_STRICTLY = (
    "one float32 step up only where the product is strictly above 127: where amax * (1 / need) > 127 "
    "(not >= 127, and not for every head)"
)
_PAGE_HINTS = {
    "no requant": "where a head's scale grows, re-quantize its earlier tokens: dequantize them with the old scale and "
    "quantize with the new one (the old bytes meant q * old)",
    "shrinks": "the scale never shrinks: max(old scale, what the new tokens need)",
    "one scale": "one scale per KV head: the largest |x| over the new tokens and head_dim, not over all heads",
    "truncated": "re-quantize to nearest (torch.round): truncating at each growth drifts the first tokens toward 0",
    "divided requant": "re-quantize by dequantizing, then quantizing: (q * old) * (1 / new), the reciprocal as in "
    "my_quantize; (q * old) / new rounds a few codes the other way",
    "ratio requant": "re-quantize by dequantizing, then quantizing: (q * old) * (1 / new); q * (old / new) rounds "
    "a few codes the other way",
    "no nextafter": "what the new tokens need is amax / 127, one float32 step up (torch.nextafter) where "
    "amax * (1 / need) still exceeds 127: otherwise amax * (1 / scale) comes out above 127 and saturates "
    "(pr.quant.count_saturated counts it; calibrate's rule)",
    "at least 127": _STRICTLY,
    "always nextafter": _STRICTLY,
    "divided step test": "test the step up with the product, as my_quantize computes it: amax * (1 / need) > 127; "
    "amax / need rounds apart from it for some amax, and the step is there to keep amax * (1 / scale) at most 127",
    "times 1/127": "need = amax / 127, a division: amax * (1 / 127) is one float32 step off for some amax",
    "calibrate 1.0": "0 where amax is 0; calibrate returns 1.0 there",
    "at 0": "the new tokens go at offset, offset + 1, ..., after the ones the page holds",
    "at offset + 1": "the first new token goes at offset itself (positions offset .. offset + n - 1), not offset + 1",
    "last token": "what the new tokens need is over all of them: the largest |x| over every new token and head_dim",
}


class _NanCasts(TorchFunctionMode):
    """Within ``with _NanCasts() as casts:``, ``casts.seen`` is True once a torch call turned a float tensor
    holding NaN into integers (a cast, or a write into an integer tensor): what NaN becomes is platform-defined.
    """

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.seen:
            into = out if isinstance(out, torch.Tensor) else args[0] if args else None  # a write: its target
            if isinstance(into, torch.Tensor) and not into.is_floating_point() and into.dtype != torch.bool:
                floats = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                self.seen = any(t.is_floating_point() and bool(t.isnan().any()) for t in floats)
        return out


def _page_state(cache, page: int) -> tuple:
    """(K bytes, K scale, V bytes, V scale) of ``page``: int8 ``[ps, Hkv, D]``, float32 ``[Hkv]``, copies."""
    k_scales, v_scales = cache.kv_scales(0)
    return (
        cache.k_cache[0][page].clone(),
        k_scales[page].clone(),
        cache.v_cache[0][page].clone(),
        v_scales[page].clone(),
    )


def check_page_write(fn, *, time_limit: float | None = DEFAULT_TIME_LIMIT_S) -> CheckReport:
    """Check ``fn(page, scale, x, offset) -> (page, scale)`` (see the module docstring) against the int8
    pages of ``PagedKVCache(kv_format=KVFormat(torch.int8, scales="page"))``."""

    def check_one(case, run):
        name, ps, hkv, d, writes = case
        cache = PagedKVCache(
            num_layers=1,
            num_pages=1,
            page_size=ps,
            num_kv_heads=hkv,
            head_dim=d,
            kv_format=KVFormat(torch.int8, scales="page"),
        )
        seq = cache.add_sequence()
        offset = 0
        for w, (k, v) in enumerate(writes):
            before = _page_state(cache, 0)
            cache.write(0, cache.reserve(seq, k.shape[0]), k, v)
            after = _page_state(cache, 0)
            for side, page, scale, x, want_page, want_scale in (
                ("K", before[0], before[1], k, after[0], after[1]),
                ("V", before[2], before[3], v, after[2], after[3]),
            ):
                failure = _check_write(
                    run, fn, name, w, len(writes), side, page, scale, x, offset, want_page, want_scale
                )
                if failure is not None:
                    return failure
            offset += k.shape[0]
        return None

    return run_cases(
        "page_write",
        _page_write_cases(),
        check_one,
        lambda c: f"{c[0]}: page_size={c[1]}, {c[2]} KV heads, head_dim {c[3]}",
        "called as my_write_into_page(page int8 [page_size, Hkv, D], scale float32 [Hkv], x float32 [n, Hkv, D], "
        "offset) -> (page, scale)",
        time_limit=time_limit,
    )


def _check_write(run, fn, name, w, count, side, page, scale, x, offset, want_page, want_scale):
    ps, hkv, d = page.shape
    where = (
        f"{name}: page_size={ps}, {hkv} KV heads, head_dim {d}\n"
        f"write {w + 1} of {count}, the {side} side: {x.shape[0]} token(s) at offset {offset}; "
        f"scale before = {scale.tolist()}, new tokens' largest |x| per head = {x.abs().amax(dim=(0, 2)).tolist()}"
    )
    inputs = (page.clone(), scale.clone(), x.clone())
    try:
        with _NanCasts() as casts:
            got = run.call(fn, *inputs, offset)
    except StudentError as raised:
        interface = "my_write_into_page(page, scale, x, offset) -> (page, scale)"
        return Failure(where, "a result", f"raised {raised}", raised_hint(raised, interface))
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(isinstance(t, torch.Tensor) for t in got):
        return Failure(
            where, "a tuple (page, scale) of tensors", f"{type(got).__name__}"[:100], "return both: return page, scale"
        )
    if not all(torch.equal(a, b) for a, b in zip(inputs, (page, scale, x))):
        return Failure(
            where,
            "page, scale and x unchanged",
            "the inputs were changed in place",
            "return a new page and scale: page.clone() first, then write into the copy",
        )
    new_page, new_scale = got
    if new_page.dtype != torch.int8 or new_page.shape != page.shape:
        return Failure(
            where,
            f"a {torch.int8} page {tuple(page.shape)}",
            f"{new_page.dtype} {tuple(new_page.shape)}",
            "the page keeps its shape and int8 bytes",
        )
    if new_scale.dtype != torch.float32 or new_scale.shape != scale.shape:
        return Failure(
            where,
            f"a {torch.float32} scale {tuple(scale.shape)}",
            f"{new_scale.dtype} {tuple(new_scale.shape)}",
            "one float32 scale per KV head",
        )
    if casts.seen:
        return Failure(
            where,
            "no NaN cast to int8",
            "a NaN cast to int8 (0 * (1 / 0) = NaN: a value quantized at a scale of 0?)",
            "a head whose scale is still 0 holds only zeros: quantize with 1.0 there; what NaN becomes in int8 is "
            "platform-defined (0 on this CPU, by chance)",
        )
    if torch.equal(new_page, want_page) and torch.equal(new_scale, want_scale):
        return None
    variants = _page_variants(page, scale, x, offset)
    hint = (
        "scale = max(old, need) per KV head; where it grew, old tokens: quantize(dequantize(q, old), new); "
        "then the new tokens at offset: quantize(x, scale)"
    )
    same = [v for v, (vp, vs) in variants.items() if torch.equal(new_page, vp) and torch.equal(new_scale, vs)]
    same = same or [
        v for v, (_, vs) in variants.items() if torch.equal(new_scale, vs) and not torch.equal(vs, want_scale)
    ]
    if same:
        hint = _PAGE_HINTS[same[0]]
    if not torch.equal(new_scale, want_scale):
        h = int((new_scale != want_scale).nonzero()[0])
        expected = f"scale[{h}] = {want_scale[h].item()!r} (all: {want_scale.tolist()})"
        return Failure(where, expected, f"scale[{h}] = {new_scale[h].item()!r} (all: {new_scale.tolist()})", hint)
    t, h, c = _mismatch(new_page, want_page)
    token = "a new token" if t >= offset else "an earlier token"
    expected = f"page[{t}, {h}, {c}] = {int(want_page[t, h, c])} ({token}; it was {int(page[t, h, c])})"
    return Failure(where, expected, f"page[{t}, {h}, {c}] = {int(new_page[t, h, c])}", hint)
