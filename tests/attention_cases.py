"""Random paged-attention cases and a float64 oracle, shared by the attention tests.

A case is built by `paged_ref.lab.check.cases.scatter_sequences` (the coursework checkers use the
same generator), the way a serving cache ends up after some churn:

* ragged lengths that always include 1, an exact page multiple and one past it;
* the pages of all sequences scattered over a shuffled cache, with spare pages nobody owns;
* block-table padding (entries past a sequence's pages) holding garbage: -1, ids past the end
  of the cache, and ids of other sequences' pages;
* every cache slot no sequence owns (spare pages, the unwritten tail of each last page) filled
  with large finite garbage, so reading one by mistake moves the output far off.

The oracle never looks at pages: it computes attention in float64 from the *logical* K/V of
each sequence (the exact values that were written into the cache, after rounding to the
case's dtype).

Usage:
    case = make_decode_case(seed=0, batch=4, page_size=16, num_kv_heads=2, group=4,
                            head_dim=64)
    out = f(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens)
    assert rel_error(out, case.expected()) < 1e-4
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from paged_ref.block_table import pages_needed
from paged_ref.lab.check.cases import scatter_sequences

# (num_kv_heads, group): query heads = num_kv_heads * group. GQA ratios 1, 2, 4, 8 and MQA.
HEAD_LAYOUTS = [(2, 1), (2, 2), (2, 4), (2, 8), (1, 4)]
HEAD_LAYOUT_IDS = ["mha", "gqa2", "gqa4", "gqa8", "mqa"]
PAGE_SIZES = [1, 8, 16, 64, 128]
HEAD_DIMS = [64, 128]


@dataclass
class PagedCase:
    q: torch.Tensor  # [batch, Hq, D] (decode) or [batch, Hq, max_q_len, D] (prefill)
    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]
    block_table: torch.Tensor  # int32 [batch, max_pages], garbage past each sequence's pages
    seq_lens: torch.Tensor  # int32 [batch]
    q_lens: torch.Tensor | None  # int32 [batch] for prefill, None for decode
    k_logical: list[torch.Tensor]  # per sequence [seq_len, Hkv, D], float64
    v_logical: list[torch.Tensor]  # per sequence [seq_len, Hkv, D], float64
    seed: int
    k_scale: torch.Tensor | None = None  # 8-bit pages: float32 [num_pages, Hkv] (maybe stride 0)
    v_scale: torch.Tensor | None = None

    @property
    def scales(self) -> dict:
        """The page-scale keywords of the attention functions (empty for floating pages)."""
        return {} if self.k_scale is None else dict(k_scale=self.k_scale, v_scale=self.v_scale)

    @property
    def args(self) -> tuple:
        """Positional arguments of the decode / prefill attention functions."""
        base = (self.q, self.k_cache, self.v_cache, self.block_table, self.seq_lens)
        return base if self.q_lens is None else base + (self.q_lens,)

    def expected(self, scale: float | None = None) -> torch.Tensor:
        """float64 attention from the logical K/V (padding query rows are 0)."""
        return dense_oracle(self.q, self.k_logical, self.v_logical, self.q_lens, scale)

    def physical_mask(self) -> torch.Tensor:
        """bool [batch, q_len, num_pages * page_size]: which physical slots each query sees."""
        num_pages, page_size = self.k_cache.shape[:2]
        q_len = 1 if self.q_lens is None else self.q.shape[2]
        mask = torch.zeros(len(self.k_logical), q_len, num_pages * page_size, dtype=torch.bool)
        for b, n in enumerate(self.seq_lens.tolist()):
            pos = torch.arange(n)  # logical positions
            slots = self.block_table[b, pos // page_size].long() * page_size + pos % page_size
            if self.q_lens is None:
                visible = [n]  # the decode query sees all
            else:
                m = int(self.q_lens[b])
                visible = [n - m + i + 1 for i in range(m)]  # causal: up to itself
            for i, count in enumerate(visible):
                mask[b, i, slots[:count]] = True
        return mask


def quantize_case(case: PagedCase, fmt: torch.dtype, *, scales: str = "page", rounding: str = "nearest") -> PagedCase:
    """``case`` with its pages stored in the 8-bit ``fmt`` (`paged_ref.quant`): ``scales="page"`` calibrates a
    scale per page and KV head on the slots the sequences own (so the junk elsewhere saturates: reading
    it still moves the output far off), ``"layer"`` one scale for all of K (and one for V), expanded to
    ``[num_pages, Hkv]``. The logical K/V become what the 8-bit pages hold, in float64."""
    from paged_ref import quant

    num_pages, page_size, num_kv_heads, _ = case.k_cache.shape
    owned = torch.zeros(num_pages, page_size, dtype=torch.bool)  # slots holding a sequence's token
    for b, n in enumerate(case.seq_lens.tolist()):
        pos = torch.arange(n)
        owned[case.block_table[b, pos // page_size].long(), pos % page_size] = True
    out = {}
    for name, cache in (("k", case.k_cache), ("v", case.v_cache)):
        real = cache.float() * owned[:, :, None, None]  # [num_pages, page_size, Hkv, D], junk zeroed
        if scales == "page":
            scale = quant.calibrate(real, fmt, dim=(1, 3))  # [num_pages, Hkv]
        else:
            scale = quant.calibrate(real, fmt).expand(num_pages, num_kv_heads)
        pages = quant.quantize(cache.float(), scale[:, None, :, None], fmt, rounding=rounding)
        values = quant.dequantize(pages, scale[:, None, :, None], torch.float64)
        flat = values.flatten(0, 1)  # [num_pages * page_size, Hkv, D]
        logical = []
        for b, n in enumerate(case.seq_lens.tolist()):
            pos = torch.arange(n)
            logical.append(flat[case.block_table[b, pos // page_size].long() * page_size + pos % page_size])
        out[name] = (pages, scale, logical)
    (kc, ks, kl), (vc, vs, vl) = out["k"], out["v"]
    return replace(case, k_cache=kc, v_cache=vc, k_logical=kl, v_logical=vl, k_scale=ks, v_scale=vs)


def dense_oracle(q, k_logical, v_logical, q_lens=None, scale=None) -> torch.Tensor:
    """Softmax attention in float64 on contiguous per-sequence K/V, causal for prefill."""
    decode = q_lens is None
    q64 = (q.unsqueeze(2) if decode else q).to(torch.float64)  # [batch, Hq, Q, D]
    out = torch.zeros_like(q64)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    for b, (k, v) in enumerate(zip(k_logical, v_logical)):
        k, v = k.to(q64.device), v.to(q64.device)  # the logical K/V are built on the host
        n = k.shape[0]
        m = 1 if decode else int(q_lens[b])
        group = q.shape[1] // k.shape[1]
        kk = k.transpose(0, 1).repeat_interleave(group, 0)  # [Hq, n, D]
        vv = v.transpose(0, 1).repeat_interleave(group, 0)  # [Hq, n, D]
        s = q64[b, :, :m] @ kk.transpose(1, 2) * scale  # [Hq, m, n]
        q_pos = torch.arange(n - m, n, device=q64.device)[:, None]  # decode: [[n - 1]]
        s = s.masked_fill(torch.arange(n, device=q64.device)[None, :] > q_pos, float("-inf"))
        out[b, :, :m] = torch.softmax(s, -1) @ vv
    return out.squeeze(2) if decode else out


def ragged_lengths(batch: int, page_size: int, max_len: int, gen: torch.Generator) -> list[int]:
    """Lengths starting with 1, an exact page multiple and one past it, then random."""
    special = [1, page_size * 2, page_size * 2 + 1, page_size]
    lens = [min(n, max_len) for n in special]
    while len(lens) < batch:
        lens.append(int(torch.randint(1, max_len + 1, (1,), generator=gen)))
    lens = lens[:batch]
    order = torch.randperm(batch, generator=gen).tolist()
    return [lens[i] for i in order]


def _fill_cache(seq_lens, page_size, num_kv_heads, head_dim, dtype, gen, spare_pages, pad_cols, garbage):
    """Scatter random logical K/V over shuffled pages (the package's generator, junk padding)."""
    return scatter_sequences(
        seq_lens,
        page_size,
        num_kv_heads,
        head_dim,
        generator=gen,
        dtype=dtype,
        spare_pages=spare_pages,
        pad_cols=pad_cols,
        garbage=garbage,
    )


def make_decode_case(
    seed: int,
    batch: int,
    page_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    *,
    max_len: int | None = None,
    seq_lens: list[int] | None = None,
    dtype=torch.float32,
    spare_pages: int = 3,
    pad_cols: int = 2,
    garbage: float = 100.0,
) -> PagedCase:
    """One decode query per sequence. ``max_len`` defaults to ``3 * page_size + 5``."""
    gen = torch.Generator().manual_seed(seed)
    max_len = max_len or 3 * page_size + 5
    lens = seq_lens or ragged_lengths(batch, page_size, max_len, gen)
    k_cache, v_cache, table, kl, vl = _fill_cache(
        lens, page_size, num_kv_heads, head_dim, dtype, gen, spare_pages, pad_cols, garbage
    )
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    return PagedCase(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), None, kl, vl, seed)


def make_prefill_case(
    seed: int,
    batch: int,
    page_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    *,
    max_len: int | None = None,
    max_q_len: int = 12,
    seq_lens: list[int] | None = None,
    q_lens: list[int] | None = None,
    dtype=torch.float32,
    spare_pages: int = 3,
    pad_cols: int = 2,
    garbage: float = 100.0,
) -> PagedCase:
    """Several new tokens per sequence (the last ``q_lens[b]`` of its ``seq_lens[b]``), with
    ragged ``q_lens`` including a full prefill (q_len = seq_len) where it fits, a single token
    and, for batch >= 4, an empty row; q is right-padded with random values."""
    gen = torch.Generator().manual_seed(seed)
    max_len = max_len or 3 * page_size + 5
    lens = seq_lens or ragged_lengths(batch, page_size, max_len, gen)
    if q_lens is None:
        q_lens = [int(torch.randint(1, min(n, max_q_len) + 1, (1,), generator=gen)) for n in lens]
        q_lens[-1] = 1  # a decode-like row
        if len(lens) >= 4:
            q_lens[-2] = 0  # an empty row
        fits = [b for b, n in enumerate(lens[:-2]) if n <= max_q_len]
        if fits:  # one full prefill
            b = max(fits, key=lambda i: lens[i])
            q_lens[b] = lens[b]
    k_cache, v_cache, table, kl, vl = _fill_cache(
        lens, page_size, num_kv_heads, head_dim, dtype, gen, spare_pages, pad_cols, garbage
    )
    q = torch.randn(len(lens), num_kv_heads * group, max_q_len, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    return PagedCase(
        q,
        k_cache,
        v_cache,
        table,
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(q_lens, dtype=torch.int32),
        kl,
        vl,
        seed,
    )


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.to(torch.float64), ref.to(torch.float64)
    return float((out - ref).norm() / ref.norm())


# the compiled-flex decode case (static shapes: each compiles once per process, so the tests that
# compile flex share these shapes and page sizes); add seed= and page_size=
COMPILED_DECODE_CASE = dict(batch=4, page_size=16, num_kv_heads=2, group=4, head_dim=64, seq_lens=[17, 300, 1024, 64])


def per_row_copies(case: PagedCase, poison: bool = True) -> PagedCase:
    """The same problem with one copy of the cache per sequence: row ``b`` reads copy ``b``.
    With ``poison``, every page of copy ``b`` that row ``b`` does not use (spare pages, other
    sequences' pages, the pages padding entries name) holds NaN in K and Inf in V: one batched
    call then shows that no row reads a slot outside its own pages, not even one it masks out."""
    num_pages, page_size = case.k_cache.shape[:2]
    batch = len(case.k_logical)
    k = case.k_cache.repeat(batch, 1, 1, 1)  # [batch * num_pages, page_size, Hkv, D]
    v = case.v_cache.repeat(batch, 1, 1, 1)  # [batch * num_pages, page_size, Hkv, D]
    table = case.block_table.clone()  # int32 [batch, max_pages]
    for b, n in enumerate(case.seq_lens.tolist()):
        ids = table[b]
        own = torch.zeros(batch * num_pages, dtype=torch.bool)
        own[ids[: pages_needed(n, page_size)].long() + b * num_pages] = True
        foreign = torch.zeros_like(own)
        foreign[b * num_pages : (b + 1) * num_pages] = True
        foreign &= ~own
        if poison:
            k[foreign], v[foreign] = float("nan"), float("inf")
        # valid ids move into copy b; ids past the end of the cache stay past the end
        table[b] = torch.where(ids < 0, ids, ids + torch.where(ids < num_pages, b, batch - 1) * num_pages)
    return replace(case, k_cache=k, v_cache=v, block_table=table)


# ---- bad inputs: every error names the argument --------------------------------------------
# Each entry: (name, change to valid_inputs(), error type, words the message must contain).


def valid_inputs(decode: bool = False) -> dict:
    """A small valid problem as a dict of named arguments (prefill, or decode without q_lens)."""
    case = make_prefill_case(seed=9, batch=4, page_size=4, num_kv_heads=2, group=2, head_dim=8, max_q_len=4)
    args = dict(
        q=case.q,
        k_cache=case.k_cache,
        v_cache=case.v_cache,
        block_table=case.block_table,
        seq_lens=case.seq_lens,
        q_lens=case.q_lens,
    )
    if decode:
        args["q"] = case.q[:, :, 0]  # [batch, heads, head_dim]
        del args["q_lens"]
    return args


def _bad_page(a):
    bt = a["block_table"].clone()
    bt[0, 0] = a["k_cache"].shape[0]  # a used entry past the end
    return {"block_table": bt}


def _repeated_page(a):
    bt, lens = a["block_table"].clone(), a["seq_lens"].clone()
    lens[0] = 8  # two pages used
    bt[0, 1] = bt[0, 0]
    return {"block_table": bt, "seq_lens": lens}


BAD_INPUTS = [
    ("q not a tensor", lambda a: {"q": a["q"].tolist()}, TypeError, "q must be a torch.Tensor"),
    ("q int", lambda a: {"q": a["q"].long()}, TypeError, "q must be a floating-point"),
    ("q wrong ndim", lambda a: {"q": a["q"][0]}, ValueError, "q must have shape"),
    ("k_cache ndim", lambda a: {"k_cache": a["k_cache"][0]}, ValueError, "k_cache must have shape"),
    ("v_cache shape", lambda a: {"v_cache": a["v_cache"][:-1]}, ValueError, "v_cache must have"),
    ("k_cache dtype", lambda a: {"k_cache": a["k_cache"].double()}, TypeError, "k_cache must have the same dtype"),
    ("v_cache dtype", lambda a: {"v_cache": a["v_cache"].double()}, TypeError, "v_cache must have the same dtype"),
    ("head_dim", lambda a: {"q": a["q"][..., :4]}, ValueError, "q head_dim"),
    ("heads", lambda a: {"q": a["q"][:, :3]}, ValueError, "num_q_heads (3)"),
    (
        "empty batch",
        lambda a: {k: v[:0] for k, v in a.items() if k != "k_cache" and k != "v_cache"},
        ValueError,
        "at least one sequence",
    ),
    ("block_table dtype", lambda a: {"block_table": a["block_table"].float()}, TypeError, "block_table must be int32"),
    ("block_table shape", lambda a: {"block_table": a["block_table"][:2]}, ValueError, "block_table must have shape"),
    ("seq_lens dtype", lambda a: {"seq_lens": a["seq_lens"].float()}, TypeError, "seq_lens must be int32"),
    ("seq_lens shape", lambda a: {"seq_lens": a["seq_lens"][None]}, ValueError, "seq_lens must have shape"),
    ("seq_lens zero", lambda a: {"seq_lens": a["seq_lens"] * 0}, ValueError, "seq_lens[0] must be in [1"),
    ("seq_lens too long", lambda a: {"seq_lens": a["seq_lens"] + 1000}, ValueError, "max_pages * page_size"),
    ("page id out of range", _bad_page, ValueError, "block_table[0] uses page ids outside"),
    ("page id repeated", _repeated_page, ValueError, "more than once"),
    ("q_lens dtype", lambda a: {"q_lens": a["q_lens"].float()}, TypeError, "q_lens must be int32"),
    ("q_lens shape", lambda a: {"q_lens": a["q_lens"][:1]}, ValueError, "q_lens must have shape"),
    ("q_lens not tensor", lambda a: {"q_lens": a["q_lens"].tolist()}, TypeError, "q_lens must be a torch.Tensor"),
    (
        "q_lens > seq_lens",
        lambda a: {"q_lens": torch.minimum(a["seq_lens"] + 1, a["q_lens"] * 0 + 4)},
        ValueError,
        "must be in [0, min(seq_lens[",
    ),
    (
        "q_lens > max_q_len",
        lambda a: {"q_lens": torch.where(a["seq_lens"] >= 5, 5, a["q_lens"])},
        ValueError,
        "max_q_len=4)",
    ),
    ("q_lens negative", lambda a: {"q_lens": a["q_lens"] * 0 - 1}, ValueError, "q_lens[0] must be in [0"),
]


def check_rejects(fn, change, error, words, *, decode: bool, **kwargs):
    """fn (decode or prefill signature) must raise `error` with `words` in its message when
    `change` is applied to valid_inputs(decode)."""
    a = valid_inputs(decode)
    a.update(change(a))
    with pytest.raises(error) as info:
        fn(*a.values(), **kwargs)
    assert words in str(info.value), str(info.value)


# The q_lens checks do not apply to decode.
DECODE_BAD_INPUTS = [b for b in BAD_INPUTS if not b[0].startswith("q_lens")]
