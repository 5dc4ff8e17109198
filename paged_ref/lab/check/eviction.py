"""Checker for an eviction policy driven on a real cache (the score checkers are in `eviction_scores`).

`check_eviction_policy` checks the policy exercise 4 defines (`TASK`), decision by decision, on
K/V built so that the task's score decides and every plausible wrong score decides otherwise.
Original page ``p`` has a level drawn per page (all distinct, 25% apart, in a random order, so the
lowest-scoring page is rarely the oldest or the newest): the task's score of the page, the mean
||V||/||K|| over its tokens, KV heads and layers. Around that mean the ratio differs by layer and
by KV head (factors of mean one over them) and token by token (factors of mean one over the page),
and ||K|| is drawn per token, independently of the ratio, ten times larger in KV head 0 than in
KV head 1. So each of these ranks the pages differently from the task's score, and the hint names
it (`_SCORE_MISTAKES`): ||V|| alone, 1/||K|| alone, layer 0 only, the last layer only, one norm
over all KV heads together, and the page's mean ||V|| over its mean ||K|| (a ratio of means). The
last prompt adds a decoy for three more: the squared ratio, L1 norms, the largest KV head.
Each token's position is written into the direction of its key (its norm stays the one drawn),
so the checker reads back which tokens a policy kept.
"""

from __future__ import annotations

import math
import re

import torch

from ..._arith import cdiv
from ...cache import PagedKVCache
from ...eviction.base import Reserved, max_pages_held, sequence_scores
from ...eviction.policies import POLICY_NAMES, make_policy
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


# wrong page scores a student may compute, and the hint that names each
_SCORE_MISTAKES = {
    "value_norm": "you ranked the pages by ||V|| alone: the score is ||V||/||K||, each token's value norm divided "
    "by its key norm",
    "inverse_key_norm": "you ranked the pages by 1/||K|| alone: the score is ||V||/||K||, the value norm counts too",
    "first_layer": "you scored from layer 0 only: average the token scores over every layer (cache.num_layers)",
    "last_layer": "you scored from the last layer only: average the token scores over every layer (cache.num_layers)",
    "all_heads_norm": "you took one norm over all KV heads together (||V|| / ||K|| of the heads side by side): take "
    "||V||/||K|| per KV head, then average over the heads",
    "ratio_of_means": "you divided the page's mean ||V|| by its mean ||K|| (a ratio of means): the score is the mean "
    "over the page's tokens of each token's ||V||/||K|| (a mean of ratios)",
    "squared_ratio": "you averaged the squared ratio (||V||/||K||)^2 (or ||V||^2/||K||^2): average ||V||/||K|| itself",
    "l1_norms": "you took L1 norms (the sum of absolute values): ||V|| and ||K|| are L2 norms "
    "(torch.linalg.vector_norm or .norm(dim=-1))",
    "max_over_heads": "you took the largest KV head's ||V||/||K||: average over the KV heads",
}


def _score_variants(cache: PagedKVCache, seq_id: int) -> dict[str, torch.Tensor]:
    """The page scores of each `_SCORE_MISTAKES` entry, ``name -> [num_pages]``."""
    k = torch.stack([cache.gather(layer, seq_id)[0] for layer in range(cache.num_layers)]).double()  # [L, T, H, D]
    v = torch.stack([cache.gather(layer, seq_id)[1] for layer in range(cache.num_layers)]).double()
    kn, vn = k.norm(dim=-1), v.norm(dim=-1)  # [L, T, H]
    ratio = vn / kn

    def pages(x: torch.Tensor) -> torch.Tensor:  # x: [T, ...] -> page means [num_pages, ...]
        return torch.stack([chunk.mean(dim=0) for chunk in x.split(cache.page_size)])

    return {
        "value_norm": pages(vn.mean(dim=(0, 2))),
        "inverse_key_norm": pages((1 / kn).mean(dim=(0, 2))),
        "first_layer": pages(ratio[0].mean(dim=-1)),
        "last_layer": pages(ratio[-1].mean(dim=-1)),
        "all_heads_norm": pages((v.flatten(2).norm(dim=-1) / k.flatten(2).norm(dim=-1)).mean(dim=0)),
        "ratio_of_means": (pages(vn.transpose(0, 1)) / pages(kn.transpose(0, 1))).mean(dim=(1, 2)),
        "squared_ratio": pages(ratio.square().mean(dim=(0, 2))),
        "l1_norms": pages((v.abs().sum(dim=-1) / k.abs().sum(dim=-1)).mean(dim=(0, 2))),
        "max_over_heads": pages(ratio.amax(dim=-1).mean(dim=0)),
    }


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

    NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, NEIGHBOUR_PAGES = 2, 2, 4, 2

    def __init__(self, make, budget, page_size, prompt_len, steps, pool, seed, sink_lowest, decoy=False):
        self.cache = PagedKVCache(
            num_layers=self.NUM_LAYERS,
            num_pages=pool,
            page_size=page_size,
            num_kv_heads=self.NUM_KV_HEADS,
            head_dim=self.HEAD_DIM,
        )
        neighbour = self.cache.add_sequence()  # holds the first pages: physical ids are not logical ones
        self.cache.reserve(neighbour, self.NEIGHBOUR_PAGES * page_size)
        self.seq = self.cache.add_sequence()
        self.make, self.budget, self.prompt_len, self.steps = make, budget, prompt_len, steps
        self.gen = torch.Generator().manual_seed(seed)
        last = prompt_len + steps - 1
        self.angle_step = (math.pi / 2) / (last + 1)  # position p: a key at angle p * angle_step
        pages = last // page_size + 1
        order = torch.randperm(pages, generator=self.gen)  # distinct levels, random order
        levels = 0.5 * 1.25 ** order.double()  # the task's score of original page p
        if sink_lowest:
            levels[0] = 0.5 * levels.min()
        self.levels = levels  # [pages]
        layers_heads = (self.NUM_LAYERS, self.NUM_KV_HEADS)
        shape = (pages, page_size, *layers_heads)  # per original page, token in the page, layer, KV head
        head_scale = torch.tensor([3.0, 0.3], dtype=torch.float64)  # ||K|| of head 0 ten times head 1's
        k_page = head_scale * self._spread((pages, 1, *layers_heads), 1.5)  # ||K|| level of each page
        k_token = self._spread(shape, 1.2)
        per_head = self._spread((pages, 1, *layers_heads), 1.2, dims=(2, 3))  # mean 1 over layers and heads
        sign = torch.randint(0, 2, (pages, 1, 1, 1), generator=self.gen) * 2 - 1  # per page: with ||K|| or against
        per_token = k_token**sign
        per_token = per_token / per_token.mean(dim=1, keepdim=True)  # mean 1 over the page's tokens
        self.decoy = decoy and pages > 3
        if self.decoy:  # see `_make_decoy`
            self._make_decoy(levels, per_head, per_token, prompt_pages=cdiv(prompt_len, page_size))
        self.ratio = (levels[:, None, None, None] * per_head * per_token).flatten(0, 1)  # [tokens, layers, heads]
        self.k_norm = (k_page * k_token).flatten(0, 1)
        self.policy = None  # set by the caller: the student's through run.call
        self.record = False  # set by `_later_decisions`: keep the page scores before each hook

    def _make_decoy(self, levels, per_head, per_token, prompt_pages) -> None:
        """Pages 1 and 2 score lowest of the prompt's pages (page 1 lowest, 10% below page 2), and the
        squared ratio, L1 norms and the largest KV head each rank page 1 above page 2: page 2 is flat
        (every token, layer and head at its level, V along one axis); page 1 puts its ratio in KV head
        0 (19 times head 1's, mean 1 over layers and heads), nine tenths of it in one token (mean 1 over
        the page) and V along a diagonal (its L1 norm twice its L2 norm; the key's is at most sqrt 2 times).
        Edits ``levels [pages]``, ``per_head [pages, 1, layers, heads]``, ``per_token [pages, B, layers, heads]``."""
        levels[2] = 0.95 * levels[1 : max(prompt_pages - 1, 3)].min()
        levels[1] = 0.9 * levels[2]
        per_head[2], per_token[2] = 1.0, 1.0
        layer = torch.tensor([1.3, 0.7], dtype=torch.float64)[:, None]  # [layers, 1], mean 1
        per_head[1] = layer * torch.tensor([1.9, 0.1], dtype=torch.float64)  # [layers, heads], mean 1
        token = torch.full((per_token.shape[1],), 0.1, dtype=torch.float64)  # [B]
        token[0] = per_token.shape[1] - 0.1 * (per_token.shape[1] - 1)  # mean 1 over the page
        per_token[1] = token[:, None, None]

    def _spread(self, shape, width, dims=()) -> torch.Tensor:
        """Log-uniform factors in exp(+-width), scaled to mean 1 over ``dims`` (none: as drawn)."""
        x = torch.exp(width * (2 * torch.rand(shape, generator=self.gen, dtype=torch.float64) - 1))
        return x / x.mean(dim=dims, keepdim=True) if dims else x

    def write(self, start: int, n: int) -> None:
        slots = self.cache.reserve(self.seq, n)
        position = torch.arange(start, start + n)  # [n]
        angle = position.double() * self.angle_step
        shape = (n, self.NUM_KV_HEADS, self.HEAD_DIM)
        for layer in range(self.NUM_LAYERS):
            k_norm = self.k_norm[position, layer][:, :, None]  # [n, heads, 1]
            k = torch.zeros(shape, dtype=torch.float64)
            k[:, :, 0], k[:, :, 1] = angle.cos()[:, None], angle.sin()[:, None]
            v = torch.randn(shape, generator=self.gen, dtype=torch.float64)
            if self.decoy:  # page 1's V along a diagonal, page 2's along one axis (`_make_decoy`)
                page = (position // self.cache.page_size)[:, None, None]  # [n, 1, 1]
                axis = torch.zeros_like(v).scatter_(-1, v.abs().argmax(dim=-1, keepdim=True), 1.0) * v.sign()
                v = torch.where(page == 1, v.sign(), torch.where(page == 2, axis, v))
            v = v / v.norm(dim=-1, keepdim=True) * (self.ratio[position, layer][:, :, None] * k_norm)
            self.cache.write(layer, slots, (k * k_norm).float(), v.float())

    def kept(self) -> list[int]:
        k = self.cache.gather(0, self.seq)[0][:, 0].double()  # [seq_len, head_dim]
        return torch.round(torch.atan2(k[:, 1], k[:, 0]) / self.angle_step).long().tolist()

    def step(self, step: int, call) -> int:
        """Write step ``step``'s tokens (0: the prompt) and call the hook; returns the newest position."""
        start, n = (0, self.prompt_len) if step == 0 else (self.prompt_len + step - 1, 1)
        self.write(start, n)
        self.physical = self.cache.pages(self.seq)  # the block table the hook is given
        self.held_before = self.kept()
        if self.record:  # the scores the hook sees, for the hints
            self.scores = _page_scores(self.cache, self.seq), _score_variants(self.cache, self.seq)
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
    every earlier hook agreed); ``scores``: the oracle's page scores of ``before``. A hint among
    `_SCORE_HINTS` is refined by `_named_mistake`.
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
        room = cdiv(len(want), page_size) * page_size
        if prefill and len(want) <= budget < room and len(kept) <= room - page_size:
            return (
                expected,
                got,
                (
                    f"the budget counts the tokens held (cache.seq_len), not the room of their pages: {len(want)} "
                    f"tokens <= budget={budget} are held after the task's drops, although their pages have room "
                    f"for {room}; stop dropping there"
                ),
            )
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
    if 0 in dropped:
        lowest_overall = min(range(len(pages)), key=lambda j: float(scores[j])) == 0
        if sorted(dropped) == list(range(len(expect))) and not lowest_overall:
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
    k = len(expect)
    if sorted(dropped) == sorted(sorted(candidates, key=lambda j: -float(scores[j]))[:k]):
        return expected, got, _ARGMAX_HINT
    if sorted(dropped) == candidates[:k]:
        return expected, got, _FIFO_HINT
    return expected, got, _LOWEST_HINT


class _Decision:
    """A hook that dropped pages: the candidates (pages 1 .. n-2 of the n held before it), the
    logical pages it dropped, the task's page scores and `_score_variants` before it."""

    def __init__(self, candidates, dropped, scores, variants):
        self.candidates, self.dropped, self.scores, self.variants = candidates, sorted(dropped), scores, variants


def _dropped(before: list[int], after: list[int], page_size: int) -> list[int]:
    """The logical pages of ``before`` (positions) that ``after`` no longer holds."""
    return [j for j, pg in enumerate(_pages_of(before, page_size)) if not set(pg) <= set(after)]


def _later_decisions(mine: _Driver, step: int, steps: int, call, limit: int, pool: int) -> list[_Decision]:
    """The student's own decisions after hook ``step``, on its own cache, until the case ends or a
    hook raises or fails a safety check: more evidence for `_named_mistake`."""
    out = []
    mine.record = True
    for later in range(step + 1, steps + 1):
        try:
            if later == 0:
                mine.policy = call(mine.make, mine.budget)
            newest = mine.step(later, call)
        except (StudentError, OverTime):
            break
        if _check_hook(mine, newest, limit, pool)[0] is not None:
            break
        dropped = _dropped(mine.held_before, mine.kept(), mine.cache.page_size)
        if dropped:
            n = cdiv(len(mine.held_before), mine.cache.page_size)
            out.append(_Decision(list(range(1, n - 1)), dropped, *mine.scores))
    return out


_LOWEST_HINT = (
    "evict the candidate with the lowest page score: the mean over its tokens of ||V||/||K|| (per KV head, "
    "averaged over heads), averaged over layers; candidates are pages 1 .. n-2"
)
_ARGMAX_HINT = (
    "you evicted the highest-scoring page: PagedEviction keeps high ||V||/||K|| and evicts the lowest "
    "(argmin, not argmax; or is the ratio inverted, ||K||/||V||?)"
)
_FIFO_HINT = (
    "you evicted the oldest candidate page(s) (first in, first out), whatever their score: evict the "
    "lowest-scoring candidate"
)


#: the hints of a decision that dropped the right number of candidate pages, but not the right ones
_SCORE_HINTS = (_LOWEST_HINT, _ARGMAX_HINT, _FIFO_HINT)


def _candidates(before: list[int], page_size: int) -> list[int]:
    """Pages 1 .. n-2 of the n pages holding ``before`` (positions): the ones a policy may drop."""
    return list(range(1, cdiv(len(before), page_size) - 1))


def _lowest(candidates, k, scores) -> list[int]:
    return sorted(sorted(candidates, key=lambda j: float(scores[j]))[:k])


def _named_mistake(decisions: list[_Decision]) -> str | None:
    """The hint of the known mistake that makes every one of the student's ``decisions``: the hooks
    before the failing one (where it agreed with the task's policy), that one and the later. Argmax
    and first-in-first-out first; then every wrong score that makes them all, each named."""

    def makes_all(choose) -> bool:
        return all(choose(d, len(d.dropped)) == d.dropped for d in decisions)

    if makes_all(lambda d, k: sorted(sorted(d.candidates, key=lambda j: -float(d.scores[j]))[:k])):
        return _ARGMAX_HINT
    if makes_all(lambda d, k: d.candidates[:k]):
        return _FIFO_HINT
    hints = [
        h for n, h in _SCORE_MISTAKES.items() if makes_all(lambda d, k, n=n: _lowest(d.candidates, k, d.variants[n]))
    ]
    if len(hints) > 1:
        return f"these cases cannot tell which of {len(hints)} wrong scores you computed: " + "; or ".join(hints)
    return hints[0] if hints else None


def _index_mistake(before, kept, want, physical, scores, page_size) -> str | None:
    """A hint when ``kept`` is what dropping the task's pages by the wrong indices leaves: physical
    page ids (``cache.pages(seq_id)[j]``) passed as logical indices, or logical indices computed
    before the first of several ``drop_pages`` calls (they shift after each)."""
    pages = _pages_of(before, page_size)
    expect = [j for j, pg in enumerate(pages) if not set(pg) <= set(want)]
    if not expect:
        return None

    def after(calls) -> list[int] | None:
        """Positions left after ``drop_pages`` calls; a call is a function of the held pages
        (original logical page -> physical id) that returns the logical indices it passes."""
        held = list(zip(range(len(pages)), physical))
        for call in calls:
            drop = call(dict(held))
            if drop is None or len(set(drop)) != len(drop) or not all(0 <= j < len(held) for j in drop):
                return None
            held = [h for i, h in enumerate(held) if i not in set(drop)]
        return [t for j, _ in held for t in pages[j]]

    def physical_of(page):  # the page's physical id, if an earlier call has not dropped it
        return lambda held: [held[page]] if page in held else None

    def physical_of_lowest(held):  # the physical id of the lowest-scoring candidate still held
        return [held[min(list(held)[1:-1], key=lambda j: float(scores[j]))]] if len(held) > 2 else None

    orders = [sorted(expect), sorted(expect, key=lambda j: float(scores[j]))]
    one_call = [lambda held: [held[j] for j in expect]]
    greedy = [physical_of_lowest] * len(expect)  # a page at a time, the lowest candidate each time
    if any(kept == after(calls) for calls in [one_call, greedy] + [[physical_of(j) for j in o] for o in orders]):
        return _PHYSICAL_HINT
    for order in orders:
        if len(order) > 1 and kept == after([lambda held, j=j: [j] for j in order]):
            return (
                "you dropped pages by logical indices computed before the first drop_pages call: after each "
                "drop_pages the later pages move down one place; recompute the index after every drop, drop from "
                "the highest index down, or drop them all in one call"
            )
    return None


_PHYSICAL_HINT = (
    "drop_pages takes logical page indices (0 .. n-1: a page's place in the sequence's block table), and you "
    "passed physical page ids (cache.pages(seq_id)[j] is the physical id of logical page j)"
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

    After every hook: the sequence is still in the cache, pages held <= ``max_pages_held(budget,
    page_size)``, every page the sequence gave up is back in the allocator (free + held = pool,
    less the pages of a neighbour sequence that makes physical page ids differ from logical
    ones), the kept tokens are written tokens in their original order with the newest among them,
    and the kept tokens are the ones the task's policy (or the reference) keeps. Seven prompts:
    longer than C by a page and a bit, 2C + 1, 2C (a page multiple), C/2 + 1 (no prefill
    eviction), 2C with page 0 scoring lowest (it must stay: the attention sink), 2C' + 1
    with a budget C' = C + B // 2 that is no multiple of B (C itself if it is none), where
    holding more than C' tokens and holding more than C' // B pages part ways, and C + B with
    pages 1 and 2 a decoy (`_Driver._make_decoy`: where C >= 3B, the one page the prefill drops
    is page 1, which the squared ratio, L1 norms and the largest KV head would each keep). When a
    decision differs from the task's, the student's policy also runs on to the end of that case
    and through the other cases, and the hint names the wrong score (`_SCORE_MISTAKES`), argmax or
    first-in-first-out that makes all of its decisions, or the wrong indices (`_index_mistake`).
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
    # a budget that is no multiple of page_size, where holding more than C tokens and holding more
    # than C // B pages part ways (``budget`` itself if it is none)
    odd = budget if budget % page_size else budget + page_size // 2
    prompts = [  # (prompt length, page 0 scoring lowest, the budget C of the case, pages 1 and 2 a decoy)
        (budget + page_size + 3, False, budget, False),
        (2 * budget + 1, False, budget, False),
        (2 * budget, False, budget, False),
        (budget // 2 + 1, False, budget, False),
        (2 * budget, True, budget, False),
        (2 * odd + 1, False, odd, False),
        (budget + page_size, False, budget, True),
    ]
    # room for all, so over budget is not out of pages, and for the neighbour's pages
    pool = cdiv(max(p[0] for p in prompts) + steps, page_size) + 8 + _Driver.NEIGHBOUR_PAGES
    if reference is None:
        make_oracle = _TaskPolicy
    elif reference == "full":
        make_oracle = lambda c: make_policy("full")  # noqa: E731
    else:
        make_oracle = lambda c: make_policy(reference, c)  # noqa: E731
    run = Run(name, len(prompts), time_limit)
    for case, (prompt_len, sink_lowest, budget, decoy) in enumerate(prompts, start=1):
        limit = max_pages_held(budget, page_size)
        mine = _Driver(factory, budget, page_size, prompt_len, steps, pool, seed + case, sink_lowest, decoy)
        oracle = _Driver(make_oracle, budget, page_size, prompt_len, steps, pool, seed + case, sink_lowest, decoy)
        oracle.policy = make_oracle(budget)
        step = 0
        try:
            with run.case(case):
                mine.policy = run.call(factory, budget)
                past = []  # the hooks so far in which the task's policy dropped pages
                for step in range(steps + 1):
                    before = _before(oracle, step)  # every earlier hook agreed: the student's too
                    newest = mine.step(step, run.call)
                    scores = variants = None
                    if reference is None:  # the oracle's page scores before its hook, for the hint
                        oracle.write(*((0, prompt_len) if step == 0 else (newest, 1)))
                        scores = _page_scores(oracle.cache, oracle.seq)
                        if step == 0 or oracle.cache.seq_len(oracle.seq) % page_size == 0:  # it may drop pages
                            variants = _score_variants(oracle.cache, oracle.seq)
                        hook = oracle.policy.after_prefill if step == 0 else oracle.policy.after_append
                        hook(oracle.cache, oracle.seq)
                    else:
                        oracle.step(step, _own)
                    problem, fatal = _check_hook(mine, newest, limit, pool)
                    want = oracle.kept()
                    got = None if fatal else mine.kept()
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
                    if reference is None and problem is not None and not fatal and want != got:
                        physical, cause = mine.physical, None
                        if problem[2] in _SCORE_HINTS:  # the right count of candidates: which score chose them?
                            dropped = _dropped(before, got, page_size)
                            now = _Decision(_candidates(before, page_size), dropped, scores, variants)
                            later = _later_decisions(mine, step, steps, run.call, limit, pool)
                            for other, (length, low, c, lure) in enumerate(prompts, start=1):  # and the others
                                if other != case:
                                    again = _Driver(factory, c, page_size, length, steps, pool, seed + other, low, lure)
                                    held = max_pages_held(c, page_size)
                                    later += _later_decisions(again, -1, steps, run.call, held, pool)
                            cause = _named_mistake([*past, now, *later])
                        if cause is None:
                            cause = _index_mistake(before, got, want, physical, scores, page_size)
                            if cause is not None and problem[2] == _NEWEST_HINT:  # as likely: the newest a candidate
                                cause += (
                                    "; or, if your candidates included the newest page: it is reserved, the "
                                    "candidates are pages 1 .. n-2"
                                )
                        if cause is not None:
                            problem = (*problem[:2], cause)
                    if problem is not None:
                        where = _where(budget, page_size, prompt_len, step)
                        return run.finish(CheckReport(name, False, case, Failure(where, *problem)))
                    dropped = _dropped(before, want, page_size) if reference is None else []
                    if dropped:
                        past.append(_Decision(_candidates(before, page_size), dropped, scores, variants))
        except NotImplementedYet:
            return run.finish(CheckReport(name, False, case, not_implemented=True))
        except OverTime:
            where = _where(budget, page_size, prompt_len, step)
            return run.finish(CheckReport(name, False, case, run.over_time(where)))
        except StudentError as raised:
            hint = "the hooks take (cache, seq_id); evict with cache.drop_pages(seq_id, logical_pages)"
            bad = re.search(r"logical_pages must be in \[0, \d+\) for sequence \d+, got (\d+)", str(raised))
            if bad and int(bad.group(1)) in getattr(mine, "physical", []):
                hint = _PHYSICAL_HINT
            failure = Failure(
                _where(budget, page_size, prompt_len, step) + " (during this hook)", "no exception", str(raised), hint
            )
            return run.finish(CheckReport(name, False, case, failure))
    return run.finish(CheckReport(name, True, len(prompts)))


def _short(positions: list[int]) -> str:
    return f"{positions[:10]}{' ...' if len(positions) > 10 else ''} ({len(positions)} tokens)"


def _check_hook(mine: _Driver, newest: int, limit: int, pool: int):
    """The safety checks after a hook: ``(problem, fatal)``, ``problem`` the (expected, got, hint) of the
    first check that fails (None if all pass), ``fatal`` when the sequence is gone."""
    cache, s = mine.cache, mine.seq
    if s not in cache.seq_ids:
        return (
            f"sequence {s} still in the cache after the hook, holding at most {limit} pages",
            f"sequence {s} is gone: the hook freed it (cache.free(seq_id))",
            "a policy evicts pages, never the whole sequence: drop pages with cache.drop_pages(seq_id, "
            "logical_pages) (or cache.compact); the sequence is freed by its owner when the request finishes",
        ), True
    held, positions = cache.pages(s), mine.kept()
    if len(held) > limit:
        return (
            f"<= {limit} pages held (ceil(budget / page_size) + 1)",
            f"{len(held)} pages ({cache.seq_len(s)} tokens)",
            "evict whole pages: after the prefill hold at most budget tokens; in decode drop a page each time "
            "the newest page fills over budget",
        ), False
    if cache.allocator.num_free + len(held) + mine.NEIGHBOUR_PAGES != pool:
        return (
            f"{pool - len(held) - mine.NEIGHBOUR_PAGES} free pages (pool {pool} - {len(held)} held by the sequence "
            f"- {mine.NEIGHBOUR_PAGES} by another)",
            f"{cache.allocator.num_free} free",
            "give evicted pages back to the allocator (cache.drop_pages / cache.compact do)",
        ), False
    if positions != sorted(set(positions)) or not positions or positions[-1] != newest:
        return (
            f"kept positions increasing and ending with the newest token {newest}",
            f"{positions[:8]}{' ...' if len(positions) > 8 else ''} (last {positions[-1:]})",
            _NEWEST_HINT,
        ), False
    return None, False


_NEWEST_HINT = (
    "never evict the page just written (the newest page is reserved); keep the kept tokens in their original order"
)
