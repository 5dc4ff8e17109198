"""The SDPA backend's former home: it lives in :mod:`paged_ref.attention.sdpa` (it needs no
transformers); this module re-exports it so that ``paged_ref.hf.sdpa`` imports keep working."""

from ..attention.sdpa import DECODE_CHUNK, SlotGather, attend_chunked, prepare, sdpa_paged_decode, sdpa_paged_prefill

__all__ = ["DECODE_CHUNK", "SlotGather", "attend_chunked", "prepare", "sdpa_paged_decode", "sdpa_paged_prefill"]
