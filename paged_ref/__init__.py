"""paged_ref: an educational reference implementation of paged KV-cache attention.

    >>> import paged_ref as pr
    >>> cache = pr.PagedKVCache(num_layers=1, num_pages=16, page_size=4, num_kv_heads=2, head_dim=8)

The paging core (allocator, block tables, cache, memory arithmetic) is re-exported here;
attention, transformers integration and eviction live in their submodules and are
re-exported as well when their dependencies import.
"""

from .allocator import OutOfPagesError, PageAllocator
from .block_table import from_csr, pad_block_tables, pages_needed, slot_mapping, to_csr
from .cache import PagedKVCache

__version__ = "0.1.0"

__all__ = [
    "OutOfPagesError",
    "PageAllocator",
    "PagedKVCache",
    "from_csr",
    "pad_block_tables",
    "pages_needed",
    "slot_mapping",
    "to_csr",
]
