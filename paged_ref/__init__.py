"""paged_ref: an educational reference implementation of paged KV-cache attention.

Read the lesson in the order the data flows, pages -> block tables -> the cache -> attention ->
a transformers model -> eviction -> serving: the README's "Read the code in this order" names every
file (each module opens with its idea). `lab` holds what measures, draws, grades and feeds the
notebooks; the lesson never imports it. `fast` holds the CPU speed-ups of a step, beside the lesson,
reached only through ``fast=``.

    >>> import paged_ref as pr
    >>> cache = pr.PagedKVCache(num_layers=1, num_pages=16, page_size=4, num_kv_heads=2, head_dim=8)
    >>> pr.memory.kv_cache_bytes(2048, num_layers=32, num_kv_heads=32, head_dim=128)
    1073741824

The paging core, memory arithmetic and attention functions are imported here. Modules with
heavy dependencies (``hf`` and ``models`` import transformers; ``triton_paged_decode`` imports
triton; ``eviction``; ``serve``; ``fast``; ``lab``) load on first use, so ``import paged_ref`` stays fast.
"""

import importlib

from . import memory
from .allocator import OutOfPagesError, PageAllocator
from .attention.flex import flex_paged_decode, flex_paged_prefill, paged_block_masks
from .attention.reference import reference_paged_decode, reference_paged_prefill
from .block_table import pad_block_tables, pages_needed, slot_mapping, to_csr
from .cache import PagedKVCache
from .cache_interface import KVCache
from .layered_cache import LayeredKVCache

__version__ = "0.1.0"

_LAZY_MODULES = {"hf", "models", "eviction", "serve", "fast", "lab"}


def __getattr__(name):
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "triton_paged_decode":  # `attention` loads it (and triton) on first use
        return getattr(importlib.import_module(f"{__name__}.attention"), name)
    raise AttributeError(f"module 'paged_ref' has no attribute {name!r}")


__all__ = ["KVCache", "LayeredKVCache", "OutOfPagesError", "PageAllocator", "PagedKVCache", "flex_paged_decode"]
__all__ += ["flex_paged_prefill", "memory", "pad_block_tables", "paged_block_masks", "pages_needed"]
__all__ += ["reference_paged_decode", "reference_paged_prefill", "slot_mapping", "to_csr", "triton_paged_decode"]
__all__ += [*sorted(_LAZY_MODULES)]
