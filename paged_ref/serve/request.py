"""A request in flight, and what the engine hands back when it is done.

While a request is in flight the engine keeps one `Request`: every token it knows (``token_ids``
= prompt + output so far) and how many have been fed to the model (``num_computed``). A step feeds
``token_ids[num_computed : num_computed + n]`` (a prompt chunk, or the token sampled last step);
when ``num_computed`` reaches ``len(token_ids)`` the last logits give the next token. Preemption by
recompute sets ``num_computed`` back to 0; ``high_water`` (the most ever computed) tells what is
recomputed.

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
    """One request's state inside the engine (see the module docstring)."""

    request_id: int  # what `Engine.add_request` returned (0, 1, 2, ... in submission order)
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_s: float  # when the scheduler first sees it, on the engine's clock
    eviction: EvictionPolicy | None = None  # its own KV eviction policy (None: keep every token)
    output_ids: list[int] = field(default_factory=list)
    status: str = PENDING  # PENDING (not arrived), WAITING, RUNNING, SWAPPED or FINISHED
    seq_id: int | None = None  # its sequence in the session while running or swapped
    num_computed: int = 0  # tokens fed since its latest admission (a prefix hit counts its tokens)
    high_water: int = 0  # the most tokens ever computed: feeding below it again is recomputation
    admitted: int = -1  # order of its latest admission (the most recent is preempted first)
    reserved_pages: int = 0  # pages committed on admission ("exact" / "max_len")
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    hook_failures: int = 0  # steps undone because its own eviction hook raised
    error: str | None = None  # why it finished with finish_reason="error"

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by the output so far."""
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """``token_ids[start:stop]`` without building the whole list."""
        p = len(self.prompt_ids)
        return self.prompt_ids[start:stop] + self.output_ids[max(0, start - p) : max(0, stop - p)]

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
    """A finished (or aborted) request; times on the engine's clock (``Engine.stats()["clock"]``)."""

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]  # the output, without the prompt
    finish_reason: str  # "length" (max_new_tokens), "stop" (an EOS token, kept last), "abort" or "error"
    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    ttft_s: float | None  # first_token_s - arrival_s: queueing + prefill
    tpot_s: float | None  # (finish_s - first_token_s) / (len(token_ids) - 1); None with fewer than two tokens
    num_preemptions: int
    error: str | None = None  # why it ended in "error": its eviction hook kept failing (vLLM aborts such a request)
