"""The model's linear layers through weights packed once for oneDNN: a CPU step's matmuls, faster.

A small model's decode step is mostly matrix products ``x @ W.T`` with few rows in ``x``. On a CPU
``F.linear`` hands each to the BLAS, which lays ``W`` out for its kernel again on every call; oneDNN
(what vLLM's CPU build calls for every linear layer) takes a weight laid out once ("prepacked").
`PackedLinears` packs every ``nn.Linear`` weight when it is built (a second copy) and, inside its
``with`` block, runs those layers through ``torch.ops.mkldnn._linear_pointwise``; outside it the
model is untouched. Where oneDNN cannot run them, the layers stay eager and it warns once with the
reason (``packed`` says which happened).

A weight changed after it was packed is packed again when the ``with`` block is next entered: one
changed in place (``weight.mul_(2)`` under ``torch.no_grad()``, ``load_state_dict``, an optimizer's
step: its version counter moves) or replaced (``layer.weight = ...``, ``weight.data = ...``). A
change through ``weight.data`` in place moves no counter and is not seen, nor any change in place of
an inference tensor (weights made under ``torch.inference_mode()``, which keep no counter): pack again (a
new `PackedLinears`, a new session or engine). A layer with a ``forward`` of its own on the instance (what
accelerate's hooks or a monkeypatch put there) keeps it within the block: it runs as it would without the block,
and is left in place (and so do the layers packed with it as one product). Packed layers compute no gradients:
one that autograd would record (grad mode on, and ``x`` or the weights requiring grad) raises a ``RuntimeError``;
run them under
``torch.no_grad()`` or ``torch.inference_mode()`` (as `paged_ref.hf.PagedSession.extend` does).

For the few rows of a decode step oneDNN's kernels read weights well below the rate a plain sum
reads memory (about half on the CPU of ``bench serve --profile``'s table); ``few_rows=n`` runs
products of at most ``n`` rows (a decode step's: an engine's ``max_num_seqs``) through a small C++
kernel (`SOURCE`) that reads each weight once (`stream_layout`), for all the rows: the sums up to
rounding. Past the rows where the kernel was measured ahead of oneDNN on CPUs of its vector width
(`KERNEL_ROWS`), oneDNN runs them.

Layers that read the same input are packed as one product, as vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` are: an attention's ``q_proj``, ``k_proj``, ``v_proj`` and an MLP's
``gate_proj``, ``up_proj`` (`FUSED`). transformers calls them one after the other on the same
tensor: the first call computes all of them in one product, the next ones take their slice of it
(a call on another tensor computes the product again).

Example:
    >>> from paged_ref.models import tiny_llama
    >>> model = tiny_llama()
    >>> x = torch.randn(1, 3, model.config.hidden_size)
    >>> packs = PackedLinears(model)
    >>> with packs, torch.no_grad():
    ...     y = model.model.layers[0].mlp.gate_proj(x)
    >>> packs.packed, torch.allclose(y, model.model.layers[0].mlp.gate_proj(x), atol=1e-5)
    (True, True)
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

from ..native import build

__all__ = ["BLOCK", "FUSED", "KERNEL_ROWS", "PACK_FOR_ROWS", "SOURCE", "PackedLinears", "few_rows_kernel"]
__all__ += ["cannot_pack", "kernel_rows", "stream_layout", "vector_floats", "why_not_packed"]

#: Linear layers of one module that read the same input, packed as one product (when all are present).
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

_PACKABLE = (torch.float32, torch.bfloat16)
#: the number of rows oneDNN lays a packed weight out for (a hint: products of any number of rows run):
#: a full decode step of ``bench serve``'s workloads (max_num_seqs=32)
PACK_FOR_ROWS = 32
#: The most rows of a product that `SOURCE`'s kernel runs, by the floats of a vector register its build
#: has (`vector_floats`): the most rows up to which a few_rows table has it at least as fast as oneDNN at
#: every row count. 16 (AVX-512): ``bench serve --profile``'s (figures/data/serve_profile_cpu.json);
#: 8 (AVX2, and every target without AVX-512): ``bench serve --profile --few-rows``'
#: (figures/data/few_rows_256bit.json).
KERNEL_ROWS = {16: 48, 8: 6}
#: the outputs of one block of `stream_layout` (four 16-float vectors, or eight of 8 floats without AVX-512)
BLOCK = 64

#: ``few_rows(x, w, n)``: ``x [M, K] @ W.T -> [M, n]`` for ``w = stream_layout(W)``, float32.
SOURCE = Path(__file__).parent / "csrc" / "few_rows.cpp"


class PackedLinears:
    """Every ``nn.Linear`` of ``model`` (weights ``[out, in]``, CPU, float32 or bfloat16) run through its
    prepacked oneDNN weight within ``with``; ``packed`` is False when they stay eager. ``few_rows``: products
    of at most that many rows (and `kernel_rows`) run through `SOURCE`'s kernel (0: none). Entering packs again
    the weights changed since they were packed (in place or replaced; not through ``.data`` in place), a layer
    with its own instance ``forward`` keeps it, and a packed layer refuses a product autograd would record
    (RuntimeError): see the module docstring."""

    def __init__(self, model: torch.nn.Module, *, few_rows: int = 0):
        if isinstance(few_rows, bool) or not isinstance(few_rows, int) or few_rows < 0:
            raise TypeError(f"few_rows must be a number of rows (an int >= 0), got {few_rows!r}")
        self._packs: list[_Pack] = []  # layers that read the same input, packed as one product
        self._put: list[list[torch.nn.Linear]] = []  # per ``with`` entered: the layers it gave a packed forward
        why = why_not_packed(model)
        few = few_rows_kernel() if few_rows > 0 and why is None else None  # a failed build has warned
        self._few = few = None if few is None else (few, min(few_rows, kernel_rows()))
        if why is None:
            try:
                grouped, names = set(), {m: n for n, m in model.named_modules()}
                for module in model.modules():
                    for group in _groups(module):
                        self._packs.append(_Pack(group, few, " + ".join(names[m] for m in group)))
                        grouped.update(group)
                for module in model.modules():
                    if isinstance(module, torch.nn.Linear) and module not in grouped:
                        self._packs.append(_Pack([module], few, names[module]))
            except RuntimeError as e:  # an op this build of torch lacks, a shape oneDNN refuses
                why = f"packing failed: {type(e).__name__}: {str(e).splitlines()[0]}"
                self._packs = []
        if why is not None:
            warnings.warn(f"prepack: the linear layers stay eager ({why})", RuntimeWarning, stacklevel=2)
        self.packed = why is None
        self.few_rows = self.packed and few is not None  # products of few rows through `SOURCE`'s kernel
        self._sources = [source for pack in self._packs for source in pack.sources]
        self._seen = _stamp(self._sources)

    def __enter__(self) -> PackedLinears:
        """Pack again the weights changed since they were packed (`_Pack.stale`), then put the packs in."""
        now = _stamp(self._sources)  # every pack's at once: one list, not a call per pack
        if now != self._seen:
            for pack in self._packs:
                if pack.stale():
                    try:
                        pack.pack(self._few)
                    except RuntimeError as e:  # a weight now of a dtype or on a device oneDNN does not take
                        got = ", ".join(f"{m.weight.dtype} on {m.weight.device.type}" for m in pack.layers)
                        raise RuntimeError(
                            f"prepack: changed weights cannot be packed again: {pack.name}'s weights are {got}; "
                            f"packing needs float32 or bfloat16 on the CPU ({str(e).splitlines()[0]})"
                        ) from e
            self._seen = now
        put = []  # the packs none of whose layers has a forward on the instance (its own, or a block's entered)
        for pack in self._packs:  # once per forward: the instance dict, not Module.__setattr__
            if not any("forward" in layer.__dict__ for layer in pack.layers):  # a fused product: all or none
                for layer, forward in zip(pack.layers, pack.forwards):
                    layer.__dict__["forward"] = forward  # an instance attribute: shadows the class's forward
                put += pack.layers
        self._put.append(put)
        return self

    def __exit__(self, *exc) -> None:
        for layer in self._put.pop():
            layer.__dict__.pop("forward", None)


def _stamp(sources: list[tuple[dict, str]]) -> list:
    """What each parameter ``sources`` names (a module's ``_parameters`` and a name) is now: None, or its
    tensor's id, version counter (moved by a change in place; None for an inference tensor, which keeps none)
    and storage address (moved by ``.data =``)."""
    return [None if (t := d.get(name)) is None else (id(t), _version(t), t.data_ptr()) for d, name in sources]


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


class _Pack:
    """Linear layers of one input (one, or a `FUSED` group) through one packed product of their weights,
    with the `_stamp` of the weights and biases it was made from."""

    def __init__(self, layers: list[torch.nn.Linear], few, name: str = "a linear layer"):
        self.layers, self.name = layers, name
        self.sources = [(m._parameters, p) for m in layers for p in ("weight", "bias")]
        self.pack(few)

    def pack(self, few) -> None:
        """Pack the layers' weights as they are now: ``forwards``, one per layer."""
        layers = self.layers
        self.forwards = _fused_forwards(layers, few) if len(layers) > 1 else [_packed_forward(layers[0], few)]
        # while they live, no other tensor has their id, nor their storage's address (`.data =` twice in a row
        # would otherwise find the freed address again)
        self._kept = [None if (t := d.get(name)) is None else (t, t.detach()) for d, name in self.sources]
        self._seen = _stamp(self.sources)

    def stale(self) -> bool:
        """Whether a weight or bias was changed in place or replaced since it was packed."""
        return _stamp(self.sources) != self._seen


def why_not_packed(model) -> str | None:
    """Why the layers of ``model`` cannot run packed, or None."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this build of torch has no oneDNN (mkldnn) linear"
    for name, p in model.named_parameters():
        if p.device.type != "cpu" or p.dtype not in _PACKABLE:
            return f"parameter {name} is {p.dtype} on {p.device.type}; packing needs float32 or bfloat16 on the CPU"
    for dtype in sorted({p.dtype for p in model.parameters()}, key=str):
        if cannot_pack(dtype) is not None:
            return cannot_pack(dtype)
    return None


@functools.cache
def cannot_pack(dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot pack weights of ``dtype`` on this CPU (bfloat16 needs AVX-512 or AVX-NE-CONVERT), or None:
    one weight packed to see."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(1, 1, dtype=dtype), PACK_FOR_ROWS)
    except RuntimeError as e:
        return f"this CPU cannot pack {dtype} weights: {type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def _groups(module: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """The `FUSED` groups of ``module``'s own linear layers: same input size, all with a bias or none."""
    out = []
    for names in FUSED:
        layers = [getattr(module, n, None) for n in names]
        if all(isinstance(m, torch.nn.Linear) for m in layers):
            if len({(m.in_features, m.bias is None, m.weight.dtype) for m in layers}) == 1:
                out.append(layers)
    return out


@functools.cache
def few_rows_kernel():
    """``torch.ops.paged_ref_linear.few_rows`` (`SOURCE`), built on first call; None where it cannot be built."""
    built = build("paged_ref_linear", [SOURCE], [], "products of few rows run through oneDNN")
    return None if built is None else torch.ops.paged_ref_linear.few_rows


@functools.cache
def vector_floats() -> int | None:
    """The floats of a vector register the kernel's build has, which decides its tile (`SOURCE`): 16 with
    AVX-512, else 8; None where it cannot be built."""
    return None if few_rows_kernel() is None else torch.ops.paged_ref_linear.vector_floats()


def kernel_rows() -> int:
    """The most rows of a product the kernel runs on this machine: `KERNEL_ROWS` of `vector_floats` (0: no kernel)."""
    floats = vector_floats()
    return 0 if floats is None else KERNEL_ROWS[floats]


def stream_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` -> ``[ceil(N / BLOCK), K, BLOCK]``: block ``b``'s row ``k`` holds ``weight[b * BLOCK
    + j, k]`` for ``j < BLOCK`` (zeros past ``N``), so a block is read as one stream."""
    padded = torch.nn.functional.pad(weight, (0, 0, 0, -weight.shape[0] % BLOCK))  # [N rounded up to BLOCK, K]
    return padded.view(-1, BLOCK, weight.shape[1]).transpose(1, 2).contiguous()


def _product(weight: torch.Tensor, bias: torch.Tensor | None, few=None, layers=()):
    """``x: [..., in] -> x @ weight.T + bias: [..., out]`` through ``weight [out, in]`` packed now; ``few``:
    (`few_rows_kernel`, n) for products of at most n rows (float32, no bias), or None. An ``x`` of another
    dtype than the weight's or another last size than ``in`` is refused (TypeError, ValueError), and so is
    a product autograd would record (``x`` or a weight of ``layers`` requiring grad): it computes no gradient."""
    params = [p for m in layers for p in m.parameters()]  # the layers' own: whether autograd wants their gradients
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)  # [out, in], oneDNN's blocked layout
    (out_features, in_features), dtype = weight.shape, weight.dtype
    few, limit = few if few is not None and bias is None and weight.dtype == torch.float32 else (None, 0)
    blocks = None if few is None else stream_layout(weight)  # [ceil(out / BLOCK), in, BLOCK]

    def onednn(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")  # [tokens, out]

    def product(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            raise RuntimeError(
                "prepack: packed linear layers compute no gradients (their weights are packed copies), but autograd "
                "would record this product; run it under torch.no_grad() or torch.inference_mode()"
            )
        if x.dtype != dtype:
            raise TypeError(f"prepack: a packed linear layer of {dtype} weights takes x of {dtype}, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != in_features:
            shape = list(x.shape)
            raise ValueError(f"prepack: a layer of {in_features} in_features takes x [..., {in_features}], got {shape}")
        rows = x.reshape(-1, in_features)  # [tokens, in]
        y = few(rows, blocks, out_features) if few is not None and rows.shape[0] <= limit else onednn(rows)
        return y.view(*x.shape[:-1], out_features)

    one = torch.zeros(1, in_features, dtype=dtype)  # either path fails here (one row each), not in a forward
    onednn(one)
    if few is not None:
        few(one, blocks, out_features)
    return product


def _packed_forward(layer: torch.nn.Linear, few):
    """``layer``'s forward through its weight packed now (`_product`)."""
    return _product(layer.weight.detach(), None if layer.bias is None else layer.bias.detach(), few, [layer])


def _fused_forwards(layers: list[torch.nn.Linear], few) -> list:
    """The forwards of ``layers`` (same input) through one product of their stacked weights
    ``[sum of out, in]``: a call computes it and keeps the other layers' slices (views); a later
    call on that same tensor takes its kept slice instead of computing again."""
    weights = [m.weight.detach() for m in layers]
    bias = None if layers[0].bias is None else torch.cat([m.bias.detach() for m in layers])
    fused = _product(torch.cat(weights), bias, few, layers)  # x: [..., in] -> [..., sum of out]
    sizes = [w.shape[0] for w in weights]
    kept: dict[int, torch.Tensor] = {}  # layer index -> its slice of the last product, not yet taken
    source: list = [None]  # the tensor of the last product, while slices of it are kept

    def forward_of(i: int):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if source[0] is x and i in kept:
                y = kept.pop(i)
            else:
                slices = fused(x).split_with_sizes(sizes, dim=-1)  # [..., out_j] each
                kept.clear()
                kept.update((j, t) for j, t in enumerate(slices) if j != i)
                source[0], y = x, slices[i]
            if not kept:
                source[0] = None  # nothing kept: let the input go
            return y

        return forward

    return [forward_of(i) for i in range(len(layers))]
