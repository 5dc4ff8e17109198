"""Scripted workloads for a paged KV cache: a list of steps as data, and a player that runs them.

A scenario is a tuple of :class:`Step` values -- ``add`` (a new request and the prefill of its
prompt), ``grow`` (decode more tokens), ``fork`` (a second sequence sharing the first's pages,
as in parallel sampling or beam search) and ``finish`` (the request leaves and its pages go
back). Steps name sequences ("A", "B", ...) instead of cache ids, so the same script runs on
caches with any page size and the notebook can talk about "request A".

:class:`ScenarioPlayer` applies the steps to a :class:`~paged_ref.cache.PagedKVCache` and
writes every token's K and V, encoded so that a token's value says which token it is
(``token_id * 1024 + position``). That makes the cache checkable at every step:
:meth:`ScenarioPlayer.check` compares each sequence's ``gather`` with a plain list of its token
ids -- after forks, copy-on-write and prefix-cache hits alike.

Example:
    >>> from paged_ref.cache import PagedKVCache
    >>> cache = PagedKVCache(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=1)
    >>> player = ScenarioPlayer(cache)
    >>> for step in (add("A", 6), fork("B", "A"), grow("A", 1), finish("B")):
    ...     _ = player.apply(step)
    >>> cache.pages(player.seq_id("A")), player.tokens["A"]
    ([0, 2], [8192, 8193, 8194, 8195, 8196, 8197, 8198])
    >>> player.check()
"""

from __future__ import annotations

import numbers
import random
from dataclasses import dataclass

import torch

from .._validate import check_choice, check_int

OPS = ("add", "grow", "fork", "finish")
VALUE_BASE = 1024  # a token's K value is token_id * VALUE_BASE + position
MAX_PROMPT_ID = 8192  # explicit prompt ids lie in [0, MAX_PROMPT_ID)
FIRST_FRESH_ID = 8192  # ids the player invents (counted prompts, decoded tokens): 8192, 8193, ...
# float32 holds token_id * VALUE_BASE + position exactly while it stays below 2**24, i.e. for ids
# below 16384 and positions below 1024: thousands of invented tokens, far more than any story here.


@dataclass(frozen=True)
class Step:
    """One cache operation of a scenario.

    Args:
        op: ``"add"``, ``"grow"``, ``"fork"`` or ``"finish"``.
        seq: the name of the sequence the step acts on (for ``fork``: the new sequence).
        prompt: ``add`` only: the prompt's token ids, each in ``[0, MAX_PROMPT_ID)``; leave
            empty and give ``num_tokens`` for a prompt of fresh ids no other prompt shares.
        num_tokens: ``grow``: how many tokens to decode; ``add`` without ``prompt``: the
            prompt's length.
        parent: ``fork`` only: the sequence whose pages the new one shares.
    """

    op: str
    seq: str
    prompt: tuple[int, ...] = ()
    num_tokens: int = 0
    parent: str | None = None

    def __post_init__(self):
        check_choice("op", self.op, set(OPS))
        if not isinstance(self.seq, str) or not self.seq:
            raise ValueError(f"seq must be a non-empty name, got {self.seq!r}")
        if self.op == "add" and self.prompt:
            bad = [t for t in self.prompt if not 0 <= t < MAX_PROMPT_ID]
            if bad:
                raise ValueError(f"add {self.seq}: prompt ids must be in [0, {MAX_PROMPT_ID}), got {bad[:3]}")
        elif self.op in ("add", "grow"):
            check_int("num_tokens", self.num_tokens, min_value=1)
        if self.op == "fork" and not isinstance(self.parent, str):
            raise ValueError(f"fork {self.seq}: parent must name a sequence, got {self.parent!r}")

    @property
    def prompt_len(self) -> int:
        """``add``: the number of prompt tokens (explicit or counted)."""
        return len(self.prompt) or self.num_tokens

    def describe(self) -> str:
        """A short caption such as ``"add A (19-token prompt)"``."""
        if self.op == "add":
            return f"add {self.seq} ({self.prompt_len}-token prompt)"
        if self.op == "grow":
            return f"grow {self.seq} by {self.num_tokens} token{'s' * (self.num_tokens != 1)}"
        if self.op == "fork":
            return f"fork {self.seq} from {self.parent}"
        return f"finish {self.seq}"


def add(seq: str, prompt) -> Step:
    """A new request ``seq`` and its prefill: ``prompt`` is a token count or a list of token ids.

    A count ``n`` asks the player for ``n`` fresh token ids that no other prompt shares (so no
    prefix-cache hit); explicit ids (each in ``[0, MAX_PROMPT_ID)``) let prompts share prefixes.
    """
    if isinstance(prompt, numbers.Integral) and not isinstance(prompt, bool):
        return Step("add", seq, num_tokens=check_int("prompt", prompt, min_value=1))
    prompt = tuple(check_int("prompt[i]", t) for t in prompt)
    if not prompt:
        raise ValueError(f"add {seq}: prompt must be a positive count or a non-empty list of ids, got []")
    return Step("add", seq, prompt=prompt)


def grow(seq: str, num_tokens: int = 1) -> Step:
    """Decode ``num_tokens`` more tokens of ``seq``."""
    return Step("grow", seq, num_tokens=num_tokens)


def fork(seq: str, parent: str) -> Step:
    """A new sequence ``seq`` that shares ``parent``'s pages (copy-on-write later)."""
    return Step("fork", seq, parent=parent)


def finish(seq: str) -> Step:
    """``seq`` is done: its pages lose one reference each."""
    return Step("finish", seq)


class ScenarioPlayer:
    """Applies :class:`Step` s to a cache and remembers which tokens each sequence holds.

    Args:
        cache: a :class:`~paged_ref.cache.PagedKVCache` (any page size; K/V values are written
            in its dtype, so use float32 or float64 for :meth:`check` to be exact).

    Attributes:
        tokens: name -> token ids the sequence holds, in order (the plain model of the cache).
        history: the steps applied so far.
    """

    def __init__(self, cache):
        self.cache = cache
        self.tokens: dict[str, list[int]] = {}
        self.history: list[Step] = []
        self._ids: dict[str, int] = {}
        self._next_fresh_id = FIRST_FRESH_ID

    def seq_id(self, name: str) -> int:
        """The cache's id of the live sequence ``name``."""
        if name not in self._ids:
            raise ValueError(f"no live sequence named {name!r} (live: {sorted(self._ids)})")
        return self._ids[name]

    @property
    def names(self) -> dict[int, str]:
        """Cache seq_id -> name, for every live sequence."""
        return {i: n for n, i in self._ids.items()}

    def apply(self, step: Step) -> torch.Tensor | None:
        """Run one step; returns the slots written (``add``/``grow``), else None.

        A step that fails (unknown name, pool exhausted) raises and leaves the player and every
        sequence as they were (a failed ``add`` may still have used up a cache seq_id and, with
        prefix caching, counted its hits in ``cache.prefix_hits``).
        """
        if not isinstance(step, Step):
            raise TypeError(f"step must be a Step, got {type(step).__name__}")
        cache, name = self.cache, step.seq
        if step.op in ("add", "fork") and name in self._ids:
            raise ValueError(f"{step.op} {name}: a live sequence is already called {name!r}")
        slots = None
        if step.op == "add":
            prompt = list(step.prompt) or self._fresh_ids(step.num_tokens)
            seq_id = cache.add_sequence(token_ids=prompt)
            held = cache.seq_len(seq_id)  # > 0 when cached prefix pages were reused
            try:
                slots = self._write(seq_id, prompt[held:], start=held)
            except Exception:
                cache.free(seq_id)
                raise
            self._next_fresh_id += 0 if step.prompt else step.num_tokens
            self._ids[name], self.tokens[name] = seq_id, prompt
        elif step.op == "grow":
            seq_id = self.seq_id(name)
            ids = self._fresh_ids(step.num_tokens)
            slots = self._write(seq_id, ids, start=cache.seq_len(seq_id))
            self._next_fresh_id += step.num_tokens
            self.tokens[name].extend(ids)
        elif step.op == "fork":
            self._ids[name] = cache.fork(self.seq_id(step.parent))
            self.tokens[name] = list(self.tokens[step.parent])
        else:  # finish
            cache.free(self.seq_id(name))
            del self._ids[name], self.tokens[name]
        self.history.append(step)
        return slots

    def run(self, steps) -> None:
        """Apply every step in order."""
        for step in steps:
            self.apply(step)

    def check(self) -> None:
        """Raise AssertionError unless every live sequence gathers exactly its tokens' values.

        Also runs the allocator's invariant check.
        """
        self.cache.allocator.check()
        for name, seq_id in self._ids.items():
            ids = self.tokens[name]
            assert self.cache.seq_len(seq_id) == len(ids), f"{name}: length {self.cache.seq_len(seq_id)} != {len(ids)}"
            want = token_values(ids, 0, self.cache.dtype)  # [seq_len]
            for layer in range(self.cache.num_layers):
                k, v = self.cache.gather(layer, seq_id)  # [seq_len, num_kv_heads, head_dim]
                want_kv = want.view(-1, 1, 1).expand(k.shape)  # every head and channel holds it
                assert torch.equal(k.cpu(), want_kv), f"{name}: K of layer {layer} differs"
                assert torch.equal(v.cpu(), -want_kv), f"{name}: V of layer {layer} differs"

    def _fresh_ids(self, n: int) -> list[int]:
        """The next ``n`` invented token ids (the counter moves only once the step succeeded)."""
        return list(range(self._next_fresh_id, self._next_fresh_id + n))

    def _write(self, seq_id: int, ids: list[int], *, start: int) -> torch.Tensor:
        cache = self.cache
        slots = cache.reserve(seq_id, len(ids), token_ids=ids)
        val = token_values(ids, start, cache.dtype).to(cache.device)  # [num_tokens]
        k = val.view(-1, 1, 1).expand(-1, cache.num_kv_heads, cache.head_dim).contiguous()  # [num_tokens, H, D]
        for layer in range(cache.num_layers):
            cache.write(layer, slots, k, -k)
        return slots


def token_values(ids, start: int, dtype=torch.float32) -> torch.Tensor:
    """The K value written for tokens ``ids`` at positions ``start, start+1, ...``: ``[len(ids)]``.

    A real model's K at a position depends on the tokens up to it; here it depends on the token
    id and the position, which is enough to tell every token apart and to make a reused prefix
    page hold exactly what a fresh prefill would have written.
    """
    ids_t = torch.as_tensor(list(ids), dtype=torch.float64)
    pos = torch.arange(start, start + len(ids_t), dtype=torch.float64)
    return (ids_t * VALUE_BASE + pos).to(dtype)


def random_scenario(num_seqs: int, seed: int = 0, *, max_prompt: int = 24, max_decode: int = 8) -> tuple[Step, ...]:
    """A small serving story for ``num_seqs`` requests, drawn from ``seed``.

    Requests arrive one by one (prompt lengths 4..``max_prompt``) and decode in interleaved
    rounds (up to ``max_decode`` tokens each), so their pages interleave in memory; the first
    request is forked once it has prefilled (a second sample sharing its prompt pages), and the
    second request finishes early, so later pages reuse its returned pages. Every sequence
    holds at most ``max_prompt + max_decode`` tokens.

    Example:
        >>> [s.describe() for s in random_scenario(2, seed=1)][:4]
        ['add A (8-token prompt)', "fork A' from A", 'grow A by 1 token', "grow A' by 2 tokens"]
    """
    num_seqs = check_int("num_seqs", num_seqs, min_value=1)
    if num_seqs > 26:
        raise ValueError(f"num_seqs must be <= 26 (sequences are named A..Z), got {num_seqs}")
    check_int("seed", seed, min_value=0)
    check_int("max_prompt", max_prompt, min_value=4)
    check_int("max_decode", max_decode, min_value=1)
    rng = random.Random(seed)
    names = [chr(ord("A") + i) for i in range(num_seqs)]
    steps: list[Step] = []
    budget: dict[str, int] = {}  # decode tokens left per request in flight
    for i, name in enumerate(names):
        steps.append(add(name, rng.randint(4, max_prompt)))
        budget[name] = rng.randint(1, max_decode)
        if i == 0:
            steps.append(fork("A'", "A"))
            budget["A'"] = rng.randint(1, max_decode)
        live = [n for n in budget if budget[n] > 0]
        for n in live:  # one decode round over everyone in flight
            t = min(budget[n], rng.randint(1, 3))
            steps.append(grow(n, t))
            budget[n] -= t
        if i == 1:
            steps.append(finish("B"))
            del budget["B"]
    while any(budget.values()):
        for n in [n for n in budget if budget[n] > 0]:
            t = min(budget[n], rng.randint(1, 3))
            steps.append(grow(n, t))
            budget[n] -= t
    return tuple(steps)
