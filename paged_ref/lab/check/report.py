"""What a checker returns, and how it runs a student's code: one case at a time, each with a time limit.

Every checker runs its cases smallest first, so the first failure is already a small one (the
allocator checker also shrinks its operation sequences). The student's code is called through
`Run.call`:

* ``NotImplementedError`` from the student's code is reported as "not implemented yet" (the
  skeletons raise it; where it came from another function of theirs that the checked one calls, a
  skeleton not filled in yet, the report names that one); raised anywhere else (say, while the
  checker reads the returned value) it is a failure like any other;
* any other ``Exception`` from the student's code is that case's failure (`raised_hint` names
  the student's line that raised it, or what the checker calls when none of their code ran);
* a case that runs longer than ``time_limit`` seconds is stopped and reported (an endless loop
  gets a failure, not a frozen notebook). On the main thread of a Unix process the checker
  interrupts it with a timer (``SIGALRM``); elsewhere, or while a grader's own timer is running,
  it measures each case and reports one that ran over after it returns;
* a grader's own timer is left alone: when it fires inside the student's code, whatever its
  handler raises reaches the grader instead of counting as the student's failure;
* a check that takes more than a few seconds prints a progress line (case i of n, seconds so
  far) on stderr and ends it when done.
"""

from __future__ import annotations

import os
import signal
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CheckReport", "Failure", "Run", "StudentError", "check_count", "raised_hint", "run_cases"]

PROGRESS_AFTER_S = 3.0  # a check that runs longer than this shows a progress line
DEFAULT_TIME_LIMIT_S = 10.0  # per case; the package's own implementations take milliseconds


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
    ``note`` is one more line on a pass (e.g. the precision the answer was checked to).
    """

    name: str
    passed: bool
    cases_run: int
    failure: Failure | None = None
    not_implemented: bool = False
    note: str = ""
    unfinished: str = ""  # where the NotImplementedError came from, when not the checked function itself

    def __bool__(self) -> bool:
        return self.passed

    @property
    def verdict(self) -> str:
        """``"PASS"``, ``"FAIL"`` or ``"TODO"`` (not implemented yet)."""
        return "PASS" if self.passed else "TODO" if self.not_implemented else "FAIL"

    def __str__(self) -> str:
        if self.passed:
            return f"PASS {self.name}: {self.cases_run} cases" + (f"\n  note: {self.note}" if self.note else "")
        if self.not_implemented:
            where = self.unfinished or "the function raised NotImplementedError"
            return f"TODO {self.name}: not implemented yet ({where})"
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


def check_count(name: str, value, minimum: int = 1) -> int:
    """A checker's own integer argument (cases, repeats, steps...): the grader's mistake, raised."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class StudentError(Exception):
    """The student's code raised ``error`` (any ``Exception`` but NotImplementedError)."""

    def __init__(self, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


def _library_dirs() -> tuple[str, ...]:
    """Where code that is not the student's lives: this package and the installed libraries."""
    paths = sysconfig.get_paths()
    dirs = (Path(__file__).parents[2], paths["stdlib"], paths["purelib"], paths["platlib"])
    return tuple(str(Path(d).resolve()) + os.sep for d in dirs)


def _student_frames(error: BaseException) -> list:
    """The frames of ``error``'s traceback in the student's code (outside paged_ref and the libraries)."""
    libraries = _library_dirs()
    return [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not str(Path(f.filename).resolve()).startswith(libraries) and not f.filename.startswith("<frozen")
    ]


def student_line(error: BaseException) -> str:
    """Where the student's own code raised ``error``: ``"in schedule, line 3: raise KeyError(req)"``
    for the innermost frame outside paged_ref and the installed libraries (a cell's line numbers
    count within the cell); ``""`` when no such frame ran (a missing method, other arguments).
    """
    frames = _student_frames(error)
    if not frames:
        return ""
    f = frames[-1]
    return f"in {f.name}, line {f.lineno}" + (f": {f.line.strip()}" if f.line else "")


def raised_hint(raised: StudentError, interface: str) -> str:
    """The hint for a call into the student's code that raised: where their code raised, or (when
    none of it ran: a missing method, other arguments) ``interface``, what the checker calls."""
    line = student_line(raised.error)
    if not line:
        return interface
    return f"your own code raised it {line}"


class NotImplementedYet(Exception):
    """The student's code raised NotImplementedError: the skeleton is not filled in yet.

    ``unfinished`` names the function it came from when that is not the one the checker called (the
    outermost of the student's frames): ``"the NotImplementedError came from my_quantize, which
    my_write_into_page calls"``; else ``""``.
    """

    def __init__(self, error: BaseException | None = None):
        super().__init__()
        frames = _student_frames(error) if error is not None else []
        names = list(dict.fromkeys(f.name for f in frames))  # outermost first, each once
        self.unfinished = ""
        if len(names) > 1:
            self.unfinished = f"the NotImplementedError came from {names[-1]}, which {names[0]} calls"


class OverTime(BaseException):
    """A case ran past its time limit. A BaseException, so that ``except Exception`` in the
    student's code cannot swallow it."""


class Run:
    """One checker run: its time limit per case, its progress line, and calls into student code.

    Args:
        name: the checker's name (``"allocator"``...), for the progress line.
        total: the number of cases planned.
        time_limit: seconds per case (> 0), or None for no limit.
    """

    def __init__(self, name: str, total: int, time_limit: float | None):
        if time_limit is not None:
            if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0:
                raise ValueError(f"time_limit must be a number of seconds > 0 or None, got {time_limit!r}")
        self.name, self.total, self.time_limit = name, total, time_limit
        self.start = time.perf_counter()
        self._shown = 0.0  # when the progress line was last written (0: never)
        self._width = 0  # length of the progress line on screen
        self._case_start = self.start
        self.grader_timer = _timer_running()  # a grader's own alarm is pending: never touch it

    def call(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` in the student's code; see the module docstring for what it raises."""
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as error:
            raise NotImplementedYet(error) from error
        except Exception as error:
            if self.grader_timer and not _timer_running():  # the grader's alarm fired in there
                raise
            raise StudentError(error) from error

    @contextmanager
    def case(self, index: int):
        """Run one case (1-based ``index``) under the time limit; shows progress when slow."""
        self._progress(index)
        self._case_start = time.perf_counter()
        with self._deadline():
            yield
        if self.time_limit is not None and time.perf_counter() - self._case_start > self.time_limit:
            raise OverTime()  # measured: no timer could interrupt it

    def elapsed_in_case(self) -> float:
        return time.perf_counter() - self._case_start

    def over_time(self, case: str, doing: str = "") -> Failure:
        """The failure of a case stopped at its time limit."""
        return Failure(
            case,
            f"each case done within the time limit of {self.time_limit:g} s",
            f"still running after {self.elapsed_in_case():.1f} s" + (f" ({doing})" if doing else ""),
            "a loop that never ends? (a while whose condition the loop never changes), or code far slower "
            "than it needs to be; the package's own implementation takes milliseconds per case",
        )

    def finish(self, report: CheckReport) -> CheckReport:
        if self._shown:
            self._write(f"{self.name}: {report.verdict} after {time.perf_counter() - self.start:.0f} s", end="\n")
        return report

    def _progress(self, index: int) -> None:
        now = time.perf_counter()
        if now - self.start < PROGRESS_AFTER_S or now - self._shown < 1.0:
            return
        self._shown = now
        self._write(
            f"{self.name}: case {index} of {self.total}, {now - self.start:.0f} s so far "
            "(slow: a plain implementation passes this check in about a second)"
        )

    def _write(self, text: str, end: str = "") -> None:
        """One progress line, rewritten in place (padded over a longer previous one)."""
        sys.stderr.write("\r" + text.ljust(self._width) + end)
        sys.stderr.flush()
        self._width = 0 if end else max(self._width, len(text))

    @contextmanager
    def _deadline(self):
        usable = (
            self.time_limit is not None
            and not self.grader_timer
            and hasattr(signal, "setitimer")
            and threading.current_thread() is threading.main_thread()
        )
        if not usable:
            yield
            return

        def on_alarm(signum, frame):
            raise OverTime()

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, self.time_limit)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _timer_running() -> bool:
    return hasattr(signal, "getitimer") and signal.getitimer(signal.ITIMER_REAL)[0] > 0


def run_cases(
    name: str,
    cases: Iterable,
    check_one: Callable,
    describe: Callable,
    hint_for_error: str,
    *,
    time_limit: float | None = DEFAULT_TIME_LIMIT_S,
) -> CheckReport:
    """Run ``check_one(case, run)`` (None when right, else a `Failure`) until the first failure.

    ``check_one`` calls the student's code through ``run.call``. ``describe(case)`` names a case
    whose call raised; ``hint_for_error`` is the hint then.
    """
    cases = list(cases)
    run = Run(name, len(cases), time_limit)
    for count, case in enumerate(cases, start=1):
        try:
            with run.case(count):
                failure = check_one(case, run)
        except NotImplementedYet as unfinished:
            return run.finish(CheckReport(name, False, count, not_implemented=True, unfinished=unfinished.unfinished))
        except StudentError as raised:
            failure = Failure(describe(case), "a result", str(raised), hint_for_error)
        except OverTime:
            failure = run.over_time(describe(case))
        if failure is not None:
            return run.finish(CheckReport(name, False, count, failure))
    return run.finish(CheckReport(name, True, len(cases)))
