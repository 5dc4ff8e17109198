"""Reservation: the pages admission commits to a request up front.

The three policies differ only there (`paged_ref.serve.scheduler`), so paging is the only difference
between runs on the same engine: ``"paged"`` commits nothing, pages come as tokens do (vLLM);
``"exact"`` commits every page of the request's life (prompt + max_new_tokens - 1 tokens, or its
eviction policy's bound), as a contiguous cache that knew the output length would; ``"max_len"``
commits ``max_model_len`` tokens, as servers did before paging. A committed request never needs preemption.

Example:
    >>> [reservation(name).pages(peak_pages=3, max_len_pages=16) for name in RESERVATIONS]
    [0, 3, 16]
"""

from __future__ import annotations

from .._validate import check_choice

__all__ = ["RESERVATIONS", "Reservation", "reservation"]


class Reservation:
    """``"paged"``: nothing committed up front. Subclasses commit more."""

    name = "paged"
    up_front = False  # whether admission commits pages before tokens fill them

    def pages(self, *, peak_pages: int, max_len_pages: int) -> int:
        """Pages committed to a request that holds at most ``peak_pages`` (``max_len_pages``: max_model_len's)."""
        return 0

    def __repr__(self) -> str:
        return repr(self.name)


class Exact(Reservation):
    name, up_front = "exact", True

    def pages(self, *, peak_pages: int, max_len_pages: int) -> int:
        return peak_pages


class MaxLen(Reservation):
    name, up_front = "max_len", True

    def pages(self, *, peak_pages: int, max_len_pages: int) -> int:
        return max_len_pages


_BY_NAME = {cls.name: cls() for cls in (Reservation, Exact, MaxLen)}
RESERVATIONS = tuple(_BY_NAME)


def reservation(name: str) -> Reservation:
    """The policy called ``name`` (one of `RESERVATIONS`)."""
    return _BY_NAME[check_choice("reservation", name, RESERVATIONS)]
