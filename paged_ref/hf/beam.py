"""Beam search over forked pages: the beams of a prompt share every page they have in common.

Beam search keeps, per prompt, the ``k = num_beams`` most likely continuations ("beams"). Each
step every beam proposes its next tokens, the ``2k`` best (beam, token) pairs over all beams are
ranked by their summed log-probability, and the ``k`` best that do not end the sequence become
the next step's beams; one that ends it (an EOS token, or the length limit) is a *finished
hypothesis*, scored ``sum of log-probs / generated_length ** length_penalty`` and kept if it is
among the ``k`` best finished so far. The selection is transformers' own, tensor for tensor
(``GenerationMixin._beam_search``): same candidates, same tie order, same ``early_stopping``
rules, same scores; ``model.generate(num_beams=k)`` returns the same tokens and sequence scores.

What changes is the cache. transformers keeps a contiguous cache per beam and, every step,
gathers all of them into the new beam order (``reorder_cache``: k copies of every beam's
K/V). Here each beam is a sequence of a `PagedKVCache`, and after each selection:

* a beam that no new beam continues is **cut**: `PagedSession.finish` returns its pages at once
  (pages it shared with a surviving beam only lose a reference);
* a beam continued once **keeps** its sequence and pages and just appends its token;
* a beam continued by two or more new beams is **forked**: the extra children share all its
  pages (reference counts), and the first token a child writes into the shared partial last
  page copies that one page (copy-on-write). Full pages are never copied.

The forks are made before the cut beams are freed (`_follow_selection` says why). So k beams
over a 512-token prompt hold the prompt's pages once, plus a few pages each for what they
generated. `BeamStep` records every step (pages per beam, the pages copied as the cache reports
them in ``last_copies``, beams cut and the pages they freed) for the page maps of notebook 08.
Finished hypotheses keep only their tokens, not pages; a prompt whose finished hypotheses can
no longer change (transformers' stopping heuristic) frees its beams while the other prompts of
the batch go on.

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

from .._validate import check_int
from ..cache import PagedKVCache
from .decoding import Decoding, resolve
from .inputs import open_session, prepare_inputs, prompt_namespaces

__all__ = ["BeamStep", "BeamSearchOutput", "beam_search", "run_beam_search"]

NEG = -1.0e9  # transformers' "impossible" score (finite, so that sums stay ordered)


@dataclass(frozen=True)
class BeamStep:
    """One step of a beam search, as plain data (what `beam_search` passes to its callback).

    Attributes:
        step: the forward it follows: 0 is the prefill, ``s`` feeds the ``s``-th generated token.
        pages: running beam (its sequence id) -> its physical pages after this forward.
        copied: beam -> physical pages it received by copy-on-write in this forward.
        tokens, parents: LongTensor ``[batch, num_beams]``: the token each next beam appends and
            the index of the beam it continues (transformers' beam order).
        cut: beams no next beam continues: freed here.
        released: beams freed because their prompt is done (its finished hypotheses can no longer
            change) or the search ends here.
        freed: physical pages that went back to the pool when those beams were freed.
        forked: new beam -> the beam it was forked from (sharing its pages).
        beams: ``[batch][num_beams]`` sequence ids of the next step's beams (``[]`` for a prompt
            that is done, and everywhere after the last step).
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
        sequences: LongTensor ``[batch * num_return_sequences, prompt_len + generated]``, the best
            finished hypotheses of each prompt, best first, after the (left-padded) prompt;
            shorter ones end with EOS and are filled with ``pad_token_id`` (the first EOS id
            when ``pad_token_id`` is 0), as ``model.generate`` fills them.
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
    page_size: int = 16,
    num_pages: int | None = None,
    backend: str = "auto",
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    callback: Callable[[int, BeamStep], None] | None = None,
    progress: bool = False,
    kv_cache: PagedKVCache | None = None,
    namespace: dict | list | None = None,
) -> BeamSearchOutput:
    """Beam search from a paged cache: ``model.generate(num_beams=k, do_sample=False)``'s tokens and scores.

    Args:
        num_beams: beams per prompt (>= 2; None: the model's ``generation_config``).
        num_return_sequences: hypotheses returned per prompt (<= num_beams; default 1).
        length_penalty: exponent of the generated length that divides a finished beam's
            log-probability (default 1.0; > 0 favours longer sequences).
        early_stopping: ``True``, ``False`` (default) or ``"never"``, as in transformers.
        callback: ``callback(step, beam_step)`` after each step's selection (`BeamStep`).
        progress: show a tqdm bar over the steps.
        The other arguments are `paged_ref.hf.generate`'s.

    Returns:
        `BeamSearchOutput`.

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
    return run_beam_search(
        model,
        input_ids,
        decoding,
        max_new_tokens=max_new_tokens,
        page_size=page_size,
        num_pages=num_pages,
        backend=backend,
        attention_mask=attention_mask,
        eviction=None,
        budget=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        callback=callback,
        progress=progress,
        kv_cache=kv_cache,
        namespace=namespace,
    )


def run_beam_search(
    model,
    input_ids,
    decoding: Decoding,
    *,
    max_new_tokens,
    attention_mask,
    eos_token_id,
    pad_token_id,
    callback=None,
    progress=False,
    namespace=None,
    **pool,
) -> BeamSearchOutput:
    """`beam_search` with its decoding arguments already resolved (also `generate`'s beam path)."""
    check_int("max_new_tokens", max_new_tokens, min_value=1)
    prompts, eos, pad = prepare_inputs(model, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id)
    namespaces = prompt_namespaces(namespace, len(prompts))
    session = open_session(model, prompts, max_new_tokens, decoding.num_beams, **pool)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable, got {type(callback).__name__}")
    from tqdm.auto import tqdm

    with session, tqdm(total=max_new_tokens, disable=not progress, desc="paged beam search", unit="tok") as bar:
        ids = input_ids.to(session.kv.device)
        out = _search(session, ids, prompts, namespaces, max_new_tokens, eos, pad, decoding, callback, bar)
    return replace(out, sequences=out.sequences.to(input_ids.device))


def _search(
    session, input_ids, prompts, namespaces, max_new_tokens, eos, pad, decoding, callback, bar
) -> BeamSearchOutput:
    """transformers' selection, step by step; the pages follow it in `_follow_selection` and `_feed`."""
    device = session.kv.device
    batch, width = input_ids.shape
    k = decoding.num_beams
    max_length = width + max_new_tokens
    length_penalty, early_stopping = decoding.length_penalty, decoding.early_stopping
    # transformers' shapes: a tensor per (prompt, beam); 2k candidates (more with several EOS ids)
    keep = max(2, 1 + eos.numel()) * k
    top_k_mask = torch.arange(keep, device=device) < k  # [keep]: only the k best may finish
    fill = pad if pad != 0 else (int(eos[0]) if eos.numel() else pad)  # model.generate's fill value
    running = torch.full((batch, k, max_length), fill, dtype=torch.long, device=device)  # [batch, k, max_length]
    running[:, :, :width] = input_ids[:, None, :]
    finished = running.clone()  # the k best finished hypotheses per prompt
    finished_len = torch.zeros(batch, k, dtype=torch.long, device=device)  # their generated lengths
    running_scores = torch.zeros(batch, k, device=device)  # [batch, k]
    running_scores[:, 1:] = NEG  # step 0: all k rows are the prompt; only beam 0's candidates count
    finished_scores = torch.full((batch, k), NEG, device=device)
    is_finished = torch.zeros(batch, k, dtype=torch.bool, device=device)
    can_improve = torch.ones(batch, 1, dtype=torch.bool, device=device)  # transformers' heuristic, per prompt
    pages_held, copies = [], 0

    beams, logits, pages = _prefill(session, prompts, namespaces, k)
    copied: dict[int, list[int]] = {}
    cur_len = width
    for step in range(max_new_tokens):
        pages_held.append(len({p for held in pages.values() for p in held}))
        vocab = logits.shape[-1]
        log_probs = torch.log_softmax(logits, dim=-1).view(batch, k, vocab) + running_scores[:, :, None]
        top_scores, top_index = torch.topk(log_probs.view(batch, k * vocab), k=keep)  # [batch, keep]
        top_beam, top_token = top_index // vocab, top_index % vocab
        top_running = running.gather(1, top_beam[:, :, None].expand(-1, -1, max_length)).clone()
        top_running[:, :, cur_len] = top_token
        hits = torch.isin(top_token, eos) | (cur_len + 1 >= max_length)  # [batch, keep]: the candidate ends here

        # the next running beams: the k best candidates that do not end
        running_candidates = top_scores + hits.to(torch.float32) * NEG
        nxt = torch.topk(running_candidates, k=k)[1]  # [batch, k]
        running = _gather(top_running, nxt)
        running_scores = _gather(running_candidates, nxt)
        parents = _gather(top_beam, nxt)  # [batch, k]

        # the k best finished hypotheses so far, with the length penalty
        just_finished = hits & top_k_mask[None, :]
        scores = top_scores / ((cur_len + 1 - width) ** length_penalty)
        scores += (is_finished.all(dim=-1, keepdim=True) & (early_stopping is True)).to(torch.float32) * NEG
        scores += (~can_improve).to(torch.float32) * NEG
        scores += (~just_finished) * NEG
        best = torch.topk(torch.cat((finished_scores, scores), dim=1), k=k)[1]  # [batch, k]
        finished = _gather(torch.cat((finished, top_running), dim=1), best)
        finished_scores = _gather(torch.cat((finished_scores, scores), dim=1), best)
        new_len = torch.full_like(top_beam, cur_len + 1 - width)
        finished_len = _gather(torch.cat((finished_len, new_len), dim=1), best)
        is_finished = _gather(torch.cat((is_finished, just_finished), dim=1), best)

        cur_len += 1
        can_improve = can_improve & _may_improve(
            running_scores, finished_scores, is_finished, cur_len, width, max_length, early_stopping, length_penalty
        )
        stop = not (
            bool(can_improve.any())
            and not (bool(is_finished.all()) and early_stopping is True)
            and not bool(hits.all())
        )
        bar.update(1)

        tokens = running[:, :, cur_len - 1]  # [batch, k]: the token each next beam appends
        done = [stop or not bool(can_improve[b]) for b in range(batch)]  # nothing it runs can change its result
        moves = _follow_selection(session, beams, parents.tolist(), done)
        if callback is not None:
            callback(
                step,
                BeamStep(
                    step=step,
                    pages=pages,
                    copied=copied,
                    tokens=tokens.clone(),
                    parents=parents.clone(),
                    finished=is_finished.sum(dim=1).tolist(),
                    **moves,
                ),
            )
        beams = moves["beams"]
        if not any(beams):
            break
        logits, pages, copied = _feed(session, beams, tokens)
        copies += sum(len(c) for c in copied.values())

    n = decoding.num_return_sequences
    lengths = finished_len[:, :n].reshape(-1)  # [batch * n]
    out_len = width + int(lengths.max())
    return BeamSearchOutput(
        sequences=finished[:, :n, :out_len].reshape(batch * n, out_len),
        sequences_scores=finished_scores[:, :n].reshape(-1),
        pages_held=pages_held,
        copies=copies,
    )


# ------------------------------------------------------------------ the pages of the beams
def _prefill(session, prompts, namespaces, k: int):
    """One sequence per prompt, prefilled once: its k beams start as that one sequence.

    Returns ``beams`` (``[batch][k]`` sequence ids), the logits ``[batch * k, vocab]`` (each
    prompt's row repeated k times, transformers' layout) and each sequence's pages.
    """
    roots = [session.add(namespace=ns) for ns in namespaces]
    logits = session.extend(roots, prompts).repeat_interleave(k, dim=0)
    return [[root] * k for root in roots], logits, {s: session.kv.pages(s) for s in roots}


def _follow_selection(session, beams: list[list[int]], parents: list[list[int]], done: list[bool]) -> dict:
    """The pages follow one selection: each running beam is cut, kept or forked (the module
    docstring), then the beams left behind are freed. ``beams[b][j]``: prompt ``b``'s beam ``j``
    (``[]`` once the prompt is done); ``parents[b][j]``: the beam next beam ``j`` continues;
    ``done[b]``: prompt ``b`` stops here (its beams are released).

    Fork before free: every fork of the step is made before any beam is freed, the order vLLM's
    scheduler keeps (it forks the new sequences before it frees the old ones). A fork adds a
    reference to each page of its source, a free removes one; forking first means that a page a
    next beam needs carries that beam's reference before any old beam lets go of it, so it never
    drops to zero on the way: it is never returned to the pool (zeroed, free to be handed out)
    while a next beam still needs its K/V. Freeing first breaks as soon as a freed beam is also a
    fork's source (in vLLM, a parent whose own continuation just finished); here the first child
    keeps its parent's sequence, which is a fork of the parent followed by its free, done as
    nothing. The frees also all come before the next forward, so the reservation then sees only
    the references of running beams: it copies just the pages two running beams share (the
    partial last page of a beam continued more than once) and writes the others in place.
    Forking the first child too and freeing the parent after the forward would copy that page
    once more for every beam continued.

    Returns the `BeamStep` fields it decides: ``cut``, ``released``, ``forked``, ``freed`` and
    ``beams`` (the next step's, ``[]`` for a prompt that is done).
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
    return {
        "cut": cut,
        "released": released,
        "forked": forked,
        "freed": sorted(dropped - still_held),
        "beams": next_beams,
    }


def _feed(session, beams: list[list[int]], tokens: torch.Tensor):
    """One decode forward: each running beam appends its token (``tokens: [batch, k]``).

    Returns the logits ``[batch * k, vocab]`` (zero rows for prompts that are done), each beam's
    pages after the forward, and the pages each beam received by copy-on-write in it, as the
    cache reported them (``last_copies`` of the reservation, the forward's only page change:
    beam search runs no eviction policy). On a `LayeredKVCache` both are layer 0's.
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


def _may_improve(running_scores, finished_scores, is_finished, cur_len, width, max_length, early_stopping, penalty):
    """transformers' early-stop heuristic: can the best running beam still beat the worst finished one?"""
    if early_stopping == "never" and penalty > 0.0:
        best_length = max_length - width  # a longer beam scores higher: judge it at the longest
    else:
        best_length = cur_len - width
    best_running = running_scores[:, :1] / (best_length**penalty)  # [batch, 1]
    worst_finished = torch.where(is_finished, torch.min(finished_scores, dim=1, keepdim=True)[0], NEG)
    return torch.any(best_running > worst_finished, dim=-1, keepdim=True)
