"""KV-cache memory arithmetic: bytes per token, dense score tensors, reservation reports.

Two memory questions live side by side in attention, and they are different objects:

* the **KV cache** keeps K and V of every past token, in every layer, for the KV heads only:
  ``2 * num_layers * num_kv_heads * head_dim * bytes_per_elem`` bytes per token, so it grows
  *linearly* with the number of tokens;
* the **dense score tensor** ``softmax(Q K^T)`` of a naive prefill is
  ``batch * num_heads * N * N * bytes_per_elem`` bytes, *quadratic* in N (FlashAttention never
  writes it to memory).

Neither is a part of the other, so one is never subtracted from the other.

Example (LLaMA-7B, fp16, 2048 tokens; the IBM paper's "about 160 MB per layer" is 5x too big):
    >>> kv_cache_bytes(2048, num_layers=1, num_kv_heads=32, head_dim=128)
    33554432
    >>> format_bytes(kv_cache_bytes(2048, **MODEL_PRESETS["LLaMA-7B"].kv_shape), "GB")
    '1.07 GB'
"""

from __future__ import annotations

from dataclasses import dataclass

from ._validate import check_choice, check_int
from .block_table import pages_needed

#: Bytes per element of the dtypes a KV cache is commonly kept in.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


@dataclass(frozen=True)
class KVGeometry:
    """The shape of a model's KV cache: the one geometry type of the package.

    ``num_q_heads`` and ``num_kv_heads`` differ under grouped-query attention (GQA); the cache
    is sized by the KV heads. A geometry read from a loaded model (:func:`model_geometry`) also
    carries the ``dtype`` and ``device`` of its weights; a published preset leaves them None.

    Example:
        >>> g = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, num_q_heads=9)
        >>> g.kv_shape, g.group_size
        ({'num_layers': 30, 'num_kv_heads': 3, 'head_dim': 64}, 3)
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_q_heads: int | None = None  # None: not known (a cache has no query heads) or no GQA
    name: str = ""
    dtype: object = None  # torch.dtype of the weights, for a geometry read from a model
    device: object = None  # torch.device of the weights, likewise

    def __post_init__(self):
        for arg in ("num_layers", "num_kv_heads", "head_dim"):
            check_int(arg, getattr(self, arg), min_value=1)
        if self.num_q_heads is None:
            return
        check_int("num_q_heads", self.num_q_heads, min_value=1)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads must be a multiple of num_kv_heads (GQA groups), "
                f"got num_q_heads={self.num_q_heads}, num_kv_heads={self.num_kv_heads}"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 without GQA or when ``num_q_heads`` is None)."""
        return (self.num_q_heads or self.num_kv_heads) // self.num_kv_heads

    @property
    def kv_shape(self) -> dict[str, int]:
        """The keyword arguments of :func:`kv_cache_bytes` / :func:`kv_bytes_per_token`."""
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}

    @property
    def bytes_per_token(self) -> int:
        """:func:`kv_bytes_per_token` at this geometry's ``dtype`` (a geometry read from a model)."""
        if self.dtype is None:
            raise ValueError("bytes_per_token needs the geometry's dtype; this one has dtype=None")
        return kv_bytes_per_token(**self.kv_shape, bytes_per_elem=self.dtype.itemsize)

    @property
    def cache_kwargs(self) -> dict:
        """The keyword arguments of a :class:`~paged_ref.cache.PagedKVCache` besides its pages.

        ``kv_shape`` plus ``dtype`` and ``device`` where the geometry carries them.
        """
        extra = {k: getattr(self, k) for k in ("dtype", "device") if getattr(self, k) is not None}
        return {**self.kv_shape, **extra}


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
    """Look up a model in :data:`MODEL_PRESETS` by name (ValueError lists the known names)."""
    return MODEL_PRESETS[check_choice("name", name, MODEL_PRESETS)]


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name in :data:`DTYPE_BYTES`, e.g. ``"float16" -> 2``."""
    return DTYPE_BYTES[check_choice("dtype", dtype, DTYPE_BYTES)]


def kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_elem: int = 2) -> int:
    """Bytes one token occupies in the KV cache: K and V, all layers, all KV heads.

    Example: ``kv_bytes_per_token(num_layers=32, num_kv_heads=32, head_dim=128)`` is
    524,288 (512 KiB) for LLaMA-7B in fp16.
    """
    num_layers = check_int("num_layers", num_layers, min_value=1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, min_value=1)
    head_dim = check_int("head_dim", head_dim, min_value=1)
    bytes_per_elem = check_int("bytes_per_elem", bytes_per_elem, min_value=1)
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_elem  # 2 = K and V


def kv_cache_bytes(
    num_tokens: int, *, num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_elem: int = 2
) -> int:
    """Bytes of the KV cache holding ``num_tokens`` tokens (K and V, all layers).

    The cache tensors are ``k, v: [num_layers, num_tokens, num_kv_heads, head_dim]``, so the
    size is linear in ``num_tokens``. Example: LLaMA-7B, fp16, 2048 tokens, one layer:
    ``kv_cache_bytes(2048, num_layers=1, num_kv_heads=32, head_dim=128) == 33_554_432``.
    """
    num_tokens = check_int("num_tokens", num_tokens, min_value=0)
    return num_tokens * kv_bytes_per_token(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, bytes_per_elem=bytes_per_elem
    )


def dense_scores_bytes(
    num_tokens: int, *, num_heads: int, bytes_per_elem: int = 2, batch: int = 1, num_queries: int | None = None
) -> int:
    """Bytes of one layer's dense attention score tensor ``[batch, num_heads, num_queries, N]``.

    A naive prefill scores every token against every token (``num_queries = N``, the default):
    quadratic in N. A decode step scores one new query against the N cached keys
    (``num_queries=1``): linear in N, and small. Example: 32 heads, fp16, 4096 tokens -> 1 GiB
    in prefill; 16384 tokens -> 16 GiB; a decode step at 16384 tokens -> 1 MiB.
    """
    num_tokens = check_int("num_tokens", num_tokens, min_value=0)
    num_heads = check_int("num_heads", num_heads, min_value=1)
    bytes_per_elem = check_int("bytes_per_elem", bytes_per_elem, min_value=1)
    batch = check_int("batch", batch, min_value=1)
    queries = num_tokens if num_queries is None else check_int("num_queries", num_queries, min_value=0)
    return batch * num_heads * queries * num_tokens * bytes_per_elem


def format_bytes(num_bytes: int, unit: str = "MiB", digits: int = 2) -> str:
    """Format a byte count in a fixed unit: ``format_bytes(50331648) == '48.00 MiB'``.

    Units: B, KB, MB, GB (powers of 10) and KiB, MiB, GiB (powers of 2).
    """
    num_bytes = check_int("num_bytes", num_bytes, min_value=0)
    unit = check_choice("unit", unit, _UNITS)
    return f"{num_bytes / _UNITS[unit]:.{digits}f} {unit}"


@dataclass(frozen=True)
class ReservationReport:
    """Slots (token positions) held for a batch under two ways of allocating KV memory.

    ``reserved_slots``: each request reserves ``reserved_per_request`` contiguous slots;
    ``paged_slots``: each request holds whole pages, ``ceil(length / page_size)`` of them;
    ``used_slots``: tokens actually stored (the sum of lengths).
    Byte fields are None unless ``bytes_per_token`` was given.
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
        """A small plain-text table of slots (and bytes, when known) per allocation scheme."""
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
        page_size: tokens per page (>= 1).
        reserved_per_request: contiguous slots a reservation scheme sets aside per request.
        bytes_per_token: KV bytes per token (e.g. from :func:`kv_bytes_per_token`), optional.

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


def model_geometry(model) -> KVGeometry:
    """The KV geometry of a transformers model, with the dtype and device of its weights.

    Reads the model's config (no transformers import here). ``PagedKVCache.for_model`` builds
    a cache from it; ``geometry.cache_kwargs`` are that cache's keyword arguments.
    """
    config = getattr(model, "config", None)
    needed = ("num_hidden_layers", "num_attention_heads")
    if config is None or any(getattr(config, name, None) is None for name in needed):
        raise TypeError(
            f"model must be a transformers decoder model with a config holding {list(needed)}, "
            f"got {type(model).__name__}"
        )
    num_q_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_q_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
    param = next(model.parameters())
    return KVGeometry(
        num_layers=config.num_hidden_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_q_heads=num_q_heads,
        name=getattr(config, "name_or_path", "") or "",
        dtype=param.dtype,
        device=param.device,
    )
