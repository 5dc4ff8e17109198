"""`check_allocator`: a student's page allocator against `paged_ref.PageAllocator`, op by op.

Random sequences of ``allocate``/``free``/``share`` run on the student's class and on the
reference side by side; after every operation the returned ids, the exceptions, ``num_free``
and every page's ``refcount`` must agree. Calls that must fail (more pages than are free,
freeing a page that is not held) must raise (MemoryError / ValueError) and change nothing. A
failing sequence is shrunk (shortest failing prefix, then single operations removed while it
still fails) before it is shown.
"""

from __future__ import annotations

import random

from ..allocator import PageAllocator
from .report import CheckReport, Failure

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
            if rng.random() < 0.1:
                pages = [rng.randrange(num_pages)]  # maybe not held: must raise ValueError
            op = ("free", pages)
        else:
            op = ("share", rng.sample(held, rng.randint(1, len(held))))
        ops.append(op)
        _apply(model, op)
    return ops


def _apply(alloc, op):
    """Run one op; returns ``("ok", result)`` or ``("raised", exception)``."""
    name, arg = op
    try:
        result = getattr(alloc, name)(arg)
    except NotImplementedError:
        raise
    except Exception as error:
        return "raised", error
    return "ok", result


def _state(alloc, num_pages: int) -> tuple[int, list[int]]:
    return alloc.num_free, [alloc.refcount(p) for p in range(num_pages)]


def _category(error: Exception) -> type:
    return MemoryError if isinstance(error, MemoryError) else ValueError


def _run(cls, num_pages: int, ops: list[tuple]):
    """None if the student's class agrees on every op, else ``(index, expected, got, hint)``."""
    model, student = PageAllocator(num_pages), cls(num_pages)
    for i, op in enumerate(ops):
        want, got = _apply(model, op), _apply(student, op)
        if want[0] == "raised":
            kind = _category(want[1]).__name__
            if got[0] != "raised" or not isinstance(got[1], _category(want[1])):
                shown = f"returned {got[1]!r}" if got[0] == "ok" else f"raised {type(got[1]).__name__}"
                hint = (
                    "an allocation larger than the free pages must raise MemoryError (e.g. OutOfPagesError)"
                    if kind == "MemoryError"
                    else "freeing a page that is not held (or more times than it is referenced) must raise ValueError"
                )
                return i, f"raises {kind}", shown, hint
        elif got[0] == "raised":
            return i, f"returns {want[1]!r}", f"raised {type(got[1]).__name__}: {got[1]}", "this call is valid here"
        elif op[0] == "allocate" and list(got[1]) != want[1]:
            return (
                i,
                f"returns {want[1]!r}",
                f"returned {list(got[1])!r}",
                "never-used pages come first (a bump pointer: 0, 1, 2, ...), then returned pages, "
                "oldest returned first; a page held by anyone (refcount > 0) is never handed out",
            )
        want_state, got_state = _state(model, num_pages), _state(student, num_pages)
        if want_state != got_state:
            hint = (
                "an allocation that cannot complete must take nothing: check the free count before taking pages"
                if want[0] == "raised" and op[0] == "allocate"
                else "a failing call must change nothing"
                if want[0] == "raised"
                else "share adds one reference per page; free drops one and the page is free again only at zero"
            )
            return (
                i,
                f"num_free {want_state[0]}, refcounts {want_state[1]}",
                f"num_free {got_state[0]}, refcounts {got_state[1]}",
                hint,
            )
    return None


def _shrink(cls, num_pages: int, ops: list[tuple]) -> list[tuple]:
    """A shorter sequence that still fails: the failing prefix, then ops removed one at a time."""
    ops = ops[: _run(cls, num_pages, ops)[0] + 1]
    changed = True
    while changed:
        changed = False
        for i in range(len(ops)):
            trial = ops[:i] + ops[i + 1 :]
            result = _run(cls, num_pages, trial) if trial else None
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


def check_allocator(cls, *, seed: int = 0, cases: int = 200, ops_per_case: int = 12) -> CheckReport:
    """Check a page-allocator class against `paged_ref.PageAllocator`.

    Args:
        cls: the class; ``cls(num_pages)`` makes one with pages ``0 .. num_pages-1``; it has
            ``allocate(n) -> list[int]``, ``free(pages)``, ``share(pages)``, ``refcount(page)``
            and the property ``num_free``.
        seed, cases, ops_per_case: the random operation sequences (pools of 1..8 pages).

    Returns:
        A `CheckReport`; on failure its case is a short sequence of calls ending at the first
        call whose result, exception or resulting state differs from the reference.
    """
    rng = random.Random(seed)
    name = "allocator"
    for count in range(1, cases + 1):
        num_pages = POOL_SIZES[min(len(POOL_SIZES) - 1, (count - 1) * len(POOL_SIZES) // cases)]
        ops = _random_ops(rng, num_pages, ops_per_case)
        try:
            result = _run(cls, num_pages, ops)
            if result is None:
                continue
            ops = _shrink(cls, num_pages, ops)
            _, expected, got, hint = _run(cls, num_pages, ops)
        except NotImplementedError:
            return CheckReport(name, False, count, not_implemented=True)
        except Exception as error:  # the constructor or a property raised
            failure = Failure(
                f"a = {getattr(cls, '__name__', 'Allocator')}({num_pages}) and ops {ops!r}",
                "no exception",
                f"{type(error).__name__}: {error}",
                "the constructor takes num_pages; num_free is a property and refcount(page) a method",
            )
            return CheckReport(name, False, count, failure)
        return CheckReport(name, False, count, Failure(_describe(cls, num_pages, ops, got), expected, got, hint))
    return CheckReport(name, True, cases)
