"""``fast=``: which CPU speed-ups a `PagedSession` or an `Engine` runs, checked as one value.

`Fast` names them: the attention backend that reads K/V where the pages lie (``backend="cpu_paged"``,
`paged_ref.attention.cpu_paged`), linear layers on packed weights (``prepack``) with the few-rows
kernel (``few_rows``), the flat Llama loop (``flat``) with its C++ operations (``cpu_ops``).
`resolve` turns what ``fast=`` was given into the `Fast` a step runs (``True``: every part the
model's device and dtype allow, `Fast.supported`), and `Fast.contexts` into the ``with`` blocks of
its forwards. Every part gives the eager step's tokens (the tests compare them).

Example:
    >>> Fast(backend="cpu_paged", prepack=True, few_rows=True).options()
    {'backend': 'cpu_paged', 'prepack': True, 'few_rows': True}
    >>> Fast(cpu_ops=True)
    Traceback (most recent call last):
    ...
    ValueError: fast.cpu_ops=True runs in the flat loop: give flat=True with it
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, replace

import torch

from .flat import SUPPORTED, FlatForward
from .prepack import PackedLinears, kernel_rows, why_not_packed

__all__ = ["Fast", "resolve"]


@dataclass(frozen=True, eq=False)
class Fast:
    """The speed-ups of a step; ``Fast()`` has none (the lesson's eager step).

    Args:
        backend: the attention backend (a name of `paged_ref.hf.attention.BACKENDS`), or None for the
            session's own; ``"cpu_paged"`` reads K/V where the pages lie.
        prepack: linear layers through weights packed once for oneDNN (`paged_ref.fast.prepack`); a weight
            changed later (in place, or replaced) is packed again before the next forward (not one changed
            through ``.data`` in place, or an inference tensor's; see that module).
        few_rows: (with ``prepack``) products of at most this many rows through the one-stream kernel,
            and at most the rows it was measured ahead at on this CPU's vector width (`kernel_rows`);
            True: a decode step's rows (an engine's ``max_num_seqs``), else `kernel_rows`.
        flat: a Llama model's layers as one loop, transformers' operations (`paged_ref.fast.flat`).
        cpu_ops: (with ``flat``) that loop's norms, RoPE and SwiGLU in C++ (`paged_ref.fast.cpu_ops`).
    """

    backend: str | None = None
    prepack: bool = False
    few_rows: bool | int = False
    flat: bool = False
    cpu_ops: bool = False

    def __post_init__(self):
        if self.backend is not None and not isinstance(self.backend, str):
            raise TypeError(f"fast.backend must be a backend's name or None, got {self.backend!r}")
        if self.backend == "":
            raise ValueError("fast.backend must be a backend's name or None, got ''")
        for name in ("prepack", "flat", "cpu_ops"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"fast.{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.few_rows, int) or self.few_rows < 0:
            raise TypeError(f"fast.few_rows must be True, False or a number of rows >= 0, got {self.few_rows!r}")
        if self.few_rows == 0:
            object.__setattr__(self, "few_rows", False)  # no rows: the kernel off, as False
        if self.cpu_ops and not self.flat:
            raise ValueError("fast.cpu_ops=True runs in the flat loop: give flat=True with it")
        if self.few_rows and not self.prepack:
            raise ValueError(f"fast.few_rows={self.few_rows!r} reads weights packed by prepack: give prepack=True")

    def _key(self) -> tuple:
        """The fields with their types: ``few_rows=True`` (a decode step's rows) is not ``few_rows=1``."""
        return tuple((getattr(self, f.name), type(getattr(self, f.name))) for f in fields(self))

    def __eq__(self, other) -> bool:
        return self._key() == other._key() if isinstance(other, Fast) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())

    def options(self) -> dict:
        """The fields set away from ``Fast()``, as keyword arguments (``Fast(**f.options()) == f``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    @classmethod
    def supported(cls, model) -> Fast:
        """Every part ``model``'s device and dtype allow (the speed-ups are the CPU's; the C++ parts and the
        few-rows kernel take float32): on another device, none."""
        weight = next(model.parameters())
        cpu, f32 = weight.device.type == "cpu", weight.dtype == torch.float32
        kind, act = getattr(model.config, "model_type", None), getattr(model.config, "hidden_act", None)
        llama = cpu and kind in SUPPORTED and act == "silu"
        prepack = cpu and why_not_packed(model) is None
        return cls(
            backend="cpu_paged" if cpu and f32 else None,
            prepack=prepack,
            few_rows=prepack and f32,
            flat=llama,
            cpu_ops=llama and f32,
        )

    def contexts(self, model) -> tuple:
        """The ``with`` blocks of a forward: (packed linear layers, the flat loop), each a null one when off;
        built now (packing the weights, building the C++ parts)."""
        rows = 0 if self.few_rows is False else kernel_rows() if self.few_rows is True else self.few_rows
        linears = PackedLinears(model, few_rows=rows) if self.prepack else contextlib.nullcontext()
        return linears, FlatForward(model, cpu_ops=self.cpu_ops) if self.flat else contextlib.nullcontext()


def resolve(fast, model, *, rows: int | None = None) -> Fast | None:
    """What ``fast=`` was given (None, True, False or a `Fast`) as a step runs it: None for the eager step,
    else a `Fast` whose ``few_rows=True`` is ``rows`` (an engine's ``max_num_seqs``) when given."""
    if fast is True:
        fast = Fast.supported(model)
    elif fast is None or fast is False:
        return None
    elif not isinstance(fast, Fast):
        raise TypeError(f"fast must be True, False, None or a paged_ref.fast.Fast, got {fast!r}")
    if fast.few_rows is True and isinstance(rows, int) and not isinstance(rows, bool) and rows > 0:
        fast = replace(fast, few_rows=rows)
    return None if fast == Fast() else fast
