"""Checker for an eviction policy driven on a real cache (the score checkers are in `eviction_scores`).

`check_eviction_policy` checks the policy exercise 4 defines (`TASK`), decision by decision,
on K/V built so that the scores decide: every token of original page ``p`` has the same
ratio ||V||/||K|| in every KV head and layer, a level drawn per page (all levels distinct, in a
random order, so the lowest-scoring page is rarely the oldest or the newest), while ||K|| and
||V|| themselves vary token by token (a score of ||V|| or 1/||K|| alone ranks the pages
differently). Each token's position is written into the direction of its key (its norm stays
the one drawn), so the checker reads back which tokens a policy kept.
"""

from __future__ import annotations

import math

import torch

from ..._arith import cdiv
from ...cache import PagedKVCache
from ...eviction.policies import POLICY_NAMES, Reserved, make_policy, max_pages_held, sequence_scores
from ...eviction.scores import page_scores
from .eviction_scores import check_page_scores, check_token_scores
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

__all__ = ["REFERENCE_DOES", "TASK", "check_eviction_policy", "check_page_scores", "check_token_scores"]


# ------------------------------------------------------------------------------------ the policy
TASK = """\
budget C is in tokens; page_size B. A page's score is the mean ||V||/||K|| of its tokens (per KV
head, averaged over heads, then over layers). Page 0 (the attention sink) and the newest page are
reserved; every other page is a candidate.
after_prefill: while the sequence holds more than C tokens, drop the lowest-scoring candidate page.
after_append:  when the newest page has just filled (seq_len % B == 0) and the sequence holds more
               than C tokens, drop the lowest-scoring candidate page (one page).
So after the prefill at most C tokens are held, and never more than ceil(C / B) + 1 pages."""

# What each `make_policy` name does, for the hint of ``reference=`` mode.
_PAGED_DECODE = (
    "in decode, each time the newest page fills while over budget, it drops the lowest-mean page among "
    "pages 1 .. n-2 (page 0 and the newest page reserved)"
)
REFERENCE_DOES = {
    "paged_eviction": "at prefill it keeps the top-budget tokens by ||V||/||K||, token by token (cache.compact), "
    "the first and the last page_size tokens always among them; " + _PAGED_DECODE,
    "paged_eviction_literal": "at prefill it keeps the top-budget tokens by ||V||/||K||, token by token "
    "(cache.compact), the last page_size tokens always among them (page 0 is NOT reserved); in decode, each time "
    "the newest page fills while over budget, it drops the lowest-mean page among pages 0 .. n-2",
    "streaming_llm": "at prefill it keeps the first 4 tokens and the newest budget - 4 (cache.compact); in decode, "
    "each time the newest page fills while over budget, it drops the oldest page after the first (sink) page",
    "token_topk": "after the prefill and after every append over budget it keeps the top-budget tokens by "
    "||V||/||K|| (cache.compact), the first and the last page_size tokens always among them",
    "full": "it never evicts",
}
for _name, _what in (
    ("inverse_key_norm", "1/||K||"),
    ("value_norm", "||V||"),
    ("key_norm", "||K||"),
    ("key_value_ratio", "||K||/||V||"),
    ("random", "a random number"),
):
    REFERENCE_DOES[_name] = REFERENCE_DOES["paged_eviction"].replace("||V||/||K||", _what)
assert set(REFERENCE_DOES) == set(POLICY_NAMES)


def _page_scores(cache: PagedKVCache, seq_id: int) -> torch.Tensor:
    """The task's page scores: mean ||V||/||K|| per page, averaged over layers, ``[num_pages]``."""
    return page_scores(sequence_scores(cache, seq_id, "value_key_ratio"), cache.page_size)


class _TaskPolicy:
    """The policy `TASK` defines: the oracle of `check_eviction_policy`."""

    reserved = Reserved(first_pages=1, last_page=True)

    def __init__(self, budget: int):
        self.budget = budget

    def _drop_lowest(self, cache, seq_id) -> None:
        candidates = self.reserved.candidate_pages(len(cache.pages(seq_id)))
        scores = _page_scores(cache, seq_id)[candidates]
        cache.drop_pages(seq_id, [candidates[int(scores.argmin())]])

    def after_prefill(self, cache, seq_id) -> None:
        while cache.seq_len(seq_id) > self.budget and self.reserved.candidate_pages(len(cache.pages(seq_id))):
            self._drop_lowest(cache, seq_id)

    def after_append(self, cache, seq_id) -> None:
        n = cache.seq_len(seq_id)
        if n > self.budget and n % cache.page_size == 0:
            self._drop_lowest(cache, seq_id)


class _Driver:
    """One case: a cache, a policy, a prompt and ``steps`` decode steps of constructed K/V."""

    NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 4

    def __init__(self, make, budget, page_size, prompt_len, steps, pool, seed, sink_lowest):
        self.cache = PagedKVCache(
            num_layers=self.NUM_LAYERS,
            num_pages=pool,
            page_size=page_size,
            num_kv_heads=self.NUM_KV_HEADS,
            head_dim=self.HEAD_DIM,
        )
        self.seq = self.cache.add_sequence()
        self.make, self.budget, self.prompt_len, self.steps = make, budget, prompt_len, steps
        self.gen = torch.Generator().manual_seed(seed)
        last = prompt_len + steps - 1
        self.angle_step = (math.pi / 2) / (last + 1)  # position p: a key at angle p * angle_step
        pages = last // page_size + 1
        order = torch.randperm(pages, generator=self.gen)  # distinct levels, random order
        self.levels = 0.5 * 1.25 ** order.double()  # ratio of every token of original page p
        if sink_lowest:
            self.levels[0] = 0.5 * self.levels.min()
        self.policy = None  # set by the caller: the student's through run.call

    def write(self, start: int, n: int) -> None:
        slots = self.cache.reserve(self.seq, n)
        position = torch.arange(start, start + n)  # [n]
        angle = position.double() * self.angle_step
        ratio = self.levels[position // self.cache.page_size]  # [n]
        shape = (n, self.NUM_KV_HEADS, self.HEAD_DIM)
        for layer in range(self.NUM_LAYERS):
            k_norm = 1 + 3 * torch.rand(n, self.NUM_KV_HEADS, 1, generator=self.gen, dtype=torch.float64)
            k = torch.zeros(shape, dtype=torch.float64)
            k[:, :, 0], k[:, :, 1] = angle.cos()[:, None], angle.sin()[:, None]
            v = torch.randn(shape, generator=self.gen, dtype=torch.float64)
            v = v / v.norm(dim=-1, keepdim=True) * ratio[:, None, None]
            self.cache.write(layer, slots, (k * k_norm).float(), (v * k_norm).float())

    def kept(self) -> list[int]:
        k = self.cache.gather(0, self.seq)[0][:, 0].double()  # [seq_len, head_dim]
        return torch.round(torch.atan2(k[:, 1], k[:, 0]) / self.angle_step).long().tolist()

    def step(self, step: int, call) -> int:
        """Write step ``step``'s tokens (0: the prompt) and call the hook; returns the newest position."""
        start, n = (0, self.prompt_len) if step == 0 else (self.prompt_len + step - 1, 1)
        self.write(start, n)
        call(self.policy.after_prefill if step == 0 else self.policy.after_append, self.cache, self.seq)
        return start + n - 1


def _own(fn, *args):
    return fn(*args)


def _before(driver: _Driver, step: int) -> list[int]:
    """Positions held just before hook ``step``: what was kept, plus the tokens written since."""
    return list(range(driver.prompt_len)) if step == 0 else driver.kept() + [driver.prompt_len + step - 1]


def _where(budget, page_size, prompt_len, step) -> str:
    hook = "after the prefill" if step == 0 else f"after decode step {step} (position {prompt_len + step - 1} written)"
    return (
        f"budget C={budget} tokens, page_size B={page_size}, a prompt of {prompt_len} tokens "
        f"(positions 0..{prompt_len - 1}), {hook}"
    )


def _pages_of(positions: list[int], page_size: int) -> list[list[int]]:
    return [positions[i : i + page_size] for i in range(0, len(positions), page_size)]


def _decision_hint(before, kept, want, scores, budget, page_size, prefill) -> tuple[str, str, str]:
    """(expected, got, hint) for a hook whose kept tokens differ from the task's policy.

    ``before``: positions held before the hook (the same for the student and the oracle, as
    every earlier hook agreed); ``scores``: the oracle's page scores of ``before``.
    """
    pages = _pages_of(before, page_size)
    newest = len(pages) - 1
    candidates = list(range(1, newest))
    dropped = sorted({i // page_size for i, p in enumerate(before) if p not in set(kept)})
    expect = sorted({i // page_size for i, p in enumerate(before) if p not in set(want)})
    shown = ", ".join(f"{j}: {float(scores[j]):.3g}" for j in range(len(pages)))
    expected = (
        f"drop logical page(s) {expect} (the lowest-scoring candidate(s) of pages 1..{newest - 1}); "
        f"page scores {{{shown}}}; held {len(want)} tokens"
        if expect
        else f"no eviction here ({len(before)} tokens held, budget {budget}); page scores {{{shown}}}"
    )
    got = f"dropped logical page(s) {dropped}; held {len(kept)} tokens"
    partial = [j for j in dropped if any(p in set(kept) for p in pages[j])]
    if partial:
        return expected, got, "evict whole pages with cache.drop_pages(seq_id, [logical_page]): no single tokens"
    if not expect:
        return (
            expected,
            got,
            (
                "evicted although the rule does not: drop pages only while the sequence holds more than budget tokens "
                "(after the prefill) or when the newest page has just filled over budget (decode)"
            ),
        )
    if len(dropped) < len(expect):
        if prefill:
            return (
                expected,
                got,
                (
                    f"budget is in tokens: after the prefill hold at most budget={budget} tokens "
                    f"(you hold {len(kept)}); ceil(budget / page_size) + 1 pages is the bound during decode, "
                    "not the prefill's target"
                ),
            )
        return (
            expected,
            got,
            (
                f"the newest page has just filled while {len(before)} tokens > budget={budget} are held: "
                "drop the lowest-scoring candidate page in this after_append"
            ),
        )
    if len(dropped) > len(expect):
        only_newest = len(kept) <= page_size and newest not in dropped
        return (
            expected,
            got,
            (
                ("you kept only the newest page: " if only_newest else "")
                + "drop one page at a time, the lowest-scoring candidate, and only until the rule is met "
                "(prefill: at most budget tokens held; decode: one page when the newest fills over budget)"
            ),
        )
    k = len(expect)
    by_score = sorted(candidates, key=lambda j: float(scores[j]))
    if 0 in dropped:
        lowest_overall = min(range(len(pages)), key=lambda j: float(scores[j])) == 0
        if sorted(dropped) == list(range(k)) and not lowest_overall:
            return (
                expected,
                got,
                (
                    "you evicted the oldest page(s) (first in, first out), whatever their score: evict the "
                    "lowest-scoring candidate; and page 0, the attention sink, is reserved"
                ),
            )
        return (
            expected,
            got,
            (
                "page 0 holds the attention sink and is reserved (notebook 07): never evict it, even when its score "
                "is the lowest; the candidates are pages 1 .. n-2"
            ),
        )
    if sorted(dropped) == sorted(by_score[-k:]):
        return (
            expected,
            got,
            (
                "you evicted the highest-scoring page: PagedEviction keeps high ||V||/||K|| and evicts the lowest "
                "(argmin, not argmax; or is the ratio inverted, ||K||/||V||?)"
            ),
        )
    if sorted(dropped) == candidates[:k]:
        return (
            expected,
            got,
            (
                "you evicted the oldest candidate page(s) (first in, first out), whatever their score: evict the "
                "lowest-scoring candidate"
            ),
        )
    return (
        expected,
        got,
        (
            "evict the candidate with the lowest page score: the mean over its tokens of ||V||/||K|| (per KV head, "
            "averaged over heads), averaged over layers; candidates are pages 1 .. n-2"
        ),
    )


def check_eviction_policy(
    factory,
    *,
    budget: int = 24,
    page_size: int = 8,
    reference: str | None = None,
    seed: int = 0,
    steps: int = 40,
    time_limit: float | None = DEFAULT_TIME_LIMIT_S,
) -> CheckReport:
    """Drive a student's policy on a real `PagedKVCache`: prefill, then ``steps`` decode steps.

    Args:
        factory: ``factory(budget)`` returns a fresh policy object with the hooks
            ``after_prefill(cache, seq_id)`` and ``after_append(cache, seq_id)`` (see
            `paged_ref.eviction.policies`); it evicts through the cache's ``drop_pages`` /
            ``compact``.
        budget, page_size: C (tokens) and B; ``budget >= 2 * page_size``.
        reference: None to check the policy exercise 4 defines (`TASK`), or a `make_policy`
            name (e.g. ``"paged_eviction"``) whose kept tokens the student's must equal, hook by
            hook, on the same K/V (`REFERENCE_DOES` says what each does).
        seed, steps: the constructed K/V and the decode length.
        time_limit: seconds per case (a prompt and its decode steps), or None.

    After every hook: pages held <= ``max_pages_held(budget, page_size)``, every page the
    sequence gave up is back in the allocator (free + held = pool), the kept tokens are written
    tokens in their original order with the newest among them, and the kept tokens are the ones
    the task's policy (or the reference) keeps. Five prompts: longer than C by a page and a bit,
    2C + 1, 2C (a page multiple), C/2 + 1 (no prefill eviction), and 2C with page 0 scoring
    lowest (it must stay: the attention sink).
    """
    name = "eviction_policy"
    budget = check_count("budget", budget)
    page_size = check_count("page_size", page_size)
    steps = check_count("steps", steps)
    if reference is None and budget < 2 * page_size:
        raise ValueError(
            f"budget must be >= 2 * page_size = {2 * page_size} (page 0 and the newest page are reserved), got {budget}"
        )
    if reference is not None and reference not in POLICY_NAMES:
        raise ValueError(f"reference must be None or one of {sorted(POLICY_NAMES)}, got {reference!r}")
    prompts = [
        (budget + page_size + 3, False),
        (2 * budget + 1, False),
        (2 * budget, False),
        (budget // 2 + 1, False),
        (2 * budget, True),
    ]
    pool = cdiv(max(p for p, _ in prompts) + steps, page_size) + 8  # room for all, so over budget is not out of pages
    limit = max_pages_held(budget, page_size)
    if reference is None:
        make_oracle = _TaskPolicy
    elif reference == "full":
        make_oracle = lambda c: make_policy("full")  # noqa: E731
    else:
        make_oracle = lambda c: make_policy(reference, c)  # noqa: E731
    run = Run(name, len(prompts), time_limit)
    for case, (prompt_len, sink_lowest) in enumerate(prompts, start=1):
        mine = _Driver(factory, budget, page_size, prompt_len, steps, pool, seed + case, sink_lowest)
        oracle = _Driver(make_oracle, budget, page_size, prompt_len, steps, pool, seed + case, sink_lowest)
        oracle.policy = make_oracle(budget)
        step = 0
        try:
            with run.case(case):
                mine.policy = run.call(factory, budget)
                for step in range(steps + 1):
                    before = _before(oracle, step)  # every earlier hook agreed: the student's too
                    newest = mine.step(step, run.call)
                    scores = None
                    if reference is None:  # the oracle's page scores before its hook, for the hint
                        oracle.write(*((0, prompt_len) if step == 0 else (newest, 1)))
                        scores = _page_scores(oracle.cache, oracle.seq)
                        hook = oracle.policy.after_prefill if step == 0 else oracle.policy.after_append
                        hook(oracle.cache, oracle.seq)
                    else:
                        oracle.step(step, _own)
                    problem = _check_hook(mine, newest, limit, pool)
                    want, got = oracle.kept(), mine.kept()
                    if problem is None and want != got:
                        if reference is None:
                            problem = _decision_hint(before, got, want, scores, budget, page_size, step == 0)
                        else:
                            gone, extra = sorted(set(want) - set(got))[:6], sorted(set(got) - set(want))[:6]
                            differ = [f"you dropped {gone}, which it keeps"] if gone else []
                            differ += [f"you keep {extra}, which it drops"] if extra else []
                            problem = (
                                f"the tokens {reference!r} keeps: {_short(want)}",
                                f"{_short(got)} ({'; '.join(differ)})",
                                f"reference={reference!r} asks for exactly what that policy does: "
                                f"{REFERENCE_DOES[reference]}",
                            )
                    if problem is not None:
                        where = _where(budget, page_size, prompt_len, step)
                        return run.finish(CheckReport(name, False, case, Failure(where, *problem)))
        except NotImplementedYet:
            return run.finish(CheckReport(name, False, case, not_implemented=True))
        except OverTime:
            where = _where(budget, page_size, prompt_len, step)
            return run.finish(CheckReport(name, False, case, run.over_time(where)))
        except StudentError as raised:
            failure = Failure(
                _where(budget, page_size, prompt_len, step) + " (during this hook)",
                "no exception",
                str(raised),
                "the hooks take (cache, seq_id); evict with cache.drop_pages(seq_id, logical_pages)",
            )
            return run.finish(CheckReport(name, False, case, failure))
    return run.finish(CheckReport(name, True, len(prompts)))


def _short(positions: list[int]) -> str:
    return f"{positions[:10]}{' ...' if len(positions) > 10 else ''} ({len(positions)} tokens)"


def _check_hook(mine: _Driver, newest: int, limit: int, pool: int):
    """The safety checks after a hook: (expected, got, hint) of the first that fails, else None."""
    cache, s = mine.cache, mine.seq
    held, positions = cache.pages(s), mine.kept()
    if len(held) > limit:
        return (
            f"<= {limit} pages held (ceil(budget / page_size) + 1)",
            f"{len(held)} pages ({cache.seq_len(s)} tokens)",
            "evict whole pages: after the prefill hold at most budget tokens; in decode drop a page each time "
            "the newest page fills over budget",
        )
    if cache.allocator.num_free + len(held) != pool:
        return (
            f"{pool - len(held)} free pages (pool {pool} - {len(held)} held)",
            f"{cache.allocator.num_free} free",
            "give evicted pages back to the allocator (cache.drop_pages / cache.compact do)",
        )
    if positions != sorted(set(positions)) or not positions or positions[-1] != newest:
        return (
            f"kept positions increasing and ending with the newest token {newest}",
            f"{positions[:8]}{' ...' if len(positions) > 8 else ''} (last {positions[-1:]})",
            "never evict the page just written (the newest page is reserved); keep the kept tokens in their "
            "original order",
        )
    return None
