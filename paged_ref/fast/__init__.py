"""The CPU speed-ups of a serving step, beside the lesson: what ``fast=`` turns on.

The lesson's step is the readable one: transformers' modules, ``F.linear``, PyTorch's small ops. On a
CPU a small model's step spends much of its time around the ideas the lesson is about (``bench
serve --profile`` says where); these modules do what vLLM's CPU build does about it, each giving
the eager step's tokens:

- `paged_ref.fast.prepack`: linear layers on weights packed once for oneDNN (q/k/v and gate/up each
  one product), and a C++ kernel for products of few rows (``csrc/few_rows.cpp``);
- `paged_ref.fast.flat`: a Llama model's layers as one loop, transformers' operations without its
  module calls;
- `paged_ref.fast.cpu_ops`: that loop's norms, RoPE and SwiGLU as C++ kernels (``csrc/cpu_ops.cpp``).

`Fast` (`paged_ref.fast.option`) says which run, with the attention backend that reads the pages in
place (`paged_ref.attention.cpu_paged`, one of the lesson's backends): ``PagedSession(model, ...,
fast=Fast(prepack=True))``, or ``fast=True`` for every part the model allows. The lesson reaches
this package only through that option (`paged_ref.hf.session.fast_step`).
"""

from .option import Fast, resolve

__all__ = ["Fast", "resolve"]
