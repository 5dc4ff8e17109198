"""Sampling from the paged cache on a tiny random Llama: the same draws as model.generate, shared pages, checks.

Also run under the GPU image's transformers (5.17) by `make test-compat`.
"""

import copy

import pytest
import torch
from prompts import left_padded

from paged_ref import PagedKVCache, hf
from paged_ref.hf.decoding import choose, resolve, warp


def _seeded(fn, seed, *args, **kwargs):
    torch.manual_seed(seed)
    return fn(*args, **kwargs)


WARPERS = {
    "defaults (top_k=50)": {},
    "temperature": {"temperature": 0.7},
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.8},
    "all three": {"temperature": 1.3, "top_k": 0, "top_p": 0.9},
}


# ---------------------------------------------------------------------------------- same draws
@pytest.mark.parametrize(
    ("n", "warpers"),
    [
        (1, "defaults (top_k=50)"),
        (2, "temperature"),
        (4, "top_k"),
        (8, "top_p"),
        (4, "all three"),
        (8, "defaults (top_k=50)"),
    ],
)
def test_seeded_samples_equal_model_generate(model, n, warpers):
    ids, mask = left_padded([3, 9, 5], seed=n)
    args = dict(attention_mask=mask, do_sample=True, num_return_sequences=n, max_new_tokens=14, **WARPERS[warpers])
    free = _seeded(model.generate, n, ids, eos_token_id=[], **args)
    eos = int(free[0, ids.shape[1] + 2])  # a token row 0 samples at step 2: some rows now finish early
    expected = _seeded(model.generate, n, ids, eos_token_id=eos, pad_token_id=1, **args)
    kv = PagedKVCache.for_model(model, num_pages=3 * n * 6, page_size=4)  # every row at full length
    out = _seeded(hf.generate, n, model, ids, eos_token_id=eos, pad_token_id=1, kv_cache=kv, **args)
    assert out.shape == expected.shape == (3 * n, ids.shape[1] + expected.shape[1] - ids.shape[1])
    assert torch.equal(out, expected)
    assert (expected[:, ids.shape[1] :] == 1).any(), "the eos chosen should finish a row early"
    assert kv.seq_ids == [] and kv.allocator.num_free == kv.num_pages


def test_stream_yields_every_row_and_equals_generate(model):
    ids = torch.randint(3, 512, (1, 6), generator=torch.Generator().manual_seed(1))
    args = dict(max_new_tokens=6, do_sample=True, num_return_sequences=3, top_p=0.9)
    with _seeded(hf.stream, 4, model, ids, **args) as steps:
        tokens = torch.stack(list(steps), dim=1)  # [3, 6]
    assert torch.equal(torch.cat([ids.repeat(3, 1), tokens], dim=1), _seeded(model.generate, 4, ids, **args))


def test_model_generation_config_sets_the_defaults(model):
    sampler = copy.deepcopy(model)
    sampler.generation_config.do_sample = True  # a checkpoint that samples by default
    sampler.generation_config.temperature = 0.6
    sampler.generation_config.top_k = 7
    d = resolve(sampler)
    assert (d.mode, d.temperature, d.top_k, d.top_p) == ("sample", 0.6, 7, 1.0)
    assert resolve(sampler, do_sample=False).mode == "greedy"  # an argument wins
    ids = torch.tensor([[5, 9, 11, 3]])
    expected = _seeded(sampler.generate, 2, ids, max_new_tokens=8)
    assert torch.equal(_seeded(hf.generate, 2, sampler, ids, max_new_tokens=8), expected)
    assert not torch.equal(expected, model.generate(ids, max_new_tokens=8, do_sample=False))


def test_unimplemented_processor_in_generation_config_is_refused(model):
    penalized = copy.deepcopy(model)
    penalized.generation_config.repetition_penalty = 1.2
    with pytest.raises(NotImplementedError, match="repetition_penalty=1.2"):
        hf.generate(penalized, torch.tensor([[1, 2]]), max_new_tokens=2)


@pytest.mark.parametrize(("name", "value"), [("max_time", 5.0), ("stop_strings", ["ab"]), ("token_healing", True)])
def test_stopping_criteria_in_generation_config_are_refused(model, name, value):
    """transformers stops early on a time limit or a stop string (token healing rewrites the prompt):
    paged_ref.hf implements none of them, so it refuses them rather than generating past them."""
    configured = copy.deepcopy(model)
    setattr(configured.generation_config, name, value)
    with pytest.raises(NotImplementedError, match=f"{name}="):
        hf.generate(configured, torch.tensor([[1, 2]]), max_new_tokens=2)


@pytest.mark.parametrize(("name", "value"), [("encoder_repetition_penalty", 5.0), ("encoder_no_repeat_ngram_size", 1)])
def test_encoder_side_processors_penalize_a_decoders_prompt_and_are_refused(model, name, value):
    """On a decoder-only model transformers takes the prompt for the encoder input: these settings change
    model.generate's tokens (the penalty on the prompt's tokens, the prompt's 1-grams banned), so they are refused."""
    ids = torch.arange(100, 112)[None]
    free = model.generate(ids, max_new_tokens=8, do_sample=False)
    penalized = copy.deepcopy(model)
    setattr(penalized.generation_config, name, value)
    if name == "encoder_no_repeat_ngram_size":  # the prompt holds the tokens generated without it: now banned
        ids = torch.cat([ids, free[:, 12:]], dim=1)
        free = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert not torch.equal(penalized.generate(ids, max_new_tokens=8, do_sample=False), free)
    with pytest.raises(NotImplementedError, match=f"{name}={value}"):
        hf.generate(penalized, ids, max_new_tokens=8)


# ---------------------------------------------------------------------------------- shared pages
def test_samples_share_the_prompts_pages_and_copy_only_the_partial_one(model):
    kv = PagedKVCache.for_model(model, num_pages=32, page_size=4)
    snapshots = []
    prompt = torch.arange(3, 12)[None]  # 9 tokens: pages of 4, 4 and 1
    hf.generate(
        model,
        prompt,
        max_new_tokens=3,
        do_sample=True,
        num_return_sequences=4,
        eos_token_id=[],
        kv_cache=kv,
        callback=lambda step, tokens: snapshots.append([kv.pages(s) for s in kv.seq_ids]),
    )
    after_prefill, after_one = snapshots[0], snapshots[1]
    assert all(pages == after_prefill[0] for pages in after_prefill)  # one prefill, 4 forks of it
    assert len({p for pages in after_prefill for p in pages}) == 3
    assert all(pages[:2] == after_prefill[0][:2] for pages in after_one)  # full pages stay shared
    assert len({pages[2] for pages in after_one}) == 4  # the partial page: 3 copies, 1 original
    assert after_prefill[0][2] in {pages[2] for pages in after_one}
    assert kv.allocator.num_free == kv.num_pages


# ---------------------------------------------------------------------------------- the warpers
@pytest.mark.parametrize("seed", range(3))
def test_warpers_match_transformers_own(seed):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 300, generator=g) * 3
    logits[0, :10] = logits[0, 10]  # ties at the top-k boundary
    logits[1] = logits[1].round()  # many ties everywhere
    for t, k, p in [(1.0, 50, 1.0), (0.5, 0, 0.9), (2.0, 7, 0.3), (1.0, 1, 1e-6), (0.8, 300, 0.999)]:
        d = resolve(None, do_sample=True, temperature=t, top_k=k, top_p=p)
        expected = logits
        if t != 1.0:
            expected = TemperatureLogitsWarper(t)(None, expected)
        if k:
            expected = TopKLogitsWarper(top_k=k)(None, expected)
        if p < 1.0:
            expected = TopPLogitsWarper(top_p=p)(None, expected)
        assert torch.equal(warp(logits, d), expected), (t, k, p)


def test_placeholder_rows_change_no_other_rows_draw():
    probs_logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    d = resolve(None, do_sample=True, top_k=0)
    every = _seeded(choose, 3, probs_logits, d)  # [5]: all rows active
    some = _seeded(choose, 3, probs_logits[[0, 2, 4]], d, rows=5, active=[0, 2, 4])
    assert torch.equal(some, every[[0, 2, 4]])


# ---------------------------------------------------------------------------------- bad input
TRANSFORMERS_REFUSES = [  # refused by model.generate too (ValueError)
    dict(num_return_sequences=3),  # greedy returns one sequence per prompt
    dict(do_sample=True, temperature=0.0),
    dict(do_sample=True, temperature=-1.0),
    dict(do_sample=True, top_p=-0.1),
    dict(do_sample=True, top_k=-1),
    dict(num_beams=2, num_return_sequences=3),
]
ALSO_REFUSED = [
    (dict(do_sample=True, top_p=0.0), ValueError),
    (dict(do_sample=True, top_p=1.5), ValueError),  # transformers ignores top_p > 1
    (dict(do_sample="yes"), TypeError),
    (dict(early_stopping="sometimes"), ValueError),
    (dict(num_beams=0), ValueError),
    (dict(top_k=2.5), TypeError),
    (dict(num_beams=2, do_sample=True), NotImplementedError),  # beam sampling
    (dict(do_sample=True, num_return_sequences=2, eviction="streaming_llm", budget=8), NotImplementedError),
    (dict(num_beams=2, streamer=object()), ValueError),
]


@pytest.mark.parametrize("kwargs", TRANSFORMERS_REFUSES)
def test_bad_arguments_refused_like_transformers_and_nothing_allocated(model, kwargs):
    ids = torch.tensor([[4, 5, 6]])
    with pytest.raises(ValueError):
        model.generate(ids, max_new_tokens=2, **kwargs)
    kv = PagedKVCache.for_model(model, num_pages=8, page_size=4)
    with pytest.raises(ValueError, match=next(iter(k for k in kwargs if k not in ("do_sample", "num_beams")))):
        hf.generate(model, ids, max_new_tokens=2, kv_cache=kv, **kwargs)
    assert kv.seq_ids == [] and kv.allocator.num_free == kv.num_pages


@pytest.mark.parametrize(("kwargs", "error"), ALSO_REFUSED)
def test_other_bad_arguments_refused_and_nothing_allocated(model, kwargs, error):
    kv = PagedKVCache.for_model(model, num_pages=8, page_size=4)
    with pytest.raises(error):
        hf.generate(model, torch.tensor([[4, 5, 6]]), max_new_tokens=2, kv_cache=kv, **kwargs)
    assert kv.seq_ids == [] and kv.allocator.num_free == kv.num_pages
