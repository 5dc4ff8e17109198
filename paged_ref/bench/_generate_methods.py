"""What the generate benchmarks run: the model, its prompts, the generation methods, a peak-RSS probe.

`generate` times these methods in one process; `_generate_memory` runs one of them per fresh
process under `PeakRSS`.
"""

from __future__ import annotations

import inspect
import os
import threading

import torch

from .. import hf, textdata
from ..block_table import pages_needed
from ..cache import PagedKVCache
from ..memory import model_geometry

__all__ = ["PAGE_SIZE", "PeakRSS", "generation_methods", "load_model", "prompt_tokens", "start_run"]

PAGE_SIZE = 16


def prompt_tokens(model, tokenizer, n: int) -> torch.Tensor:
    """LongTensor ``[n]``: real text when a tokenizer is given, else seeded random ids."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(n)
        return torch.randint(3, model.config.vocab_size, (n,), generator=g)
    words = n
    while True:  # pydoc prose tokenizes to ~1.3 tokens per word: grow until long enough
        ids = tokenizer(textdata.english_text(words)).input_ids
        if len(ids) >= n:
            return torch.tensor(ids[:n])
        words = int(words * 1.5) + 8


class PeakRSS:
    """Peak resident-set size of this process while the block runs, sampled every 2 ms (Linux)."""

    def __enter__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self.page
        except OSError:  # not Linux: no sampling
            return 0

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def rise_bytes(self) -> int:
        return self.peak - self.start


def load_model(name: str):
    """``(model, tokenizer)`` for ``--model``: the bundled SmolLM2, or the tiny random Llama without a tokenizer."""
    if name == "smollm2":
        from ..models import load_smollm2

        return load_smollm2()
    from ..models import tiny_llama

    return tiny_llama(), None


def start_run(args, quick: dict, full: dict):
    """The start the model benchmarks (generate, sharing) share: ``--threads``, the ``--model``,
    the sizes of ``--quick`` or the full run with ``--repeats`` over the profile's, and the
    JSON's first keys. Returns ``(model, tokenizer, sizes, data)``."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    sizes = dict(quick if args.quick else full)
    if args.repeats is not None:
        sizes["repeats"] = args.repeats
    data = {"model": args.model, "mode": "quick" if args.quick else "full", "torch_threads": torch.get_num_threads()}
    return model, tokenizer, sizes, data


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r)
        mask[b, width - len(r) :] = 1
    return ids, mask


def generation_methods(model, rows, new, backends, with_generate_batch):
    """name -> (run() -> list of generated token lists, kv_bytes() -> dict) for one workload."""
    from transformers import GenerationConfig

    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else pad
    ids, mask = _left_pad(rows, pad)
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    per_token = model_geometry(model).bytes_per_token
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
    methods = {}

    def hf_default():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
        return [row[ids.shape[1] :].tolist() for row in out]

    methods["hf_generate"] = (hf_default, lambda: {"kv_bytes": len(rows) * (ids.shape[1] + new) * per_token})

    for backend in backends:
        num_pages = sum(pages_needed(len(r) + new, PAGE_SIZE) for r in rows)
        state = {}

        def paged(backend=backend, num_pages=num_pages, state=state):
            kv = PagedKVCache.for_model(model, num_pages=num_pages, page_size=PAGE_SIZE)
            used = [0]

            def count(step, tokens):
                used[0] = max(used[0], kv.num_pages - kv.allocator.num_free)

            out = hf.generate(
                model,
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                backend=backend,
                eos_token_id=[],
                kv_cache=kv,
                callback=count,
                progress=False,
            )
            state.update(peak_pages=used[0], page_bytes=kv.page_bytes, pool_pages=kv.num_pages)
            return [row[ids.shape[1] :].tolist() for row in out]

        methods[f"paged_{backend}"] = (
            paged,
            lambda state=state: {
                "kv_bytes": state["peak_pages"] * state["page_bytes"],
                "kv_pool_bytes": state["pool_pages"] * state["page_bytes"],
            },
        )

    if with_generate_batch:
        from transformers import ContinuousBatchingConfig

        blocks = sum(pages_needed(len(r) + new, PAGE_SIZE) for r in rows)

        # the page size is `page_size` in transformers 5.24 and `block_size` in 5.17
        params = inspect.signature(ContinuousBatchingConfig.__init__).parameters
        size_kw = {"page_size" if "page_size" in params else "block_size": PAGE_SIZE}

        def cb():
            cfg = ContinuousBatchingConfig(
                **size_kw,
                num_blocks=blocks,
                max_batch_tokens=sum(len(r) for r in rows),
                use_cuda_graph=False,
                use_async_batching=False,
            )
            res = model.generate_batch(
                rows, generation_config=config, continuous_batching_config=cfg, warmup=False, progress_bar=False
            )
            order = sorted(res.values(), key=lambda o: int(o.request_id.split("_")[-1]))
            return [list(o.generated_tokens) for o in order]

        methods["hf_generate_batch"] = (cb, lambda: {"kv_bytes": blocks * PAGE_SIZE * per_token})
    return methods
