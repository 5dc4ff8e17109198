"""KV-cache memory arithmetic: a model's KV geometry and the bytes its cache takes.

The cache keeps K and V of every past token, in every layer, for the KV heads only:
``2 * num_layers * num_kv_heads * head_dim * bytes_per_elem`` bytes per token.

Example (LLaMA-7B, fp16, 2048 tokens, one layer):
    >>> kv_cache_bytes(2048, num_layers=1, num_kv_heads=32, head_dim=128)
    33554432
"""

from __future__ import annotations

from dataclasses import dataclass

from ._validate import check_int


@dataclass(frozen=True)
class KVGeometry:
    """The shape of a model's KV cache (sized by the KV heads; ``num_q_heads`` differs under GQA).

    Example:
        >>> g = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, num_q_heads=9)
        >>> g.kv_shape
        {'num_layers': 30, 'num_kv_heads': 3, 'head_dim': 64}
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
        if self.num_q_heads is not None and check_int("num_q_heads", self.num_q_heads, min_value=1) % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads must be a multiple of num_kv_heads (GQA groups), "
                f"got num_q_heads={self.num_q_heads}, num_kv_heads={self.num_kv_heads}"
            )

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
        """A `PagedKVCache`'s keyword arguments besides its pages: ``kv_shape``, and ``dtype`` and
        ``device`` where the geometry carries them."""
        extra = {k: getattr(self, k) for k in ("dtype", "device") if getattr(self, k) is not None}
        return {**self.kv_shape, **extra}


def kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_elem: int = 2) -> int:
    """Bytes one token occupies in the KV cache: K and V, all layers, all KV heads."""
    num_layers = check_int("num_layers", num_layers, min_value=1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, min_value=1)
    head_dim = check_int("head_dim", head_dim, min_value=1)
    bytes_per_elem = check_int("bytes_per_elem", bytes_per_elem, min_value=1)
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_elem  # 2 = K and V


def kv_cache_bytes(
    num_tokens: int, *, num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_elem: int = 2
) -> int:
    """Bytes of the KV cache holding ``num_tokens`` tokens: K and V, each
    ``[num_layers, num_tokens, num_kv_heads, head_dim]``, linear in ``num_tokens``."""
    num_tokens = check_int("num_tokens", num_tokens, min_value=0)
    return num_tokens * kv_bytes_per_token(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, bytes_per_elem=bytes_per_elem
    )


def model_geometry(model) -> KVGeometry:
    """The KV geometry of a transformers model's config, with the dtype and device of its weights."""
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
