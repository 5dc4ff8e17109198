"""A request in flight, and what the engine hands back when it is done.

A request is a prompt and a number of tokens to generate. While it is in flight the engine keeps
one `Request`: every token it knows (``token_ids`` = prompt + output so far), how many of them
have been fed to the model (``num_computed``), and where it is (``status``). The engine's whole
bookkeeping is those two numbers: a step feeds ``token_ids[num_computed : num_computed + n]``
(a chunk of the prompt, or the one token sampled last step), and when ``num_computed`` reaches
``len(token_ids)`` the forward's last logits give the next token. Preemption by recompute sets
``num_computed`` back to 0 (prompt and output are prefilled again, and the final logits give the
next new token); ``high_water`` remembers the most tokens ever computed, so every token fed again
below it is counted as recomputed.

Example:
    >>> r = Request(request_id=0, prompt_ids=[5, 6, 7], max_new_tokens=2, arrival_s=0.0)
    >>> r.num_tokens, r.remaining, r.peak_tokens      # the last sampled token is never fed
    (3, 3, 4)
    >>> r.num_computed = 3; r.output_ids.append(9); r.remaining, r.tokens(2, 4)
    (1, [7, 9])
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..eviction.policies import EvictionPolicy

__all__ = ["PENDING", "WAITING", "RUNNING", "SWAPPED", "FINISHED", "Request", "RequestOutput"]

# where a request is: not arrived yet, queued, holding pages, its K/V in host memory, done
PENDING, WAITING, RUNNING, SWAPPED, FINISHED = "pending", "waiting", "running", "swapped", "finished"


@dataclass(eq=False)
class Request:
    """One request's state inside the engine (see the module docstring).

    Attributes:
        request_id: the id `Engine.add_request` returned (0, 1, 2, ... in submission order).
        prompt_ids: the prompt's token ids.
        max_new_tokens: tokens to generate at most.
        arrival_s: when it becomes visible to the scheduler, on the engine's clock.
        eviction: its own KV eviction policy, or None (keep every token).
        output_ids: tokens generated so far.
        status: ``PENDING`` (not arrived), ``WAITING``, ``RUNNING``, ``SWAPPED`` or ``FINISHED``.
        seq_id: its sequence in the engine's session while it has one (running or swapped), else None.
        num_computed: tokens of ``token_ids`` fed to the model since it was (re)admitted; a prefix
            cache hit counts its reused tokens here.
        high_water: the most tokens ever computed: feeding below it again is recomputation.
        admitted: order of its latest admission (larger = more recent: preempted first).
        reserved_pages: pages committed to it on admission (``"exact"``/``"max_len"``), else 0.
        hook_failures: steps undone because its own eviction hook raised.
        error: why it was finished with ``finish_reason="error"`` (its hook kept failing), else None.
    """

    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_s: float
    eviction: EvictionPolicy | None = None
    output_ids: list[int] = field(default_factory=list)
    status: str = PENDING
    seq_id: int | None = None
    num_computed: int = 0
    high_water: int = 0
    admitted: int = -1
    reserved_pages: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    hook_failures: int = 0
    error: str | None = None

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by the output so far."""
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """``token_ids[start:stop]`` without building the whole list."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - p) : stop - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next token can be sampled (1 while decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def peak_tokens(self) -> int:
        """Tokens whose K/V the request holds at most: prompt + max_new_tokens - 1 (the last
        sampled token is never fed back)."""
        return len(self.prompt_ids) + self.max_new_tokens - 1

    def output(self) -> RequestOutput:
        """The finished request as a `RequestOutput`."""
        ttft = tpot = None
        if self.first_token_s is not None:
            ttft = self.first_token_s - self.arrival_s
            if len(self.output_ids) > 1:
                tpot = (self.finish_s - self.first_token_s) / (len(self.output_ids) - 1)
        return RequestOutput(
            request_id=self.request_id,
            prompt_ids=list(self.prompt_ids),
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            arrival_s=self.arrival_s,
            first_token_s=self.first_token_s,
            finish_s=self.finish_s,
            ttft_s=ttft,
            tpot_s=tpot,
            num_preemptions=self.num_preemptions,
            error=self.error,
        )


@dataclass(frozen=True)
class RequestOutput:
    """A finished (or aborted) request. Times are on the engine's clock (``Engine.stats()["clock"]``).

    Attributes:
        request_id: as returned by `Engine.add_request`.
        prompt_ids: the prompt.
        token_ids: the generated tokens (the prompt not included).
        finish_reason: ``"length"`` (``max_new_tokens`` reached), ``"stop"`` (an EOS token, kept as
            the last token), ``"abort"`` (`Engine.abort`) or ``"error"`` (its eviction hook kept
            failing: ``error`` says how; vLLM aborts such a request).
        arrival_s, first_token_s, finish_s: when it arrived, got its first token, finished
            (first_token_s None if it never got one).
        ttft_s: time to first token, ``first_token_s - arrival_s`` (queueing + prefill).
        tpot_s: time per output token after the first, ``(finish_s - first_token_s) /
            (len(token_ids) - 1)``; None with fewer than two tokens.
        num_preemptions: how often it was preempted (recomputed or swapped out).
        error: with ``finish_reason="error"``, the exception that finished it; else None.
    """

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    num_preemptions: int
    error: str | None = None
