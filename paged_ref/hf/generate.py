"""Generation from a paged KV cache: `generate` and its iterator form `stream`.

Decoding as ``model.generate`` does it, with its argument names, defaults and checks
(`paged_ref.hf.decoding`): greedy by default; ``do_sample=True`` with ``temperature``, ``top_k``,
``top_p`` draws the same tokens as ``model.generate`` after the same ``torch.manual_seed``
(`paged_ref.hf.sampling`); ``num_beams=k`` is beam search over forked pages (`paged_ref.hf.beam`).

Sharing pages. ``num_return_sequences=n`` samples n sequences per prompt: the prompt is
prefilled once and *forked* n - 1 times, so the n rows share its pages (reference counts); the
first token a row writes into a shared page copies that page first (copy-on-write), full pages
stay shared to the end. The output has ``batch * n`` rows, prompt ``b``'s samples in rows
``b * n .. b * n + n - 1``, as ``model.generate`` lays them out.

Mixed-length batches: pass the prompts left-padded with an ``attention_mask`` (what
``tokenizer(..., padding=True)`` gives with ``padding_side="left"``, and what
``model.generate`` expects). Padding is stripped before anything reaches the cache: each
sequence holds only its own tokens, at positions 0, 1, 2, ... (per-sequence lengths). The output
keeps the input's layout, so it lines up with ``model.generate``'s output token for token.

Stopping: a sequence that emits an EOS token is finished; later columns of its row hold
``pad_token_id`` (as in ``model.generate``) and its pages go back to the allocator at once.
Generation ends after ``max_new_tokens`` or when every sequence is finished.

Example:
    >>> import torch
    >>> from paged_ref.models import tiny_llama
    >>> model = tiny_llama()
    >>> ids = torch.tensor([[1, 7, 9, 4]])
    >>> out = generate(model, ids, max_new_tokens=5, page_size=2)
    >>> out.shape
    torch.Size([1, 9])
    >>> bool((out == model.generate(ids, max_new_tokens=5, do_sample=False)).all())
    True
    >>> _ = torch.manual_seed(0); mine = generate(model, ids, max_new_tokens=5, do_sample=True, num_return_sequences=3)
    >>> _ = torch.manual_seed(0); theirs = model.generate(ids, max_new_tokens=5, do_sample=True, num_return_sequences=3)
    >>> mine.shape, torch.equal(mine, theirs)
    (torch.Size([3, 9]), True)
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator

import torch

from .._arith import cdiv
from .._validate import check_int
from ..cache import PagedKVCache
from ..memory import model_geometry
from .decoding import Decoding, resolve
from .sampling import choose
from .session import PagedSession

__all__ = ["Stream", "generate", "stream"]

PROGRESS_MIN_TOKENS = 128  # progress="auto" shows a bar from this many new tokens on


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
    page_size: int = 16,
    num_pages: int | None = None,
    backend: str = "auto",
    attention_mask: torch.Tensor | None = None,
    eviction=None,
    budget: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    kv_cache: PagedKVCache | None = None,
    namespace: dict | list | None = None,
) -> Iterator[torch.Tensor]:
    """Greedy or sampled decoding that yields each step's new tokens as they are produced.

    Same arguments as `generate` (beam search excepted: its sequences are known only at the end).
    Yields LongTensor ``[batch * num_return_sequences]`` per step (``pad_token_id`` in rows
    already finished). Pages are freed when a sequence finishes, and all of them when the stream
    is exhausted, closed (``close()``) or left as a context manager: use
    ``with stream(...) as steps:`` to leave early (``break``) and free everything at once. A
    stream kept in a variable and left with ``break`` holds its pages until it is closed or
    garbage collected; the model itself is never left switched (its attention is "paged_ref"
    only during each forward).

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
    return Stream(
        _steps(
            model,
            input_ids,
            decoding,
            max_new_tokens=max_new_tokens,
            page_size=page_size,
            num_pages=num_pages,
            backend=backend,
            attention_mask=attention_mask,
            eviction=eviction,
            budget=budget,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            kv_cache=kv_cache,
            namespace=namespace,
        )
    )


def open_session(model, prompts, max_new_tokens, copies, *, kv_cache, num_pages, page_size, backend, eviction, budget):
    """The `PagedSession` for a generation (checked here, before a page is taken).

    The pool created when neither ``kv_cache`` nor ``num_pages`` is given holds every sequence at
    full length with its prompt's full pages shared by its ``copies`` rows (samples or beams):
    per prompt of P tokens, ``P // page_size`` shared pages plus, per row, the pages that
    positions ``P // page_size * page_size .. P + max_new_tokens`` span. Generation never runs
    out of pages there (a beam continued twice shares everything before its partial last page).
    """
    if kv_cache is not None and num_pages is not None:
        raise ValueError("pass either kv_cache or num_pages, not both (num_pages sizes a cache created here)")
    if copies > 1 and (eviction is not None or budget is not None):
        raise NotImplementedError(
            "KV eviction with sequences that share pages (num_return_sequences > 1 or num_beams > 1) is not "
            "implemented; pass eviction=None"
        )
    if kv_cache is None and num_pages is None:
        # the one page_size check on this path before the cache's own (the sizing divides by it)
        page_size = check_int("page_size", page_size, min_value=1)
        num_pages = sum(
            p.numel() // page_size + copies * cdiv(p.numel() % page_size + max_new_tokens, page_size) for p in prompts
        )
    return PagedSession(
        model, kv=kv_cache, num_pages=num_pages, page_size=page_size, backend=backend, eviction=eviction, budget=budget
    )


def _steps(model, input_ids, decoding: Decoding, *, max_new_tokens, attention_mask, eos_token_id, pad_token_id, **pool):
    """Check everything, then return the decoding loop (a generator: it starts on the first ``next``)."""
    namespace = pool.pop("namespace")
    prompts, eos, pad = _prepare(model, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id)
    namespaces = _namespaces(namespace, len(prompts))
    session = open_session(model, prompts, max_new_tokens, decoding.num_return_sequences, **pool)
    return _decode_steps(session, prompts, max_new_tokens, eos, pad, decoding, namespaces)


class Stream:
    """The iterator `stream` returns: each step's tokens, plus ``close()`` and ``with`` support."""

    def __init__(self, steps: Iterator[torch.Tensor]):
        self._steps = steps
        self.closed = False

    def __iter__(self) -> Stream:
        return self

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

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _decode_steps(
    session: PagedSession, prompts, max_new_tokens: int, eos: torch.Tensor, pad: int, decoding, namespaces
):
    """The decoding loop behind `stream`: greedy or sampled, ``num_return_sequences`` rows per prompt."""
    n = decoding.num_return_sequences
    with session:  # paged attention on; on exit every sequence is freed and attention restored
        roots = [session.add(namespace=ns) for ns in namespaces]
        logits = session.extend(roots, prompts)  # prefill, once per prompt: [batch, vocab]
        # the n rows of a prompt: the prefilled sequence and n - 1 forks sharing its pages
        seq_ids = [s for root in roots for s in [root] + [session.fork(root) for _ in range(n - 1)]]
        if n > 1:
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
    page_size: int = 16,
    num_pages: int | None = None,
    backend: str = "auto",
    attention_mask: torch.Tensor | None = None,
    eviction=None,
    budget: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    streamer=None,
    callback: Callable[[int, object], None] | None = None,
    progress: bool | None = None,
    kv_cache: PagedKVCache | None = None,
    namespace: dict | list | None = None,
) -> torch.Tensor:
    """Generation with every layer's K/V in a paged cache; same tokens as ``model.generate``.

    Args:
        model: a transformers causal LM (Llama family; attention through `AttentionInterface`).
        input_ids: LongTensor ``[batch, prompt_len]``, left-padded when lengths differ.
        max_new_tokens: most tokens to add per sequence (>= 1).
        do_sample, temperature, top_k, top_p, num_return_sequences, num_beams, length_penalty,
            early_stopping: as in ``model.generate`` (transformers' `GenerationConfig`): None
            takes the model's ``generation_config`` value, else transformers' default (greedy;
            ``top_k=50`` when sampling). See `paged_ref.hf.decoding`.
        page_size: tokens per page of the cache created here.
        num_pages: pages of the cache created here; default: enough for every sequence at full
            length (rows of one prompt sharing its full pages). A smaller pool raises
            `OutOfPagesError` when it runs out.
        backend: which paged attention reads the pages: ``"auto"`` (default: ``"triton"`` on
            CUDA, ``"sdpa"`` elsewhere, the fastest tested paths), ``"reference"`` (the oracle),
            ``"flex"``, ``"triton"`` or ``"sdpa"`` (table in `paged_ref.hf.attention`).
        attention_mask: ``[batch, prompt_len]`` of 0/1, 1 on real tokens, padding on the left.
        eviction, budget: KV eviction (`paged_ref.eviction`): a policy name and a budget in
            tokens (``eviction="paged_eviction", budget=256``), or a policy object. The default
            pool still holds every sequence at full length. One sequence per prompt only.
        eos_token_id: int or list of ints that end a sequence; default: the model's
            ``generation_config.eos_token_id``. Pass ``[]`` to never stop early.
        pad_token_id: fills finished rows; default: ``generation_config.pad_token_id``, else
            the first EOS id.
        streamer: an object with ``put(LongTensor)`` and ``end()`` (e.g.
            ``transformers.TextStreamer``), called as ``model.generate`` calls it: the prompt
            first, then each step's tokens ``[batch]``, then ``end()``. Not with beam search.
        callback: ``callback(step, tokens)`` after each step, ``tokens: LongTensor [rows]``; with
            beam search ``callback(step, beam_step)``, a `paged_ref.hf.beam.BeamStep`.
        progress: show a tqdm bar; default (None): only from 128 new tokens on.
        kv_cache: use this `PagedKVCache` (e.g. to inspect its pages from the callback) instead
            of creating one; the sequences added are freed before returning.
        namespace: the prefix-cache namespace (str -> str, e.g. ``{"adapter": "lora-7"}``) of
            every prompt, or a list of one per prompt (None or a dict each); see
            `PagedSession.add`.

    Returns:
        LongTensor ``[batch * num_return_sequences, prompt_len + steps]``, each row its prompt
        followed by the generated tokens.

    Raises:
        TypeError / ValueError: bad arguments (the message names the argument); nothing is allocated.
        paged_ref.OutOfPagesError: the page pool ran out (every page is freed again).
    """
    show = (
        progress
        if progress is not None
        else check_int("max_new_tokens", max_new_tokens, min_value=1) >= PROGRESS_MIN_TOKENS
    )
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
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable as callback(step, tokens) or None, got {type(callback).__name__}")
    if streamer is not None:
        if decoding.mode == "beam":
            raise ValueError("streamer cannot be used with beam search (num_beams > 1), as in model.generate")
        missing = [m for m in ("put", "end") if not callable(getattr(streamer, m, None))]
        if missing:
            raise TypeError(
                f"streamer must have put(tokens) and end() methods (like "
                f"transformers.TextStreamer); {type(streamer).__name__} lacks {missing}"
            )
    pool = dict(
        page_size=page_size,
        num_pages=num_pages,
        backend=backend,
        attention_mask=attention_mask,
        eviction=eviction,
        budget=budget,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        kv_cache=kv_cache,
        namespace=namespace,
    )
    if decoding.mode == "beam":
        from .beam import run_beam_search

        return run_beam_search(
            model, input_ids, decoding, max_new_tokens=max_new_tokens, callback=callback, progress=show, **pool
        ).sequences
    steps = Stream(_steps(model, input_ids, decoding, max_new_tokens=max_new_tokens, **pool))
    from tqdm.auto import tqdm

    n = decoding.num_return_sequences
    new_tokens = []
    bar = tqdm(total=max_new_tokens, disable=not show, desc="paged generate", unit="tok")
    try:
        for step, tokens in enumerate(steps):
            if step == 0 and streamer is not None:
                streamer.put(input_ids.repeat_interleave(n, dim=0).cpu())
            new_tokens.append(tokens)
            if streamer is not None:
                streamer.put(tokens.cpu())
            if callback is not None:
                callback(step, tokens)
            bar.update(1)
    finally:
        steps.close()  # frees the pages even when a callback raised
        bar.close()
        if streamer is not None:
            streamer.end()
    generated = torch.stack(new_tokens, dim=1).to(input_ids.device)  # [rows, steps]
    return torch.cat([input_ids.repeat_interleave(n, dim=0), generated], dim=1)


def _prepare(model, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id):
    """Validate the inputs; return (prompts: list of LongTensor [len_b], eos: LongTensor [k], pad: int)."""
    model_geometry(model)  # a transformers decoder, else a TypeError naming what it lacks
    check_int("max_new_tokens", max_new_tokens, min_value=1)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise TypeError(
            "input_ids must be a LongTensor [batch, prompt_len], got "
            + (
                f"a tensor of shape {list(input_ids.shape)} and dtype {input_ids.dtype}"
                if isinstance(input_ids, torch.Tensor)
                else type(input_ids).__name__
            )
        )
    batch, length = input_ids.shape
    if batch < 1 or length < 1:
        raise ValueError(f"input_ids must hold at least one token per row, got shape {list(input_ids.shape)}")
    vocab = model.config.vocab_size
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:  # (left padding must hold valid ids too, as for model.generate)
        raise ValueError(f"input_ids must hold token ids in [0, vocab_size={vocab}), got values in [{lo}, {hi}]")
    device = next(model.parameters()).device
    if attention_mask is None:
        prompts = [row.to(device) for row in input_ids]
    else:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask must be a tensor of the shape of input_ids {list(input_ids.shape)}, got "
                + (
                    str(list(attention_mask.shape))
                    if isinstance(attention_mask, torch.Tensor)
                    else type(attention_mask).__name__
                )
            )
        mask = attention_mask.to("cpu")
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError("attention_mask must hold only 0 and 1")
        mask = mask.bool()
        lengths = mask.sum(dim=1)
        left_padded = mask == (torch.arange(length)[None, :] >= (length - lengths)[:, None])
        if not left_padded.all():
            bad = int((~left_padded.all(dim=1)).nonzero()[0])
            raise ValueError(
                f"attention_mask row {bad} is not left-padded (zeros then ones); pad prompts on the left "
                "(tokenizer.padding_side = 'left'), as model.generate expects"
            )
        if int(lengths.min()) < 1:
            raise ValueError(
                f"every prompt needs at least one real token; attention_mask row {int(lengths.argmin())} is all 0"
            )
        prompts = [input_ids[b, length - int(n) :].to(device) for b, n in enumerate(lengths)]
    config = getattr(model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        eos_token_id = []
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.tolist()
    eos_list = [eos_token_id] if _is_int(eos_token_id) else eos_token_id
    if isinstance(eos_list, (str, bytes)) or not hasattr(eos_list, "__iter__") or not all(_is_int(e) for e in eos_list):
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
    eos_list = [int(e) for e in eos_list]
    if any(not 0 <= e < vocab for e in eos_list):
        raise ValueError(f"eos_token_id must be token ids in [0, vocab_size={vocab}), got {eos_list}")
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = eos_list[0] if eos_list else 0
    if not _is_int(pad_token_id) or not 0 <= int(pad_token_id) < vocab:
        raise ValueError(f"pad_token_id must be a token id in [0, vocab_size={vocab}) or None, got {pad_token_id!r}")
    eos = torch.tensor(eos_list, dtype=torch.long, device=device)
    return prompts, eos, int(pad_token_id)


def _namespaces(namespace, batch: int) -> list:
    """One prefix-cache namespace per prompt (each checked by the cache when its sequence is added)."""
    if namespace is None or isinstance(namespace, dict):
        return [namespace] * batch
    if not isinstance(namespace, (list, tuple)) or len(namespace) != batch:
        got = len(namespace) if isinstance(namespace, (list, tuple)) else type(namespace).__name__
        raise ValueError(f"namespace must be None, a dict or a list of one per row ({batch}), got {got}")
    return list(namespace)


def _is_int(x) -> bool:
    """A Python or numpy integer (not a bool)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
