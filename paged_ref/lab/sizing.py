"""KV-cache sizing for the notebooks: published presets, dtype sizes, the dense score tensor,
a fixed reservation against paging, and bytes in a fixed unit.

The cache's own arithmetic (`KVGeometry`, `kv_bytes_per_token`, `kv_cache_bytes`) is in
`paged_ref.memory`; this module adds what notebooks 01, 03 and 08 compare it with.

Example (LLaMA-7B, fp16, 2048 tokens; the IBM paper's "about 160 MB per layer" is 5x too big):
    >>> from paged_ref.memory import kv_cache_bytes
    >>> format_bytes(kv_cache_bytes(2048, **MODEL_PRESETS["LLaMA-7B"].kv_shape), "GB")
    '1.07 GB'
"""

from __future__ import annotations

from dataclasses import dataclass

from .._validate import check_choice, check_int
from ..block_table import pages_needed
from ..memory import KVGeometry

#: Bytes per element of the dtypes a KV cache is commonly kept in.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}

#: Published configurations (from each model's config.json).
MODEL_PRESETS: dict[str, KVGeometry] = {
    c.name: c
    for c in (
        KVGeometry(name="LLaMA-7B", num_layers=32, num_q_heads=32, num_kv_heads=32, head_dim=128),
        KVGeometry(name="Llama-3-8B", num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128),
        KVGeometry(name="SmolLM2-135M", num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64),
    )
}


def model_preset(name: str) -> KVGeometry:
    """A model of :data:`MODEL_PRESETS` by name (ValueError lists the known names)."""
    return MODEL_PRESETS[check_choice("name", name, MODEL_PRESETS)]


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name in :data:`DTYPE_BYTES`, e.g. ``"float16" -> 2``."""
    return DTYPE_BYTES[check_choice("dtype", dtype, DTYPE_BYTES)]


def dense_scores_bytes(
    num_tokens: int, *, num_heads: int, bytes_per_elem: int = 2, batch: int = 1, num_queries: int | None = None
) -> int:
    """Bytes of one layer's dense attention scores ``[batch, num_heads, num_queries, N]``.

    A naive prefill scores every token against every token (``num_queries = N``, the default):
    quadratic in N, where the KV cache is linear. A decode step (``num_queries=1``) is linear.
    Example: 32 heads, fp16, 4096 tokens -> 1 GiB in prefill; a decode step at 16384 -> 1 MiB.
    """
    num_tokens = check_int("num_tokens", num_tokens, min_value=0)
    num_heads = check_int("num_heads", num_heads, min_value=1)
    bytes_per_elem = check_int("bytes_per_elem", bytes_per_elem, min_value=1)
    batch = check_int("batch", batch, min_value=1)
    queries = num_tokens if num_queries is None else check_int("num_queries", num_queries, min_value=0)
    return batch * num_heads * queries * num_tokens * bytes_per_elem


def format_bytes(num_bytes: int, unit: str = "MiB", digits: int = 2) -> str:
    """A byte count in a fixed unit (B, KB, MB, GB: powers of 10; KiB, MiB, GiB: of 2).

    Example: ``format_bytes(50331648) == '48.00 MiB'``.
    """
    num_bytes = check_int("num_bytes", num_bytes, min_value=0)
    unit = check_choice("unit", unit, _UNITS)
    return f"{num_bytes / _UNITS[unit]:.{digits}f} {unit}"


@dataclass(frozen=True)
class ReservationReport:
    """Slots held for a batch: a fixed reservation per request, or whole pages.

    ``reserved_slots``: ``reserved_per_request`` contiguous slots per request; ``paged_slots``:
    ``ceil(length / page_size)`` pages per request; ``used_slots``: the sum of lengths. Byte
    fields are None unless ``bytes_per_token`` was given.
    """

    lengths: tuple[int, ...]
    page_size: int
    reserved_per_request: int
    reserved_slots: int
    paged_slots: int
    used_slots: int
    bytes_per_token: int | None = None

    @property
    def unused_paged_slots(self) -> int:
        """Empty slots in the last page of each request (each fewer than page_size)."""
        return self.paged_slots - self.used_slots

    @property
    def unused_reserved_slots(self) -> int:
        return self.reserved_slots - self.used_slots

    def _bytes(self, slots: int) -> int | None:
        return None if self.bytes_per_token is None else slots * self.bytes_per_token

    @property
    def reserved_bytes(self) -> int | None:
        return self._bytes(self.reserved_slots)

    @property
    def paged_bytes(self) -> int | None:
        return self._bytes(self.paged_slots)

    @property
    def used_bytes(self) -> int | None:
        return self._bytes(self.used_slots)

    def table(self, unit: str = "MiB") -> str:
        """A plain-text table of slots (and bytes, when known) per allocation scheme."""
        rows = [
            (f"reserved ({self.reserved_per_request} per request)", self.reserved_slots),
            (f"paged ({self.page_size}-token pages)", self.paged_slots),
            ("used (tokens stored)", self.used_slots),
            ("unused in last pages", self.unused_paged_slots),
        ]
        lines = []
        for label, slots in rows:
            line = f"{label:<32}{slots:>7} slots"
            if self.bytes_per_token is not None:
                line += f"  {format_bytes(self._bytes(slots), unit):>12}"
            lines.append(line)
        return "\n".join(lines)


def reservation_report(
    lengths, *, page_size: int, reserved_per_request: int, bytes_per_token: int | None = None
) -> ReservationReport:
    """Compare a fixed per-request reservation with paging for requests of ``lengths`` tokens.

    Args:
        lengths: token count of each request (ints >= 1, each <= reserved_per_request).
        bytes_per_token: KV bytes per token (e.g. from `kv_bytes_per_token`), optional.

    Example (the explainer's seed example):
        >>> r = reservation_report([19, 45, 70], page_size=16, reserved_per_request=128,
        ...                        bytes_per_token=128 * 1024)
        >>> r.reserved_slots, r.paged_slots, r.used_slots, r.unused_paged_slots
        (384, 160, 134, 26)
        >>> format_bytes(r.paged_bytes)
        '20.00 MiB'
    """
    page_size = check_int("page_size", page_size, min_value=1)
    reserved_per_request = check_int("reserved_per_request", reserved_per_request, min_value=1)
    if bytes_per_token is not None:
        bytes_per_token = check_int("bytes_per_token", bytes_per_token, min_value=1)
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise TypeError(f"lengths must be a sequence of ints, got {type(lengths).__name__}")
    lengths = tuple(check_int(f"lengths[{i}]", n, min_value=1) for i, n in enumerate(lengths))
    if not lengths:
        raise ValueError("lengths must hold at least one request, got an empty sequence")
    for i, n in enumerate(lengths):
        if n > reserved_per_request:
            raise ValueError(
                f"lengths[{i}] = {n} exceeds reserved_per_request = "
                f"{reserved_per_request}: a fixed reservation cannot hold it"
            )
    return ReservationReport(
        lengths=lengths,
        page_size=page_size,
        reserved_per_request=reserved_per_request,
        reserved_slots=len(lengths) * reserved_per_request,
        paged_slots=sum(pages_needed(n, page_size) for n in lengths) * page_size,
        used_slots=sum(lengths),
        bytes_per_token=bytes_per_token,
    )
