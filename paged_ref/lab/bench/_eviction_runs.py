"""The eviction benchmark's engine: one sequence per (policy, budget), forked from one prefilled prompt,
in the batches (`Group`) `policy_groups` makes; a `Batch` decodes them together, one `PagedSession` forward a step."""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

import torch

from ..._arith import cdiv
from ...cache import PagedKVCache
from ...eviction import make_policy, max_pages_held, token_scores
from ...hf import PagedSession
from ...layered_cache import LayeredKVCache
from ..likelihood import prompt_kv

PER_LAYER = ("paged_eviction_per_layer", "paged_eviction_literal_per_layer")  # a LayeredKVCache of their own
TOKEN_LEVEL = ("token_topk", "token_inverse_key_norm")  # act after every token: a batch of their own
_SCORES = ["inverse_key_norm", "value_norm", "key_norm", "key_value_ratio", "random"]  # the same page eviction
POLICIES = ["full", "paged_eviction", "paged_eviction_literal", *PER_LAYER, *_SCORES, "streaming_llm", *TOKEN_LEVEL]
# labels that are a policy with options rather than a policy name
VARIANTS = {
    "token_inverse_key_norm": ("token_topk", {"method": "inverse_key_norm"}),
    "paged_eviction_per_layer": ("paged_eviction", {"decision": "per_layer"}),
    "paged_eviction_literal_per_layer": ("paged_eviction_literal", {"decision": "per_layer"}),
}


def policy_runs(budgets, exclude=(), only=None, policies=POLICIES):
    """(label, policy name, budget) for every policy and budget; the full cache once."""
    names = [n for n in policies if n not in exclude and (only is None or n in only)]
    out = [("full", "full", None)] if "full" in names else []
    out += [(label, VARIANTS.get(label, (label, {}))[0], c) for c in budgets for label in names if label != "full"]
    return out


class Group(NamedTuple):
    """Sequences that decode together in one cache of their own: ``runs`` (label, policy, budget) at
    ``page_size``; ``per_layer``: a `LayeredKVCache`; ``kv_format``: the cache's (None: floating pages;
    a `paged_ref.quant.KVFormat`; or a function of the prompt ``[n]`` returning one, e.g. scales
    calibrated on it); ``cache``: the cache class instead of `PagedKVCache` (a lab variant of it)."""

    page_size: int
    runs: list
    per_layer: bool = False
    kv_format: Any = None
    cache: type | None = None


def policy_groups(budgets, page_sizes, policies=POLICIES, kv_format=None) -> list[Group]:
    """A `Group` for each batch that decodes together; the token-level policies at the first page size only."""
    out = []
    for ps in page_sizes:
        out.append(
            Group(ps, policy_runs(budgets, exclude=TOKEN_LEVEL + PER_LAYER, policies=policies), False, kv_format)
        )
        out.append(Group(ps, policy_runs(budgets, only=PER_LAYER, policies=policies), True, kv_format))
    out.append(Group(page_sizes[0], policy_runs(budgets, only=TOKEN_LEVEL, policies=policies), False, kv_format))
    return [g for g in out if g.runs]


def pool_pages(runs, page_size, longest):
    """Pages for all sequences at their bound plus one prompt held whole before its eviction."""
    need = sum(cdiv(longest, page_size) + 1 if c is None else max_pages_held(c, page_size) for _, _, c in runs)
    return need + cdiv(longest, page_size) + 1


def prefilled_root(
    model, prompt: torch.Tensor, page_size: int, num_pages: int, per_layer: bool, kv_format=None, cache=None
):
    """``(session, root)``: an open session (sdpa) over a fresh cache (a `LayeredKVCache` for
    per-layer policies; ``kv_format`` and ``cache`` as a `Group`'s) holding ``prompt: [n]`` in a
    sequence without a policy, to fork from."""
    cls = cache or (LayeredKVCache if per_layer else PagedKVCache)
    fmt = kv_format(prompt) if callable(kv_format) else kv_format
    kv = cls.for_model(model, num_pages=num_pages, page_size=page_size, **({} if fmt is None else {"kv_format": fmt}))
    session = PagedSession(model, kv_cache=kv, backend="sdpa").open()
    root = session.add()
    session.extend([root], [prompt])
    return session, root


class Batch:
    """One sequence per (policy, budget), forked from a prefilled prompt, decoding together."""

    def __init__(self, session: PagedSession, root: int, runs, kv_format=None):
        self.session, self.cache, self.runs = session, session.kv, runs
        # rows name a cache's format: a `Group`'s kv_format label (or the KVFormat itself), its cache's label
        self.format_label = None if kv_format is None else str(getattr(kv_format, "label", kv_format))
        self.policies = [make_policy(name, c, **VARIANTS.get(label, (label, {}))[1]) for label, name, c in runs]
        self.seqs = [session.fork(root, eviction=p) for p in self.policies]  # after_prefill runs here

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens: [batch]`` (one per sequence); returns log-probs ``[batch, vocab]``."""
        return self._extend(list(tokens[:, None]))[:, 0]

    def feed(self, tokens: torch.Tensor, max_chunk: int = 16):
        """Feed the same ``tokens: [n]`` to every sequence, in chunks no policy must act inside.

        Yields ``(offset, log-probs [batch, m, vocab])`` per chunk of ``m`` tokens.
        """
        i = 0
        while i < tokens.numel():
            room = min(p.tokens_until_action(self.cache, s) for s, p in zip(self.seqs, self.policies))
            m = min(tokens.numel() - i, max_chunk, room)
            yield i, self._extend([tokens[i : i + m]] * len(self.seqs))
            i += m

    def _extend(self, tokens: list[torch.Tensor]) -> torch.Tensor:
        logits = self.session.extend(self.seqs, tokens, all_logits=True)  # batch x [m, vocab]; hooks ran
        return torch.log_softmax(torch.stack(logits), dim=-1)  # [batch, m, vocab]

    def region_held(self, i: int, region) -> float:
        """Share of the original tokens ``region[0] .. region[1]-1`` sequence ``i`` holds now."""
        lo, hi = region
        pos = self.policies[i].positions(self.seqs[i]).reshape(-1, self.cache.seq_len(self.seqs[i]))  # [lanes, n]
        return float(((pos >= lo) & (pos < hi)).sum()) / (pos.shape[0] * (hi - lo))

    def row(self, i):
        s, st = self.seqs[i], self.policies[i].stats(self.seqs[i])
        label, _, c = self.runs[i]
        return dict(
            policy=label,
            budget=c,
            page_size=self.cache.page_size,
            tokens_held=self.cache.seq_len(s),
            pages_held=len(self.cache.pages(s)),
            max_pages_held=st.max_pages_held,
            page_bound=None if c is None else max_pages_held(c, self.cache.page_size),
            page_bytes=self.cache.page_bytes,
            kv_bytes_held=len(self.cache.pages(s)) * self.cache.page_bytes,
            tokens_evicted=st.tokens_evicted,
            pages_dropped=st.pages_dropped,
            tokens_moved=st.tokens_moved,
            max_holes_per_page=round(st.max_holes_per_page, 4),
            **({} if self.format_label is None else {"kv_format": self.format_label}),
        )

    def close(self):
        for s in self.seqs:
            self.session.finish(s)  # frees its pages and releases it from its policy


def close_session(session: PagedSession) -> None:
    """Close ``session`` (finishing every sequence it holds) and check that every page came back."""
    session.close()
    assert session.kv.allocator.num_free == session.kv.allocator.num_pages


def prefilled_batch(
    model, prompt: torch.Tensor, runs, page_size: int, longest: int, per_layer: bool, kv_format=None, cache=None
) -> Batch:
    """A session of its own holding ``prompt`` once, forked into one sequence per run."""
    pages = pool_pages(runs, page_size, longest)
    session, root = prefilled_root(model, prompt, page_size, pages, per_layer, kv_format, cache)
    batch = Batch(session, root, runs, kv_format if cache is None else getattr(cache, "label", cache.__name__))
    session.finish(root)  # the forks keep the prompt's pages they still share
    return batch


def lowest_ratio_tokens(model, tok, ids, count: int = 25) -> dict:
    """Which tokens the layer-averaged ||V||/||K|| ranks lowest in one text (what the literal
    PagedEviction evicts first), and where the first token (the attention sink) ranks."""
    ks, vs = prompt_kv(model, ids)  # what the paged cache holds for the text
    score = torch.stack([token_scores(k, v) for k, v in zip(ks, vs)]).mean(0)  # [n], as sequence_scores
    order = torch.argsort(score, stable=True)  # lowest first
    lowest = [dict(position=int(i), token=tok.decode(ids[i : i + 1]), score=float(score[i])) for i in order[:count]]
    return dict(
        tokens=int(ids.numel()),
        lowest=lowest,
        lowest_token_counts=dict(Counter(r["token"] for r in lowest).most_common()),  # ties: first seen first
        first_token_rank=int((score < score[0]).sum()),  # 0 = the lowest of the text
        median_score=float(score.median()),
    )


def group_batch(model, prompt: torch.Tensor, group: Group, longest: int) -> Batch:
    """`prefilled_batch` for a `Group`: its runs in a cache of its own, ``longest`` tokens at most."""
    g = group
    return prefilled_batch(model, prompt, g.runs, g.page_size, longest, g.per_layer, g.kv_format, g.cache)
