"""Integer arithmetic the paging code repeats: ceiling division and the power-of-two growth rule."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0``: pages for ``a`` tokens, tiles over ``a`` columns.

    Example:
        >>> cdiv(33, 16), cdiv(32, 16), cdiv(0, 16)
        (3, 2, 0)
    """
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (``n >= 1``): the size a growing pool doubles to.

    Example:
        >>> next_pow2(1), next_pow2(5), next_pow2(8)
        (1, 8, 8)
    """
    return 1 << (n - 1).bit_length()
