"""paged_ref: an educational reference implementation of paged KV-cache attention."""

__version__ = "0.1.0"
