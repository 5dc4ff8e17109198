"""Generation from a paged KV cache: `generate` and its iterator form `stream`.

The same tokens as ``model.generate`` for the same decoding arguments (`paged_ref.hf.decoding`):
greedy, sampling after the same ``torch.manual_seed``, beam search over forked pages
(`paged_ref.hf.beam`). ``num_return_sequences=n`` prefills a prompt once and *forks* it n - 1
times: the rows share its pages, and a row's first write into a shared page copies it
(copy-on-write). Left padding (``attention_mask``) is stripped before anything reaches the cache;
a sequence that emits EOS gives its pages back at once and its row is filled with ``pad_token_id``.
One exception: dynamic RoPE (``rope_type="dynamic"``) past the model's original context scales by the
largest position in the batch, which in ``model.generate`` still counts the finished rows.

Example:
    >>> import torch
    >>> from paged_ref.models import tiny_llama
    >>> model = tiny_llama()
    >>> ids = torch.tensor([[1, 7, 9, 4]])
    >>> out = generate(model, ids, max_new_tokens=5, page_size=2)
    >>> out.shape, bool((out == model.generate(ids, max_new_tokens=5, do_sample=False)).all())
    (torch.Size([1, 9]), True)
    >>> _ = torch.manual_seed(0); mine = generate(model, ids, max_new_tokens=5, do_sample=True, num_return_sequences=3)
    >>> _ = torch.manual_seed(0); theirs = model.generate(ids, max_new_tokens=5, do_sample=True, num_return_sequences=3)
    >>> mine.shape, torch.equal(mine, theirs)
    (torch.Size([3, 9]), True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ._checks import check_hooks, show_progress
from .beam import run_beam_search
from .decoding import Decoding, choose, resolve
from .inputs import Prepared, prepare

__all__ = ["Stream", "generate", "stream"]


def generate(
    model,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    num_return_sequences: int | None = None,
    num_beams: int | None = None,
    length_penalty: float | None = None,
    early_stopping: bool | str | None = None,
    streamer=None,
    callback: Callable[[int, object], None] | None = None,
    progress: bool | None = None,
    **options,
) -> torch.Tensor:
    """Generation with every layer's K/V in a paged cache; the same tokens as ``model.generate``.

    Args:
        model: a transformers causal LM (Llama family; attention through `AttentionInterface`).
        input_ids: LongTensor ``[batch, prompt_len]``, left-padded when lengths differ.
        max_new_tokens: most tokens added per sequence (>= 1).
        do_sample, temperature, top_k, top_p, num_return_sequences, num_beams, length_penalty,
            early_stopping: as in ``model.generate``; None takes the model's ``generation_config``
            value, else transformers' default (`paged_ref.hf.decoding`).
        streamer: ``put(LongTensor)`` and ``end()`` (e.g. ``transformers.TextStreamer``), called as
            ``model.generate`` calls them. Not with beam search.
        callback: ``callback(step, tokens: LongTensor [rows])`` after each step; with beam search
            ``callback(step, beam_step)`` (`paged_ref.hf.beam.BeamStep`).
        progress: show a tqdm bar; None: from 128 new tokens on.
        **options: `paged_ref.hf.inputs.prepare`'s (the cache, ``attention_mask``, eviction, EOS / pad ids).

    Returns:
        LongTensor ``[batch * num_return_sequences, prompt_len + steps]``: each row its prompt,
        then its tokens (prompt ``b``'s rows are ``b * n .. b * n + n - 1``, as ``model.generate``).

    Raises:
        TypeError / ValueError: bad arguments (the message names the argument); nothing is allocated.
        paged_ref.OutOfPagesError: the page pool ran out (every page is freed again).
    """
    progress = show_progress(progress, max_new_tokens)
    decoding = resolve(
        model,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        num_return_sequences=num_return_sequences,
        num_beams=num_beams,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    check_hooks(streamer, callback, beam=decoding.mode == "beam")
    if decoding.mode == "beam":
        return run_beam_search(
            model, input_ids, decoding, max_new_tokens, "generate", callback=callback, progress=progress, **options
        ).sequences
    n = decoding.num_return_sequences
    steps = Stream(_steps(prepare(model, input_ids, n, "generate", max_new_tokens=max_new_tokens, **options), decoding))
    prompts = input_ids.repeat_interleave(n, dim=0)  # [rows, prompt_len]
    generated = _collect(steps, prompts, max_new_tokens, streamer=streamer, callback=callback, progress=progress)
    return torch.cat([prompts, generated.to(input_ids.device)], dim=1)


def _collect(steps: Stream, prompts, max_new_tokens: int, *, streamer, callback, progress: bool) -> torch.Tensor:
    """Run ``steps`` to the end, each step's tokens to the streamer and the callback: ``[rows, steps]``."""
    from tqdm.auto import tqdm

    new_tokens = []
    try:  # leaving `steps` frees the pages, even when a callback raised
        with steps, tqdm(total=max_new_tokens, disable=not progress, desc="paged generate", unit="tok") as bar:
            for step, tokens in enumerate(steps):
                if step == 0 and streamer is not None:
                    streamer.put(prompts.cpu())
                new_tokens.append(tokens)
                if streamer is not None:
                    streamer.put(tokens.cpu())
                if callback is not None:
                    callback(step, tokens)
                bar.update(1)
    finally:
        if streamer is not None:
            streamer.end()
    return torch.stack(new_tokens, dim=1)  # [rows, steps]


def stream(
    model,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    num_return_sequences: int | None = None,
    **options,
) -> Stream:
    """Greedy or sampled decoding that yields each step's tokens, LongTensor ``[batch * num_return_sequences]``
    (``pad_token_id`` in finished rows); `generate`'s arguments, beam search excepted. Pages are freed
    as sequences finish, all of them when the stream ends or is closed (leaving ``with``).

    Example:
        >>> from paged_ref.models import tiny_llama
        >>> with stream(tiny_llama(), torch.tensor([[1, 2, 3]]), max_new_tokens=3) as steps:
        ...     first = next(steps)
        >>> first.shape, steps.closed
        (torch.Size([1]), True)
    """
    decoding = resolve(
        model,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        num_return_sequences=num_return_sequences,
    )
    if decoding.mode == "beam":
        raise ValueError(
            f"stream yields tokens step by step, but the model's generation_config asks for beam search "
            f"(num_beams={decoding.num_beams}), whose sequences are chosen only at the end; use "
            "paged_ref.hf.generate or paged_ref.hf.beam_search"
        )
    n = decoding.num_return_sequences
    return Stream(_steps(prepare(model, input_ids, n, "stream", max_new_tokens=max_new_tokens, **options), decoding))


class Stream(Iterator, contextlib.AbstractContextManager):
    """The iterator `stream` returns: each step's tokens, plus ``close()`` and ``with`` support."""

    def __init__(self, steps: Iterator[torch.Tensor]):
        self._steps = steps
        self.closed = False

    def __next__(self) -> torch.Tensor:
        if self.closed:
            raise StopIteration
        try:
            return next(self._steps)
        except BaseException:
            self.closed = True
            raise

    def close(self) -> None:
        """Stop generating and free every page the stream holds (idempotent)."""
        self.closed = True
        self._steps.close()

    def __exit__(self, *exc) -> None:
        self.close()


def _steps(prepared: Prepared, decoding: Decoding):
    """The decoding loop: greedy or sampled, ``num_return_sequences`` rows per prompt."""
    session, prompts, eos, pad, namespaces, max_new_tokens = prepared
    n = decoding.num_return_sequences
    with session:  # on exit every sequence is freed
        roots = [session.add(namespace=ns) for ns in namespaces]
        logits = session.extend(roots, prompts)  # prefill, once per prompt: [batch, vocab]
        # the n rows of a prompt: the prefilled sequence and n - 1 forks sharing its pages
        seq_ids = [s for root in roots for s in [root] + [session.fork(root) for _ in range(n - 1)]]
        logits = logits.repeat_interleave(n, dim=0)  # [batch * n, vocab]
        rows = len(seq_ids)
        active = list(range(rows))  # rows still generating
        for step in range(max_new_tokens):
            next_tokens = choose(logits, decoding, rows=rows, active=active)  # [num_active]
            row_tokens = torch.full((rows,), pad, dtype=torch.long, device=logits.device)
            row_tokens[active] = next_tokens
            yield row_tokens  # [rows]
            if step == max_new_tokens - 1:
                break  # the last token needs no forward of its own
            done = torch.isin(next_tokens, eos).tolist()
            for b, finished in zip(active, done):
                if finished:
                    session.finish(seq_ids[b])  # its pages are free from now on
            keep = [i for i, finished in enumerate(done) if not finished]
            active = [active[i] for i in keep]
            if not active:
                break
            next_tokens = next_tokens[keep]
            logits = session.extend([seq_ids[b] for b in active], list(next_tokens[:, None]))  # decode
