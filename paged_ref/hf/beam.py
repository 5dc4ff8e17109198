"""Beam search over forked pages: the beams of a prompt share every page they have in common.

Beam search keeps, per prompt, the ``k = num_beams`` most likely continuations (beams). Each step
the ``2k`` best (beam, token) pairs by summed log-probability are ranked; the ``k`` best that do
not end become the next beams, and one that ends (EOS, or the length limit) is a finished
hypothesis, scored ``sum of log-probs / generated_length ** length_penalty``. The selection is
transformers' own (``GenerationMixin._beam_search``), tensor for tensor: ``model.generate(num_beams=k)``
returns the same tokens and scores.

What changes is the cache. transformers gathers every beam's contiguous cache into the new beam
order each step (``reorder_cache``). Here each beam is a sequence of a `PagedKVCache`; after each
selection a beam no next beam continues is **cut** (`PagedSession.finish`: its pages go back, or
lose a reference); one continued once **keeps** its pages; one continued by several is **forked**
(the children share its pages; the first token a child writes into the shared partial last page
copies that one page, copy-on-write). So k beams over a 512-token prompt hold its pages once, plus
a few pages each. `BeamStep` records every step's pages for the page maps of notebook 08.

Example:
    >>> import torch
    >>> from paged_ref.models import tiny_llama
    >>> model = tiny_llama()
    >>> ids = torch.tensor([[1, 7, 9, 4, 3]])
    >>> out = beam_search(model, ids, num_beams=3, max_new_tokens=6, page_size=4)
    >>> theirs = model.generate(ids, num_beams=3, max_new_tokens=6, do_sample=False,
    ...                         output_scores=True, return_dict_in_generate=True)
    >>> torch.equal(out.sequences, theirs.sequences)
    True
    >>> bool((out.sequences_scores - theirs.sequences_scores).abs().max() < 1e-4)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from .decoding import Decoding, resolve
from .inputs import Prepared, prepare

__all__ = ["BeamStep", "BeamSearchOutput", "beam_search", "run_beam_search"]

NEG = -1.0e9  # transformers' "impossible" score (finite, so that sums stay ordered)


@dataclass(frozen=True)
class BeamStep:
    """One step of a beam search, as plain data (what `beam_search` passes to its callback).

    Attributes:
        step: the forward it follows: 0 is the prefill, ``s`` feeds the ``s``-th generated token.
        pages: running beam (its sequence id) -> its physical pages after this forward.
        copied: beam -> pages it received by copy-on-write in this forward (the cache's ``last_copies``).
        tokens, parents: LongTensor ``[batch, num_beams]``: the token each next beam appends and the
            index of the beam it continues.
        cut: beams no next beam continues, freed here.
        released: beams freed because their prompt is done or the search ends here.
        freed: physical pages that went back to the pool when those beams were freed.
        forked: new beam -> the beam it was forked from.
        beams: ``[batch][num_beams]`` sequence ids of the next beams (``[]`` for a prompt that is done).
        finished: finished hypotheses kept so far, per prompt.
    """

    step: int
    pages: dict[int, list[int]]
    copied: dict[int, list[int]]
    tokens: torch.Tensor
    parents: torch.Tensor
    cut: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    forked: dict[int, int] = field(default_factory=dict)
    beams: list[list[int]] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)

    @property
    def pages_held(self) -> int:
        """Distinct physical pages the running beams held after this forward."""
        return len({p for pages in self.pages.values() for p in pages})


@dataclass(frozen=True)
class BeamSearchOutput:
    """What `beam_search` returns.

    Attributes:
        sequences: LongTensor ``[batch * num_return_sequences, prompt_len + generated]``, each prompt's
            best finished hypotheses, best first, filled as ``model.generate`` fills them.
        sequences_scores: float32 ``[batch * num_return_sequences]``, their scores.
        pages_held: distinct pages the running beams held after each forward.
        copies: pages copied on write, over the whole search.
    """

    sequences: torch.Tensor
    sequences_scores: torch.Tensor
    pages_held: list[int]
    copies: int


def beam_search(
    model,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    num_beams: int | None = None,
    num_return_sequences: int | None = None,
    length_penalty: float | None = None,
    early_stopping: bool | str | None = None,
    callback: Callable[[int, BeamStep], None] | None = None,
    progress: bool = False,
    **options,
) -> BeamSearchOutput:
    """``model.generate(num_beams=k, do_sample=False)``'s tokens and scores, from a paged cache.

    Args:
        num_beams: beams per prompt (>= 2; None: the model's ``generation_config``).
        num_return_sequences: hypotheses returned per prompt (<= num_beams; default 1).
        length_penalty: exponent of the generated length dividing a finished beam's log-probability
            (default 1.0; > 0 favours longer sequences).
        early_stopping: ``True``, ``False`` (default) or ``"never"``, as in transformers.
        callback: ``callback(step, beam_step)`` after each step's selection (`BeamStep`).
        progress: show a tqdm bar over the steps.
        The other arguments are `paged_ref.hf.generate`'s.

    Raises:
        TypeError / ValueError: bad arguments (the message names the argument); nothing is allocated.
        paged_ref.OutOfPagesError: the page pool ran out (every page is freed again).
    """
    decoding = resolve(
        model,
        num_beams=num_beams,
        num_return_sequences=num_return_sequences,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        do_sample=False,
    )
    if decoding.num_beams < 2:
        raise ValueError(f"num_beams must be >= 2 for beam search, got {decoding.num_beams}")
    return run_beam_search(model, input_ids, decoding, max_new_tokens, callback=callback, progress=progress, **options)


def run_beam_search(
    model, input_ids, decoding: Decoding, max_new_tokens, *, callback=None, progress=False, **options
) -> BeamSearchOutput:
    """`beam_search` with its decoding arguments resolved (also `generate`'s beam path)."""
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable, got {type(callback).__name__}")
    prepared = prepare(model, input_ids, decoding.num_beams, max_new_tokens=max_new_tokens, **options)
    from tqdm.auto import tqdm

    with (
        prepared.session,
        tqdm(total=max_new_tokens, disable=not progress, desc="paged beam search", unit="tok") as bar,
    ):
        out = _search(prepared, input_ids.to(prepared.session.kv.device), decoding, callback, bar)
    return replace(out, sequences=out.sequences.to(input_ids.device))


def _search(prepared: Prepared, input_ids, decoding, callback, bar) -> BeamSearchOutput:
    """The beams' pages follow transformers' selection (`_Selection`) step by step: one prefill per
    prompt, then per step the selection, the pages following it (`_follow_selection`), one decode
    forward (`_feed`)."""
    session, prompts, eos, pad, namespaces, max_new_tokens = prepared
    k = decoding.num_beams
    selection = _Selection(input_ids, decoding, eos, pad, max_new_tokens)
    # one sequence per prompt, prefilled once: its k beams start as that one sequence
    roots = [session.add(namespace=ns) for ns in namespaces]
    logits = session.extend(roots, prompts).repeat_interleave(k, dim=0)  # [batch * k, vocab], transformers' rows
    beams, pages, copied = [[root] * k for root in roots], {s: session.kv.pages(s) for s in roots}, {}
    pages_held, copies = [], 0
    for step in range(max_new_tokens):
        pages_held.append(len({p for held in pages.values() for p in held}))
        tokens, parents, done = selection.step(logits)
        bar.update(1)
        moves = _follow_selection(session, beams, parents.tolist(), done)
        if callback is not None:
            finished = selection.is_finished.sum(dim=1).tolist()
            beam_step = BeamStep(step, pages, copied, tokens.clone(), parents.clone(), finished=finished, **moves)
            callback(step, beam_step)
        beams = moves["beams"]
        if not any(beams):
            break
        logits, pages, copied = _feed(session, beams, tokens)
        copies += sum(len(c) for c in copied.values())
    sequences, scores = selection.best(decoding.num_return_sequences)
    return BeamSearchOutput(sequences, scores, pages_held, copies)


class _Selection:
    """transformers' beam selection (``GenerationMixin._beam_search``), tensor for tensor: per prompt
    the ``k`` running beams and the ``k`` best finished hypotheses, ``[batch, k, ...]`` each."""

    def __init__(self, input_ids: torch.Tensor, decoding: Decoding, eos: torch.Tensor, pad: int, max_new_tokens: int):
        device, (batch, self.width), k = input_ids.device, input_ids.shape, decoding.num_beams
        self.decoding, self.eos, self.k = decoding, eos, k
        self.cur_len, self.max_length = self.width, self.width + max_new_tokens
        self.keep = max(2, 1 + eos.numel()) * k  # candidates per prompt: 2k (more with several EOS ids)
        fill = pad if pad != 0 else (int(eos[0]) if eos.numel() else pad)  # model.generate's fill value
        self.running = torch.full((batch, k, self.max_length), fill, dtype=torch.long, device=device)
        self.running[:, :, : self.width] = input_ids[:, None, :]  # [batch, k, max_length]
        self.running_scores = torch.zeros(batch, k, device=device)  # [batch, k]
        self.running_scores[:, 1:] = NEG  # step 0: the k rows are one prompt; only beam 0's candidates count
        self.finished = self.running.clone()  # [batch, k, max_length]
        self.finished_len = torch.zeros(batch, k, dtype=torch.long, device=device)  # generated lengths
        self.finished_scores = torch.full((batch, k), NEG, device=device)
        self.is_finished = torch.zeros(batch, k, dtype=torch.bool, device=device)
        self.can_improve = torch.ones(batch, 1, dtype=torch.bool, device=device)  # per prompt

    def step(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
        """Select from ``logits: [batch * k, vocab]``; returns the token each next beam appends and
        the beam it continues (``[batch, k]`` each), and per prompt whether it is done."""
        batch, k, width, cur_len = self.running.shape[0], self.k, self.width, self.cur_len
        penalty, early_stopping = self.decoding.length_penalty, self.decoding.early_stopping
        vocab = logits.shape[-1]
        log_probs = torch.log_softmax(logits, dim=-1).view(batch, k, vocab) + self.running_scores[:, :, None]
        top_scores, top_index = torch.topk(log_probs.view(batch, k * vocab), k=self.keep)  # [batch, keep]
        top_beam, top_token = top_index // vocab, top_index % vocab
        top_running = self.running.gather(1, top_beam[:, :, None].expand(-1, -1, self.max_length)).clone()
        top_running[:, :, cur_len] = top_token
        hits = torch.isin(top_token, self.eos) | (cur_len + 1 >= self.max_length)  # [batch, keep]: ends here

        # the next running beams: the k best candidates that do not end
        running_candidates = top_scores + hits.to(torch.float32) * NEG
        nxt = torch.topk(running_candidates, k=k)[1]  # [batch, k]
        self.running = _gather(top_running, nxt)
        self.running_scores = _gather(running_candidates, nxt)
        parents = _gather(top_beam, nxt)  # [batch, k]

        # the k best finished hypotheses so far (only the k best candidates may finish), length-penalized
        just_finished = hits & (torch.arange(self.keep, device=hits.device) < k)[None, :]
        scores = top_scores / ((cur_len + 1 - width) ** penalty)
        scores += (self.is_finished.all(dim=-1, keepdim=True) & (early_stopping is True)).to(torch.float32) * NEG
        scores += (~self.can_improve).to(torch.float32) * NEG
        scores += (~just_finished) * NEG
        best = torch.topk(torch.cat((self.finished_scores, scores), dim=1), k=k)[1]  # [batch, k]
        self.finished = _gather(torch.cat((self.finished, top_running), dim=1), best)
        self.finished_scores = _gather(torch.cat((self.finished_scores, scores), dim=1), best)
        new_len = torch.full_like(top_beam, cur_len + 1 - width)
        self.finished_len = _gather(torch.cat((self.finished_len, new_len), dim=1), best)
        self.is_finished = _gather(torch.cat((self.is_finished, just_finished), dim=1), best)

        self.cur_len = cur_len = cur_len + 1
        # transformers' early-stop heuristic: can the best running beam still beat the worst finished one?
        best_length = self.max_length - width if early_stopping == "never" and penalty > 0.0 else cur_len - width
        best_running = self.running_scores[:, :1] / (best_length**penalty)  # [batch, 1]
        worst = torch.where(self.is_finished, torch.min(self.finished_scores, dim=1, keepdim=True)[0], NEG)
        self.can_improve &= torch.any(best_running > worst, dim=-1, keepdim=True)
        stop = not (
            bool(self.can_improve.any())
            and not (bool(self.is_finished.all()) and early_stopping is True)
            and not bool(hits.all())
        )
        done = [stop or not bool(self.can_improve[b]) for b in range(batch)]  # nothing it runs can change its result
        return self.running[:, :, cur_len - 1], parents, done

    def best(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``n`` best finished hypotheses of each prompt, ``[batch * n, width + longest]``, and their scores."""
        out_len = self.width + int(self.finished_len[:, :n].max())
        return self.finished[:, :n, :out_len].reshape(-1, out_len), self.finished_scores[:, :n].reshape(-1)


def _follow_selection(session, beams: list[list[int]], parents: list[list[int]], done: list[bool]) -> dict:
    """The pages follow one selection: each running beam is cut, kept or forked, then the beams left
    behind are freed. ``beams[b][j]``: prompt ``b``'s beam ``j`` (``[]`` once the prompt is done);
    ``parents[b][j]``: the beam next beam ``j`` continues; ``done[b]``: prompt ``b``'s beams are released.

    Fork before free (the order vLLM's scheduler keeps): a fork adds a reference to each page of its
    source, a free removes one. Forking first, a page a next beam needs carries that beam's reference
    before any old beam lets go of it, so it never drops to zero: it is never returned to the pool
    (zeroed, handed out) while a next beam still needs its K/V. The first child keeps its parent's
    sequence (a fork followed by a free, done as nothing). All frees come before the next forward, so
    its reservation sees only running beams' references and copies just the pages two of them share
    (the partial last page of a beam continued more than once).

    Returns the `BeamStep` fields it decides: ``cut``, ``released``, ``forked``, ``freed``, ``beams``.
    """
    kv, k = session.kv, len(parents[0])
    cut, released, forked, next_beams = [], [], {}, [[] for _ in beams]
    for b, running in enumerate(beams):
        if not running:
            continue
        if done[b]:
            released += list(dict.fromkeys(running))
            continue
        children: dict[int, list[int]] = {}
        for j, parent in enumerate(parents[b]):
            children.setdefault(running[parent], []).append(j)
        cut += [s for s in dict.fromkeys(running) if s not in children]
        next_beams[b] = [0] * k
        for seq, js in children.items():
            next_beams[b][js[0]] = seq  # the first child continues the beam itself
            for j in js[1:]:
                next_beams[b][j] = child = session.fork(seq)
                forked[child] = seq
    dropped = {p for s in cut + released for p in kv.pages(s)}
    for s in cut + released:  # after every fork (see above)
        session.finish(s)
    still_held = {p for running in next_beams for s in running for p in kv.pages(s)}
    freed = sorted(dropped - still_held)
    return {"cut": cut, "released": released, "forked": forked, "freed": freed, "beams": next_beams}


def _feed(session, beams: list[list[int]], tokens: torch.Tensor):
    """One decode forward: each running beam appends its token (``tokens: [batch, k]``).

    Returns the logits ``[batch * k, vocab]`` (zero rows for prompts that are done), each beam's pages
    after the forward, and the pages each received by copy-on-write, as the cache reports them
    (``last_copies``: beam search runs no eviction, so the reservation is the only page change; layer
    0's on a `LayeredKVCache`).
    """
    kv, (batch, k) = session.kv, tokens.shape
    live = [b for b, running in enumerate(beams) if running]
    seqs = [s for b in live for s in beams[b]]
    step_logits = session.extend(seqs, list(tokens[live].reshape(-1, 1)))  # [len(live) * k, vocab]
    copied: dict[int, list[int]] = {}
    for c in kv.last_copies:
        if c.layer in (None, 0):
            copied.setdefault(c.seq_id, []).append(c.page)
    logits = torch.zeros(batch * k, step_logits.shape[-1], device=step_logits.device)
    rows = torch.tensor([b * k + j for b in live for j in range(k)], device=step_logits.device)
    logits[rows] = step_logits
    return logits, {s: kv.pages(s) for s in seqs}, copied


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[b, index[b, j], ...]`` for a ``[batch, n, ...]`` tensor and ``index: [batch, m]``."""
    while index.dim() < t.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(t, index, dim=1)
