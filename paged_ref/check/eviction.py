"""Checkers for PagedEviction's scores and for an eviction policy driven on a real cache."""

from __future__ import annotations

import torch

from ..cache import PagedKVCache
from ..eviction.policies import make_policy, max_pages_held
from ..eviction.scores import page_scores, token_scores
from .report import CheckReport, Failure, run_cases

__all__ = ["check_eviction_policy", "check_page_scores", "check_token_scores"]


def _kv_cases(seed: int):
    """(k, v) pairs ``[T, Hkv, D]``, smallest first, with norms that differ token to token."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for num_tokens, heads, dim in ((1, 1, 2), (3, 1, 4), (5, 2, 4), (16, 2, 8), (40, 3, 16), (64, 4, 8)):
        k = torch.randn(num_tokens, heads, dim, generator=gen) * torch.rand(num_tokens, heads, 1, generator=gen) * 4
        v = torch.randn(num_tokens, heads, dim, generator=gen) * torch.rand(num_tokens, heads, 1, generator=gen) * 4
        cases.append((k + 0.01, v + 0.01))  # no zero norms
    return cases


def _describe_kv(case) -> str:
    k, v = case
    return f"k, v of shape {list(k.shape)} [num_tokens, num_kv_heads, head_dim]"


def _fmt(t: torch.Tensor) -> str:
    return str([round(x, 4) for x in t.flatten()[:6].tolist()]) + (" ..." if t.numel() > 6 else "")


def check_token_scores(fn, *, seed: int = 0):
    """Check ``fn(k, v) -> [num_tokens]``: PagedEviction's ||V|| / ||K|| per head, averaged over heads."""

    def one(case):
        k, v = case
        want = token_scores(k, v, "value_key_ratio")
        got = torch.as_tensor(fn(k, v)).float().cpu()
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-6):
            return None
        if got.shape == want.shape and torch.allclose(got, token_scores(v, k, "value_key_ratio"), rtol=1e-4):
            hint = "the ratio is inverted: the score is ||V|| / ||K|| (keep tokens with large values, small keys)"
        elif got.shape == want.shape and torch.allclose(
            got, v.norm(dim=(1, 2)) / k.norm(dim=(1, 2)).clamp_min(1e-12), rtol=1e-4
        ):
            hint = "take the norms per head (over head_dim), the ratio per head, then the mean over heads"
        elif got.shape != want.shape:
            hint = f"one score per token: shape [{k.shape[0]}]"
        else:
            hint = "per token and head: ||v|| / ||k|| over head_dim; then the mean over the heads"
        return Failure(_describe_kv(case), _fmt(want), _fmt(got), hint)

    return run_cases("token_scores", _kv_cases(seed), one, _describe_kv, "fn(k, v) returns a [num_tokens] tensor")


def check_page_scores(fn, *, seed: int = 0):
    """Check ``fn(token_scores, page_size) -> [num_pages]``: the mean score of the tokens each page holds."""
    gen = torch.Generator().manual_seed(seed)
    cases = [(torch.rand(n, generator=gen), p) for n, p in ((1, 1), (4, 2), (5, 2), (7, 4), (16, 4), (33, 8), (50, 16))]

    def describe(case):
        scores, page_size = case
        return f"token_scores={_fmt(scores)} ({scores.numel()} tokens), page_size={page_size}"

    def one(case):
        scores, page_size = case
        want = page_scores(scores, page_size)
        got = torch.as_tensor(fn(scores.clone(), page_size)).float()
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-7):
            return None
        if got.shape != want.shape:
            hint = "one score per page, ceil(num_tokens / page_size) pages (a partial last page counts)"
        else:
            hint = "average each page over the tokens it holds: the last page may hold fewer than page_size"
        return Failure(describe(case), _fmt(want), _fmt(got), hint)

    return run_cases("page_scores", cases, one, describe, "fn(token_scores, page_size) returns a [num_pages] tensor")


def check_eviction_policy(
    factory, *, budget: int = 24, page_size: int = 8, reference: str | None = None, seed: int = 0, steps: int = 40
) -> CheckReport:
    """Drive a student's policy on a real `PagedKVCache`: prefill, then ``steps`` decode steps.

    Args:
        factory: ``factory(budget)`` returns a fresh policy object with the hooks
            ``after_prefill(cache, seq_id)`` and ``after_append(cache, seq_id)`` (see
            `paged_ref.eviction.policies`); it evicts through the cache's ``drop_pages`` /
            ``compact``.
        budget, page_size: C and B.
        reference: optionally a `make_policy` name (e.g. ``"paged_eviction"``) whose kept tokens
            the student's must equal, step by step, on the same K/V.
        seed, steps: the random K/V and the decode length.

    After every hook: pages held <= ``max_pages_held(budget, page_size)``, every page the
    sequence gave up is back in the allocator (free + held = pool), the kept tokens are written
    tokens in their original order, and the newest token is kept.
    """
    name = "eviction_policy"
    pool = max_pages_held(budget, page_size) + 64 // page_size + 8
    prompts = [budget + page_size + 3, 2 * budget + 1, 2 * budget, budget // 2 + 1]  # one a page multiple

    def run(make, prompt_len, gen):
        """Yields (phase, step, cache, seq_id, written markers) after each hook."""
        cache = PagedKVCache(num_layers=2, num_pages=pool, page_size=page_size, num_kv_heads=2, head_dim=4)
        s = cache.add_sequence()
        policy = make(budget)
        for step in range(steps + 1):
            n = prompt_len if step == 0 else 1
            slots = cache.reserve(s, n)
            position = torch.arange(n) + (0 if step == 0 else prompt_len + step - 1)  # [n]
            for layer in range(2):
                k = torch.randn(n, 2, 4, generator=gen) * (1 + torch.rand(n, 1, 1, generator=gen) * 3)  # [n, Hkv, D]
                v = torch.randn(n, 2, 4, generator=gen) * (1 + torch.rand(n, 1, 1, generator=gen) * 3)
                k[:, 0, 0] = position.float()  # the token's position, readable back from the pages
                cache.write(layer, slots, k, v)
            (policy.after_prefill if step == 0 else policy.after_append)(cache, s)
            yield ("prefill" if step == 0 else "decode", step, cache, s, int(position[-1]))

    def kept(cache, s):
        return [int(x) for x in cache.gather(0, s)[0][:, 0, 0].round().tolist()]

    for case, prompt_len in enumerate(prompts, start=1):
        gen, twin = torch.Generator().manual_seed(seed + case), torch.Generator().manual_seed(seed + case)
        ref_run = run(lambda c: make_policy(reference, c), prompt_len, twin) if reference else None
        try:
            for _, step, cache, s, newest in run(factory, prompt_len, gen):
                where = (
                    f"budget={budget}, page_size={page_size}, prompt of {prompt_len} tokens, "
                    f"after {'the prefill' if step == 0 else f'decode step {step}'}"
                )
                held, positions = cache.pages(s), kept(cache, s)
                limit = max_pages_held(budget, page_size)
                problem = None
                if len(held) > limit:
                    problem = (
                        f"<= {limit} pages held",
                        f"{len(held)} pages ({cache.seq_len(s)} tokens)",
                        "evict whole pages until at most ceil(budget / page_size) + 1 are held",
                    )
                elif cache.allocator.num_free + len(held) != pool:
                    problem = (
                        f"{pool - len(held)} free pages (pool {pool} - {len(held)} held)",
                        f"{cache.allocator.num_free} free",
                        "give evicted pages back to the allocator (cache.drop_pages / cache.compact do)",
                    )
                elif positions != sorted(set(positions)) or not positions or positions[-1] != newest:
                    problem = (
                        f"kept positions increasing and ending with the newest token {newest}",
                        f"{positions[:8]}{' ...' if len(positions) > 8 else ''} (last {positions[-1:]})",
                        "never evict the token just written; keep the kept tokens in their original order",
                    )
                elif ref_run is not None:
                    _, _, ref_cache, ref_s, _ = next(ref_run)
                    want = kept(ref_cache, ref_s)
                    if want != positions:
                        gone = sorted(set(want) - set(positions))[:6]
                        problem = (
                            f"the tokens {reference!r} keeps: {want[:10]} ...",
                            f"{positions[:10]} ... (you dropped {gone} which it keeps)",
                            "evict the page with the lowest mean score among those not protected",
                        )
                if problem is not None:
                    return CheckReport(name, False, case, Failure(where, *problem))
        except NotImplementedError:
            return CheckReport(name, False, case, not_implemented=True)
        except Exception as error:
            return CheckReport(
                name,
                False,
                case,
                Failure(
                    f"budget={budget}, page_size={page_size}, prompt of {prompt_len} tokens",
                    "no exception",
                    f"{type(error).__name__}: {error}",
                    "the hooks take (cache, seq_id); evict with cache.drop_pages(seq_id, logical_pages)",
                ),
            )
    return CheckReport(name, True, len(prompts))
