"""Fragmentation of KV memory under a stream of requests: contiguous vs paged allocation.

A workload is a list of requests, each arriving at some step with a prompt and a number of
tokens to generate. :func:`simulate` serves it from a fixed budget of token slots with one of
three allocation policies and records, at every step, where the memory went:

* ``"reserve_max"`` -- each request reserves ``max_len`` contiguous slots on admission (what a
  server does when it cannot know the output length);
* ``"exact"`` -- each request gets exactly ``prompt + output`` contiguous slots (an oracle that
  knows the output length), first fit over a linear address space;
* ``"paged"`` -- each request holds whole pages from a :class:`~paged_ref.allocator.PageAllocator`,
  one more whenever its last page is full. When no page is free the youngest running request is
  preempted (its pages return to the pool and it waits at the head of the queue);
* ``"paged_pow2"`` -- paged, but a request's page count grows in powers of two (it doubles
  when full, capped at ``max_len``), the reservation the IBM paper describes.

Per step, after admission, the budget splits into (in slots): ``used`` (tokens stored),
``future`` (reserved for tokens not generated yet: a contiguous request's whole remainder, or
pages a paged request holds ahead of its tokens that it will fill before it ends),
``internal`` (held but never going to hold a token: the tail of a max-length reservation, the
empty end of each request's last page of tokens, pages reserved beyond a request's end),
``external`` (free memory that cannot
serve the next request because no hole is big enough, although in total there is enough) and
``free``. Requests are admitted first come, first served. The model is deliberately simple:
one token per running request per step, prefill in the admission step. A preemption costs no
steps here, but its price is counted: ``recomputed_tokens`` is the prompt plus generated tokens
every preempted request must prefill again when it is readmitted (a real server spends that
compute, or swaps the pages out and back).

Example:
    >>> wl = make_workload(50, seed=0)
    >>> res = simulate(wl, "paged", budget_slots=8192, page_size=16)
    >>> 0.0 <= res.summary()["utilization"] <= 1.0
    True
"""

from __future__ import annotations

import bisect
import numbers
from collections import deque
from dataclasses import dataclass

import numpy as np

from .._arith import next_pow2
from .._validate import check_choice, check_int
from ..allocator import PageAllocator
from ..block_table import pages_needed

POLICIES = ("reserve_max", "exact", "paged", "paged_pow2")


@dataclass(frozen=True)
class Workload:
    """Requests to serve. Arrays are int64 ``[num_requests]``, ordered by arrival step."""

    arrival: np.ndarray  # step at which each request arrives (non-decreasing, >= 0)
    prompt_len: np.ndarray  # tokens in the prompt (>= 1)
    output_len: np.ndarray  # tokens to generate (>= 1)
    max_len: int  # the model's context limit: prompt_len + output_len <= max_len

    def __post_init__(self):
        max_len = check_int("max_len", self.max_len, min_value=2)
        arrays = {}
        for name in ("arrival", "prompt_len", "output_len"):
            a = np.asarray(getattr(self, name))
            if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
                raise TypeError(f"{name} must be a 1-D integer array, got dtype {a.dtype} and shape {a.shape}")
            arrays[name] = a.astype(np.int64)
        arrival, prompt, output = arrays["arrival"], arrays["prompt_len"], arrays["output_len"]
        if not len(arrival) == len(prompt) == len(output) >= 1:
            raise ValueError(
                f"arrival, prompt_len and output_len must have one equal length >= 1, "
                f"got {len(arrival)}, {len(prompt)}, {len(output)}"
            )
        for name, bad in (
            ("arrival", (arrival < 0) | np.r_[False, np.diff(arrival) < 0]),
            ("prompt_len", prompt < 1),
            ("output_len", output < 1),
            ("prompt_len + output_len", prompt + output > max_len),
        ):
            if bad.any():
                i = int(np.argmax(bad))
                rule = {"arrival": "non-decreasing and >= 0", "prompt_len + output_len": f"<= max_len = {max_len}"}.get(
                    name, ">= 1"
                )
                raise ValueError(f"{name} must be {rule}; request {i} breaks it")
        for name, a in arrays.items():
            object.__setattr__(self, name, a)
        object.__setattr__(self, "max_len", max_len)

    @property
    def total_len(self) -> np.ndarray:
        """Final length of each request, ``prompt_len + output_len``: int64 [num_requests]."""
        return self.prompt_len + self.output_len

    def __len__(self) -> int:
        return len(self.arrival)


def make_workload(
    num_requests: int,
    *,
    seed: int = 0,
    mean_prompt: float = 256.0,
    mean_output: float = 256.0,
    sigma: float = 1.0,
    arrival_rate: float = 0.5,
    max_len: int = 2048,
) -> Workload:
    """A seeded stream of mixed-length requests.

    Prompt and output lengths are lognormal with the given means and shape ``sigma`` (a long
    tail, as in chat traffic), rounded, at least 1, and clipped so that each request fits in
    ``max_len``. Arrivals form a Poisson process of ``arrival_rate`` requests per step.

    Example: ``make_workload(200, seed=1).total_len.max() <= 2048``.
    """
    num_requests = check_int("num_requests", num_requests, min_value=1)
    seed = check_int("seed", seed, min_value=0)
    max_len = check_int("max_len", max_len, min_value=2)
    for name, value in (
        ("mean_prompt", mean_prompt),
        ("mean_output", mean_output),
        ("sigma", sigma),
        ("arrival_rate", arrival_rate),
    ):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
        if not value > 0:  # also rejects NaN
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    rng = np.random.default_rng(seed)

    def lognormal(mean: float) -> np.ndarray:  # mean of exp(N(mu, sigma^2)) is exp(mu + s^2/2)
        return rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, num_requests)

    prompt = np.clip(np.rint(lognormal(mean_prompt)), 1, max_len - 1).astype(np.int64)
    output = np.clip(np.rint(lognormal(mean_output)), 1, max_len - prompt).astype(np.int64)
    arrival = np.floor(np.cumsum(rng.exponential(1.0 / arrival_rate, num_requests)))
    return Workload(arrival.astype(np.int64), prompt, output, max_len)


class _Contiguous:
    """First fit over a linear address space of ``budget`` slots; holes kept sorted by start."""

    def __init__(self, budget: int):
        self.starts: list[int] = [0]  # hole starts, ascending
        self.sizes: list[int] = [budget]
        self.where: dict[int, tuple[int, int]] = {}  # request -> (start, size)

    def admit(self, req: int, size: int) -> bool:
        for i, hole in enumerate(self.sizes):
            if hole >= size:
                self.where[req] = (self.starts[i], size)
                if hole == size:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += size
                    self.sizes[i] -= size
                return True
        return False

    def release(self, req: int) -> None:
        start, size = self.where.pop(req)
        i = bisect.bisect(self.starts, start)
        self.starts.insert(i, start)
        self.sizes.insert(i, size)
        # merge with the hole after, then with the hole before
        if i + 1 < len(self.starts) and start + size == self.starts[i + 1]:
            self.sizes[i] += self.sizes.pop(i + 1)
            del self.starts[i + 1]
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == start:
            self.sizes[i - 1] += self.sizes.pop(i)
            del self.starts[i]

    def largest_hole(self) -> int:
        return max(self.sizes, default=0)


@dataclass(frozen=True)
class SimResult:
    """Where the memory went at every step. Per-step arrays are int64 ``[num_steps]``: the steps
    when some request was running or waiting (idle stretches between arrivals are skipped and
    counted in ``idle_steps``)."""

    policy: str
    budget_slots: int
    page_size: int
    used: np.ndarray
    future: np.ndarray
    internal: np.ndarray
    external: np.ndarray
    free: np.ndarray
    running: np.ndarray  # requests holding memory
    waiting: np.ndarray  # requests queued (arrived, not admitted)
    admitted_step: np.ndarray  # int64 [num_requests]: first admission of each request
    finished_step: np.ndarray  # int64 [num_requests]: step in which its last token was written
    preemptions: int
    recomputed_tokens: int = 0  # tokens held by preempted requests, to be prefilled again
    idle_steps: int = 0  # steps with nothing to serve, skipped (not in the series)
    total_tokens: int = 0  # prompt + output tokens of the whole workload

    @property
    def num_steps(self) -> int:
        return len(self.used)

    def summary(self) -> dict:
        """Averages over the steps under memory pressure (some request waiting).

        Fractions are of the budget; ``mean_running`` is how many requests fit at once.
        ``internal_over_used`` names the other common way to state internal fragmentation:
        slots held that never hold a token per token stored (the "overhead over the minimum").
        ``recompute_share`` is the recomputed tokens per token of the workload.
        Falls back to all steps with a running request if nothing ever waited.
        """
        mask = self.waiting > 0
        if not mask.any():
            mask = self.running > 0
        b = self.budget_slots
        return {
            "policy": self.policy,
            "page_size": self.page_size,
            "budget_slots": b,
            "utilization": float(self.used[mask].mean() / b),
            "future": float(self.future[mask].mean() / b),
            "internal": float(self.internal[mask].mean() / b),
            "external": float(self.external[mask].mean() / b),
            "free": float(self.free[mask].mean() / b),
            "mean_running": float(self.running[mask].mean()),
            "max_running": int(self.running.max()),
            "pressure_steps": int(mask.sum()),
            "makespan": self.num_steps + self.idle_steps,
            "preemptions": self.preemptions,
            "internal_over_used": float(self.internal[mask].mean() / self.used[mask].mean()),
            "recomputed_tokens": self.recomputed_tokens,
            "recompute_share": self.recomputed_tokens / max(self.total_tokens, 1),
        }


def simulate(workload: Workload, policy: str, *, budget_slots: int, page_size: int = 16) -> SimResult:
    """Serve ``workload`` from ``budget_slots`` token slots under ``policy`` (see module doc).

    Args:
        workload: the requests (:func:`make_workload`).
        policy: one of :data:`POLICIES`.
        budget_slots: memory budget in token slots; at least ``workload.max_len`` and, for
            the paged policies, a multiple of ``page_size``.
        page_size: tokens per page (used by the paged policies only).
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a Workload (make_workload), got {type(workload).__name__}")
    policy = check_choice("policy", policy, POLICIES)
    budget = check_int("budget_slots", budget_slots, min_value=1)
    page_size = check_int("page_size", page_size, min_value=1)
    if budget < workload.max_len:
        raise ValueError(
            f"budget_slots must be >= workload.max_len = {workload.max_len} so that "
            f"every request can be served, got {budget}"
        )
    paged, pow2 = policy.startswith("paged"), policy == "paged_pow2"
    if paged and budget % page_size:
        raise ValueError(f"budget_slots must be a multiple of page_size = {page_size} for {policy!r}, got {budget}")

    n = len(workload)
    arrival = workload.arrival.tolist()
    total = workload.total_len.tolist()
    length = workload.prompt_len.tolist()  # current length of each request
    admitted = [-1] * n
    finished = [-1] * n
    held: dict[int, int] = {}  # running request -> slots it holds
    pages: dict[int, list[int]] = {}  # paged policies: running request -> its pages
    contiguous = None if paged else _Contiguous(budget)
    pool = PageAllocator(budget // page_size) if paged else None
    max_pages = pages_needed(workload.max_len, page_size)  # cap of power-of-two growth

    def demand(r: int) -> int:  # contiguous slots needed to admit r
        return workload.max_len if policy == "reserve_max" else total[r]

    def try_admit(r: int) -> bool:
        if paged:
            need = pages_needed(length[r] + 1, page_size)  # room for the next token too
            if pow2:
                need = min(next_pow2(need), max_pages)
            if need > pool.num_free:
                return False
            pages[r] = pool.allocate(need)
            held[r] = need * page_size
            return True
        if not contiguous.admit(r, demand(r)):
            return False
        held[r] = demand(r)
        return True

    def release(r: int) -> None:
        if paged:
            pool.free(pages.pop(r))
        else:
            contiguous.release(r)
        del held[r]

    series = {k: [] for k in ("used", "future", "internal", "external", "free", "running", "waiting")}
    queue: deque[int] = deque()
    running: list[int] = []  # in admission order, oldest first
    nxt, done, step, preemptions, recomputed, idle = 0, 0, 0, 0, 0, 0
    while done < n:
        if not running and not queue and arrival[nxt] > step:
            # nothing to serve until the next arrival: jump there instead of recording idle
            # steps one by one (arrivals 10**9 steps apart would otherwise never finish)
            idle += arrival[nxt] - step
            step = arrival[nxt]
        while nxt < n and arrival[nxt] <= step:
            queue.append(nxt)
            nxt += 1
        while queue and try_admit(queue[0]):
            r = queue.popleft()
            running.append(r)
            if admitted[r] < 0:
                admitted[r] = step

        # snapshot of the memory after admission
        used = sum(length[r] for r in running)
        allocated = sum(held.values())
        if paged:  # pages held ahead of the tokens, up to the request's final length
            future = sum(
                min(held[r], pages_needed(total[r], page_size) * page_size)
                - pages_needed(length[r], page_size) * page_size
                for r in running
            )
        else:
            future = sum(total[r] - length[r] for r in running)
        free = budget - allocated
        external = 0
        upcoming = queue[0] if queue else (nxt if nxt < n else None)
        if not paged and upcoming is not None:
            d = demand(upcoming)
            if free >= d and contiguous.largest_hole() < d:
                external = free  # enough memory in total, but no hole is big enough
        for key, value in (
            ("used", used),
            ("future", future),
            ("internal", allocated - used - future),
            ("external", external),
            ("free", free - external),
            ("running", len(running)),
            ("waiting", len(queue)),
        ):
            series[key].append(value)

        # decode: every running request writes one token, oldest first
        for r in list(running):
            if r not in held:
                continue  # preempted earlier in this step
            if paged and length[r] == held[r]:  # last page full: take a page (or double)
                extra = min(len(pages[r]), max_pages - len(pages[r])) if pow2 else 1
                while pool.num_free < extra:
                    victim = running.pop()  # the youngest gives its pages back
                    release(victim)
                    queue.appendleft(victim)
                    preemptions += 1
                    recomputed += length[victim]  # prefilled again on readmission
                    if victim == r:
                        break
                if r not in held:
                    continue
                pages[r] += pool.allocate(extra)
                held[r] += extra * page_size
            length[r] += 1
            if length[r] == total[r]:  # its last token: it leaves and frees its memory
                running.remove(r)
                release(r)
                finished[r] = step
                done += 1
        step += 1

    arrays = {k: np.asarray(v, dtype=np.int64) for k, v in series.items()}
    return SimResult(
        policy=policy,
        budget_slots=budget,
        page_size=page_size,
        admitted_step=np.asarray(admitted, dtype=np.int64),
        finished_step=np.asarray(finished, dtype=np.int64),
        preemptions=preemptions,
        recomputed_tokens=recomputed,
        idle_steps=idle,
        total_tokens=int(sum(total)),
        **arrays,
    )


def compare_policies(workload: Workload, *, budget_slots: int, page_size: int = 16) -> list[dict]:
    """:meth:`SimResult.summary` of each policy in :data:`POLICIES` on the same workload."""
    return [simulate(workload, p, budget_slots=budget_slots, page_size=page_size).summary() for p in POLICIES]


def page_size_sweep(workload: Workload, *, budget_slots: int, page_sizes, policy: str = "paged") -> list[dict]:
    """:meth:`SimResult.summary` of a paged policy for each page size."""
    policy = check_choice("policy", policy, [p for p in POLICIES if p.startswith("paged")])
    return [simulate(workload, policy, budget_slots=budget_slots, page_size=p).summary() for p in page_sizes]


def requests_that_fit(lengths, *, budget_slots: int, page_size: int, reserved_per_request: int) -> dict[str, int]:
    """How many of ``lengths`` (taken in order, all present at once) fit in ``budget_slots``.

    A static count at the requests' final lengths in fresh memory: ``reserve_max`` reserves
    ``reserved_per_request`` each, ``exact`` the length, ``paged`` whole pages.
    Example: ``requests_that_fit([19, 45, 70], budget_slots=256, page_size=16,
    reserved_per_request=128) == {"reserve_max": 2, "exact": 3, "paged": 3}``.
    """
    budget = check_int("budget_slots", budget_slots, min_value=1)
    page_size = check_int("page_size", page_size, min_value=1)
    reserved = check_int("reserved_per_request", reserved_per_request, min_value=1)
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise TypeError(f"lengths must be a sequence of ints, got {type(lengths).__name__}")
    lengths = [check_int(f"lengths[{i}]", n, min_value=1) for i, n in enumerate(lengths)]
    cost = {
        "reserve_max": lambda n: reserved,
        "exact": lambda n: n,
        "paged": lambda n: pages_needed(n, page_size) * page_size,
    }
    fit = {}
    for policy, slots in cost.items():
        spent, count = 0, 0
        for n in lengths:
            if (policy == "reserve_max" and n > reserved) or spent + slots(n) > budget:
                break
            spent += slots(n)
            count += 1
        fit[policy] = count
    return fit
