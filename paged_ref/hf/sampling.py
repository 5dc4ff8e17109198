"""Choosing the next token from the logits, as transformers' ``generate`` does.

Greedy takes the argmax. Sampling passes the logits through transformers' warpers in its order
(``temperature``, ``top_k``, ``top_p``, computed as it computes them, so that a token on a boundary
falls on the same side), then draws one token per row. After the same ``torch.manual_seed`` the
draws are ``model.generate``'s: one ``torch.multinomial`` per step over *every* row of the batch,
finished rows included. A finished row has no logits, so `choose` gives it a placeholder
distribution: the one-sample ``multinomial`` draws ``argmax(p / q)`` with ``q ~ Exp(1)`` over the
whole ``[rows, vocab]`` tensor, so the placeholder changes no other row's token.

Example:
    >>> import dataclasses, torch
    >>> from paged_ref.hf.decoding import Decoding
    >>> d = Decoding(do_sample=True, temperature=1.0, top_k=2, top_p=1.0, num_return_sequences=1,
    ...              num_beams=1, length_penalty=1.0, early_stopping=False)
    >>> warp(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), d)        # top_k=2 keeps the two largest
    tensor([[-inf, 3., -inf, 2.]])
    >>> torch.manual_seed(0) and None
    >>> choose(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), d)                 # drawn from tokens 1 and 3 only
    tensor([1])
    >>> choose(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), dataclasses.replace(d, do_sample=False))  # greedy
    tensor([1])
"""

from __future__ import annotations

import torch

from .decoding import Decoding

__all__ = ["top_k_warp", "top_p_warp", "warp", "choose"]


def top_k_warp(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep each row's ``top_k`` largest scores (and any equal to the k-th); the rest become -inf."""
    k = min(top_k, scores.shape[-1])
    kth = torch.topk(scores, k).values[..., -1:]  # [rows, 1]: the k-th largest score
    return scores.masked_fill(scores < kth, float("-inf"))


def top_p_warp(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens holding at least ``top_p`` of the probability."""
    ascending, order = torch.sort(scores, descending=False)  # [rows, vocab], least likely first
    below = ascending.softmax(dim=-1).cumsum(dim=-1)  # probability of this token and all less likely ones
    drop_sorted = below <= (1 - top_p)  # these together hold at most 1 - top_p: the tail to cut
    drop_sorted[..., -1:] = False  # the most likely token always stays
    drop = drop_sorted.scatter(1, order, drop_sorted)  # back to vocabulary order
    return scores.masked_fill(drop, float("-inf"))


def warp(logits: torch.Tensor, decoding: Decoding) -> torch.Tensor:
    """The sampling warpers transformers applies for ``decoding``, in its order; ``[rows, vocab]``."""
    scores = logits
    if decoding.temperature != 1.0:
        scores = scores / decoding.temperature
    if decoding.top_k != 0:
        scores = top_k_warp(scores, decoding.top_k)
    if decoding.top_p < 1.0:
        scores = top_p_warp(scores, decoding.top_p)
    return scores


def choose(
    logits: torch.Tensor, decoding: Decoding, *, rows: int | None = None, active: list[int] | None = None
) -> torch.Tensor:
    """The next token of each row: LongTensor ``[len(active)]`` (``[rows]`` when all are active).

    Args:
        logits: float32 ``[len(active), vocab]``, the logits of the rows still generating.
        decoding: greedy (argmax) or sampling (warpers, softmax, one multinomial draw).
        rows, active: the batch has ``rows`` rows and ``logits`` belongs to rows ``active`` (in
            order); the draw is made over all ``rows``, finished ones with a placeholder
            distribution, so that the random stream is consumed as transformers consumes it.
            Default: every row is active.
    """
    if not decoding.do_sample:
        return logits.argmax(dim=-1)
    probs = warp(logits, decoding).softmax(dim=-1)  # [num_active, vocab]
    if rows is None or active is None or len(active) == rows:
        return torch.multinomial(probs, num_samples=1)[:, 0]
    full = torch.ones(rows, probs.shape[-1], dtype=probs.dtype, device=probs.device)  # [rows, vocab]
    index = torch.tensor(active, device=probs.device)
    full[index] = probs
    return torch.multinomial(full, num_samples=1)[index, 0]
