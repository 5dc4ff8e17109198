"""Argument checks shared by every public entry point: each error names the argument, what was
expected and what was given."""

from __future__ import annotations

import numbers

import torch


def check_int(name: str, value, *, min_value: int | None = None) -> int:
    """Return ``value`` as an int, or raise if it is not an integer >= ``min_value``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    value = int(value)
    if min_value is not None and value < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {value}")
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


def check_choice(name: str, value, choices) -> str:
    """Raise unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def describe(x) -> str:
    """What was given, for an error message: a tensor's shape and dtype, else the type's name."""
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {list(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__}"
