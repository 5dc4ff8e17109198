"""Count the bytes a PyTorch attention path actually reads out of the cache tensors.

`ReadCounter` is a `torch.overrides.TorchFunctionMode` watching a set of tensors (the K/V pages
of every layer, and Quest's page summaries). Every PyTorch call that takes a tensor sharing
storage with one of them is looked at:

* a call whose result is itself a view of a watched tensor (a slice, ``view``, ``transpose``)
  reads nothing yet;
* indexing (``t[index]``, ``index_select``, ``gather``) copies out what it selects: the bytes of
  its result are counted (not those of the whole cache it indexes);
* any other call (a matmul on a view of a page, a ``copy_`` out of it) reads its watched inputs
  whole: their bytes are counted;
* writes into a watched tensor (``index_copy_`` of new tokens) return the watched tensor, and
  metadata (``shape``, ``dim()``, ``dtype``) is no tensor: neither counts.

Example:
    >>> import torch
    >>> cache = torch.zeros(8, 4, 2)                    # 8 pages of 4 tokens x 2 floats
    >>> with ReadCounter([cache]) as reads:
    ...     pages = cache[torch.tensor([1, 5])]        # two pages copied out: 2 * 4 * 2 * 4 B
    ...     s = cache[3] @ torch.ones(2)               # a view, then a matmul reads it: 4 * 2 * 4 B
    >>> reads.bytes
    96
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["CallCounter", "ReadCounter"]

_INDEXING = {torch.Tensor.__getitem__, torch.index_select, torch.Tensor.index_select, torch.gather, torch.Tensor.gather}


class ReadCounter(TorchFunctionMode):
    """Within ``with ReadCounter(tensors) as reads:``, ``reads.bytes`` counts what is read from ``tensors``."""

    def __init__(self, tensors):
        super().__init__()
        self._storages = {t.untyped_storage().data_ptr() for t in tensors}
        self.bytes = 0

    def _watched(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in self._storages

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not any(isinstance(x, torch.Tensor) for x in tree_flatten(out)[0]) or self._watched(out):
            return out  # metadata (shape, dtype, dim), a view of a watched tensor or a write into one
        inputs = [x for x in tree_flatten((args, kwargs))[0] if self._watched(x)]
        if inputs:
            if func in _INDEXING and isinstance(out, torch.Tensor):
                self.bytes += out.numel() * out.element_size()
            else:
                self.bytes += sum(x.numel() * x.element_size() for x in inputs)
        return out


class CallCounter(TorchFunctionMode):
    """Within ``with CallCounter() as c:``, ``c.calls`` counts the PyTorch functions called (each one a
    trip from Python into PyTorch: what a loop over requests pays per request).

    Example:
        >>> with CallCounter() as c:
        ...     y = torch.ones(3).sum() + 1
        >>> c.calls
        3
    """

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))
