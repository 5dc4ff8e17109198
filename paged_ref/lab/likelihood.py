"""Teacher-forced log-likelihood through the paged cache, and the plain model's for comparison.

The IBM paper checks its paged attention by perplexity. Done properly, that is a per-token
check: feed a real text through the paged cache (``chunk_size`` tokens per forward, each chunk
attending to everything cached before it) and compare every token's log-probability with the
plain model's single forward over the whole text. ``chunk_size=1`` puts every token through
the decode path; larger chunks exercise prefill over a cached prefix (chunked prefill).

Example:
    >>> import torch
    >>> from paged_ref.models import tiny_llama
    >>> model = tiny_llama()
    >>> ids = torch.randint(3, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    >>> paged = log_likelihood(model, ids, chunk_size=1, page_size=4)     # [2, 19]
    >>> plain = reference_log_likelihood(model, ids)                     # [2, 19]
    >>> bool(torch.allclose(paged, plain, atol=1e-4))
    True
"""

from __future__ import annotations

import torch

from .._validate import check_int, describe
from ..block_table import pages_needed
from ..cache import PagedKVCache
from ..hf import PagedSession
from ..memory import model_geometry

__all__ = ["log_likelihood", "prompt_kv", "reference_log_likelihood"]


def _check_ids(input_ids, model) -> torch.Tensor:
    """``input_ids`` checked against the model before any forward: a LongTensor [batch, seq_len]
    of token ids in its vocabulary."""
    model_geometry(model)  # a transformers decoder, else a TypeError naming what it lacks
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise TypeError(
            "input_ids must be a LongTensor [batch, seq_len], got "
            + (
                f"shape {list(input_ids.shape)}, dtype {input_ids.dtype}"
                if isinstance(input_ids, torch.Tensor)
                else type(input_ids).__name__
            )
        )
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids needs >= 1 row of >= 2 tokens, got shape {list(input_ids.shape)}")
    vocab = model.config.vocab_size
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"input_ids must hold token ids in [0, vocab_size={vocab}), got values in [{lo}, {hi}]")
    return input_ids


def log_likelihood(
    model,
    input_ids: torch.Tensor,
    *,
    chunk_size: int = 1,
    prefill_len: int | None = None,
    page_size: int = 16,
    num_pages: int | None = None,
    backend: str = "auto",
    kv_cache: PagedKVCache | None = None,
) -> torch.Tensor:
    """Per-token log-probabilities of a text fed through the paged cache (teacher forcing).

    Args:
        model: a transformers causal LM.
        input_ids: LongTensor ``[batch, seq_len]`` (no padding: rows of equal length).
        chunk_size: tokens per forward; 1 = every token through the decode path.
        prefill_len: tokens of the first forward (a prefill), default `chunk_size`; e.g.
            ``prefill_len=48, chunk_size=1`` scores a 48-token prompt at once, then decodes.
        page_size, num_pages: the cache created here (default size: just enough).
        backend: a backend name (`paged_ref.hf.BACKENDS`, default ``"auto"``) or a `Backend` object
            (e.g. `paged_ref.lab.mistakes.MISTAKES`).
        kv_cache: use this `PagedKVCache` instead (its sequences are freed before returning).

    Returns:
        float32 ``[batch, seq_len - 1]``: entry ``t`` is ``log p(input_ids[:, t+1] | input_ids[:, :t+1])``.
    """
    input_ids = _check_ids(input_ids, model)
    chunk_size = check_int("chunk_size", chunk_size, min_value=1)
    prefill_len = chunk_size if prefill_len is None else check_int("prefill_len", prefill_len, min_value=1)
    batch, seq_len = input_ids.shape
    if kv_cache is None and num_pages is None:
        num_pages = batch * pages_needed(seq_len, check_int("page_size", page_size, min_value=1))
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    out = torch.empty(batch, seq_len - 1, dtype=torch.float32, device=device)
    with PagedSession(
        model,
        kv_cache=kv_cache,
        num_pages=None if kv_cache is not None else num_pages,
        page_size=page_size,
        backend=backend,
    ) as session:
        seq_ids = [session.add() for _ in range(batch)]
        starts = [0, *range(prefill_len, seq_len - 1, chunk_size)]
        for start in starts:
            if start >= seq_len - 1:
                break
            stop = min(start + (prefill_len if start == 0 else chunk_size), seq_len - 1)  # last token predicts nothing
            logits = session.extend(seq_ids, list(ids[:, start:stop]), all_logits=True)  # batch x [n, vocab]
            logprobs = torch.stack(logits).log_softmax(dim=-1)  # [batch, n, vocab]
            targets = ids[:, start + 1 : stop + 1]  # [batch, n]
            out[:, start:stop] = logprobs.gather(-1, targets[..., None])[..., 0]
    return out


@torch.inference_mode()
def reference_log_likelihood(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The plain model's per-token log-probabilities: one forward over the whole text, no paging.

    Returns:
        float32 ``[batch, seq_len - 1]``, laid out like `log_likelihood`.
    """
    input_ids = _check_ids(input_ids, model)
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    logits = model(input_ids=ids, use_cache=False).logits.float()  # [batch, seq_len, vocab]
    logprobs = logits[:, :-1].log_softmax(dim=-1)  # [batch, seq_len - 1, vocab]
    return logprobs.gather(-1, ids[:, 1:, None])[..., 0]


@torch.inference_mode()
def prompt_kv(model, ids: torch.Tensor, *, page_size: int = 16) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The K (after RoPE) and V a paged cache holds for a prompt, read back from its pages.

    One prefill of ``ids: LongTensor [n]`` through a `PagedSession` (default backend), then
    `PagedKVCache.gather` of every layer: the per-layer lists the eviction analysis takes.

    Returns:
        ``(ks, vs)`` with ``ks[layer], vs[layer]: [n, num_kv_heads, head_dim]``.

    Example:
        >>> from paged_ref.models import tiny_llama
        >>> ks, vs = prompt_kv(tiny_llama(), torch.arange(1, 11))
        >>> len(ks), ks[0].shape
        (2, torch.Size([10, 2, 32]))
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() < 1:
        raise TypeError(f"ids must be a non-empty 1-D LongTensor of token ids, got {describe(ids)}")
    num_pages = pages_needed(ids.numel(), check_int("page_size", page_size, min_value=1))
    with PagedSession(model, num_pages=num_pages, page_size=page_size) as session:
        s = session.add()
        session.extend([s], [ids])
        kv = [session.kv.gather(layer, s) for layer in range(session.kv.num_layers)]
    return [k for k, _ in kv], [v for _, v in kv]
