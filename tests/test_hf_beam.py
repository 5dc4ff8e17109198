"""Beam search over forked pages on a tiny random Llama: model.generate's beams and scores, pages kept, forked, freed.

Also run under the GPU image's transformers (5.17) by `make test-compat`.
"""

import pytest
import torch
from prompts import left_padded

from paged_ref import PagedKVCache, hf
from paged_ref.hf.cache import PagedCache
from paged_ref.models import tiny_llama


def _ends(model, ids, mask, k):
    """Two tokens the best beams generate at steps 3 and 5: as EOS ids they end hypotheses early."""
    free = model.generate(
        ids, attention_mask=mask, num_beams=k, max_new_tokens=12, do_sample=False, eos_token_id=[], pad_token_id=1
    )
    return [int(free[0, ids.shape[1] + 3]), int(free[-1, ids.shape[1] + 5])]


SETTINGS = [  # (num_beams, length_penalty, early_stopping, num_return_sequences)
    (2, 1.0, False, 1),
    (4, 1.0, False, 4),
    (4, 0.5, True, 2),
    (8, 2.0, "never", 3),
    (8, -1.0, False, 8),
]


@pytest.mark.parametrize(("k", "length_penalty", "early_stopping", "n"), SETTINGS)
def test_beams_and_scores_equal_model_generate(model, k, length_penalty, early_stopping, n):
    ids, mask = left_padded([3, 9, 5], seed=k)
    args = dict(
        attention_mask=mask,
        num_beams=k,
        max_new_tokens=12,
        eos_token_id=_ends(model, ids, mask, k),
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        num_return_sequences=n,
    )
    expected = model.generate(ids, do_sample=False, output_scores=True, return_dict_in_generate=True, **args)
    kv = PagedKVCache.for_model(model, num_pages=3 * 8 * 6, page_size=4)
    out = hf.beam_search(model, ids, kv_cache=kv, **args)
    assert torch.equal(out.sequences, expected.sequences)
    # float32 scores: 1e-4 absolute, and a few ulps where a length_penalty < 0 makes them large
    torch.testing.assert_close(out.sequences_scores, expected.sequences_scores, atol=1e-4, rtol=1e-6)
    assert torch.equal(hf.generate(model, ids, **args), expected.sequences)  # generate's beam path
    assert kv.seq_ids == [] and kv.allocator.num_free == kv.num_pages
    kv.allocator.check()


def test_some_hypotheses_end_early_and_are_filled_like_model_generate(model):
    ids, mask = left_padded([4, 7], seed=3)
    eos = _ends(model, ids, mask, 4)
    args = dict(attention_mask=mask, num_beams=4, num_return_sequences=4, max_new_tokens=12, eos_token_id=eos)
    args["length_penalty"] = 0.0  # scores are plain sums of log-probabilities: short hypotheses win
    expected = model.generate(ids, do_sample=False, **args)  # pad_token_id is 0: filled with the first eos id
    out = hf.generate(model, ids, **args)
    assert torch.equal(out, expected)
    ended = torch.isin(out[:, ids.shape[1] :], torch.tensor(eos))  # [8, generated]
    lengths = [int(row.nonzero()[0]) if row.any() else None for row in ended]
    early = [(row, x) for row, x in enumerate(lengths) if x is not None and ids.shape[1] + x + 1 < out.shape[1]]
    assert len({x for _, x in early}) > 1  # hypotheses ended at different steps
    for row, x in early:  # after its EOS a hypothesis is filled with the first EOS id (pad_token_id is 0)
        assert (out[row, ids.shape[1] + x + 1 :] == eos[0]).all()


def test_pages_follow_the_selection(model):
    """Survivors keep their pages, a fork shares its parent's, a cut beam's pages go back to the pool."""
    kv = PagedKVCache.for_model(model, num_pages=64, page_size=4)
    checked = {"forks": 0, "cuts": 0, "copies": 0}

    def check(step, st):
        held = {p for pages in st.pages.values() for p in pages}
        assert st.pages_held == len(held)
        for child, parent in st.forked.items():  # a fork holds exactly its parent's pages, shared
            assert kv.pages(child) == kv.pages(parent)
            assert all(kv.allocator.refcount(p) >= 2 for p in kv.pages(child))
            checked["forks"] += 1
        for p in st.freed:  # returned to the pool
            assert kv.allocator.refcount(p) == 0
        for seq in st.cut:
            assert seq not in kv.seq_ids
            checked["cuts"] += 1
        live = [s for b in st.beams for s in b]
        assert sorted(live) == sorted(kv.seq_ids)  # only the next step's beams hold pages
        for seq, pages in st.copied.items():  # a copy replaces the beam's last, partly filled page
            assert len(pages) == 1 and pages[0] == st.pages[seq][-1]
            assert seq in st.cut + st.released or kv.allocator.refcount(pages[0]) >= 1
            checked["copies"] += 1

    prompt = torch.arange(20, 29)[None]  # 9 tokens: pages of 4, 4 and 1
    out = hf.beam_search(model, prompt, num_beams=4, max_new_tokens=10, eos_token_id=[], kv_cache=kv, callback=check)
    assert all(checked.values()), checked
    assert out.copies == checked["copies"]
    assert max(out.pages_held) < 4 * 5  # 4 beams of 19 tokens without sharing: 20 pages
    assert kv.seq_ids == [] and kv.allocator.num_free == kv.num_pages


def test_a_prompt_that_is_done_frees_its_beams_while_the_batch_goes_on(model):
    ids, mask = left_padded([5, 8], seed=11)
    eos = _ends(model, ids, mask, 2)
    steps = []
    args = dict(attention_mask=mask, num_beams=2, max_new_tokens=12, eos_token_id=eos, length_penalty=0.0)
    out = hf.beam_search(model, ids, callback=lambda step, st: steps.append(st), **args)
    assert torch.equal(out.sequences, model.generate(ids, do_sample=False, **args))
    done_early = [b for b in range(2) if any(not st.beams[b] for st in steps[:-1])]
    assert done_early, "one prompt should be done before the last step"
    b = done_early[0]
    first = next(i for i, st in enumerate(steps) if not st.beams[b])
    assert steps[first].released and all(not st.beams[b] for st in steps[first:])


def test_beam_search_arguments(model):
    ids = torch.tensor([[3, 4, 5]])
    kv = PagedKVCache.for_model(model, num_pages=8, page_size=4)
    with pytest.raises(ValueError, match="num_beams must be >= 2"):
        hf.beam_search(model, ids, num_beams=1, max_new_tokens=2, kv_cache=kv)
    with pytest.raises(ValueError, match="num_return_sequences"):
        hf.beam_search(model, ids, num_beams=2, num_return_sequences=3, max_new_tokens=2, kv_cache=kv)
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf.beam_search(model, ids, num_beams=2, max_new_tokens=0, kv_cache=kv)
    with pytest.raises(TypeError, match="callback"):
        hf.beam_search(model, ids, num_beams=2, max_new_tokens=2, kv_cache=kv, callback=3)
    assert kv.seq_ids == [] and kv.allocator.num_free == kv.num_pages
    with pytest.raises(ValueError, match="beam search"):  # stream cannot beam-search
        model_beams = tiny_llama(seed=0)
        model_beams.generation_config.num_beams = 2
        hf.stream(model_beams, ids, max_new_tokens=2)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("call", ["beam_search", "generate num_beams=2", "generate"])
@pytest.mark.parametrize(("max_new_tokens", "shown"), [(127, False), (128, True)])
def test_progress_none_shows_a_bar_from_128_new_tokens_on_in_every_search(
    model, monkeypatch, call, max_new_tokens, shown
):
    """``progress=None`` (the default) means the same in beam_search as in generate: a bar from 128 new tokens on.
    The callback stops the search at its first step: the bar is made before it."""
    import tqdm.auto

    bars, real = [], tqdm.auto.tqdm
    monkeypatch.setattr(
        tqdm.auto, "tqdm", lambda *args, **kwargs: bars.append(not kwargs["disable"]) or real(*args, **kwargs)
    )

    def stop(step, _):
        raise _Stop

    ids, kv = torch.tensor([[3, 4, 5]]), PagedKVCache.for_model(model, num_pages=2 * 33, page_size=4)
    args = dict(max_new_tokens=max_new_tokens, kv_cache=kv, callback=stop, progress=None)
    with pytest.raises(_Stop):
        if call == "beam_search":
            hf.beam_search(model, ids, num_beams=2, **args)
        else:
            hf.generate(model, ids, num_beams=2 if call.endswith("=2") else 1, **args)
    assert bars == [shown]
    assert kv.seq_ids == [] and kv.allocator.num_free == kv.num_pages


def test_paged_cache_refuses_reordering_and_names_the_paged_way():
    cache = PagedCache(PagedKVCache(num_layers=1, num_pages=2, page_size=2, num_kv_heads=1, head_dim=2))
    with pytest.raises(NotImplementedError, match="num_beams=k"):
        cache.reorder_cache(torch.tensor([0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["auto", "sdpa", "flex"])  # auto is the Triton decode kernel on CUDA
def test_on_cuda_samples_and_beams_equal_model_generate(backend):
    cuda = tiny_llama(seed=0).cuda()
    ids, mask = (t.cuda() for t in left_padded([3, 9, 5], seed=1))
    sample = dict(attention_mask=mask, do_sample=True, num_return_sequences=4, max_new_tokens=10, top_p=0.9)
    torch.manual_seed(0)
    expected = cuda.generate(ids, **sample)
    torch.manual_seed(0)
    assert torch.equal(hf.generate(cuda, ids, backend=backend, **sample), expected)
    beams = dict(attention_mask=mask, num_beams=4, num_return_sequences=2, max_new_tokens=10)
    expected = cuda.generate(ids, do_sample=False, output_scores=True, return_dict_in_generate=True, **beams)
    out = hf.beam_search(cuda, ids, backend=backend, page_size=4, **beams)
    assert torch.equal(out.sequences, expected.sequences)
    assert (out.sequences_scores - expected.sequences_scores).abs().max() < 1e-4
