"""What the model benchmarks (generate, sharing, serve) share: the run's start, prompts, generation methods,
a peak-RSS probe and the median of per-pair ratios."""

from __future__ import annotations

import functools
import inspect
import os
import threading

import torch

from ... import hf, models
from ...block_table import pages_needed
from ...cache import PagedKVCache
from ...memory import model_geometry
from .. import textdata
from .common import bench_parser, paired_ratio

__all__ = ["PAGE_SIZE", "PeakRSS", "cb_config", "generation_methods", "load_model", "paired_ratio", "prompt_tokens"]
__all__ += ["model_parser", "start_run", "text_ids"]

PAGE_SIZE = 16


def text_ids(tokenizer, n: int, *, start: int = 0) -> list[int]:
    """The first ``n`` token ids of English prose from paragraph ``start`` (`paged_ref.lab.textdata`)."""
    words = n
    while True:  # pydoc prose tokenizes to ~1.3 tokens per word: grow until long enough
        ids = tokenizer(textdata.english_text(words, start=start)).input_ids
        if len(ids) >= n:
            return ids[:n]
        words = int(words * 1.5) + 8


def prompt_tokens(model, tokenizer, n: int, start: int = 0) -> torch.Tensor:
    """LongTensor ``[n]``: real text when a tokenizer is given, else random ids seeded by ``n``."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(n)
        return torch.randint(3, model.config.vocab_size, (n,), generator=g)
    return torch.tensor(text_ids(tokenizer, n, start=start))


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
    """``(model, tokenizer)``: the bundled SmolLM2, or the tiny random Llama without a tokenizer."""
    return models.load_smollm2() if name == "smollm2" else (models.tiny_llama(), None)


def model_parser(name: str, doc: str, *, repeats: str):
    """`bench_parser` with the flags `start_run` reads: ``--quick``, ``--model``, ``--threads``, ``--repeats``."""
    parser = bench_parser(name, doc)
    parser.add_argument("--quick", action="store_true", help="short prompts, few tokens, one repeat")
    parser.add_argument(
        "--model", choices=["smollm2", "tiny"], default="smollm2", help="SmolLM2-135M or the tiny Llama"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=None, help=repeats)
    return parser


def start_run(args, quick: dict, full: dict, *, model=None):
    """``--threads``, the ``--model`` (or ``model``, a ``(model, tokenizer)`` already loaded), the
    sizes of ``--quick`` or the full run with ``--repeats`` over the profile's, and the JSON's first
    keys. Returns ``(model, tokenizer, sizes, data)``."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model) if model is None else model
    sizes = dict(quick if args.quick else full)
    if args.repeats is not None:
        sizes["repeats"] = args.repeats
    data = {"model": args.model, "mode": "quick" if args.quick else "full", "torch_threads": torch.get_num_threads()}
    return model, tokenizer, sizes, data


def cb_config(page_size: int, **kwargs):
    """transformers' ``ContinuousBatchingConfig``, ``page_size`` tokens per block (``block_size`` before 5.24),
    CUDA graphs and async batching off."""
    from transformers import ContinuousBatchingConfig

    params = inspect.signature(ContinuousBatchingConfig.__init__).parameters
    size = {"page_size" if "page_size" in params else "block_size": page_size}
    return ContinuousBatchingConfig(**size, use_cuda_graph=False, use_async_batching=False, **kwargs)


def generation_methods(model, rows, new, backends, with_generate_batch):
    """name -> run() -> ``(generated token lists, {"kv_bytes": ...})`` for one workload (greedy, EOS off)."""
    from transformers import GenerationConfig

    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else pad
    width = max(len(r) for r in rows)  # left padding
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)  # [B, width]
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)  # [B, width]
    per_token = model_geometry(model).bytes_per_token
    num_pages = sum(pages_needed(len(r) + new, PAGE_SIZE) for r in rows)
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
    same = dict(attention_mask=mask, max_new_tokens=new, eos_token_id=[], progress=False)

    def hf_generate():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
        return [row[width:].tolist() for row in out], {"kv_bytes": len(rows) * (width + new) * per_token}

    def paged(backend):
        kv = PagedKVCache.for_model(model, num_pages=num_pages, page_size=PAGE_SIZE)
        used = [0]

        def count(step, tokens):
            used[0] = max(used[0], kv.num_pages - kv.allocator.num_free)

        out = hf.generate(model, ids, backend=backend, kv_cache=kv, callback=count, **same)
        pool = {"kv_bytes": used[0] * kv.page_bytes, "kv_pool_bytes": kv.num_pages * kv.page_bytes}
        return [row[width:].tolist() for row in out], pool

    def hf_generate_batch():
        cfg = cb_config(PAGE_SIZE, num_blocks=num_pages, max_batch_tokens=sum(len(r) for r in rows))
        res = model.generate_batch(
            rows, generation_config=config, continuous_batching_config=cfg, warmup=False, progress_bar=False
        )
        order = sorted(res.values(), key=lambda o: int(o.request_id.split("_")[-1]))
        return [list(o.generated_tokens) for o in order], {"kv_bytes": num_pages * PAGE_SIZE * per_token}

    methods = {"hf_generate": hf_generate}
    methods.update({f"paged_{b}": functools.partial(paged, b) for b in backends})
    if with_generate_batch:
        methods["hf_generate_batch"] = hf_generate_batch
    return methods
