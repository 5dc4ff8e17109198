"""What a checker returns: passed or not, and the first failing case, small, with a hint.

Every checker runs its cases smallest first, so the first failure is already a small one (the
allocator checker also shrinks its operation sequences). A student's ``NotImplementedError`` is
reported as "not implemented yet", any other exception as a failure of that case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["CheckReport", "Failure", "run_cases"]


@dataclass
class Failure:
    """One failing case: what went in, what was expected, what came back, and where to look."""

    case: str
    expected: str
    got: str
    hint: str


@dataclass
class CheckReport:
    """The outcome of one checker.

    ``bool(report)`` is ``report.passed``; ``str(report)`` (and a notebook's display) is the
    readable text; `raise_if_failed` turns a failure into an AssertionError for graders.
    """

    name: str
    passed: bool
    cases_run: int
    failure: Failure | None = None
    not_implemented: bool = False

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        if self.passed:
            return f"PASS {self.name}: {self.cases_run} cases"
        if self.not_implemented:
            return f"TODO {self.name}: not implemented yet (the function raised NotImplementedError)"
        f = self.failure
        return (
            f"FAIL {self.name}: case {self.cases_run} of the run failed\n"
            f"  case (the smallest failing one):\n{_indent(f.case)}\n"
            f"  expected: {f.expected}\n"
            f"  got:      {f.got}\n"
            f"  hint: {f.hint}"
        )

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython / Jupyter display
        printer.text(str(self))

    def raise_if_failed(self) -> None:
        if not self.passed:
            raise AssertionError(str(self))


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def run_cases(name: str, cases: Iterable, check_one: Callable, describe: Callable, hint_for_error: str) -> CheckReport:
    """Run ``check_one(case)`` (None when right, else a `Failure`) until the first failure.

    ``describe(case)`` names a case whose call raised; ``hint_for_error`` is the hint then.
    """
    count = 0
    for case in cases:
        count += 1
        try:
            failure = check_one(case)
        except NotImplementedError:
            return CheckReport(name, False, count, not_implemented=True)
        except Exception as error:  # the student's code raised: that is this case's failure
            failure = Failure(describe(case), "a result", f"{type(error).__name__}: {error}", hint_for_error)
        if failure is not None:
            return CheckReport(name, False, count, failure)
    return CheckReport(name, True, count)
