"""The checks at the door of every public attention function: ``TypeError`` for a wrong type or
dtype, ``ValueError`` for a wrong shape, device or value, each naming the argument, what was
expected and what was given. Every backend runs :func:`check_paged_inputs` (or
:func:`check_prefill_inputs`) first; the rest are one backend's own rules.
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention.flex_attention import BlockMask

from .._arith import cdiv
from .._validate import check_bool, check_int
from ..quant import FORMATS

__all__ = ["EIGHT_BIT_BACKENDS", "INT_DTYPES", "check_block_mask", "check_block_size", "check_cascade_inputs"]
__all__ += [
    "check_contiguous",
    "check_floating_pages",
    "check_mask_arguments",
    "check_page_scales",
    "check_paged_inputs",
    "check_prefill_inputs",
    "check_quest_inputs",
]
__all__ += ["check_table_pages", "check_triton_inputs", "mask_source"]

INT_DTYPES = (torch.int32, torch.int64)
#: The backends (`paged_ref.hf`'s names) that read 8-bit pages; those that cannot refuse them naming these.
EIGHT_BIT_BACKENDS = ("reference", "sdpa", "cpu_paged", "triton", "flex")


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _int_tensor(name: str, t, q: torch.Tensor, layout: str, shape_ok) -> None:
    """``t`` an int32/int64 tensor on ``q``'s device whose shape passes ``shape_ok`` (``layout`` says which)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INT_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got dtype {t.dtype}")
    if not shape_ok(tuple(t.shape)):
        raise ValueError(f"{name} must have shape {layout}, got shape {_shape(t)}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")


def check_paged_inputs(
    q, k_cache, v_cache, block_table, seq_lens, *, scale=None, q_ndim=3, check_values=True, k_scale=None, v_scale=None
) -> float:
    """The common paged-attention arguments; returns the softmax scale as a float.

    ``q`` is ``[batch, num_q_heads, head_dim]`` (``q_ndim=3``) or ``[batch, num_q_heads,
    max_q_len, head_dim]`` (``q_ndim=4``), floating; ``k_cache``, ``v_cache`` of its dtype (or both
    in one 8-bit format with ``k_scale``, ``v_scale``: :func:`check_page_scales`) and device;
    ``block_table`` and ``seq_lens`` int32/int64. ``check_values`` also reads the values on the
    host: ``seq_lens[b]`` in ``[1, max_pages * page_size]``, the used block-table entries distinct
    page ids."""
    for name, t in dict(q=q, k_cache=k_cache, v_cache=v_cache).items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    layout = "[batch, num_q_heads, head_dim]" if q_ndim == 3 else "[batch, num_q_heads, max_q_len, head_dim]"
    if q.dim() != q_ndim:
        raise ValueError(f"q must have shape {layout} ({q_ndim} dims), got shape {_shape(q)}")
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got dtype {q.dtype}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must have shape [num_pages, page_size, num_kv_heads, head_dim], got shape {_shape(k_cache)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the same shape as k_cache {_shape(k_cache)}, got {_shape(v_cache)}")
    check_page_scales(q, k_cache, v_cache, k_scale, v_scale)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    batch, num_q_heads = q.shape[0], q.shape[1]
    if num_pages < 1 or page_size < 1 or num_kv_heads < 1 or head_dim < 1:
        raise ValueError(f"k_cache must have no empty dimension, got shape {_shape(k_cache)}")
    if q.shape[-1] != head_dim:
        raise ValueError(f"q head_dim (last dim) must equal k_cache head_dim {head_dim}, got q shape {_shape(q)}")
    if num_q_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads}) of k_cache"
        )
    if batch < 1:
        raise ValueError(f"q must hold at least one sequence, got batch {batch}")
    rows = f"[batch={batch}, max_pages>=1]"
    _int_tensor("block_table", block_table, q, rows, lambda s: len(s) == 2 and s[0] == batch and s[1] >= 1)
    _int_tensor("seq_lens", seq_lens, q, f"[batch={batch}]", lambda s: s == (batch,))
    scale = _scale(scale, head_dim)
    if check_bool("check_values", check_values):
        _check_table_values(block_table, seq_lens, num_pages=num_pages, page_size=page_size)
    return scale


def check_page_scales(q, k_cache, v_cache, k_scale, v_scale) -> None:
    """Floating pages in ``q``'s dtype with no page scales, or 8-bit pages (one of `paged_ref.quant.FORMATS`,
    K and V alike) with ``k_scale`` and ``v_scale``: float32 ``[num_pages, num_kv_heads]`` on ``q``'s device,
    any strides (a per-layer scale is one value expanded). Stored byte ``x`` of page ``p``, KV head ``h``
    stands for ``x.float() * scale[p, h]``; the values are not read (no host sync)."""
    if k_cache.dtype not in FORMATS:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != q.dtype:
                raise TypeError(f"{name} must have the same dtype as q ({q.dtype}) or be 8-bit, got {t.dtype}")
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is not None:
                raise ValueError(f"{name} must be None with {k_cache.dtype} pages (it scales 8-bit pages)")
        return
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache must have k_cache's 8-bit dtype ({k_cache.dtype}), got {v_cache.dtype}")
    shape = (k_cache.shape[0], k_cache.shape[2])
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            got = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a float32 tensor with {k_cache.dtype} pages, got {got}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape [num_pages, num_kv_heads] = {list(shape)}, got {_shape(t)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")


def check_floating_pages(backend: str, k_cache) -> None:
    """``backend`` reads floating pages only: 8-bit ``k_cache`` is refused, naming the backends that read it."""
    if isinstance(k_cache, torch.Tensor) and k_cache.dtype in FORMATS:
        raise ValueError(
            f"{backend} cannot read {k_cache.dtype} pages (8-bit): use one of {', '.join(EIGHT_BIT_BACKENDS)}"
        )


def _scale(scale, head_dim: int) -> float:
    """The softmax scale: ``scale`` checked to be a finite real number, or ``head_dim ** -0.5``."""
    if scale is None:
        scale = head_dim**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be None or a real number, got {type(scale).__name__}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def _check_table_values(block_table, seq_lens, *, num_pages: int, page_size: int) -> None:
    """On the host: each ``seq_lens[b]`` in ``[1, max_pages * page_size]``, the block-table entries it uses
    distinct page ids in ``[0, num_pages)``."""
    max_pages = block_table.shape[1]
    lens = seq_lens.tolist()
    for b, n in enumerate(lens):
        if not 1 <= n <= max_pages * page_size:
            raise ValueError(
                f"seq_lens[{b}] must be in [1, max_pages * page_size = {max_pages} * {page_size}], got {n}"
            )
    table = block_table.tolist()
    for b, n in enumerate(lens):
        used = table[b][: cdiv(n, page_size)]
        bad = [p for p in used if not 0 <= p < num_pages]
        if bad:
            raise ValueError(
                f"block_table[{b}] uses page ids outside [0, num_pages={num_pages}) "
                f"within its first {len(used)} entries (seq_lens[{b}]={n}): {bad[:4]}"
            )
        if len(set(used)) != len(used):  # a corrupted table (sharing *between* sequences is fine)
            twice = sorted({p for p in used if used.count(p) > 1})
            raise ValueError(
                f"block_table[{b}] lists page ids {twice[:4]} more than once within its "
                f"first {len(used)} entries (seq_lens[{b}]={n})"
            )


def check_prefill_inputs(
    q, k_cache, v_cache, block_table, seq_lens, q_lens, *, scale=None, check_values=True, **scales
):
    """:func:`check_paged_inputs` for prefill (``scales``: ``k_scale``, ``v_scale``), plus ``q_lens``: int
    ``[batch]`` with ``0 <= q_lens[b] <= min(seq_lens[b], max_q_len)``."""
    scale = check_paged_inputs(
        q, k_cache, v_cache, block_table, seq_lens, scale=scale, q_ndim=4, check_values=check_values, **scales
    )
    _int_tensor("q_lens", q_lens, q, f"[batch={q.shape[0]}]", lambda s: s == tuple(seq_lens.shape))
    if check_values:
        max_q_len = q.shape[2]
        for b, (m, n) in enumerate(zip(q_lens.tolist(), seq_lens.tolist())):
            if not 0 <= m <= min(n, max_q_len):
                raise ValueError(f"q_lens[{b}] must be in [0, min(seq_lens[{b}]={n}, max_q_len={max_q_len})], got {m}")
    return scale


# --- cascade (shared-prefix) attention ------------------------------------------------------
def check_cascade_inputs(
    q, k_cache, v_cache, block_table, seq_lens, group_indptr, prefix_lens, *, scale=None, check_values=True, **scales
) -> float:
    """:func:`check_paged_inputs` (``scales``: ``k_scale``, ``v_scale``), plus the groups: ``group_indptr
    [num_groups + 1]`` rising strictly from 0 to ``batch``; ``prefix_lens [num_groups]``, whole pages, at most
    the group's shortest ``seq_lens``, on which its block-table rows agree (values: only with ``check_values``)."""
    scale = check_paged_inputs(
        q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values, **scales
    )
    batch, page_size = q.shape[0], k_cache.shape[1]
    _int_tensor("group_indptr", group_indptr, q, "[num_groups + 1]", lambda s: len(s) == 1)
    num_groups = group_indptr.shape[0] - 1
    _int_tensor("prefix_lens", prefix_lens, q, f"[num_groups={num_groups}]", lambda s: s == (num_groups,))
    if not check_values:
        return scale
    bounds = group_indptr.tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != batch or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"group_indptr must rise strictly from 0 to batch={batch} (group g = requests "
            f"group_indptr[g] .. group_indptr[g + 1] - 1), got {bounds[:8]}{' ...' if len(bounds) > 8 else ''}"
        )
    prefixes = prefix_lens.tolist()
    lens, table = seq_lens.tolist(), block_table.tolist()
    for g, prefix in enumerate(prefixes):
        first, last = bounds[g], bounds[g + 1]
        if prefix < 0 or prefix % page_size:
            raise ValueError(
                f"prefix_lens[{g}] must be a whole number of pages (a multiple of page_size={page_size}, >= 0), "
                f"got {prefix}"
            )
        shortest = min(lens[first:last])
        if prefix > shortest:
            raise ValueError(
                f"prefix_lens[{g}] must be at most the shortest seq_lens of its requests {first}..{last - 1} "
                f"({shortest}), got {prefix}"
            )
        pages = prefix // page_size
        for b in range(first + 1, last):
            if table[b][:pages] != table[first][:pages]:
                col = next(i for i in range(pages) if table[b][i] != table[first][i])
                raise ValueError(
                    f"block_table rows {first} and {b} (group {g}) must share their first {pages} pages "
                    f"(prefix_lens[{g}]={prefix}), but differ at column {col}: {table[first][col]} vs {table[b][col]}"
                )
    return scale


def check_quest_inputs(
    q, k_cache, v_cache, block_table, seq_lens, k_min, k_max, budget, *, scale, check_values, **scales
):
    """:func:`check_paged_inputs` (``scales``: ``k_scale``, ``v_scale``), plus the key summaries ``k_min``,
    ``k_max``: ``[num_pages, num_kv_heads, head_dim]`` and ``budget`` in ``[1, max_pages]``. Returns
    ``(scale, budget)``."""
    scale = check_paged_inputs(
        q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values, **scales
    )
    num_pages, _, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("k_min", k_min), ("k_max", k_max)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (num_pages, num_kv_heads, head_dim):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be [num_pages={num_pages}, num_kv_heads={num_kv_heads}, {head_dim}], got {got}"
            )
    budget = check_int("budget", budget, min_value=1)
    if budget > block_table.shape[1]:
        raise ValueError(
            f"budget must be at most the pages a sequence can hold (max_pages={block_table.shape[1]}), got {budget}"
        )
    return scale, budget


# --- the Triton kernel's own rules ----------------------------------------------------------
def check_triton_inputs(q, k_cache, v_cache, block_table, seq_lens, num_splits, out, *, interpret: bool):
    """The Triton kernels' own rules (after `check_paged_inputs`); ``interpret``: the call runs in
    Triton's interpreter (float32 only)."""
    allowed = (torch.float32,) if interpret else (torch.float16, torch.bfloat16, torch.float32)
    if q.dtype not in allowed:
        where = "Triton's interpreter (used for CPU tensors; float32 only)" if interpret else "the compiled kernel"
        raise TypeError(f"q must have dtype in {[str(d) for d in allowed]} for {where}, got {q.dtype}")
    check_contiguous(
        "call .contiguous()", q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens
    )
    page_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    if page_size & (page_size - 1) or page_size > 256:
        raise ValueError(f"k_cache page_size (dim 1) must be a power of two in [1, 256], got {page_size}")
    if head_dim > 256:
        raise ValueError(f"head_dim must be at most 256, got {head_dim}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be None or a torch.Tensor, got {type(out).__name__}")
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out must match q (shape {tuple(q.shape)}, dtype {q.dtype}, device {q.device}), "
                f"got shape {tuple(out.shape)}, dtype {out.dtype}, device {out.device}"
            )
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous, got strides {tuple(out.stride())}")


# --- FlexAttention's own rules --------------------------------------------------------------
def check_mask_arguments(block_table, seq_lens, q_lens, num_pages, page_size, q_len) -> None:
    """The types and shapes `paged_block_masks` takes, each named in its error."""
    check_int("num_pages", num_pages, min_value=1)
    check_int("page_size", page_size, min_value=1)
    check_int("q_len", q_len, min_value=1)
    for name, t, dims, layout in (
        ("block_table", block_table, 2, "[batch, max_pages]"),
        ("seq_lens", seq_lens, 1, "[batch]"),
        ("q_lens", q_lens, 1, "[batch]"),
    ):
        if name == "q_lens" and t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.is_floating_point() or t.is_complex():
            what = f"shape {list(t.shape)} and dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            optional = "None or " if name == "q_lens" else ""
            raise TypeError(f"{name} must be {optional}a {dims}-D integer torch.Tensor {layout}, got {what}")
        if name != "block_table" and tuple(t.shape) != (block_table.shape[0],):
            raise ValueError(f"{name} must have shape [batch={block_table.shape[0]}], got {list(t.shape)}")


def check_table_pages(block_table, seq_lens, num_pages: int, page_size: int) -> None:
    """The pages each sequence uses must exist in the cache (a host read of the used entries)."""
    columns = torch.arange(block_table.shape[1], device=block_table.device)  # [max_pages]
    used = columns[None, :] < cdiv(seq_lens.long(), page_size)[:, None]  # [batch, max_pages]
    ids = block_table[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
        raise ValueError(
            f"block_table: the pages sequences use must be in [0, num_pages={num_pages}), "
            f"got values in [{int(ids.min())}, {int(ids.max())}]"
        )


def check_block_size(size: int, name: str = "kv_block_size") -> int:
    """A FlexAttention tile size: a positive power of two."""
    size = check_int(name, size)
    if size < 1 or size & (size - 1):
        raise ValueError(f"{name} must be a positive power of two, got {size}")
    return size


def _version(t) -> int | None:
    """In-place version counter (inference-mode tensors have none: their identity is trusted)."""
    return None if t is None or t.is_inference() else t._version


def mask_source(block_table, seq_lens, q_lens) -> tuple:
    """What a physical BlockMask is built from, for :func:`check_block_mask`: the tensors, their
    version counters and copies of their values."""
    tensors = (block_table, seq_lens, q_lens)
    copies = tuple(None if t is None else t.detach().clone() for t in tensors)
    return tensors, tuple(_version(t) for t in tensors), copies


def check_block_mask(block_mask, block_table, seq_lens, q_lens, q_len: int, num_pages: int, page_size: int) -> None:
    """A reused BlockMask must be a ``paged_block_masks(...).physical`` of this shape, built from
    this block table and these lengths: the same tensors unmodified since (no host read), or equal
    values (a host sync)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            "block_mask must be None or the .physical BlockMask of "
            f"paged_block_masks(...), got {type(block_mask).__name__}"
        )
    batch = block_table.shape[0]
    if block_mask.kv_num_blocks.shape[0] != batch or tuple(block_mask.seq_lengths) != (q_len, num_pages * page_size):
        raise ValueError(
            "block_mask must be the .physical BlockMask of paged_block_masks(...) for this "
            f"batch ({batch}), q_len ({q_len}) and cache ({num_pages} pages x {page_size}); got "
            f"batch {block_mask.kv_num_blocks.shape[0]}, seq_lengths {block_mask.seq_lengths}"
        )
    source = getattr(block_mask, "paged_ref_source", None)
    if source is None:
        raise ValueError(
            "block_mask must come from paged_block_masks(...).physical (or "
            "to_physical_block_mask): a BlockMask of unknown origin cannot be "
            "checked against this block_table"
        )
    tensors, versions, values = source
    now = (block_table, seq_lens, q_lens)
    if all(a is b and _version(a) == v for a, b, v in zip(now, tensors, versions)):
        return
    for name, given, built in zip(("block_table", "seq_lens", "q_lens"), now, values):
        if given is None or built is None:
            same = given is built
        else:
            same = given.shape == built.shape and torch.equal(given.to(built.device, built.dtype), built)
        if not same:
            raise ValueError(
                f"block_mask was built for another {name} than the one given: build it "
                f"with paged_block_masks(...) from this block_table and seq_lens"
            )


def check_contiguous(why: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous ({why}), got strides {tuple(t.stride())} for shape {tuple(t.shape)}"
            )
