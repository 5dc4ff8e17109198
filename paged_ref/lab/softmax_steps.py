"""The online softmax tile by tile with every state kept: notebook 05's table, `lab.viz.kernel`'s figure.

Example:
    >>> import torch
    >>> scores = torch.tensor([[1.0, 3.0, 2.0, 5.0, 0.0]])        # [rows=1, n=5], base 2
    >>> values = torch.arange(5.0).unsqueeze(1)                    # [n=5, d=1]
    >>> steps = online_softmax_steps(scores, values, block_n=2)
    >>> [s.m.item() for s in steps], [round(s.alpha.item(), 3) for s in steps]
    ([3.0, 5.0, 5.0], [0.0, 0.25, 1.0])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._validate import check_int
from ..attention.online_softmax import online_update

__all__ = ["TileStep", "online_softmax_steps"]


@dataclass(frozen=True)
class TileStep:
    """The online-softmax state after tile ``[start, end)``: its largest score ``tile_max [rows]``,
    the factor ``alpha = 2^(m_old - m) [rows]`` the old ``l`` and ``acc`` were rescaled by, and
    the new ``m, l [rows]``, ``acc [rows, d]``."""

    start: int
    end: int
    tile_max: torch.Tensor
    alpha: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor

    @property
    def out(self) -> torch.Tensor:
        """What the kernel would write if the sequence ended here: ``acc / l``, ``[rows, d]``."""
        return self.acc / self.l[:, None]


def online_softmax_steps(scores: torch.Tensor, values: torch.Tensor, *, block_n: int) -> list[TileStep]:
    """Softmax-weighted sum of ``values [n, d]`` one tile of ``block_n`` scores (``[rows, n]``,
    base 2, finite) at a time with :func:`~paged_ref.attention.online_softmax.online_update`: one
    :class:`TileStep` per tile, ``steps[-1].out`` equal to ``softmax(scores * ln 2) @ values``."""
    block_n = check_int("block_n", block_n, min_value=1)
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or scores.shape[1] < 1:
        raise ValueError(
            f"scores must be a tensor [rows, n >= 1], got "
            f"{tuple(scores.shape) if isinstance(scores, torch.Tensor) else scores!r}"
        )
    if not isinstance(values, torch.Tensor) or values.dim() != 2 or values.shape[0] != scores.shape[1]:
        raise ValueError(
            f"values must be a tensor [n={scores.shape[1]}, d], got "
            f"{tuple(values.shape) if isinstance(values, torch.Tensor) else values!r}"
        )
    if not torch.isfinite(scores).all():
        raise ValueError("scores must all be finite")
    rows, d = scores.shape[0], values.shape[1]
    m = torch.full((rows,), float("-inf"), dtype=scores.dtype, device=scores.device)  # [rows]
    l = torch.zeros(rows, dtype=scores.dtype, device=scores.device)  # [rows]
    acc = torch.zeros(rows, d, dtype=scores.dtype, device=scores.device)  # [rows, d]
    steps = []
    for start in range(0, scores.shape[1], block_n):
        end = min(start + block_n, scores.shape[1])
        tile = scores[:, start:end]  # [rows, <= block_n]
        m, l, acc, alpha = online_update(m, l, acc, tile, values[start:end].to(scores.dtype))
        steps.append(TileStep(start, end, tile.amax(dim=1), alpha, m, l, acc))
    return steps
