"""`load_smollm2`'s one-parse load against transformers' own, in one process (not collected by pytest).

    python tests/check_gguf_load.py

Loads SmolLM2 twice, with and without `paged_ref.models._gguf_parsed_once`, prints both times and
checks that the weights, config, generation config, tokenizer and chat template are identical
(~20 s on 2 cores). Exit status 1 on any difference.
"""

import sys
import time

import torch

from paged_ref import models

TEXTS = ["The KV cache stores keys and values.", "  Héllo wörld\n\t<|im_start|>user 12345 ```py\nx=1```"]


def main() -> int:
    load = models._load_smollm2_cached.__wrapped__  # the uncached load, one-parse shortcut included
    start = time.perf_counter()
    fast, fast_tok = load(torch.float32)
    fast_s = time.perf_counter() - start
    shortcut = models._gguf_parsed_once
    models._gguf_parsed_once = lambda: __import__("contextlib").nullcontext()  # transformers as shipped
    try:
        start = time.perf_counter()
        plain, plain_tok = load(torch.float32)
        plain_s = time.perf_counter() - start
    finally:
        models._gguf_parsed_once = shortcut
    a, b = fast.state_dict(), plain.state_dict()
    checks = {
        "same weight names": a.keys() == b.keys(),
        "same weights": all(torch.equal(a[k], b[k]) for k in a),
        "same config": fast.config.to_dict() == plain.config.to_dict(),
        "same generation config": fast.generation_config.to_dict() == plain.generation_config.to_dict(),
        "same token ids": all(fast_tok(t).input_ids == plain_tok(t).input_ids for t in TEXTS),
        "same chat template": fast_tok.chat_template == plain_tok.chat_template,
        "same special tokens": fast_tok.special_tokens_map == plain_tok.special_tokens_map,
    }
    print(f"one-parse load {fast_s:.1f} s, transformers' own {plain_s:.1f} s ({plain_s / fast_s:.2f}x)")
    for name, ok in checks.items():
        print(f"  {name}: {ok}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
