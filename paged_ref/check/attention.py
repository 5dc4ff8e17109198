"""Checkers for slot mapping and paged decode attention, against the package's oracles.

Cases run smallest first: one token, one page, then ragged lengths over shuffled pages with
garbage in every slot a sequence does not own (block-table padding points at other sequences'
pages), GQA and MQA head layouts, and a case whose scores are in the thousands (a softmax
without the max subtracted overflows there). A wrong answer is compared with the answers of
typical mistakes to give a precise hint.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..attention.reference import paged_attention_reference
from ..block_table import slot_mapping
from .cases import scatter_sequences
from .report import Failure, run_cases

__all__ = ["check_paged_attention", "check_slot_mapping", "check_triton_decode", "make_attention_cases"]


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


def check_slot_mapping(fn, *, seed: int = 0, cases: int = 120):
    """Check ``fn(pages, *, start, num_tokens, page_size)`` against `paged_ref.slot_mapping`.

    ``fn`` returns the flat slot ``pages[t // page_size] * page_size + t % page_size`` of each
    token ``t`` in ``start .. start + num_tokens - 1`` (a list or an integer tensor).
    """

    def one(case):
        pages, start, num_tokens, page_size = case
        want = slot_mapping(pages, start=start, num_tokens=num_tokens, page_size=page_size).tolist()
        out = fn(list(pages), start=start, num_tokens=num_tokens, page_size=page_size)
        got = [int(x) for x in torch.as_tensor(out)]
        if got == want:
            return None
        if got == list(range(start, start + num_tokens)):
            hint = "these are logical positions: look up each token's physical page in pages[t // page_size]"
        elif len(got) != len(want):
            hint = f"one slot per token: {num_tokens} tokens from position {start}"
        else:
            hint = "slot = pages[t // page_size] * page_size + t % page_size, for t = start, start + 1, ..."
        return Failure(_describe_slots(case), str(want), str(got), hint)

    hint = "token t (start <= t < start + num_tokens) lies on page pages[t // page_size] at offset t % page_size"
    return run_cases("slot_mapping", _slot_cases(seed, cases), one, _describe_slots, hint)


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

    def describe(self) -> str:
        num_pages, page_size, num_kv_heads, head_dim = self.k_cache.shape
        return (
            f"batch={self.q.shape[0]}, num_q_heads={self.q.shape[1]}, num_kv_heads={num_kv_heads}, "
            f"head_dim={head_dim}, page_size={page_size}, num_pages={num_pages}, scale={self.scale:g}\n"
            f"seq_lens={self.seq_lens.tolist()}\nblock_table={self.block_table.tolist()}"
        )


# (batch, page_size, num_kv_heads, group, head_dim, max_len, scale multiplier), smallest first
_LAYOUTS = [
    (1, 1, 1, 1, 8, 1, 1.0),
    (1, 4, 1, 1, 8, 4, 1.0),
    (2, 4, 1, 1, 8, 9, 1.0),
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
    # valid page ids in the padding (a gather that reads padding gets wrong numbers, not an
    # index error); garbage of scale 50 in every unowned slot; K/V of scale 3
    k_cache, v_cache, table, _, _ = scatter_sequences(
        lens,
        page_size,
        num_kv_heads,
        head_dim,
        generator=gen,
        dtype=torch.float64,
        spare_pages=2,
        pad_cols=1,
        garbage=50.0,
        value_scale=3.0,
        padding="pages",
    )
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen, dtype=torch.float64)
    scale = head_dim**-0.5 * scale_mult
    return AttentionCase(
        q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), table, torch.tensor(lens, dtype=torch.int32), scale
    )


def _reference(case: AttentionCase, *, lens=None, table=None, q=None) -> torch.Tensor:
    f64 = (case.q if q is None else q).double().cpu(), case.k_cache.double().cpu(), case.v_cache.double().cpu()
    return paged_attention_reference(
        *f64,
        (case.block_table if table is None else table).cpu(),
        (case.seq_lens if lens is None else lens).cpu(),
        scale=case.scale,
        check_values=False,
    )


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    return got.shape == want.shape and bool(torch.isfinite(got).all()) and bool(((got - want).abs() <= tol).all())


def _attention_hint(case: AttentionCase, got: torch.Tensor, tol: float) -> str:
    """Which typical mistake ``got`` matches."""
    if not bool(torch.isfinite(got).all()):
        return "inf/nan: subtract each row's max score before exp (large scores overflow exp)"
    lens = case.seq_lens.cpu()
    if _close(got, _reference(case, lens=(lens - 1).clamp(min=1)), tol):
        return "one token short: attend to tokens 0 .. seq_len-1, that is all seq_len tokens"
    longer = lens + 1
    if bool((longer.long() <= case.block_table.shape[1] * case.k_cache.shape[1]).all()) and _close(
        got, _reference(case, lens=longer), tol
    ):
        return "one token too many: attend to tokens 0 .. seq_len-1 only"
    logical = torch.arange(case.block_table.shape[1], dtype=torch.int32).repeat(case.q.shape[0], 1)
    if int(logical.max()) < case.k_cache.shape[0] and _close(got, _reference(case, table=logical), tol):
        return "read pages through the block table: logical page j of sequence b is block_table[b, j]"
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


def _attention_checker(name: str, fn, cases: list[AttentionCase], tol: float, error_hint: str):
    def one(case):
        got = fn(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, scale=case.scale)
        if not isinstance(got, torch.Tensor):
            expected = "a tensor [batch, num_q_heads, head_dim]"
            return Failure(case.describe(), expected, type(got).__name__, "return a tensor")
        want = _reference(case)
        got64 = got.detach().to("cpu", torch.float64)
        if _close(got64, want, tol):
            return None
        if got64.shape != want.shape:
            shapes = f"shape {list(want.shape)}", f"shape {list(got64.shape)}"
            return Failure(case.describe(), *shapes, "the output has the shape of q")
        err = (got64 - want).abs().nan_to_num(float("inf"))
        b, h = divmod(int(err.amax(-1).argmax()), want.shape[1])
        return Failure(
            case.describe(),
            f"out[{b}, {h}, :4] = {[round(x, 4) for x in want[b, h, :4].tolist()]}",
            f"out[{b}, {h}, :4] = {[round(x, 4) for x in got64[b, h, :4].tolist()]} (max error {float(err.max()):.3g})",
            _attention_hint(case, got64, tol),
        )

    return run_cases(name, cases, one, AttentionCase.describe, error_hint)


def check_paged_attention(fn, *, seed: int = 0, repeats: int = 2):
    """Check a paged decode attention ``fn(q, k_cache, v_cache, block_table, seq_lens, scale=...)``.

    Same contract as `paged_ref.paged_attention_reference`: q ``[batch, Hq, D]``, caches
    ``[num_pages, page_size, Hkv, D]``, block_table int32 ``[batch, max_pages]`` (entries past
    a sequence's pages are padding), seq_lens int32 ``[batch]``; returns ``[batch, Hq, D]``.
    Inputs are float64; answers must match the reference to 1e-8.
    """
    cases = make_attention_cases(seed, torch.float64, repeats)
    return _attention_checker("paged_attention", fn, cases, 1e-8, "the call raised: check shapes and dtypes")


def check_triton_decode(fn, *, seed: int = 0, repeats: int = 1):
    """The same check for a Triton decode launcher, on float32 inputs (tolerance 1e-4).

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
    return _attention_checker("triton_decode", fn, cases, 1e-4, hint)
