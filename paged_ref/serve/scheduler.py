"""The scheduler: which requests the next forward feeds, and how many tokens each.

`Scheduler.schedule` plans one step in vLLM's order (first come, first served):

1. **Running requests**, oldest admission first: a decode takes 1 token, a prefill the next
   **chunk** (what ``max_batched_tokens`` leaves once every decode is counted). If its pages cannot
   come from the pool, the most recently admitted request is **preempted** (perhaps itself):
   ``"recompute"`` frees its pages and requeues it first; ``"swap"`` moves its K/V to host memory.
2. **Swapped requests** come back, oldest first, while their pages fit.
3. **Waiting requests** are admitted in arrival order while ``max_num_seqs``, the budget and the
   pool allow: the pool must cover the whole sequence (vLLM's ``scheduler_reserve_full_isl``) plus a
   **watermark**. Admission asks before it adds (nano-vllm's ``can_allocate``); none happens in a
   step that preempted or while a request is swapped out.

A row's pages are taken when it is planned (vLLM's ``allocate_slots``) and, with prefix caching,
the full pages it fills are published then (``cache_blocks``): a later admission in the step can hit
them. ``reservation`` (`paged_ref.serve.reservation`) changes admission only. With vLLM's settings
(``"paged"``, watermark 0, ``"recompute"``) it makes vLLM 0.32's decisions step by step (``make
test-vllm``); swap is ours (vLLM's V1 only recomputes). An evicting request's policy runs through
`paged_ref.serve.evict`: it acts once on the whole prompt, then chunks end where it acts next, and
the pages its action may copy are counted with the row's.

Example (a dry session: the same pool and scheduler, no model):
    >>> from paged_ref.serve.dry import DrySession
    >>> from paged_ref.serve.request import Request
    >>> session = DrySession(num_pages=4, page_size=4)
    >>> sched = Scheduler(session, max_num_seqs=8, max_batched_tokens=6)
    >>> for i, n in enumerate((5, 7)):
    ...     sched.add(Request(request_id=i, prompt_ids=list(range(n)), max_new_tokens=4, arrival_s=0.0))
    >>> [(r.request_id, n) for r, n in sched.schedule().rows]      # 6 tokens: all of A, a chunk of B
    [(0, 5), (1, 1)]
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from .._arith import cdiv
from .._validate import check_choice, check_int
from ..block_table import pages_needed
from .evict import AfterPrompt, Evictions
from .request import RUNNING, SWAPPED, WAITING, Request
from .reservation import RESERVATIONS, Reservation
from .swap import SwapSpace

__all__ = ["RESERVATIONS", "PREEMPTIONS", "Schedule", "Scheduler"]

PREEMPTIONS = ("recompute", "swap")


@dataclass
class Schedule:
    """One step's plan (its rows' pages already taken, its preempted requests' already back)."""

    # the forward's rows: (request, tokens it feeds; vLLM's num_scheduled_tokens), oldest first
    rows: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # from the waiting queue

    def inputs(self) -> tuple[list[int], list[list[int]]]:
        """The forward's rows: each request's sequence and the tokens it feeds (`PagedSession.extend`'s)."""
        return [r.seq_id for r, _ in self.rows], [r.tokens(r.num_computed, r.num_computed + n) for r, n in self.rows]


class Scheduler:
    """Waiting, running and swapped queues over the pool of ``session`` (a `paged_ref.hf.PagedSession` or a
    `DrySession`); ``reservation``: a name or a `Reservation`; ``max_model_len``: the longest request, what
    ``"max_len"`` reserves (default: the pool)."""

    def __init__(
        self,
        session,
        *,
        max_num_seqs: int,
        max_batched_tokens: int,
        reservation: str | Reservation = "paged",
        preemption: str = "recompute",
        max_model_len: int | None = None,
    ):
        self.session = session
        self.kv = session.kv
        self.page_size = self.kv.page_size
        self.max_num_seqs = check_int("max_num_seqs", max_num_seqs, min_value=1)
        self.max_batched_tokens = check_int("max_batched_tokens", max_batched_tokens, min_value=1)
        # what admission commits up front, and keeps free (a name: the default 1% free)
        self.commitment = reservation if isinstance(reservation, Reservation) else Reservation(reservation)
        self.reservation = self.commitment.name
        self.preemption = check_choice("preemption", preemption, PREEMPTIONS)
        self.watermark_pages = int(self.commitment.watermark * self.kv.num_pages)  # kept free while others run
        if max_model_len is None:
            max_model_len = self.kv.num_pages * self.page_size
        self.max_model_len = check_int("max_model_len", max_model_len, min_value=1)
        self._max_len_pages = pages_needed(self.max_model_len, self.page_size)
        self.waiting: deque[Request] = deque()  # arrival order; preempted requests go back to the front
        self.running: list[Request] = []  # admission order, oldest first
        self.swapped: list[Request] = []  # admission order
        self.swap = SwapSpace()
        self.preemptions = 0
        self._admissions = 0
        self._planned: dict[int, int] = {}  # request_id -> pages its row takes in the step being planned
        self.evictions = Evictions(self.kv)  # the evicting requests' hooks and page arithmetic

    # ------------------------------------------------------------------ what a request costs
    def committed_pages(self, r: Request) -> int:
        """Pages admission commits to ``r`` up front: 0 for ``"paged"`` (pages come as tokens do)."""
        return self.commitment.pages(peak_pages=self.evictions.peak_pages(r), max_len_pages=self._max_len_pages)

    def add(self, r: Request) -> None:
        """Queue ``r`` (it has arrived; `Engine.add_request` asked `paged_ref.serve._checks.refusal` first)."""
        r.status = WAITING
        self.waiting.append(r)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def queues(self) -> str:
        return f"{len(self.waiting)} waiting, {len(self.running)} running and {len(self.swapped)} swapped requests"

    def hooks(self) -> list[AfterPrompt]:
        """The eviction hooks of the requests holding a sequence."""
        return list(self.evictions.hooks.values())

    # ------------------------------------------------------------------ one step
    def schedule(self) -> Schedule:
        """Plan the next forward (see the module docstring); preemptions, swaps and the rows' pages happen here."""
        out = Schedule()
        self._planned, self.evictions.compacting = {}, set()
        budget = self.max_batched_tokens
        decodes = sum(r.remaining == 1 for r in self.running)  # tokens kept back for decodes not yet planned
        i = 0
        while i < len(self.running):
            r = self.running[i]
            if r.remaining == 1:
                decodes -= 1
                want = 1
            else:
                want = min(self.evictions.limit(r), budget - decodes)
            if want > 0 and budget > 0:
                n = self._make_room(r, want, out)
                if r.status != RUNNING:  # it was the most recent and preempted itself: nothing after it
                    break
                self._plan(r, n, out)
                budget -= n
            i += 1
        if out.preempted:
            return out
        for r in list(self.swapped):  # oldest first
            want = min(self.evictions.limit(r), budget)
            if len(self.running) >= self.max_num_seqs or want < 1:
                break
            held = self.swap.tokens(r.seq_id)
            if max(pages_needed(held + want, self.page_size), self.committed_pages(r)) > self._available():
                break
            self.swapped.remove(r)
            # under eviction its pages stop being shared: no token ids to key them by
            hashable = r.token_ids[:held] if self.kv.prefix_caching and r.eviction is None else None
            self.swap.swap_in(self.kv, r.seq_id, hashable)
            r.reserved_pages = self.committed_pages(r)
            r.status = RUNNING
            bisect.insort(self.running, r, key=lambda s: s.admitted)
            self._plan(r, want, out)
            budget -= want
        if self.swapped:
            return out
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            r = self.waiting[0]
            if not self._admit(r, budget, out):
                break
            self.waiting.popleft()
            budget -= out.rows[-1][1]
        return out

    def _admit(self, r: Request, budget: int, out: Schedule) -> bool:
        """Give ``r`` a sequence and plan its first chunk, if the pool covers it plus the watermark."""
        # an evicting request's policy must see the prompt alone first: only the prompt may match
        tokens = r.prompt_ids if r.eviction is not None else r.token_ids
        reused = self.kv.cached_prefix(tokens)  # asked first: pages the prefix cache would share or revive
        computed = len(reused) * self.page_size
        want = min(len(tokens) - computed, budget)
        # new pages: a whole commitment, or all it has to compute though it is fed in chunks (vLLM's
        # scheduler_reserve_full_isl): one admitted while its last chunk cannot fit would be preempted
        need = max(self.committed_pages(r), pages_needed(len(tokens), self.page_size)) - len(reused)
        copies, shares = self.evictions.admission(r, reused, acts=computed + want == len(tokens))
        need += copies + shares
        # cached pages taken back hold its own K/V: they must be free, but the watermark guards new pages
        revived = sum(self.kv.allocator.refcount(p) == 0 for p in reused)
        avail = self._available()
        # the watermark guards running requests' growth: with none running there is nothing to guard
        watermark = self.watermark_pages if self.running else 0
        if revived + need > avail or need > avail - watermark:
            return False
        hooks = self.evictions.start(r)
        r.seq_id = self.session.add(tokens if self.kv.prefix_caching else None, eviction=hooks)
        r.num_computed = self.session.position(r.seq_id)  # = computed: the prefix cache's hit
        self.evictions.track(r, hooks)
        r.reserved_pages = self.committed_pages(r)
        r.status = RUNNING
        r.admitted = self._admissions
        self._admissions += 1
        self.running.append(r)
        out.admitted.append(r)
        self._plan(r, want, out)
        self._planned[r.request_id] += shares
        return True

    def _make_room(self, r: Request, want: int, out: Schedule) -> int:
        """Tokens ``r`` can take this step (<= want), preempting the most recent requests if needed."""
        while True:
            own = self._unfilled(r) if self.commitment.up_front else 0  # its own commitment is for this
            if self._pages(r, want) <= self._available() + own:
                return want
            victim = self.running[-1]
            self.preempt(victim, out)
            if victim is r:
                return 0

    def preempt(self, r: Request, out: Schedule) -> None:
        """Take ``r``'s pages back: recompute (back to the head of the queue) or swap (to host memory)."""
        self.running.remove(r)
        r.num_preemptions += 1
        self.preemptions += 1
        r.reserved_pages = 0
        if self.preemption == "swap":
            self.swap.swap_out(self.kv, r.seq_id)
            r.status = SWAPPED
            bisect.insort(self.swapped, r, key=lambda s: s.admitted)
        else:
            self._release(r)
            r.status = WAITING
            self.waiting.appendleft(r)
        out.preempted.append(r)

    def remove(self, r: Request) -> None:
        """Take ``r`` out of every queue and free its sequence (it finished or was aborted)."""
        if r in self.running:
            self.running.remove(r)
        elif r in self.swapped:
            self.swapped.remove(r)
            self.swap.drop(r.seq_id)
        elif r in self.waiting:
            self.waiting.remove(r)
        if r.seq_id is not None:
            self._release(r)

    def _release(self, r: Request) -> None:
        """Finish ``r``'s sequence: its pages go back, its policy forgets it."""
        self.session.finish(r.seq_id)
        self.evictions.release(r)
        r.seq_id, r.num_computed = None, 0

    # ------------------------------------------------------------------ page arithmetic
    def _held(self, r: Request) -> int:
        return len(self.kv.pages(r.seq_id))

    def _pages(self, r: Request, n: int) -> int:
        """Pages ``r``'s row of ``n`` tokens takes: its new pages, and the copies its policy may make after it."""
        grow = max(0, cdiv(self.kv.seq_len(r.seq_id) + n, self.page_size) - self._held(r))
        return grow + self.evictions.copies(r, n)  # and the copies its policy may make after the row

    def _available(self) -> int:
        """Free pages that neither this step's policies' copies nor a running request's commitment has claimed."""
        avail = self.kv.allocator.num_free - sum(self._planned.values())
        if self.commitment.up_front:
            avail -= sum(self._unfilled(o) for o in self.running)
        return avail

    def _unfilled(self, r: Request) -> int:
        """Pages committed to ``r`` that neither the pages it holds nor its copies planned this step take."""
        return max(0, r.reserved_pages - self._held(r) - self._planned.get(r.request_id, 0))

    def _plan(self, r: Request, n: int, out: Schedule) -> None:
        """Take the pages of ``r``'s row of ``n`` tokens now (vLLM's ``allocate_slots``) and, with prefix
        caching, publish the full pages its tokens fill (vLLM's ``cache_blocks``): later rows and
        admissions of this step see them. The copies its policy may make after the forward are kept back."""
        acts = self.evictions.acts(r, n)  # its policy acts after this row
        self._planned[r.request_id] = self.evictions.copies(r, n)
        ids = r.tokens(r.num_computed, r.num_computed + n) if self.kv.prefix_caching else None
        self.kv.reserve(r.seq_id, n, token_ids=ids)
        self.evictions.planned(r, acts)
        out.rows.append((r, n))

    def unfilled_commitments(self) -> int:
        """Pages committed to running requests that no token fills yet (0 under ``"paged"``: none committed)."""
        return sum(max(0, r.reserved_pages - self._held(r)) for r in self.running)
