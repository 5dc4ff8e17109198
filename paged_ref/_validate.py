"""Argument checks shared by every public entry point: each error names the argument, what was
expected and what was given."""

from __future__ import annotations

import math
import numbers

import torch

INT32_MAX = 2**31 - 1  # the largest page id or length a block table (int32) holds


def is_int(x) -> bool:
    """A Python or numpy integer (not a bool)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_int(name: str, value, *, min_value: int | None = None, max_value: int | None = None) -> int:
    """Return ``value`` as an int, or raise if it is not an integer in ``[min_value, max_value]``."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    value = int(value)
    if min_value is not None and value < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {value}")
    if max_value is not None and value > max_value:
        bound = f"<= {max_value}" if min_value is None else f"in [{min_value}, {max_value}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_list(name: str, value, what: str = "ints") -> list:
    """``value`` as a list (a list as it is; a tuple, range, 1-D tensor or array); a scalar, string,
    dict or 0-d tensor is refused."""
    if type(value) is list:
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        return value.tolist()
    if not isinstance(value, (str, bytes, dict, torch.Tensor)):
        try:
            return list(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be a list of {what}, got {type(value).__name__} ({value!r})")


def check_bool(name: str, value, what: str = "True or False") -> bool:
    """Raise unless ``value`` is True or False (not 0 or 1); ``what`` names what else the caller took."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    return value


def check_real(name: str, value, what: str = "a finite real number") -> float:
    """``value`` as a float, or a TypeError unless it is a finite real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    return float(value)


def check_token_range(name: str, lo: int, hi: int, vocab: int | None) -> None:
    """Raise unless the token ids ``name`` holds, from ``lo`` to ``hi``, are in ``[0, vocab)`` (None: any >= 0)."""
    if lo < 0 or (vocab is not None and hi >= vocab):
        raise ValueError(f"{name} must hold token ids in [0, vocab_size={vocab}), got values in [{lo}, {hi}]")


def eos_ids(eos, vocab: int | None) -> list[int]:
    """End-of-sequence ids as a list: an int, a list or 1-D tensor of ints, or None/[] (never stop early)."""
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    items = [] if eos is None else [eos] if is_int(eos) else eos
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__") or not all(is_int(e) for e in items):
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos!r}")
    items = [int(e) for e in items]
    if any(e < 0 or (vocab is not None and e >= vocab) for e in items):
        raise ValueError(f"eos_token_id must be token ids in [0, vocab_size={vocab}), got {items}")
    return items


def check_choice(name: str, value, choices) -> str:
    """Raise unless ``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:  # every choice is a str (a list is not even hashable)
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def describe(x) -> str:
    """What was given, for an error message: a tensor's shape and dtype, else the type's name."""
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {list(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__}"
