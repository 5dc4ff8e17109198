"""Beam search over forked pages: the beams of a prompt share every page they have in common.

Beam search keeps, per prompt, the ``k = num_beams`` most likely continuations (beams), chosen by
transformers' own selection (`paged_ref.hf.beam_selection`): ``model.generate(num_beams=k)``
returns the same tokens and scores. What changes is the cache: transformers gathers every beam's
contiguous cache into the new beam order each step (``reorder_cache``). Here each beam is a sequence
of a `PagedKVCache`; after each selection a beam no next beam continues is **cut**
(`PagedSession.finish`: its pages go back, or lose a reference); one continued once **keeps** its
pages; one continued by several is **forked** (the children share its pages; the first token a
child writes into the shared partial last page copies that one page, copy-on-write). So k beams
over a 512-token prompt hold its pages once, plus a few each. `BeamStep` records every step's pages
for the page maps of notebook 08.

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
from dataclasses import dataclass, field

import torch

from ._checks import check_hooks, show_progress
from .beam_selection import BeamSelection
from .decoding import Decoding, resolve
from .inputs import prepare

__all__ = ["BeamStep", "BeamSearchOutput", "beam_search", "run_beam_search"]


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
    progress: bool | None = None,
    **options,
) -> BeamSearchOutput:
    """``model.generate(num_beams=k, do_sample=False)``'s tokens and scores, from a paged cache.

    ``num_beams`` (>= 2), ``num_return_sequences``, ``length_penalty`` and ``early_stopping`` are
    ``model.generate``'s (`paged_ref.hf.decoding`); ``callback(step, beam_step)`` is called after each
    step's selection (`BeamStep`); ``progress`` shows a tqdm bar, None from 128 new tokens on (as `generate`);
    the other arguments, and what it raises, are `generate`'s.
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
    check_hooks(None, callback, beam=True)  # generate checks its own before its beam path
    args = (model, input_ids, decoding, max_new_tokens, "beam_search")
    return run_beam_search(*args, callback=callback, progress=show_progress(progress, max_new_tokens), **options)


def run_beam_search(
    model, input_ids, decoding: Decoding, max_new_tokens, caller: str, /, *, callback=None, progress=False, **options
) -> BeamSearchOutput:
    """`beam_search` with its decoding arguments resolved (also `generate`'s beam path, ``caller``): one prefill
    per prompt, then per step the selection, the pages following it and one decode forward."""
    k = decoding.num_beams
    prepared = prepare(model, input_ids, k, caller, max_new_tokens=max_new_tokens, **options)
    session, prompts, eos, pad, namespaces, _ = prepared
    selection = BeamSelection(input_ids.to(session.kv.device), decoding, eos, pad, max_new_tokens)
    pages_held, copies = [], 0
    from tqdm.auto import tqdm

    with session, tqdm(total=max_new_tokens, disable=not progress, desc="paged beam search", unit="tok") as bar:
        # one sequence per prompt, prefilled once: its k beams start as that one sequence
        roots = [session.add(namespace=ns) for ns in namespaces]
        logits = session.extend(roots, prompts).repeat_interleave(k, dim=0)  # [batch * k, vocab]
        beams, pages, copied = [[root] * k for root in roots], {s: session.kv.pages(s) for s in roots}, {}
        for step in range(max_new_tokens):
            pages_held.append(len({p for held in pages.values() for p in held}))
            tokens, parents, done = selection.step(logits)  # [batch, k] each, done per prompt
            bar.update(1)
            moves = _follow_selection(session, beams, parents.tolist(), done)
            if callback is not None:
                finished = selection.is_finished.sum(dim=1).tolist()
                callback(
                    step, BeamStep(step, pages, copied, tokens.clone(), parents.clone(), finished=finished, **moves)
                )
            beams = moves["beams"]
            if not any(beams):
                break
            logits, pages, copied = _feed(session, beams, tokens)
            copies += sum(len(c) for c in copied.values())
    sequences, scores = selection.best(decoding.num_return_sequences)
    return BeamSearchOutput(sequences.to(input_ids.device), scores, pages_held, copies)


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
    """One decode forward, each running beam appending its token (``tokens: [batch, k]``): the logits
    ``[batch * k, vocab]`` (zero rows for prompts that are done), each beam's pages, and the pages each
    got by copy-on-write (``last_copies``, layer 0's on a `LayeredKVCache`: no eviction in beam search)."""
    kv, (batch, k) = session.kv, tokens.shape
    live = [b for b, running in enumerate(beams) if running]
    seqs = [s for b in live for s in beams[b]]
    step_logits = session.extend(seqs, list(tokens[live].reshape(-1, 1)))  # [len(live) * k, vocab]
    copied: dict[int, list[int]] = {}
    for c in kv.last_copies:
        if c.layer in (None, 0):
            copied.setdefault(c.seq_id, []).append(c.page)
    logits = torch.zeros(batch * k, step_logits.shape[-1], device=step_logits.device)
    logits.view(batch, k, -1)[live] = step_logits.view(len(live), k, -1)  # prompt b's beams: rows b * k ..
    return logits, {s: kv.pages(s) for s in seqs}, copied
