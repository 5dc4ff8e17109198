"""Pages that sequences of one request hold under three designs of sharing.

n samples of one prompt, or the k beams of a beam search, have most of their tokens in common.
How many pages they hold depends on how a cache shares them:

* **fork + copy-on-write** (the vLLM paper's design; `paged_ref.hf`): the sequences are forks of
  one another and share every page they have in common, a partial page included, until one of
  them writes into it. Measured, not counted here: the allocator's count during a real run.
* **prefix caching** (today's vLLM: n separate requests; its beam search admits every beam again
  at each step as a new request): a request admitted with ``A`` tokens reuses the cached *full*
  pages among its first ``A - 1`` tokens (the last token is always computed, for its logits:
  ``(A - 1) // page_size`` pages) and computes the rest into pages of its own, so the partial
  last page, or a last full page, is duplicated per request. `prefix_caching_pages`.
* **no sharing**: every sequence holds all its tokens in pages of its own. `no_sharing_pages`.

A full page is identified by all the tokens up to its end (the chained hash of prefix caching),
so two requests share a cached page exactly when their token prefixes agree up to that page.

Example:
    >>> prompt = list(range(20))                    # 20 tokens: pages of 8 hold 8 + 8 + 4
    >>> samples = [prompt + [100], prompt + [200]]  # two samples after one decode step
    >>> no_sharing_pages(samples, page_size=8)      # 3 pages each
    6
    >>> prefix_caching_pages(samples, admitted=[20, 20], page_size=8)   # 2 shared + 1 each
    4
"""

from __future__ import annotations

from collections.abc import Sequence

from ..block_table import pages_needed

__all__ = ["computed_tokens", "no_sharing_pages", "prefix_caching_pages"]


def no_sharing_pages(sequences: Sequence[Sequence[int]], *, page_size: int) -> int:
    """Pages the sequences hold when each keeps all its tokens in pages of its own."""
    return sum(pages_needed(len(s), page_size) for s in sequences)


def prefix_caching_pages(sequences: Sequence[Sequence[int]], *, admitted: Sequence[int], page_size: int) -> int:
    """Pages held when each sequence is a request admitted with ``admitted[i]`` of its tokens.

    Request ``i`` shares the full pages among its first ``admitted[i] - 1`` tokens with every
    request whose tokens agree up to the end of the page (counted once), and holds the rest of its
    ``len(sequences[i])`` tokens in pages of its own.
    """
    if len(admitted) != len(sequences):
        raise ValueError(f"admitted must have one length per sequence ({len(sequences)}), got {len(admitted)}")
    shared: set[tuple[int, ...]] = set()
    own = 0
    for tokens, a in zip(sequences, admitted):
        if not 1 <= a <= len(tokens):
            raise ValueError(f"admitted lengths must be in [1, len(sequence)], got {a} for a {len(tokens)}-token one")
        cached = (a - 1) // page_size  # full pages reused from the cache
        shared.update(tuple(tokens[: (i + 1) * page_size]) for i in range(cached))
        own += pages_needed(len(tokens), page_size) - cached
    return len(shared) + own


def computed_tokens(admitted: int, *, page_size: int) -> int:
    """Tokens a request admitted with ``admitted`` tokens computes under prefix caching.

    Everything after the ``(admitted - 1) // page_size`` full pages it reuses, whoever else has
    them in the cache already: the partial last page, or the whole last page when the tokens
    fill their pages exactly (at least the last token must be computed, for its logits).

    Example:
        >>> computed_tokens(21, page_size=8), computed_tokens(16, page_size=8)
        (5, 8)
    """
    return admitted - (admitted - 1) // page_size * page_size
