"""Reservation: what admission commits to a request up front, and the share of the pool it keeps free.

The three policies differ only there (`paged_ref.serve.scheduler`), so paging is the only difference
between runs on the same engine: ``"paged"`` commits nothing, pages come as tokens do (vLLM);
``"exact"`` commits every page of the request's life (prompt + max_new_tokens - 1 tokens, or its
eviction policy's bound), as a contiguous cache that knew the output length would; ``"max_len"``
commits ``max_model_len`` tokens, as servers did before paging. A committed request never needs preemption.
Each keeps a **watermark** free while others run, room for them to grow: ``int(watermark * num_pages)``
pages (default 1%, vLLM V0's; vLLM 0.32 keeps none: `VLLM_ADMISSION`).

Example:
    >>> [Reservation(name).pages(peak_pages=3, max_len_pages=16) for name in RESERVATIONS]
    [0, 3, 16]
"""

from __future__ import annotations

from dataclasses import dataclass

from .._validate import check_real

__all__ = ["RESERVATIONS", "VLLM_ADMISSION", "Reservation"]

RESERVATIONS = ("paged", "exact", "max_len")


@dataclass(frozen=True)
class Reservation:
    """Admission's policy ``name`` (one of `RESERVATIONS`: the `pages` it commits to a request up front) and
    ``watermark``, the share of the pool it keeps free while others run."""

    name: str = "paged"
    watermark: float = 0.01

    def __post_init__(self):
        if not isinstance(self.name, str) or self.name not in RESERVATIONS:
            kind = ValueError if isinstance(self.name, str) else TypeError
            also = "" if isinstance(self.name, Reservation) else " or a Reservation"  # what an Engine takes
            raise kind(f"reservation must be one of {list(RESERVATIONS)}{also}, got {self.name!r}")
        if not 0 <= check_real("watermark", self.watermark, "a share of the pool in [0, 1)") < 1:
            raise ValueError(f"watermark must be a share of the pool in [0, 1), got {self.watermark!r}")

    @property
    def up_front(self) -> bool:
        """Whether admission commits pages before tokens fill them."""
        return self.name != "paged"

    def pages(self, *, peak_pages: int, max_len_pages: int) -> int:
        """Pages committed to a request that holds at most ``peak_pages`` (``max_len_pages``: max_model_len's)."""
        return {"paged": 0, "exact": peak_pages, "max_len": max_len_pages}[self.name]


#: vLLM 0.32's admission (V1): pages as tokens come, no watermark; what every comparison with vLLM runs
VLLM_ADMISSION = Reservation("paged", watermark=0)
