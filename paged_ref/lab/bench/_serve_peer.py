"""transformers' own continuous batching on the same requests: the peer of ``bench serve``.

``model.generate_batch`` takes one ``max_new_tokens`` for every prompt, so this runs the manager it
wraps (``continuous_batching_context_manager``) and adds each request with its own ``max_new_tokens``,
all at once (offline), EOS disabled. The manager is sized like our pool: ``num_blocks`` = our pages of
``page_size`` tokens (equal KV memory), the same token budget per step and ``max_requests_per_batch``;
CUDA graphs, async batching and prefix sharing off. Times come from its own per-token timestamps.
"""

from __future__ import annotations

import time

from ..serve_metrics import percentile
from ._model_bench import cb_config

__all__ = ["run_peer"]


def run_peer(model, requests, *, page_size: int, num_pages: int, max_batched_tokens: int, max_num_seqs: int):
    """Serve ``requests`` (``[(prompt_ids, max_new_tokens)]``) offline with transformers' manager.

    Returns ``(tokens, summary)``: the generated ids per request, and ``{"tokens", "wall_s",
    "wall_tokens_per_s", "ttft_p50_s", ..., "tpot_p90_s", "num_blocks"}`` (the manager's count of its cache).
    """
    from transformers import GenerationConfig

    cfg = cb_config(
        page_size,
        num_blocks=num_pages,
        max_batch_tokens=max_batched_tokens,
        max_requests_per_batch=max_num_seqs,
        allow_block_sharing=False,
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
        num_blocks = getattr(getattr(getattr(manager, "batch_processor", None), "cache", None), "num_blocks", None)
    outs = [results[f"r{i}"] for i in range(len(requests))]
    for o in outs:
        if o.error is not None:
            raise RuntimeError(f"transformers' manager failed request {o.request_id}: {o.error}")
    tokens = [list(o.generated_tokens) for o in outs]
    ttft = [o.timestamps[0] - start for o in outs if o.timestamps]
    tpot = [
        (o.timestamps[-1] - o.timestamps[0]) / (len(t) - 1) for o, t in zip(outs, tokens) if o.timestamps and len(t) > 1
    ]
    n = sum(len(t) for t in tokens)
    summary = {"tokens": n, "wall_s": wall, "wall_tokens_per_s": n / wall}
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        summary.update({f"{name}_p50_s": percentile(values, 50), f"{name}_p90_s": percentile(values, 90)})
    return tokens, {**summary, "num_blocks": num_blocks}
