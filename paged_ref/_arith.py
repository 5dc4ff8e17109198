"""Integer arithmetic the paging code repeats: ceiling division and the power-of-two growth rule."""

from __future__ import annotations


def cdiv(a, b: int):
    """``ceil(a / b)`` for an int or an integer tensor ``a`` (elementwise), ``b > 0``: pages for
    ``a`` tokens, tiles over ``a`` columns.

    Example:
        >>> cdiv(33, 16), cdiv(32, 16), cdiv(0, 16)
        (3, 2, 0)
        >>> import torch
        >>> cdiv(torch.tensor([0, 1, 16, 17]), 16).tolist()
        [0, 1, 1, 2]
    """
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (``n >= 1``): the size a growing pool doubles to.

    Example:
        >>> next_pow2(1), next_pow2(5), next_pow2(8)
        (1, 8, 8)
    """
    return 1 << (n - 1).bit_length()
