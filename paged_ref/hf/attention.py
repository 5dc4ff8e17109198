"""The attention function transformers calls, registered as ``"paged_ref"``.

transformers' attention modules end with ``attention_interface(module, query, key, value,
attention_mask, scaling=..., **kwargs)``, the function looked up by ``config._attn_implementation``
in `transformers.AttentionInterface`. `paged_attention_forward` is registered there, and while a
session's forward runs the model's implementation is ``"paged_ref"``: every layer's attention
reads K/V from the pages, without copying model code. It ignores ``key``/``value`` (the new
tokens, already in the pages) and the mask: the step plan, passed as the extra keyword
``paged_step``, says where each sequence's K/V live. ``"paged_ref"`` has no entry in
`AttentionMaskInterface`, so transformers builds no mask: causality and lengths are the kernels' job.

A `Backend` reads the pages, decode (one new token per sequence) and prefill: ``reference`` (the
oracle), ``flex``, ``triton`` (prefill, compute-bound and once per prompt, through SDPA), ``sdpa``
(gather by slot, then PyTorch's SDPA: the CPU's path), ``cpu_paged`` (a small C++ kernel reading
the pages in place, built when the backend is first used; a packed step's rows in one call) and ``cascade`` (the pages
rows share are read once for all of them); ``auto``, the default, is ``triton`` on CUDA and ``sdpa``
elsewhere. `register_backend` adds one. On a cache of 8-bit pages (`paged_ref.kv_pages`) every call also
gets the layer's ``k_scale`` and ``v_scale`` (``kv.kv_scales(layer)``; who takes them: `._checks.reads_8bit`).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .._validate import check_choice
from ..attention.cascade import shared_prefix_groups
from ..attention.flex import paged_block_masks
from ..attention.sdpa import prepare
from .cache import region

__all__ = ["ATTN_IMPLEMENTATION", "BACKENDS", "Backend", "auto_backend", "get_backend", "register_backend"]
__all__ += ["paged_attention_forward", "register"]

ATTN_IMPLEMENTATION = "paged_ref"
AUTO = "auto"


@dataclass(frozen=True)
class Backend:
    """One way of reading K/V from the pages.

    Attributes:
        name: what ``backend=`` takes.
        decode, prefill: ``(module, function)``, imported on first use (triton only by the backend that
            needs it), taking ``(q, k_cache, v_cache, block_table, seq_lens[, q_lens], *, scale, **prepared)``.
        prepare: ``prepare(plan) -> dict``: keywords computed once per forward from its `StepPlan`
            and passed to every layer's call (masks, slot maps, skipped checks).
        load: ``(module, function)`` called once by `functions`, before any forward (a kernel
            built ahead of the first step), or None.
        packed: ``(module, function)`` attending a packed forward's rows in one call (`StepPlan.packed`), or None.
    """

    name: str
    decode: tuple[str, str]
    prefill: tuple[str, str]
    prepare: Callable[..., dict] = field(default=lambda plan: {}, compare=False)
    load: tuple[str, str] | None = None
    packed: tuple[str, str] | None = None

    def functions(self) -> tuple[Callable, Callable]:
        """The (decode, prefill) functions."""
        if self.load is not None:
            _function(self.load)()
        return _function(self.decode), _function(self.prefill)

    def packed_function(self) -> Callable | None:
        """The ``packed`` function, or None."""
        return None if self.packed is None else _function(self.packed)


def _function(where: tuple[str, str]) -> Callable:
    module, name = where
    return getattr(importlib.import_module(module), name)


#: Every backend by name; `register_backend` adds one.
BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Make ``backend`` available as ``backend=backend.name`` (a name may be registered once)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a paged_ref.hf.attention.Backend, got {type(backend).__name__}")
    if backend.name in BACKENDS or backend.name == AUTO:
        raise ValueError(f"backend name {backend.name!r} is taken (registered: {sorted(BACKENDS)})")
    BACKENDS[backend.name] = backend
    return backend


def get_backend(name, device="cpu", argument: str = "backend") -> Backend:
    """The backend registered as ``name`` (``"auto"``: `auto_backend` on ``device``); a `Backend` as it is."""
    if isinstance(name, Backend):
        return name
    check_choice(argument, name, [*BACKENDS, AUTO])  # argument: the name of the argument that gave ``name``
    return BACKENDS[auto_backend(device) if name == AUTO else name]


def auto_backend(device) -> str:
    """The backend ``"auto"`` stands for on ``device``: the fastest tested path there.

    Example:
        >>> auto_backend("cpu"), auto_backend("cuda")
        ('sdpa', 'triton')
    """
    return "triton" if torch.device(device).type == "cuda" else "sdpa"


# Per-step work happens once per forward, in `prepare`: every layer shares the step's block table
# and lengths. Value checks that copy the table to the host are skipped per layer (it comes straight
# from the cache); the reference backend, being the oracle, keeps all of its checks.
def _prepare_flex(plan) -> dict:
    masks = paged_block_masks(
        plan.block_table,
        plan.seq_lens,
        plan.kv.k_cache[0].shape[0],  # physical pages (a LayeredKVCache's pool holds every layer's)
        plan.kv.page_size,
        q_len=plan.max_q_len,
        q_lens=None if plan.is_decode else plan.q_lens,
    )
    # decode keeps its shapes from step to step: compiled flex pays for its compile, on CPU too
    # (`bench scaling --cpu`); prefill shapes change with every prompt: eager on CPU
    return {"block_mask": masks.physical, "check_values": False, "compiled": True if plan.is_decode else None}


def _prepare_sdpa(plan) -> dict:
    q_lens = None if plan.is_decode else plan.q_lens
    gather = prepare(plan.block_table, plan.seq_lens, plan.kv.page_size, q_lens, plan.max_q_len)
    return {"gather": gather, "check_values": False}


def _sdpa_prefill(prepare_decode: Callable[..., dict]) -> Callable[..., dict]:
    """``prepare`` of a backend whose prefill is SDPA's, from that of its decode."""
    return lambda plan: prepare_decode(plan) if plan.is_decode else _prepare_sdpa(plan)


def _unchecked(plan) -> dict:  # a kernel reading the block table itself: nothing to prepare
    return {"check_values": False}


_prepare_unchecked = _sdpa_prefill(_unchecked)


@_sdpa_prefill
def _prepare_cascade(plan) -> dict:
    order, indptr, prefix = shared_prefix_groups(plan.block_table, plan.seq_lens, plan.kv.page_size)
    return {"order": order, "group_indptr": indptr, "prefix_lens": prefix}


def cascade_layer_decode(
    q, k_cache, v_cache, block_table, seq_lens, *, order, group_indptr, prefix_lens, scale=None, check_values=False
):
    """Cascade decode of the rows in ``order`` (groups side by side), returned in the batch's order;
    Triton's kernels on CUDA, the PyTorch reference elsewhere."""
    if q.device.type == "cuda":
        from ..attention.triton_cascade import triton_cascade_decode as decode
    else:
        from ..attention.cascade import reference_cascade_decode as decode
    q, block_table, seq_lens = q[order].contiguous(), block_table[order].contiguous(), seq_lens[order].contiguous()
    out = decode(
        q, k_cache, v_cache, block_table, seq_lens, group_indptr, prefix_lens, scale=scale, check_values=check_values
    )
    return out[torch.argsort(order)]  # [batch, Hq, D] back from the grouped order


_REFERENCE, _FLEX, _SDPA = "paged_ref.attention.reference", "paged_ref.attention.flex", "paged_ref.attention.sdpa"
_TRITON, _CPU = "paged_ref.attention.triton_decode", "paged_ref.attention.cpu_paged"
_PREFILL = (_SDPA, "sdpa_paged_prefill")
_CPU_KERNEL = {"load": (_CPU, "kernel"), "packed": (_CPU, "cpu_paged_packed")}
for _backend in (
    Backend("reference", (_REFERENCE, "reference_paged_decode"), (_REFERENCE, "reference_paged_prefill")),
    Backend("flex", (_FLEX, "flex_paged_decode"), (_FLEX, "flex_paged_prefill"), _prepare_flex),
    Backend("triton", (_TRITON, "triton_paged_decode"), _PREFILL, _prepare_unchecked),
    Backend("sdpa", (_SDPA, "sdpa_paged_decode"), _PREFILL, _prepare_sdpa),
    Backend("cpu_paged", (_CPU, "cpu_paged_decode"), (_CPU, "cpu_paged_prefill"), _unchecked, **_CPU_KERNEL),
    Backend("cascade", (__name__, "cascade_layer_decode"), _PREFILL, _prepare_cascade),
):
    register_backend(_backend)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of the new tokens over their sequences' pages (transformers' attention signature).

    ``query: [batch, num_q_heads, max_q_len, head_dim]`` after RoPE; ``module.layer_idx`` picks
    the layer's pages; ``kwargs["paged_step"]`` is the forward's `StepPlan`; ``key``, ``value``
    (already written by `PagedCache.update`) and ``attention_mask`` (None) are unused. Returns
    ``(out, None)``, ``out: [batch, max_q_len, num_q_heads, head_dim]`` (padding rows: garbage, never read).
    """
    plan = kwargs.get("paged_step")
    if plan is None:
        raise RuntimeError(
            f"attn_implementation {ATTN_IMPLEMENTATION!r} reads K/V from paged_ref pages and needs a step plan; "
            "call the model through paged_ref.hf.generate / PagedSession (the model keeps this implementation "
            "only while a paged generation is running; finish or close that generator first)"
        )
    if dropout:
        raise NotImplementedError(f"paged attention is inference-only, got dropout={dropout}")
    window = kwargs.get("sliding_window")  # masks keys >= window positions back: none in a span <= window
    if window is not None and (plan.span is None or plan.span > window):
        raise NotImplementedError(f"paged attention does not support sliding_window={window!r} over span={plan.span}")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"paged attention does not support softcap={kwargs['softcap']!r}")
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError("paged attention does not support attention sinks")
    with region("paged_ref::attention"):
        return _attention(plan, module.layer_idx, query, scaling), None


def _attention(plan, layer: int, query: torch.Tensor, scaling) -> torch.Tensor:
    """`paged_attention_forward`'s output for one layer: ``[batch, max_q_len, Hq, D]``."""
    k_cache, v_cache = plan.kv.k_cache[layer], plan.kv.v_cache[layer]  # [num_pages, page_size, Hkv, D]
    block_table, attn_kwargs = plan.layer(layer)  # int32 [batch, max_pages], this layer's keywords
    k_scale, v_scale = plan.kv.kv_scales(layer)  # 8-bit pages: float32 [num_pages, Hkv] each; else None
    if k_scale is not None:  # floating pages: the calls as they always were
        attn_kwargs = {**attn_kwargs, "k_scale": k_scale, "v_scale": v_scale}
    if plan.packed is not None and plan.valid is None:  # no padding: the tokens lie packed, row after row
        tokens = query.transpose(1, 2).flatten(0, 1)  # [num_new, Hq, D]
        scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        out = plan.packed(tokens, k_cache, v_cache, block_table, plan.seq_lens, plan.q_lens, scale=scaling, **scales)
        if out is not None:  # else the backend cannot run these tensors: the parts, or decode and prefill
            return out.view(query.shape[0], -1, *out.shape[1:])  # [batch, max_q_len, Hq, D]
    if plan.parts is not None:
        return _packed_attention(plan, layer, query, scaling)
    if plan.is_decode:
        q = query[:, :, 0, :].contiguous()  # [batch, Hq, D]
        out = plan.decode(q, k_cache, v_cache, block_table, plan.seq_lens, scale=scaling, **attn_kwargs)
        return out.unsqueeze(1)  # [batch, 1, Hq, D]
    out = plan.prefill(
        query, k_cache, v_cache, block_table, plan.seq_lens, plan.q_lens, scale=scaling, **attn_kwargs
    )  # [batch, Hq, max_q_len, D]
    return out.transpose(1, 2)  # [batch, max_q_len, Hq, D]


def _packed_attention(plan, layer: int, query: torch.Tensor, scaling) -> torch.Tensor:
    """Attention of a packed forward, ``query: [1, Hq, total, D]`` -> ``[1, total, Hq, D]``: each part's
    tokens laid out as its own rectangle (the decode rows: one column) and attended as one."""
    tokens = query[0].transpose(0, 1)  # [total, Hq, D]
    out = torch.empty_like(tokens)  # [total, Hq, D]
    for index, part in plan.parts:
        q = tokens[index]  # [n, Hq, D]
        shape = (len(part.seq_ids), part.max_q_len, *q.shape[1:])  # [rows, max_q_len, Hq, D]
        if part.valid is None:  # rows of one length: the tokens fill the rectangle
            rows = q.view(shape)
        else:
            rows = q.new_zeros(shape)
            rows[part.valid] = q
        o = _attention(part, layer, rows.transpose(1, 2), scaling)  # [rows, max_q_len, Hq, D]
        out[index] = o.flatten(0, 1) if part.valid is None else o[part.valid]
    return out[None]  # [1, total, Hq, D]


def register() -> str:
    """Register `paged_attention_forward` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


@contextlib.contextmanager
def paged_attention_active(model):
    """Within the ``with`` block the model's attention is ``"paged_ref"``: only the config attribute the
    layers read is set (`PagedSession.open` checked that the model accepts it), restored on exit."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    try:
        yield
    finally:
        model.config._attn_implementation = previous


def set_attn_implementation(model, name: str) -> None:
    """Set ``model``'s attention implementation to ``name``, or raise if the model does not take it."""
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:  # e.g. a model that hard-codes its attention
        raise TypeError(
            f"{type(model).__name__} did not accept attn_implementation={name!r} (it stays "
            f"{model.config._attn_implementation!r}); paged_ref.hf needs a model whose attention goes "
            "through transformers.AttentionInterface (Llama, Mistral, Qwen2, SmolLM2, ...)"
        )
