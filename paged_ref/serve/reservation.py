"""Reservation: what admission commits to a request up front, and the share of the pool it keeps free.

The three policies differ only there (`paged_ref.serve.scheduler`), so paging is the only difference
between runs on the same engine: ``"paged"`` commits nothing, pages come as tokens do (vLLM);
``"exact"`` commits every page of the request's life (prompt + max_new_tokens - 1 tokens, or its
eviction policy's bound), as a contiguous cache that knew the output length would; ``"max_len"``
commits ``max_model_len`` tokens, as servers did before paging. A committed request never needs preemption.
Each keeps a **watermark** free while others run, room for them to grow: a share of the pool (default 1%,
vLLM V0's; vLLM 0.32 keeps none, ``Paged(watermark=0)``).

Example:
    >>> [reservation(name).pages(peak_pages=3, max_len_pages=16) for name in RESERVATIONS]
    [0, 3, 16]
"""

from __future__ import annotations

import numbers

from .._validate import check_choice

__all__ = ["RESERVATIONS", "Exact", "MaxLen", "Paged", "Reservation", "reservation"]


class Reservation:
    """An admission policy: the `pages` it commits to a request up front, the ``watermark`` it keeps free."""

    name: str
    up_front: bool  # whether admission commits pages before tokens fill them

    def __init__(self, watermark: float = 0.01):
        if not isinstance(watermark, numbers.Real) or isinstance(watermark, bool) or not 0 <= watermark < 1:
            raise ValueError(f"watermark must be a share of the pool in [0, 1), got {watermark!r}")
        self.watermark = watermark

    def pages(self, *, peak_pages: int, max_len_pages: int) -> int:
        """Pages committed to a request that holds at most ``peak_pages`` (``max_len_pages``: max_model_len's)."""
        return {"paged": 0, "exact": peak_pages, "max_len": max_len_pages}[self.name]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(watermark={self.watermark!r})"


class Paged(Reservation):
    name, up_front = "paged", False


class Exact(Reservation):
    name, up_front = "exact", True


class MaxLen(Reservation):
    name, up_front = "max_len", True


_BY_NAME = {cls.name: cls for cls in (Paged, Exact, MaxLen)}
RESERVATIONS = tuple(_BY_NAME)


def reservation(policy: str | Reservation, *, watermark: float | None = None) -> Reservation:
    """The policy called ``policy`` (one of `RESERVATIONS`) keeping ``watermark`` free (None: 1%), or
    ``policy`` itself when it is a `Reservation` (with its own watermark: ``watermark`` must then be None)."""
    if isinstance(policy, Reservation):
        if watermark is not None:
            raise ValueError(f"watermark={watermark!r} and a Reservation, {policy!r}, that carries its own")
        return policy
    cls = _BY_NAME[check_choice("reservation", policy, RESERVATIONS)]
    return cls() if watermark is None else cls(watermark)
