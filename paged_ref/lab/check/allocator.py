"""`check_allocator`: a student's page allocator against `paged_ref.PageAllocator`, op by op.

Random sequences of ``allocate``/``free``/``share`` run on the student's class and on the
reference side by side; after every operation the returned ids, the exceptions, ``num_free``
and every page's ``refcount`` must agree. Calls that must fail must raise and change nothing:
more pages than are free (MemoryError), freeing a page that is not held or more times than it
is referenced, e.g. ``free([p, p])`` with ``refcount(p) == 1`` (ValueError), sharing a page
that is not held (ValueError). Frees and shares list several pages, sometimes a bad one after
good ones, so a call that changes some pages before it raises is caught. A failing sequence is
shrunk (shortest failing prefix, then single operations removed while it still fails) before
it is shown.
"""

from __future__ import annotations

import numbers
import random

from ...allocator import PageAllocator
from .report import (
    DEFAULT_TIME_LIMIT_S,
    CheckReport,
    Failure,
    NotImplementedYet,
    OverTime,
    Run,
    StudentError,
    check_count,
)

__all__ = ["check_allocator"]

POOL_SIZES = (1, 2, 3, 4, 6, 8)


def _random_ops(rng: random.Random, num_pages: int, length: int) -> list[tuple]:
    """Operations drawn against a model allocator so that most are valid and some are not."""
    model = PageAllocator(num_pages)
    ops = []
    for _ in range(length):
        held = [p for p in range(num_pages) if model.refcount(p) > 0]
        roll = rng.random()
        if roll < 0.45 or not held:
            op = ("allocate", rng.randint(1, max(1, min(3, num_pages))) if rng.random() < 0.85 else num_pages + 1)
        elif roll < 0.85:
            pages = rng.sample(held, rng.randint(1, len(held)))
            kind = rng.random()
            if kind < 0.08:
                pages = [rng.randrange(num_pages)]  # maybe not held: must raise ValueError
            elif kind < 0.16:
                pages = pages + [rng.randrange(num_pages)]  # good pages, then one maybe not held
            elif kind < 0.24:
                pages = pages + [pages[0]]  # listed twice: valid only with two references
            op = ("free", pages)
        else:
            pages = rng.sample(held, rng.randint(1, len(held)))
            if rng.random() < 0.12:
                pages = pages + [rng.randrange(num_pages)]  # maybe not held: must raise ValueError
            op = ("share", pages)
        ops.append(op)
        _apply(model, op)
    return ops


def _apply(alloc, op, run: Run | None = None):
    """Run one op; returns ``("ok", result)`` or ``("raised", exception)``.

    ``run`` given: ``alloc`` is the student's, called through ``run.call``.
    """
    name, arg = op
    if run is None:
        try:
            return "ok", getattr(alloc, name)(arg)
        except Exception as error:
            return "raised", error
    try:
        return "ok", run.call(lambda: getattr(alloc, name)(list(arg) if isinstance(arg, list) else arg))
    except StudentError as raised:
        return "raised", raised.error


def _state(alloc, num_pages: int, run: Run | None = None) -> tuple[int, list[int]]:
    if run is None:
        return alloc.num_free, [alloc.refcount(p) for p in range(num_pages)]
    return run.call(lambda: (alloc.num_free, [alloc.refcount(p) for p in range(num_pages)]))


def _category(error: Exception) -> type:
    return MemoryError if isinstance(error, MemoryError) else ValueError


def _page_list_problem(result, n: int) -> str | None:
    """Why ``result`` is not a list of ``n`` int page ids, or None."""
    if result is None:
        return "allocate returned None: return the list of page ids it took (return pages)"
    if not isinstance(result, (list, tuple)):
        return f"allocate returns a list of page ids (ints), not a {type(result).__name__}"
    if any(isinstance(p, bool) or not isinstance(p, numbers.Integral) for p in result):
        return "allocate returns a list of int page ids: " + repr([type(p).__name__ for p in result][:4])
    return None


_RAISE_HINTS = {
    "allocate": "an allocation larger than the free pages must raise MemoryError (e.g. OutOfPagesError) "
    "and take nothing",
    "free": "freeing a page that is not held, or more times than it is referenced (free([p, p]) needs "
    "refcount(p) >= 2), must raise ValueError and change nothing",
    "share": "sharing a page that is not held (refcount 0) must raise ValueError and change nothing: "
    "only a page in use can be shared",
}
_UNCHANGED_HINTS = {
    "allocate": "an allocation that cannot complete must take nothing: check the free count before taking pages",
    "free": "a failing free must change nothing: check every listed page (one listed twice needs two "
    "references) before dropping any reference",
    "share": "a failing share must change nothing: check that every listed page is held before adding any reference",
}


def _run(cls, num_pages: int, ops: list[tuple], run: Run, where: list[int] | None = None):
    """None if the student's class agrees on every op, else ``(index, expected, got, hint)``.

    ``where[0]`` is set to the index of the op being run (for a case stopped by the time limit).
    """
    model, student = PageAllocator(num_pages), run.call(cls, num_pages)
    for i, op in enumerate(ops):
        if where is not None:
            where[0] = i
        want, got = _apply(model, op), _apply(student, op, run)
        kind = op[0]
        if want[0] == "raised":
            category = _category(want[1]).__name__
            if got[0] != "raised" or not isinstance(got[1], _category(want[1])):
                shown = f"returned {got[1]!r}" if got[0] == "ok" else f"raised {type(got[1]).__name__}: {got[1]}"
                return i, f"raises {category}", shown, _RAISE_HINTS[kind]
        elif got[0] == "raised":
            return i, f"returns {want[1]!r}", f"raised {type(got[1]).__name__}: {got[1]}", "this call is valid here"
        elif kind == "allocate":
            problem = _page_list_problem(got[1], len(want[1]))
            if problem is not None:
                return i, f"returns {want[1]!r}", f"returned {got[1]!r}", problem
            if list(got[1]) != want[1]:
                return (
                    i,
                    f"returns {want[1]!r}",
                    f"returned {list(got[1])!r}",
                    "never-used pages first, in order (a bump pointer: 0, 1, 2, ...), then pages that were returned, "
                    "oldest returned first (the pages one call frees count as returned in the order listed, each "
                    "when its refcount reaches 0); a page held by anyone (refcount > 0) is never handed out",
                )
        want_state = _state(model, num_pages)
        try:
            got_state = _state(student, num_pages, run)
        except StudentError as raised:
            return (
                i,
                f"num_free {want_state[0]}, refcounts {want_state[1]}",
                f"reading num_free / refcount(page) raised {raised}",
                "num_free is a property (@property) and refcount(page) a method; reading them changes nothing",
            )
        if want_state != got_state:
            if want[0] == "raised":
                hint = _UNCHANGED_HINTS[kind]
            elif want_state[1] == got_state[1]:
                hint = (
                    "num_free is wrong although every refcount is right: it counts every page with refcount 0, "
                    "never-used and returned alike (num_pages - bump pointer + returned pages)"
                )
            else:
                hint = "share adds one reference per page; free drops one and the page is free again only at zero"
            return (
                i,
                f"num_free {want_state[0]}, refcounts {want_state[1]}",
                f"num_free {got_state[0]}, refcounts {got_state[1]}",
                hint,
            )
    return None


def _shrink(cls, num_pages: int, ops: list[tuple], run: Run) -> list[tuple]:
    """A shorter sequence that still fails: the failing prefix, then ops removed one at a time."""
    ops = ops[: _run(cls, num_pages, ops, run)[0] + 1]
    changed = True
    while changed:
        changed = False
        for i in range(len(ops)):
            trial = ops[:i] + ops[i + 1 :]
            result = _run(cls, num_pages, trial, run) if trial else None
            if result is not None:
                ops = trial[: result[0] + 1]
                changed = True
                break
    return ops


def _describe(cls, num_pages: int, ops: list[tuple], got: str) -> str:
    model = PageAllocator(num_pages)
    lines = [f"a = {getattr(cls, '__name__', 'Allocator')}({num_pages})"]
    for i, op in enumerate(ops):
        status, result = _apply(model, op)
        call = f"a.{op[0]}({op[1]!r})"
        if i == len(ops) - 1:
            lines.append(f"{call}   <- here ({got})")
        elif status == "raised":
            lines.append(f"{call}   -> raises {type(result).__name__}")
        else:
            lines.append(f"{call}" + (f"   -> {result!r}" if op[0] == "allocate" else ""))
    return "\n".join(lines)


def check_allocator(
    cls, *, seed: int = 0, cases: int = 200, ops_per_case: int = 12, time_limit: float | None = DEFAULT_TIME_LIMIT_S
) -> CheckReport:
    """Check a page-allocator class against `paged_ref.PageAllocator`.

    Args:
        cls: the class; ``cls(num_pages)`` makes one with pages ``0 .. num_pages-1``; it has
            ``allocate(n) -> list[int]``, ``free(pages)``, ``share(pages)``, ``refcount(page)``
            and the property ``num_free``.
        seed, cases, ops_per_case: the random operation sequences (pools of 1..8 pages).
        time_limit: seconds per case (and again for shrinking a failing one), or None.

    Returns:
        A `CheckReport`; on failure its case is a short sequence of calls ending at the first
        call whose result, exception or resulting state differs from the reference.
    """
    check_count("cases", cases)
    check_count("ops_per_case", ops_per_case)
    rng = random.Random(seed)
    name = "allocator"
    run = Run(name, cases, time_limit)
    cls_name = getattr(cls, "__name__", "Allocator")
    for count in range(1, cases + 1):
        num_pages = POOL_SIZES[min(len(POOL_SIZES) - 1, (count - 1) * len(POOL_SIZES) // cases)]
        ops = _random_ops(rng, num_pages, ops_per_case)
        where = [0]
        try:
            with run.case(count):
                result = _run(cls, num_pages, ops, run, where)
            if result is None:
                continue
            try:
                with run.case(count):  # shrinking, under a time limit of its own
                    ops = _shrink(cls, num_pages, ops, run)
                    result = _run(cls, num_pages, ops, run)
            except OverTime:
                ops = ops[: result[0] + 1]  # shown unshrunk
        except NotImplementedYet:
            return run.finish(CheckReport(name, False, count, not_implemented=True))
        except OverTime:
            shown = _describe(cls, num_pages, ops[: where[0] + 1], "still running")
            failure = run.over_time(shown, f"in {ops[where[0]][0]}")
            return run.finish(CheckReport(name, False, count, failure))
        except StudentError as raised:  # the constructor raised
            failure = Failure(
                f"a = {cls_name}({num_pages})",
                "a new allocator",
                f"raised {raised}",
                "the constructor takes num_pages; num_free is a property and refcount(page) a method",
            )
            return run.finish(CheckReport(name, False, count, failure))
        _, expected, got, hint = result
        failure = Failure(_describe(cls, num_pages, ops, got), expected, got, hint)
        return run.finish(CheckReport(name, False, count, failure))
    return run.finish(CheckReport(name, True, cases))
