"""transformers' own continuous batching on the same requests: the peer of ``bench serve``.

``model.generate_batch`` is a loop around transformers' ``ContinuousBatchingManager``: it adds the
prompts, then collects results. It takes one ``max_new_tokens`` for every prompt, so this runs the
same manager directly (``continuous_batching_context_manager``) and adds each request with its own
``max_new_tokens``, all at once (offline), EOS disabled (``eos_token_id=-1``) as in our runs. The
manager is sized like our pool: ``page_size`` tokens per page, ``num_blocks`` = our pages (a block
holds a page of every layer: equal KV memory), the same token budget per step and the same
``max_requests_per_batch``; CUDA graphs and async batching off, prefix sharing off (our runs do
not share prefixes either). Times come from the manager's own per-token timestamps.
"""

from __future__ import annotations

import inspect
import time

__all__ = ["run_peer"]


def run_peer(model, requests, *, page_size: int, num_pages: int, max_batched_tokens: int, max_num_seqs: int) -> dict:
    """Serve ``requests`` (``[(prompt_ids, max_new_tokens)]``) offline with transformers' manager.

    Returns ``{"tokens": [[ids] per request], "wall_s", "first_token_s": [...], "finish_s": [...],
    "num_blocks": the manager's own count of its cache}`` (times from the submission of the first
    request, in seconds).
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    params = inspect.signature(ContinuousBatchingConfig.__init__).parameters
    size_kw = {"page_size" if "page_size" in params else "block_size": page_size}  # renamed in 5.24
    cfg = ContinuousBatchingConfig(
        **size_kw,
        num_blocks=num_pages,
        max_batch_tokens=max_batched_tokens,
        max_requests_per_batch=max_num_seqs,
        allow_block_sharing=False,
        use_cuda_graph=False,
        use_async_batching=False,
    )
    pad = model.generation_config.pad_token_id
    gen = GenerationConfig(do_sample=False, max_new_tokens=1, pad_token_id=0 if pad is None else pad, eos_token_id=-1)
    results = {}
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cfg, block=True, timeout=5, warmup=False
    ) as manager:
        start = time.perf_counter()
        for i, (prompt, new) in enumerate(requests):
            manager.add_request(
                list(prompt), request_id=f"r{i}", max_new_tokens=new, eos_token_id=-1, record_timestamps=True
            )
        while len(results) < len(requests):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError(f"transformers' manager stopped with {len(results)} of {len(requests)} results")
        wall = time.perf_counter() - start
        cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
        num_blocks = getattr(cache, "num_blocks", None)
    outs = [results[f"r{i}"] for i in range(len(requests))]
    for o in outs:
        if o.error is not None:
            raise RuntimeError(f"transformers' manager failed request {o.request_id}: {o.error}")
    return {
        "tokens": [list(o.generated_tokens) for o in outs],
        "wall_s": wall,
        "first_token_s": [o.timestamps[0] - start if o.timestamps else None for o in outs],
        "finish_s": [o.timestamps[-1] - start if o.timestamps else None for o in outs],
        "num_blocks": num_blocks,
    }
