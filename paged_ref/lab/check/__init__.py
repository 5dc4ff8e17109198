"""Checkers for coursework: a student's implementation against paged_ref's own oracles.

Each ``check_*`` takes the student's class or function, runs cases smallest first (random, from
a seed) against the reference implementation in this package, and returns a `CheckReport`:
``report.passed``, and as text the first failing case with what was expected, what came back
and a hint. A function that still raises ``NotImplementedError`` reports "not implemented yet".
The oracle runs first and the student's code gets copies of the inputs; every case has a time
limit (``time_limit=``, seconds) and a slow check shows a progress line (`paged_ref.lab.check.report`).

    >>> import paged_ref as pr
    >>> print(pr.lab.check.check_allocator(pr.PageAllocator))
    PASS allocator: 200 cases

=====================================  ==============================================
checker                                what the student writes
=====================================  ==============================================
`check_allocator`                      a page allocator class (bump pointer, returned pages, refcounts)
`check_slot_mapping`                   ``slot_mapping(pages, *, start, num_tokens, page_size)``
`check_paged_attention`                decode attention over pages, plain PyTorch
`check_triton_decode`                  the same as a Triton kernel (interpreter on CPU)
`check_token_scores`                   PagedEviction's ||V|| / ||K|| token score
`check_page_scores`                    a page's score from its tokens' scores
`check_eviction_policy`                exercise 4's policy (`paged_ref.lab.check.eviction.TASK`), hooks
                                       ``after_prefill`` / ``after_append``
`check_scheduler`                      exercise 5's scheduler: ``add``, ``schedule``, ``finish`` over a
                                       given `paged_ref.lab.check.scheduler.Pool`
`check_prefix_cache`                   exercise 6's prefix cache: ``start``, ``append``, ``pages``, ``free``
`check_merge_states`                   exercise 7: two partial attention results merged by their lse
`check_quest`                          exercise 7: Quest's page summaries, bound and page choice
`check_quantize`                       exercise 8: ``quantize(x, scale, fmt)`` to int8 or float8_e4m3fn
`check_dequantize`                     exercise 8: ``dequantize(q, scale)``
`check_page_write`                     exercise 8: a write into an int8 page whose scale per KV head grows
=====================================  ==============================================

The exercise notebooks (``notebooks/exercises/``) draw from the student's code with
`paged_ref.lab.check.figures` and take an instructor's solutions through `use_solution`.
``python -m paged_ref.lab.check.grade FOLDER --out grades.csv`` runs every checker on a folder of
submitted notebooks or modules (`paged_ref.lab.check.grade`).
"""

from .allocator import check_allocator
from .attention import check_paged_attention, check_slot_mapping, check_triton_decode
from .eviction import check_eviction_policy, check_page_scores, check_token_scores
from .fewer_bytes import check_dequantize, check_page_write, check_quantize
from .prefix_cache import check_prefix_cache
from .reading import check_merge_states, check_quest
from .report import CheckReport, Failure
from .scheduler import check_scheduler
from .solutions import load_solutions, use_solution

__all__ = [
    "CheckReport",
    "Failure",
    "check_allocator",
    "check_dequantize",
    "check_eviction_policy",
    "check_merge_states",
    "check_page_write",
    "check_page_scores",
    "check_paged_attention",
    "check_prefix_cache",
    "check_quantize",
    "check_quest",
    "check_scheduler",
    "check_slot_mapping",
    "check_token_scores",
    "check_triton_decode",
    "load_solutions",
    "use_solution",
]
