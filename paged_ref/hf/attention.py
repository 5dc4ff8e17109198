"""The attention function transformers calls, registered under the name ``"paged_ref"``.

transformers' attention modules end with
``attention_interface(module, query, key, value, attention_mask, scaling=..., **kwargs)``, where
the function is looked up by ``config._attn_implementation`` in `transformers.AttentionInterface`.
Registering `paged_attention_forward` there and setting the model's implementation to
``"paged_ref"`` routes every layer's attention to the paged kernels, without copying model code.

The function ignores ``key``/``value`` (only the new tokens) and the mask: the step plan, passed
as the extra keyword ``paged_step`` (transformers forwards unknown keywords from the model call
down to the attention function), says where each sequence's K/V live. Because
``"paged_ref"`` has no entry in `AttentionMaskInterface`, transformers builds no mask at all
(`masking_utils` returns early for any implementation without a mask function; written
against 5.24, the same early exit is in the 5.x sources): causality and sequence lengths are
the kernels' job.

Backends are `Backend` objects (a decode function, a prefill function and a per-forward
``prepare``) held in `BACKENDS`; `register_backend` adds one. Decode = one new token per
sequence, prefill = several:

=========== =============================== ===============================
backend     decode                          prefill
=========== =============================== ===============================
reference   reference_paged_decode          reference_paged_prefill
flex        flex_paged_decode               flex_paged_prefill
triton      triton_paged_decode             sdpa_paged_prefill
sdpa        sdpa_paged_decode               sdpa_paged_prefill
sdpa_fused  sdpa_fused_paged_decode         sdpa_paged_prefill
cascade     reference_cascade_decode        sdpa_paged_prefill
            (triton_cascade_decode on CUDA)
auto        ``triton`` on CUDA, ``sdpa`` elsewhere (the default)
=========== =============================== ===============================

``cascade`` reads the pages that rows of a step share once for all of them (forked samples and
beams, requests on prefix-cached pages): per forward it finds the groups in the block table
(`paged_ref.attention.cascade.shared_prefix_groups`), puts each group's rows side by side and
runs cascade decode attention; rows that share nothing are attended alone.

``quest_backend(budget)`` makes one more, not registered by name: Quest's decode over the
``budget`` pages of each sequence and KV head whose key summaries bound the scores highest
(`paged_ref.attention.quest`; the cache needs ``page_summaries=True``), prefill through SDPA.

Triton has no prefill kernel here: prefill is compute-bound and runs once per prompt, so the
``triton`` backend prefills through SDPA. ``sdpa`` (`paged_ref.attention.sdpa`) gathers the batch's
tokens by slot and calls PyTorch's SDPA: the fast path on a CPU, where the Triton kernel only
runs in the interpreter. ``sdpa_fused`` is ``sdpa`` with each decode layer's attention in one
call of PyTorch's fused CPU kernel (one gather, no per-layer masking, softmax or matmul passes): the
faster path beside the readable one. ``reference`` is the oracle every other backend is tested against.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .._validate import check_choice, check_int

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AUTO",
    "Backend",
    "BACKENDS",
    "register_backend",
    "auto_backend",
    "cascade_layer_decode",
    "get_backend",
    "paged_attention_active",
    "paged_attention_forward",
    "quest_backend",
    "quest_layer_decode",
    "register",
    "set_attn_implementation",
]

ATTN_IMPLEMENTATION = "paged_ref"
AUTO = "auto"


def _no_preparation(plan) -> dict:
    return {}


@dataclass(frozen=True)
class Backend:
    """One way of reading K/V from the pages.

    Attributes:
        name: what ``backend=`` takes.
        decode, prefill: ``(module, function)`` of the decode (one new token per sequence) and
            prefill (several) functions, imported on first use, so that a missing optional
            dependency (triton) only matters to the backend that needs it. Both take
            ``(q, k_cache, v_cache, block_table, seq_lens[, q_lens], *, scale, **prepared)``.
        prepare: ``prepare(plan) -> dict``: keywords computed once per forward from its
            `StepPlan` and passed to every layer's call (masks, slot maps, skipped checks).
    """

    name: str
    decode: tuple[str, str]
    prefill: tuple[str, str]
    prepare: Callable[..., dict] = field(default=_no_preparation, compare=False)

    def functions(self) -> tuple[Callable, Callable]:
        """The (decode, prefill) functions.

        Example:
            >>> decode, prefill = BACKENDS["reference"].functions()
            >>> decode.__name__, prefill.__name__
            ('reference_paged_decode', 'reference_paged_prefill')
        """
        return tuple(getattr(importlib.import_module(m), f) for m, f in (self.decode, self.prefill))


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


def get_backend(name, device="cpu") -> Backend:
    """The backend registered as ``name``; ``"auto"`` resolves to `auto_backend` on ``device``;
    a `Backend` object is used as it is (e.g. `quest_backend`'s).

    Example:
        >>> get_backend("auto", "cpu").name
        'sdpa'
    """
    if isinstance(name, Backend):
        return name
    check_choice("backend", name, [*BACKENDS, AUTO])
    return BACKENDS[auto_backend(device) if name == AUTO else name]


def auto_backend(device) -> str:
    """The backend ``"auto"`` stands for on ``device``: the fastest tested path there.

    Example:
        >>> auto_backend("cpu")
        'sdpa'
    """
    return "triton" if torch.device(device).type == "cuda" else "sdpa"


# The block table and lengths of a step are the same in all layers, so per-step work happens once
# per forward in `prepare`, not once per layer. Value checks that copy the block table to the host
# are skipped per layer (the table comes straight from `PagedKVCache.block_table`); the reference
# backend, being the oracle, keeps all of its checks.
def _prepare_flex(plan) -> dict:
    from ..attention.flex import paged_block_masks

    masks = paged_block_masks(
        plan.block_table,
        plan.seq_lens,
        plan.kv.k_cache[0].shape[0],  # physical pages (a LayeredKVCache's pool holds every layer's)
        plan.kv.page_size,
        q_len=plan.max_q_len,
        q_lens=None if plan.is_decode else plan.q_lens,
    )
    # decode keeps its shapes from step to step: compiled flex (block sparse) pays for its compile
    # on CPU too (`bench scaling --cpu`); prefill shapes change with every prompt: eager on CPU
    return {"block_mask": masks.physical, "check_values": False, "compiled": True if plan.is_decode else None}


def _prepare_sdpa(plan) -> dict:
    from ..attention.sdpa import prepare

    q_lens = None if plan.is_decode else plan.q_lens
    return {
        "gather": prepare(plan.block_table, plan.seq_lens, plan.kv.page_size, q_lens, plan.max_q_len),
        "check_values": False,
    }


def _prepare_sdpa_fused(plan) -> dict:
    from ..attention.sdpa import prepare_fused

    if not plan.is_decode:
        return _prepare_sdpa(plan)
    fused = prepare_fused(plan.block_table, plan.seq_lens, plan.kv.page_size, plan.kv.k_cache[0].dtype)
    return {"fused": fused, "check_values": False}


def _prepare_triton(plan) -> dict:
    return {"check_values": False} if plan.is_decode else _prepare_sdpa(plan)  # prefill: SDPA


def _prepare_cascade(plan) -> dict:
    if not plan.is_decode:
        return _prepare_sdpa(plan)
    from ..attention.cascade import shared_prefix_groups

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
    out = decode(
        q[order].contiguous(),
        k_cache,
        v_cache,
        block_table[order].contiguous(),
        seq_lens[order].contiguous(),
        group_indptr,
        prefix_lens,
        scale=scale,
        check_values=check_values,
    )  # [batch, Hq, D], grouped order
    return out[torch.argsort(order)]


def _prepare_quest(plan, *, budget: int, dense_layers: int) -> dict:
    summaries = getattr(plan.kv, "summaries", None)
    if summaries is None:
        raise ValueError(
            "the quest backend reads page key summaries: make the cache with "
            "PagedKVCache(..., page_summaries=True) (or PagedKVCache.for_model(..., page_summaries=True))"
        )
    if not plan.is_decode:
        return _prepare_sdpa(plan)  # prefill reads every page: SDPA
    # each layer's decode call finds its summaries by the K cache tensor it is given
    # the first `dense_layers` layers read every page (Quest's paper keeps its first two dense)
    by_cache = {
        k.data_ptr(): (lo, hi, layer < dense_layers)
        for layer, (k, lo, hi) in enumerate(zip(plan.kv.k_cache, summaries.k_min, summaries.k_max))
    }
    return {"summaries": by_cache, "budget": budget, "check_values": False}


def quest_layer_decode(q, k_cache, v_cache, block_table, seq_lens, *, summaries, budget, scale=None, check_values=True):
    """`quest_paged_decode` with the summaries of the layer whose ``k_cache`` this is."""
    from ..attention.quest import quest_paged_decode

    k_min, k_max, dense = summaries[k_cache.data_ptr()]
    budget = block_table.shape[1] if dense else min(budget, block_table.shape[1])  # narrower: every page
    return quest_paged_decode(
        q, k_cache, v_cache, block_table, seq_lens, k_min, k_max, budget=budget, scale=scale, check_values=check_values
    )


def quest_backend(budget: int, *, dense_layers: int = 0) -> Backend:
    """A backend that decodes with Quest over ``budget`` pages per sequence and KV head
    (`paged_ref.attention.quest`) and prefills through SDPA; pass it as ``backend=``. The first
    ``dense_layers`` layers read every page.

    Example:
        >>> quest_backend(8).name, quest_backend(8, dense_layers=2).name
        ('quest_8', 'quest_8_dense_2')
    """
    budget = check_int("budget", budget, min_value=1)
    dense_layers = check_int("dense_layers", dense_layers, min_value=0)
    return Backend(
        f"quest_{budget}" + (f"_dense_{dense_layers}" if dense_layers else ""),
        ("paged_ref.hf.attention", "quest_layer_decode"),
        _SDPA_PREFILL,
        functools.partial(_prepare_quest, budget=budget, dense_layers=dense_layers),
    )


_REFERENCE_PREFILL = ("paged_ref.attention.reference", "reference_paged_prefill")
_SDPA_PREFILL = ("paged_ref.attention.sdpa", "sdpa_paged_prefill")
for _backend in (
    Backend("reference", ("paged_ref.attention.reference", "reference_paged_decode"), _REFERENCE_PREFILL),
    Backend(
        "flex",
        ("paged_ref.attention.flex", "flex_paged_decode"),
        ("paged_ref.attention.flex", "flex_paged_prefill"),
        _prepare_flex,
    ),
    Backend("triton", ("paged_ref.attention.triton_decode", "triton_paged_decode"), _SDPA_PREFILL, _prepare_triton),
    Backend("sdpa", ("paged_ref.attention.sdpa", "sdpa_paged_decode"), _SDPA_PREFILL, _prepare_sdpa),
    Backend("sdpa_fused", ("paged_ref.attention.sdpa", "sdpa_fused_paged_decode"), _SDPA_PREFILL, _prepare_sdpa_fused),
    Backend("cascade", ("paged_ref.hf.attention", "cascade_layer_decode"), _SDPA_PREFILL, _prepare_cascade),
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
    """Attention of the new tokens over their sequences' pages (the transformers attention signature).

    Args:
        module: the attention module; ``module.layer_idx`` picks the layer's pages.
        query: ``[batch, num_q_heads, max_q_len, head_dim]`` (after RoPE).
        key, value: the new tokens' K/V, already written to the pages by `PagedCache.update`; unused.
        attention_mask: unused (None: no mask is built for this implementation).
        scaling: softmax scale (``module.scaling``).
        dropout: must be 0 (inference only).
        **kwargs: must hold ``paged_step``, the `StepPlan` of this forward.

    Returns:
        ``(out, None)`` with ``out: [batch, max_q_len, num_q_heads, head_dim]``; rows past a
        sequence's ``q_lens`` are padding (zeros or garbage, never read back).
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
    for unsupported in ("sliding_window", "softcap"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"paged attention does not support {unsupported}={kwargs[unsupported]!r}")
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError("paged attention does not support attention sinks")
    with torch.profiler.record_function("paged_ref::attention"):  # a named region in a profile
        return _attention(plan, module.layer_idx, query, scaling), None


def _attention(plan, layer: int, query: torch.Tensor, scaling) -> torch.Tensor:
    """`paged_attention_forward`'s output for one layer: ``[batch, max_q_len, Hq, D]``."""
    if plan.parts is not None:
        return _packed_attention(plan, layer, query, scaling)
    k_cache, v_cache = plan.kv.k_cache[layer], plan.kv.v_cache[layer]  # [num_pages, page_size, Hkv, D]
    block_table, attn_kwargs = plan.layer(layer)  # int32 [batch, max_pages], this layer's keywords
    if plan.is_decode:
        q = query[:, :, 0, :].contiguous()  # [batch, Hq, D]
        out = plan.decode(
            q, k_cache, v_cache, block_table, plan.seq_lens, scale=scaling, **attn_kwargs
        )  # [batch, Hq, D]
        return out.unsqueeze(1)  # [batch, 1, Hq, D]
    out = plan.prefill(
        query, k_cache, v_cache, block_table, plan.seq_lens, plan.q_lens, scale=scaling, **attn_kwargs
    )  # [batch, Hq, max_q_len, D]
    return out.transpose(1, 2)  # [batch, max_q_len, Hq, D]


def _packed_attention(plan, layer: int, query: torch.Tensor, scaling) -> torch.Tensor:
    """Attention of a packed forward (``plan.parts``): each part's tokens through its own kernel.

    ``query: [1, Hq, total, D]``, every row's new tokens one after the other. A part of decode rows
    (one token each) goes to the decode function as ``[rows, Hq, D]``; a part of longer rows is laid
    out as its own rectangle ``[rows, Hq, max_q_len, D]`` for the prefill function. Returns
    ``[1, total, Hq, D]``.
    """
    k_cache, v_cache = plan.kv.k_cache[layer], plan.kv.v_cache[layer]  # [num_pages, page_size, Hkv, D]
    tokens = query[0].transpose(0, 1)  # [total, Hq, D]
    out = torch.empty_like(tokens)  # [total, Hq, D]
    for index, part in plan.parts:
        q = tokens[index]  # [n, Hq, D]
        if part.is_decode:
            out[index] = part.decode(
                q, k_cache, v_cache, part.block_table, part.seq_lens, scale=scaling, **part.attn_kwargs
            )  # [rows, Hq, D]
            continue
        shape = (len(part.seq_ids), part.max_q_len, *q.shape[1:])  # [rows, max_q_len, Hq, D]
        if part.valid is None:  # rows of one length: the tokens fill the rectangle
            rows = q.view(shape)
        else:
            rows = q.new_zeros(shape)
            rows[part.valid] = q
        o = part.prefill(
            rows.transpose(1, 2),
            k_cache,
            v_cache,
            part.block_table,
            part.seq_lens,
            part.q_lens,
            scale=scaling,
            **part.attn_kwargs,
        ).transpose(1, 2)  # [rows, max_q_len, Hq, D]
        out[index] = o.flatten(0, 1) if part.valid is None else o[part.valid]
    return out[None]  # [1, total, Hq, D]


def register() -> str:
    """Register `paged_attention_forward` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


class paged_attention_active:
    """Within the ``with`` block the model's attention is ``"paged_ref"``; the previous one is
    restored on exit, whatever happens (nested and concurrent sessions each restore their own).

    It sets the config attribute the attention layers read (its setter recurses into sub-configs);
    ``open`` has already checked once, with ``set_attn_implementation``, that the model accepts
    the implementation. (``set_attn_implementation`` walks every module, which would happen
    twice per forward.)
    """

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.previous = self.model.config._attn_implementation
        self.model.config._attn_implementation = ATTN_IMPLEMENTATION

    def __exit__(self, *exc) -> None:
        self.model.config._attn_implementation = self.previous


def set_attn_implementation(model, name: str) -> None:
    """Set ``model``'s attention implementation to ``name``, or raise if the model does not take it."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:  # pragma: no cover - transformers without set_attn_implementation
        model.config._attn_implementation = name
    if model.config._attn_implementation != name:  # e.g. a model that hard-codes its attention
        raise TypeError(
            f"{type(model).__name__} did not accept attn_implementation={name!r} (it stays "
            f"{model.config._attn_implementation!r}); paged_ref.hf needs a model whose attention goes "
            "through transformers.AttentionInterface (Llama, Mistral, Qwen2, SmolLM2, ...)"
        )
