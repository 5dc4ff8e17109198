"""paged_ref.hf on a tiny random Llama: same tokens as model.generate, pages freed, log-likelihoods equal."""

import json
import re

import pytest
import torch
from prompts import left_padded

from paged_ref import OutOfPagesError, PagedKVCache, hf
from paged_ref.eviction import make_policy
from paged_ref.lab.likelihood import log_likelihood, reference_log_likelihood
from paged_ref.lab.mistakes import MISTAKES

BACKENDS = ["reference", "flex", "triton", "sdpa", "cpu_paged", "auto"]
# new tokens per backend: eager FlexAttention (~0.2 s a call on CPU) and the Triton interpreter are slow
NEW_TOKENS = {"reference": 12, "flex": 5, "triton": 5, "sdpa": 12, "cpu_paged": 12, "auto": 12}


def _kv(model, num_pages, page_size):
    return PagedKVCache.for_model(model, num_pages=num_pages, page_size=page_size)


def _prompt(length, seed):
    return torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------- same tokens
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 4, 16, 64])  # 64 > prompt + new tokens: a single page
def test_greedy_tokens_equal_model_generate(model, backend, page_size):
    ids = _prompt(11, seed=page_size)
    new = NEW_TOKENS[backend]
    expected = model.generate(ids, max_new_tokens=new, do_sample=False)
    kv = _kv(model, num_pages=64, page_size=page_size)
    out = hf.generate(model, ids, max_new_tokens=new, backend=backend, kv_cache=kv)
    assert torch.equal(out, expected)
    assert kv.allocator.num_free == kv.num_pages and kv.seq_ids == []
    kv.allocator.check()
    assert model.config._attn_implementation == "sdpa"  # restored


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_length_batch_equals_model_generate(model, backend):
    ids, mask = left_padded([3, 13, 1, 8], seed=1)
    new = NEW_TOKENS[backend]
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    out = hf.generate(model, ids, attention_mask=mask, max_new_tokens=new, page_size=4, backend=backend)
    assert torch.equal(out, expected)


def test_eos_stops_rows_pads_them_and_frees_their_pages_early(model):
    ids, mask = left_padded([5, 9, 2], seed=2)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=[])
    eos = int(free[1, ids.shape[1] + 3])  # a token row 1 emits at step 3: make it the end token
    expected = model.generate(
        ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    assert (expected == 0).any(), "the chosen eos should finish at least one row early"
    kv = _kv(model, num_pages=40, page_size=2)
    live = []
    out = hf.generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        page_size=2,
        eos_token_id=eos,
        pad_token_id=0,
        kv_cache=kv,
        callback=lambda step, tok: live.append(len(kv.seq_ids)),
    )
    assert torch.equal(out, expected)
    assert live[0] == 3 and min(live) < 3  # finished sequences were freed before the others ended
    assert kv.allocator.num_free == kv.num_pages


def test_default_eos_and_pad_come_from_generation_config(model):
    ids = _prompt(6, seed=3)
    free = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[])
    eos = int(free[0, -3])
    model.generation_config.eos_token_id = eos
    try:
        expected = model.generate(ids, max_new_tokens=8, do_sample=False)
        out = hf.generate(model, ids, max_new_tokens=8)
    finally:
        model.generation_config.eos_token_id = 2
    assert torch.equal(out, expected) and out.shape[1] < free.shape[1] + 1


# ---------------------------------------------------------------------------------- streaming
def test_stream_yields_the_generated_columns(model):
    ids, mask = left_padded([4, 7], seed=4)
    out = hf.generate(model, ids, attention_mask=mask, max_new_tokens=6)
    steps = list(hf.stream(model, ids, attention_mask=mask, max_new_tokens=6))
    assert torch.equal(torch.stack(steps, dim=1), out[:, ids.shape[1] :])


def test_closing_a_stream_early_frees_pages_and_restores_attention(model):
    kv = _kv(model, num_pages=16, page_size=4)
    it = hf.stream(model, _prompt(9, seed=5), max_new_tokens=20, kv_cache=kv)
    next(it)
    assert model.config._attn_implementation == "sdpa" and kv.seq_ids  # switched per forward only
    it.close()
    assert model.config._attn_implementation == "sdpa"
    assert kv.allocator.num_free == kv.num_pages and kv.seq_ids == []


def test_streamer_gets_prompt_then_tokens_then_end(model):
    class Recorder:
        def __init__(self):
            self.calls = []

        def put(self, value):
            self.calls.append(value.clone())

        def end(self):
            self.calls.append("end")

    ids = _prompt(5, seed=6)
    rec = Recorder()
    out = hf.generate(model, ids, max_new_tokens=4, streamer=rec)
    assert torch.equal(rec.calls[0], ids) and rec.calls[-1] == "end"
    assert torch.equal(torch.stack(rec.calls[1:-1], dim=1), out[:, ids.shape[1] :])


def test_progress_bar_is_shown_on_request(model, capsys):
    hf.generate(model, _prompt(4, seed=7), max_new_tokens=3, progress=True)
    assert "paged generate" in capsys.readouterr().err
    hf.generate(model, _prompt(4, seed=7), max_new_tokens=3)  # short: no bar by default
    assert "paged generate" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------- errors leave nothing behind
def test_running_out_of_pages_raises_and_frees_everything(model):
    kv = _kv(model, num_pages=3, page_size=4)
    with pytest.raises(OutOfPagesError):
        hf.generate(model, _prompt(10, seed=8), max_new_tokens=10, kv_cache=kv)
    assert kv.allocator.num_free == 3 and kv.seq_ids == []
    assert model.config._attn_implementation == "sdpa"


def test_a_failing_callback_frees_pages_and_restores_attention(model):
    kv = _kv(model, num_pages=16, page_size=4)

    def boom(step, tokens):
        raise KeyError("stop")

    with pytest.raises(KeyError):
        hf.generate(model, _prompt(6, seed=9), max_new_tokens=5, kv_cache=kv, callback=boom)
    assert kv.allocator.num_free == 16 and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=2, backend="cuda"), ValueError, "backend"),
        (dict(max_new_tokens=2, eviction=object()), TypeError, "eviction must be None, a policy name"),
        (dict(max_new_tokens=2, budget=64), ValueError, "budget=64 was given without eviction="),
        (dict(max_new_tokens=2, page_size=0), ValueError, "page_size"),
        (dict(max_new_tokens=2, eos_token_id="eos"), TypeError, "eos_token_id"),
        (dict(max_new_tokens=2, attention_mask=torch.tensor([[1, 1, 0]])), ValueError, "left-padded"),
        (dict(max_new_tokens=2, attention_mask=torch.tensor([[0, 0, 0]])), ValueError, "at least one real token"),
        (
            dict(max_new_tokens=2, attention_mask=torch.ones(1, 2)),
            ValueError,
            "attention_mask must be a tensor of the shape",
        ),
        (dict(max_new_tokens=2, num_pages=4, kv_cache="kv"), ValueError, "either kv_cache or num_pages"),
    ],
)
def test_bad_arguments_are_named(model, kwargs, error, match):
    with pytest.raises(error, match=match):
        hf.generate(model, torch.tensor([[5, 6, 7]]), **kwargs)
    assert model.config._attn_implementation == "sdpa"


def test_a_failed_extend_leaves_every_sequence_as_it_was(model):
    with hf.PagedSession(model, num_pages=3, page_size=4) as session:
        a, b = session.add(), session.add()
        session.extend([a], [torch.tensor([5, 6, 7])])  # a holds 3 tokens on 1 page
        with pytest.raises(OutOfPagesError):  # a needs no new page, b needs 3: only 2 are free
            session.extend([a, b], [torch.tensor([8]), torch.arange(3, 12)])
        assert (session.kv.seq_len(a), session.kv.seq_len(b)) == (3, 0)
        assert (session.position(a), session.position(b)) == (3, 0)
        assert session.kv.allocator.num_free == 2
        with pytest.raises(ValueError, match="not a live sequence"):
            session.extend([99], [torch.tensor([1])])
        with pytest.raises(ValueError, match="distinct"):
            session.extend([a, a], [torch.tensor([1]), torch.tensor([2])])


def test_bad_input_ids_and_mismatched_cache(model):
    with pytest.raises(TypeError, match="input_ids"):
        hf.generate(model, torch.tensor([5, 6, 7]), max_new_tokens=2)  # 1-D
    with pytest.raises(TypeError, match="input_ids"):
        hf.generate(model, torch.tensor([[5.0, 6.0]]), max_new_tokens=2)
    wrong = PagedKVCache(num_layers=3, num_pages=8, page_size=4, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="does not match the model"):
        hf.generate(model, torch.tensor([[5, 6]]), max_new_tokens=2, kv_cache=wrong)
    assert wrong.allocator.num_free == 8


def test_paged_pieces_refuse_to_run_outside_a_session(model):
    cache = hf.PagedCache(_kv(model, 4, 4))
    k = torch.zeros(1, 2, 1, 32)
    with pytest.raises(RuntimeError, match="outside a paged_ref forward"):
        cache.update(k, k, 0)
    with pytest.raises(RuntimeError, match="step plan"):
        hf.paged_attention_forward(model.model.layers[0].self_attn, torch.zeros(1, 4, 1, 32), k, k, None)
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.reorder_cache(torch.tensor([0]))


# ---------------------------------------------------------------------------------- log-likelihood
@pytest.mark.parametrize("backend", ["reference", "flex", "sdpa"])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])  # decode path, chunked prefill, one prefill
def test_teacher_forced_log_probs_match_the_plain_model(model, backend, chunk_size):
    length = 40 if backend == "reference" else 14
    ids = torch.randint(3, 512, (2, length), generator=torch.Generator().manual_seed(chunk_size))
    plain = reference_log_likelihood(model, ids)
    paged = log_likelihood(model, ids, chunk_size=chunk_size, page_size=8, backend=backend)
    assert paged.shape == plain.shape == (2, length - 1)
    torch.testing.assert_close(paged, plain, atol=2e-5, rtol=1e-5)


def test_prefill_then_decode_log_probs(model):
    ids = torch.randint(3, 512, (1, 30), generator=torch.Generator().manual_seed(1))
    paged = log_likelihood(model, ids, prefill_len=20, chunk_size=1, page_size=4)
    torch.testing.assert_close(paged, reference_log_likelihood(model, ids), atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="prefill_len"):
        log_likelihood(model, ids, prefill_len=0)
    with pytest.raises(ValueError, match=">= 2 tokens"):
        log_likelihood(model, ids[:, :1])


def test_teacher_forced_log_probs_triton_short(model):
    ids = torch.randint(3, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        log_likelihood(model, ids, page_size=2, backend="triton"),
        reference_log_likelihood(model, ids),
        atol=2e-5,
        rtol=1e-5,
    )


# ---------------------------------------------------------------------------------- positions vs tokens held
def test_rope_uses_absolute_positions_after_pages_are_dropped(model):
    """Drop the first page after prefill (what eviction will do): the next token must still be
    computed at its absolute position. Oracle: transformers' own DynamicCache with the same
    tokens cut from its front, and the absolute position passed explicitly."""
    from transformers import DynamicCache

    from paged_ref.hf.session import cache_keyword

    kw = cache_keyword(model)  # "cache" (transformers 5.24) or "past_key_values" (5.17)
    ids = _prompt(12, seed=10)
    nxt = torch.tensor([[77]])
    with hf.PagedSession(model, num_pages=8, page_size=4) as session:
        s = session.add()
        session.extend([s], [ids[0]])
        session.kv.drop_pages(s, [0])  # tokens 0..3 gone; 8 held; next position still 12
        assert session.kv.seq_len(s) == 8 and session.position(s) == 12
        paged = session.extend([s], [nxt[0]])[0]
    with torch.inference_mode():
        dyn = DynamicCache(config=model.config)
        model(input_ids=ids, use_cache=True, **{kw: dyn})
        for layer in dyn.layers:
            layer.keys, layer.values = layer.keys[:, :, 4:], layer.values[:, :, 4:]
        plain = model(input_ids=nxt, position_ids=torch.tensor([[12]]), use_cache=True, **{kw: dyn}).logits[0, -1]
        for layer in dyn.layers:  # the same cut cache, but the new token placed at position 8
            layer.keys, layer.values = layer.keys[:, :, :8], layer.values[:, :, :8]
        wrong = model(input_ids=nxt, position_ids=torch.tensor([[8]]), use_cache=True, **{kw: dyn}).logits
    torch.testing.assert_close(paged, plain.float(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(paged, wrong[0, -1], atol=1e-3)


# ---------------------------------------------------------------------------------- the sdpa backend itself
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_sdpa_backend_matches_the_reference_on_random_paged_inputs(page_size, num_q_heads, num_kv_heads):
    from paged_ref.attention.reference import reference_paged_decode, reference_paged_prefill
    from paged_ref.attention.sdpa import sdpa_paged_decode, sdpa_paged_prefill

    g = torch.Generator().manual_seed(page_size * 100 + num_q_heads)
    lens = [1, page_size, page_size + 1, 3 * page_size + 2]  # 1, a page exactly, one past, ragged
    max_pages = max(-(-n // page_size) for n in lens) + 1
    num_pages = len(lens) * max_pages + 3
    kc = torch.randn(num_pages, page_size, num_kv_heads, 16, generator=g, dtype=torch.float64)
    vc = torch.randn(num_pages, page_size, num_kv_heads, 16, generator=g, dtype=torch.float64)
    table = torch.randperm(num_pages, generator=g)[: len(lens) * max_pages].view(len(lens), max_pages)
    table = table.to(torch.int32)  # permuted pages; unused trailing entries are real page ids
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), num_q_heads, 16, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        sdpa_paged_decode(q, kc, vc, table, seq_lens, scale=0.3),
        reference_paged_decode(q, kc, vc, table, seq_lens, scale=0.3),
    )
    # new tokens per sequence: a whole prompt where it fits in 5 rows, else a chunk over a cached prefix
    q_lens = torch.tensor([min(n, c) for n, c in zip(lens, [1, 2, 5, 5])], dtype=torch.int32)
    q4 = torch.randn(len(lens), num_q_heads, 5, 16, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        sdpa_paged_prefill(q4, kc, vc, table, seq_lens, q_lens),
        reference_paged_prefill(q4, kc, vc, table, seq_lens, q_lens),
    )


def test_sdpa_backend_rejects_what_the_reference_rejects():
    from paged_ref.attention.sdpa import sdpa_paged_decode

    kc = torch.zeros(4, 4, 2, 8)
    with pytest.raises(ValueError, match="seq_lens"):
        sdpa_paged_decode(
            torch.zeros(1, 4, 8), kc, kc, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
        )


def test_bench_generate_quick_on_the_tiny_model(tmp_path):
    from paged_ref.lab.bench import generate as bench

    data = bench.main(["--quick", "--model", "tiny", "--skip-memory", "--out", str(tmp_path)])  # memory: below
    assert (tmp_path / "generate_cpu.json").exists()
    for workload in ("single", "mixed"):
        results = data[workload]["results"]
        assert all(r["tokens_match_hf_generate"] for r in results.values()), results
        assert all(r["kv_bytes"] > 0 and r["tokens_per_s"] > 0 for r in results.values())
    assert "hf_generate_batch" in data["mixed"]["results"]
    rows = data["contexts"]["rows"]
    assert [r["context"] for r in rows] == [16, 64]
    for row in rows:
        assert set(row["methods"]) == {"hf", "paged_auto", "paged_reference", "paged_auto_scattered"}
        for m, r in row["methods"].items():
            assert r["tokens_match_hf"] and r["prefill_s"] > 0 and r["decode_s_per_token"] > 0
            if m != "hf":
                assert r["prefill_over_hf"] > 0 and r["decode_over_hf_paired"] > 0
                from paged_ref.lab.bench._model_bench import paired_ratio

                hf = row["methods"]["hf"]["prefill_times_s"]  # the prefills taken back to back, pair by pair
                assert r["prefill_over_hf_paired"] == paired_ratio(r["prefill_times_s"], hf)
                assert 0 < r["plan_share_of_decode_step"] < 1


# ---------------------------------------------------------------------------------- sessions and streams
def test_two_sessions_on_one_model_closed_in_any_order(model):
    """Each forward switches the attention for itself: interleaved sessions give the tokens
    each gives alone, and the model is untouched between forwards and afterwards."""
    ids = _prompt(7, seed=12)
    alone = hf.generate(model, ids, max_new_tokens=6)[0, ids.shape[1] :]
    first = hf.PagedSession(model, num_pages=8, page_size=4).open()
    second = hf.PagedSession(model, num_pages=8, page_size=4).open()
    a, b = first.add(), second.add()
    la, lb = first.extend([a], [ids[0]]), second.extend([b], [ids[0]])
    got_a, got_b = [], []
    for _ in range(6):
        got_a.append(int(la.argmax()))
        got_b.append(int(lb.argmax()))
        first.close() if len(got_a) == 3 else None  # the first closes early (FIFO)
        if len(got_a) < 3:
            la = first.extend([a], [la.argmax(-1)])
        lb = second.extend([b], [lb.argmax(-1)])
        assert model.config._attn_implementation == "sdpa"
    second.close()
    assert got_b == alone.tolist() and got_a[:3] == alone[:3].tolist()
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(model.generate(ids, max_new_tokens=2, do_sample=False)[0, ids.shape[1] :], alone[:2])


def test_leaving_a_stream_early_with_a_context_manager_frees_everything(model):
    kv = _kv(model, num_pages=16, page_size=4)
    with hf.stream(model, _prompt(9, seed=5), max_new_tokens=20, kv_cache=kv) as steps:
        for _ in steps:
            break
        assert kv.seq_ids and model.config._attn_implementation == "sdpa"
    assert steps.closed and kv.allocator.num_free == 16 and kv.seq_ids == []
    assert list(steps) == []  # a closed stream yields nothing


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(input_ids=torch.tensor([[5, 2000]])),
            ValueError,
            r"input_ids must hold token ids in \[0, vocab_size=\d+\), got values in \[5, 2000\]",
        ),
        (dict(input_ids=torch.tensor([[-1, 5]])), ValueError, "input_ids must hold token ids"),
        (dict(pad_token_id=-1), ValueError, "pad_token_id must be a token id"),
        (dict(pad_token_id=1.7), ValueError, "pad_token_id must be a token id"),
        (dict(eos_token_id=[1, 10**6]), ValueError, "eos_token_id must be token ids"),
        (dict(streamer=object()), TypeError, r"streamer must have put\(tokens\) and end\(\).*\['put', 'end'\]"),
    ],
)
def test_bad_token_ids_and_streamers_are_named(model, kwargs, error, match):
    args = dict(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2) | kwargs
    with pytest.raises(error, match=match):
        hf.generate(model, **args)
    assert model.config._attn_implementation == "sdpa"


FLAG_CALLS = ["generate", "beam_search", "extend all_logits", "extend packed", "extend reserved"]


@pytest.mark.parametrize(
    "call, value",
    [(c, v) for c in FLAG_CALLS for v in ["no", 2, [], None] if c.startswith("extend") or v is not None],
)
def test_a_flag_of_another_kind_is_refused_naming_it_and_nothing_moves(model, call, value):
    """A truthy "no", 2 or [] is not True: each flag takes True or False (``progress`` also None)."""
    ids, kv = torch.tensor([[5, 6, 7]]), _kv(model, num_pages=8, page_size=4)
    expect = "True or False" if call.startswith("extend") else "True, False or None"
    name = call.split()[-1] if call.startswith("extend") else "progress"
    with pytest.raises(TypeError, match=rf"^{name} must be {expect}, got {re.escape(repr(value))}$"):
        if call == "generate":
            hf.generate(model, ids, max_new_tokens=2, kv_cache=kv, progress=value)
        elif call == "beam_search":
            hf.beam_search(model, ids, max_new_tokens=2, num_beams=2, kv_cache=kv, progress=value)
        else:
            with hf.PagedSession(model, kv_cache=kv) as session:
                s = session.add()
                try:
                    session.extend([s], [ids[0]], **{name: value})
                finally:
                    assert session.kv.seq_len(s) == 0 and session.position(s) == 0
    assert kv.allocator.num_free == 8 and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", ["bogus", "copies", "caller", "decoding"])  # the last three: internal names
@pytest.mark.parametrize("call", ["generate", "generate num_beams=2", "stream", "beam_search"])
def test_an_unknown_keyword_names_the_function_called(model, call, name):
    ids, kv = torch.tensor([[5, 6, 7]]), _kv(model, num_pages=8, page_size=4)
    function = getattr(hf, call.split()[0])
    beams = dict(num_beams=2) if "num_beams" in call or call == "beam_search" else {}
    with pytest.raises(TypeError, match=rf"^{call.split()[0]}\(\) got an unexpected keyword argument '{name}'$"):
        function(model, ids, max_new_tokens=2, kv_cache=kv, **beams, **{name: 2})
    assert kv.allocator.num_free == 8 and kv.seq_ids == []


def test_numpy_eos_ids_are_ints(model):
    import numpy as np

    ids = _prompt(5, seed=13)
    assert torch.equal(
        hf.generate(model, ids, max_new_tokens=3, eos_token_id=np.int64(2)),
        hf.generate(model, ids, max_new_tokens=3, eos_token_id=2),
    )


@pytest.mark.parametrize(
    "tokens, error, match",
    [
        (torch.tensor([1.0, 2.0]), TypeError, r"tokens\[0\] must be a 1-D integer tensor"),
        (torch.tensor([[1, 2], [3, 4]]), TypeError, r"tokens\[0\] must be a 1-D integer tensor.*\[2, 2\]"),
        (torch.tensor([1, 10**6]), ValueError, r"tokens\[0\] must hold token ids in \[0, vocab_size"),
        ([1, 2**63], ValueError, rf"tokens\[0\] must hold token ids .* got values in \[1, {2**63}"),
        ([10**30], ValueError, r"tokens\[0\] must hold token ids in \[0, vocab_size"),
    ],
)
def test_extend_refuses_float_2d_and_out_of_vocab_tokens(model, tokens, error, match):
    with hf.PagedSession(model, num_pages=4, page_size=4) as session:
        s = session.add()
        with pytest.raises(error, match=match):
            session.extend([s], [tokens])
        assert session.kv.seq_len(s) == 0 and session.kv.allocator.num_free == 4


def test_auto_backend_is_sdpa_on_cpu_and_the_default(model):
    with hf.PagedSession(model, num_pages=4, page_size=4) as session:
        assert session.backend == "sdpa"
    assert hf.auto_backend("cuda") == "triton" and hf.auto_backend("cpu") == "sdpa"
    with pytest.raises(ValueError, match=r"backend must be one of \['auto', 'cascade', 'cpu_paged', 'flex'"):
        hf.PagedSession(model, num_pages=4, page_size=4, backend="fast")


@pytest.mark.parametrize("name", [*hf.BACKENDS, "mistake_off_by_one", "mistake_wrong_page"])
def test_every_backend_takes_the_one_value_check_keyword(name):
    import inspect

    for fn in {**hf.BACKENDS, **MISTAKES}[name].functions():
        params = inspect.signature(fn).parameters
        assert "check_values" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()), fn.__name__
        assert not {"validate", "check_slots"} & set(params), fn.__name__


def test_a_registered_backend_is_used_with_its_preparation(model):
    calls = []

    def prepare(plan):  # once per forward, its keywords reach every layer's call
        calls.append(plan.is_decode)
        return {"check_values": False}

    backend = hf.Backend(
        "counted_reference",
        ("paged_ref.attention.reference", "reference_paged_decode"),
        ("paged_ref.attention.reference", "reference_paged_prefill"),
        prepare,
    )
    hf.register_backend(backend)
    try:
        ids = _prompt(9, seed=3)  # [1, 9]
        out = hf.generate(model, ids, max_new_tokens=4, page_size=4, backend="counted_reference")
        assert torch.equal(out, model.generate(ids, max_new_tokens=4, do_sample=False))
        assert calls == [False, True, True, True]  # one prefill forward, then three decode forwards
        with pytest.raises(ValueError, match="is taken"):
            hf.register_backend(backend)
        with pytest.raises(TypeError, match="must be a paged_ref.hf.attention.Backend"):
            hf.register_backend("counted_reference")
    finally:
        del hf.BACKENDS["counted_reference"]


@pytest.mark.parametrize("mistake", ["mistake_off_by_one", "mistake_wrong_page"])
def test_negative_controls_move_log_probs_far_beyond_the_tolerance(model, mistake):
    """The equivalence check can fail: a real bug moves per-token log-probs by far more than 1e-4."""
    ids = _prompt(24, seed=14)
    plain = reference_log_likelihood(model, ids)
    good = log_likelihood(model, ids, chunk_size=1, page_size=4, backend="reference")
    bad = log_likelihood(model, ids, chunk_size=1, page_size=4, backend=MISTAKES[mistake])
    assert (good - plain).abs().max() < 1e-4
    assert (bad - plain).abs().max() > 1e-2


def test_sdpa_decode_reads_consecutive_pages_in_place_and_gathers_scattered_ones():
    from paged_ref.attention.reference import reference_paged_decode
    from paged_ref.attention.sdpa import prepare, sdpa_paged_decode

    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(8, 4, 2, 16, generator=g), torch.randn(8, 4, 2, 16, generator=g)
    q = torch.randn(1, 6, 16, generator=g)
    for table, start in (([[2, 3, 4, 0]], 8), ([[4, 2, 3, 0]], None)):
        table, lens = torch.tensor(table, dtype=torch.int32), torch.tensor([10], dtype=torch.int32)
        gather = prepare(table, lens, 4)
        assert gather.start == start
        torch.testing.assert_close(
            sdpa_paged_decode(q, kc, vc, table, lens, gather=gather), reference_paged_decode(q, kc, vc, table, lens)
        )


def test_session_prefix_caching_through_the_public_api(model):
    """A second request with the same prompt starts from the cached pages and gets the same logits."""
    kv = PagedKVCache.for_model(model, num_pages=16, page_size=4, prefix_caching=True)
    prompt = _prompt(14, seed=21)[0]  # [14]
    with hf.PagedSession(model, kv_cache=kv) as session:
        a = session.add(prompt)
        assert session.position(a) == 0
        first = session.extend([a], [prompt])
        session.finish(a)  # its full pages stay findable
        b = session.add(prompt)
        assert session.position(b) == 12 and kv.prefix_hits == 3  # three full pages, the last token computed
        again = session.extend([b], [prompt[session.position(b) :]])
        torch.testing.assert_close(again, first, rtol=0, atol=1e-5)


def test_a_failed_forward_rolls_back_without_ending_prefix_caching(model):
    kv = PagedKVCache.for_model(model, num_pages=6, page_size=4, prefix_caching=True)
    prompt, more = _prompt(8, seed=22)[0], _prompt(4, seed=24)[0]
    with hf.PagedSession(model, kv_cache=kv) as session:
        a = session.add(prompt)
        session.extend([a], [prompt])
        pages = kv.pages(a)
        c = session.add()
        with pytest.raises(OutOfPagesError):  # a's page is reserved, then c's 5 pages do not fit: a rolls back
            session.extend([a, c], [more, _prompt(20, seed=23)[0]])
        assert kv.seq_len(a) == 8 and kv.pages(a) == pages and kv.allocator.num_free == 4
        session.extend([a], [more])  # a third full page, registered because a still hashes its tokens
        b = session.add(torch.cat([prompt, more, more[:1]]))
        assert session.position(b) == 12 and kv.pages(b) == kv.pages(a)


def test_bench_generate_memory_runs_each_method_and_takes_the_median(monkeypatch, capsys):
    """The memory workload's child (in this process; `bench generate` starts one process per run)."""
    from paged_ref.lab.bench import _generate_memory as memory

    one = memory.main(["--method", "paged_auto", "--context", "24", "--new", "3", "--model", "tiny"])
    assert one["generated"] == 3 and one["peak_rss_rise_bytes"] >= 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == one  # the line the parent reads
    rises = iter([5, 9, 7, 4, 6, 8])  # hf, paged, hf, paged, hf, paged: methods take turns per repeat
    calls = []

    def fake_child(method, context, new, model, threads):
        calls.append((method, context, new, model, threads))
        return {"peak_rss_rise_bytes": next(rises)}

    monkeypatch.setattr(memory, "_child", fake_child)
    data = memory.measure_memory(contexts=(32,), new=2, repeats=3, model="tiny", threads=1)
    assert [c[0] for c in calls] == ["hf_generate", "paged_auto"] * 3 and calls[0][1:] == (32, 2, "tiny", 1)
    hf, paged = data["rows"][0]["methods"]["hf_generate"], data["rows"][0]["methods"]["paged_auto"]
    assert hf["runs_bytes"] == [5, 7, 6] and hf["peak_rss_rise_bytes"] == 6
    assert paged["runs_bytes"] == [9, 4, 8] and paged["peak_rss_rise_bytes"] == 8 and paged["over_hf_generate"] == 8 / 6
    # the paired ratio: each repeat's rise over hf_generate's in the same repeat, then the median (not of medians)
    row = memory.memory_row(32, {"hf_generate": [10, 20, 30], "paged_auto": [12, 10, 33]})["methods"]["paged_auto"]
    assert row["over_hf_generate"] == 12 / 20 and row["over_hf_generate_paired"] == 1.1


def test_an_extend_the_pool_cannot_hold_keeps_no_copy_on_write_copy(model):
    """The first sequence's write lands in a page it shares with its fork's parent; the second
    sequence does not fit: nothing is reserved at all, so no private copy is left behind."""
    from cache_state import snapshot

    with hf.PagedSession(model, num_pages=6, page_size=4) as session:
        root = session.add()
        session.extend([root], [_prompt(10, seed=30)[0]])  # 3 pages, the last one partial
        a = session.fork(root)
        b = session.add()
        before = snapshot(session.kv)
        with pytest.raises(OutOfPagesError):  # a copies its shared page 2 (1 page), b needs 3: 3 are free
            session.extend([a, b], [torch.tensor([7]), _prompt(12, seed=31)[0]])
        after = snapshot(session.kv)
        assert after == before, after.diff(before)
        assert [session.kv.allocator.refcount(p) for p in session.kv.pages(a)] == [2, 2, 2]
        assert (session.position(a), session.position(b)) == (10, 0)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_forward_that_fails_midway_gives_back_copies_and_pages(model, prefix_caching):
    """The forward raises after layer 0 wrote its K/V: the rollback removes the new tokens, gives
    the shared page back in place of its private copy and forgets the pages filled meanwhile."""
    from cache_state import snapshot

    kv = PagedKVCache.for_model(model, num_pages=12, page_size=4, prefix_caching=prefix_caching)
    with hf.PagedSession(model, kv_cache=kv) as session:
        root = session.add()
        session.extend([root], [_prompt(10, seed=32)[0]])
        a = session.fork(root)
        b = session.add()
        session.extend([b], [_prompt(3, seed=33)[0]])
        before = snapshot(kv, exact=False)

        def boom(module, args):
            raise RuntimeError("layer 1 fails")

        hook = model.model.layers[1].register_forward_pre_hook(boom)
        try:
            with pytest.raises(RuntimeError, match="layer 1 fails"):  # a copies page 2, b fills its page and grows
                session.extend([a, b], [_prompt(3, seed=34)[0], _prompt(6, seed=35)[0]])
        finally:
            hook.remove()
        after = snapshot(kv, exact=False)
        assert after == before, after.diff(before)
        assert (session.position(a), session.position(b)) == (10, 3)
        session.extend([a, b], [_prompt(3, seed=34)[0], _prompt(6, seed=35)[0]])  # and it works again


def test_namespaces_per_sequence_through_the_session_and_generate(model):
    """Pages computed under one adapter are found under that adapter only; ``{}`` is no namespace."""
    kv = PagedKVCache.for_model(model, num_pages=32, page_size=4, prefix_caching=True)
    prompt = _prompt(9, seed=36)
    hf.generate(model, prompt, max_new_tokens=2, kv_cache=kv, namespace={"adapter": "a"})
    with hf.PagedSession(model, kv_cache=kv) as session:
        assert session.position(session.add(prompt[0], namespace={"adapter": "a"})) == 8
        assert session.position(session.add(prompt[0], namespace={"adapter": "b"})) == 0
        assert session.position(session.add(prompt[0])) == 0
        with pytest.raises(TypeError, match="namespace must be None or a dict"):
            session.add(prompt[0], namespace="a")
    hf.generate(model, prompt, max_new_tokens=2, kv_cache=kv, namespace=[{}])  # one per row; {} is none
    with hf.PagedSession(model, kv_cache=kv) as session:
        assert session.position(session.add(prompt[0], namespace={})) == 8
    with pytest.raises(ValueError, match=r"namespace must be None, a dict or a list of one per row \(1\), got 2"):
        hf.generate(model, prompt, max_new_tokens=2, kv_cache=kv, namespace=[{}, {}])
    assert kv.seq_ids == [] and kv.allocator.num_free == 32


def test_a_closed_session_takes_no_new_sequence(model):
    session = hf.PagedSession(model, num_pages=4, page_size=4)
    with session:
        s = session.add()
    with pytest.raises(RuntimeError, match="closed"):
        session.add()
    with pytest.raises(ValueError, match="not a live sequence"):
        session.fork(s)
    assert session.kv.seq_ids == [] and session.kv.allocator.num_free == 4
    with session:  # opened again, it works again
        session.finish(session.add())


def test_a_session_on_a_cache_refuses_a_size_for_another(model):
    """``num_pages`` (like ``kv_format``) sizes a cache the session makes: beside ``kv_cache`` it is refused, not
    ignored, as `generate` refuses it."""
    kv = _kv(model, num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="either kv_cache or num_pages"):
        hf.PagedSession(model, kv_cache=kv, num_pages=64)
    assert kv.seq_ids == [] and kv.allocator.num_free == 4


class _Forwards:
    """Counts the model's forwards (a pre-hook on the decoder)."""

    def __init__(self, model):
        self.calls = 0
        self.hook = model.model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.hook.remove()


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda m, ids: hf.generate(m, ids, max_new_tokens=64, callback=5), TypeError, "callback must be callable"),
        (lambda m, ids: hf.generate(None, ids, max_new_tokens=4), TypeError, "model must be a transformers"),
        (lambda m, ids: hf.stream(None, ids, max_new_tokens=4), TypeError, "model must be a transformers"),
        (lambda m, ids: log_likelihood(None, ids), TypeError, "model must be a transformers"),
        (
            lambda m, ids: log_likelihood(m, torch.cat([ids, torch.tensor([[10**6]])], 1)),
            ValueError,
            r"input_ids must hold token ids in \[0, vocab_size=\d+\), got values in \[\d+, 1000000\]",
        ),
        (
            lambda m, ids: hf.generate(m, ids, max_new_tokens=4, page_size=4, eviction="paged_eviction", budget=2),
            ValueError,
            "budget must be >= 8 tokens with page_size=4.*got budget=2",  # was raised by the hook, after the prefill
        ),
        (
            lambda m, ids: hf.generate(
                m, ids, max_new_tokens=4, eviction=make_policy("value_norm", 64, decision="per_layer")
            ),
            TypeError,
            r"decision='per_layer' needs a paged_ref.LayeredKVCache.*got PagedKVCache",
        ),
        (
            lambda m, ids: reference_log_likelihood(m, torch.cat([ids, torch.tensor([[-1]])], 1)),
            ValueError,
            r"input_ids must hold token ids in \[0, vocab_size",
        ),
    ],
)
def test_arguments_are_checked_before_any_forward(model, call, exc, match):
    with _Forwards(model) as forwards, pytest.raises(exc, match=match):
        call(model, _prompt(20, seed=37))
    assert forwards.calls == 0 and model.config._attn_implementation == "sdpa"


def test_scalars_where_lists_are_expected_are_named_by_the_session(model):
    with hf.PagedSession(model, num_pages=4, page_size=4) as session:
        s = session.add()
        with pytest.raises(TypeError, match="seq_ids must be a list of sequence ids, got int"):
            session.extend(s, [torch.tensor([1])])
        with pytest.raises(TypeError, match="tokens must be a list of token-id tensors, got int"):
            session.extend([s], 5)
        with pytest.raises(TypeError, match="token_ids must be a list of ints or a 1-D integer tensor, got int"):
            session.add(5)
        assert session.seq_ids == [s] and session.kv.seq_len(s) == 0


def test_a_policy_that_raises_after_the_forward_leaves_every_sequence_counted(model):
    """The forward is done when the hooks run: every sequence's position counts its new tokens,
    every other policy still runs, and the first error is raised at the end."""
    from paged_ref.eviction import FullCache

    class Counting(FullCache):
        def __init__(self, fail=False):
            super().__init__()
            self.fail, self.calls = fail, 0

        def after_append(self, cache, seq_id):
            self.calls += 1
            if self.fail:
                raise RuntimeError("this policy fails")
            super().after_append(cache, seq_id)

    failing, counting = Counting(fail=True), Counting()
    with hf.PagedSession(model, num_pages=8, page_size=4) as session:
        a, b = session.add(eviction=failing), session.add(eviction=counting)
        session.extend([a, b], [_prompt(5, seed=38)[0], _prompt(6, seed=39)[0]])  # prefill: no after_append
        with pytest.raises(RuntimeError, match="this policy fails"):
            session.extend([a, b], [torch.tensor([3]), torch.tensor([4])])
        assert (session.position(a), session.position(b)) == (6, 7) == (session.kv.seq_len(a), session.kv.seq_len(b))
        assert (failing.calls, counting.calls) == (1, 1)
        failing.fail = False
        session.extend([a, b], [torch.tensor([5]), torch.tensor([6])])
        assert (session.position(a), session.position(b)) == (7, 8) and counting.positions(b).numel() == 8


def test_a_sequence_id_that_is_not_an_int_is_refused_and_nothing_changes(model):
    """``True == 1`` and ``1.0 == 1`` as dict keys: the session must not take them for sequence 1."""
    with hf.PagedSession(model, num_pages=4, page_size=4) as session:
        a, b = session.add(), session.add()
        session.extend([a, b], [torch.tensor([5, 6]), torch.tensor([7])])
        for bad in (True, 1.0, [b]):
            for call in (session.finish, session.position, session.fork):
                with pytest.raises(ValueError, match=rf"seq_id {re.escape(repr(bad))} is not a live sequence"):
                    call(bad)
        assert session.seq_ids == session.kv.seq_ids == [a, b] and session.position(b) == 1
        assert session.kv.allocator.num_free == 2


def test_a_policy_the_cache_cannot_run_is_refused_before_the_sequence_is_added(model):
    with hf.PagedSession(model, num_pages=8, page_size=4) as session:
        a = session.add()
        with pytest.raises(ValueError, match="budget must be >= 8 tokens with page_size=4.*got budget=2"):
            session.add(eviction=make_policy("paged_eviction", 2))
        with pytest.raises(ValueError, match="budget must be >= 8 tokens with page_size=4.*got budget=4"):
            session.fork(a, eviction=make_policy("streaming_llm", 4, sink_tokens=1))
        assert session.seq_ids == session.kv.seq_ids == [a] and session.kv.allocator.num_free == 8


def _tiny_mistral(sliding_window):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        sliding_window=sliding_window,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MistralForCausalLM(config).eval()


@pytest.mark.parametrize("sliding_window", [4096, 7])  # MistralConfig's default; exactly the longest span
def test_a_sliding_window_no_sequence_outgrows_is_full_attention(sliding_window):
    """A Mistral's window (4096 by default) changes nothing while every sequence spans at most that many
    positions: the same tokens as model.generate; a forward reaching past it is refused, nothing held."""
    model = _tiny_mistral(sliding_window)
    ids = _prompt(5, seed=3)  # 5 + 3 new tokens: the last forward feeds position 6, spanning 7
    no_eos = dict(eos_token_id=[], pad_token_id=0)
    expected = model.generate(ids, max_new_tokens=3, do_sample=False, **no_eos)
    assert torch.equal(hf.generate(model, ids, max_new_tokens=3, page_size=2, **no_eos), expected)
    if sliding_window == 7:  # one token more spans 8 positions: keys 7 apart, outside the window
        kv = _kv(model, num_pages=8, page_size=2)
        with pytest.raises(NotImplementedError, match="sliding_window=7"):
            hf.generate(model, ids, max_new_tokens=4, kv_cache=kv, **no_eos)
        assert kv.seq_ids == [] and kv.allocator.num_free == 8
        with hf.PagedSession(model, kv_cache=kv) as session:
            s = session.add()
            session.extend([s], [ids[0, :5]])
            with pytest.raises(NotImplementedError, match="sliding_window=7"):
                session.extend([s], [torch.tensor([9, 10, 11])])
            assert (session.position(s), kv.seq_len(s)) == (5, 5)


def test_extend_reserved_refuses_rows_not_reserved_exactly_and_changes_nothing(model):
    """reserved=True writes the forward into each sequence's last n slots: without a reservation those hold
    tokens already fed (they would be overwritten), with more reserved than fed some stay unwritten. Refused,
    nothing changed; reserved exactly, the logits are those of extend reserving itself, also for a sequence
    whose policy dropped tokens (it holds fewer than it was fed)."""
    prompt, rows = torch.arange(3, 12), [torch.tensor([5]), torch.tensor([6])]
    logits = []
    for reserved in (False, True):
        with hf.PagedSession(model, num_pages=12, page_size=4) as session:
            a, b = session.add(), session.add(eviction=make_policy("streaming_llm", 8, sink_tokens=1))
            for s in (a, b):
                session.extend([s], [prompt])
            assert session.kv.seq_len(b) < session.position(b)  # b's policy dropped tokens
            if reserved:
                before = [(session.kv.seq_len(s), session.position(s), session.kv.gather(0, s)) for s in (a, b)]
                for counts in ([0, 0], [0, 1], [2, 1], [1, 0]):
                    for s, n in zip((a, b), counts):
                        if n:
                            session.kv.reserve(s, n)
                    with pytest.raises(ValueError, match=r"reserved=True: tokens\[\d\] has 1 tokens, but sequence \d"):
                        session.extend([a, b], rows, reserved=True)
                    for s, n in zip((a, b), counts):
                        session.kv.truncate(s, n)
                    now = [(session.kv.seq_len(s), session.position(s), session.kv.gather(0, s)) for s in (a, b)]
                    for (n0, p0, (k0, v0)), (n1, p1, (k1, v1)) in zip(before, now):
                        assert (n0, p0) == (n1, p1) and torch.equal(k0, k1) and torch.equal(v0, v1)
                session.kv.reserve_batch([a, b], [1, 1])
            logits.append(session.extend([a, b], rows, reserved=reserved))
    torch.testing.assert_close(logits[1], logits[0])
