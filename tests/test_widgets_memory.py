"""Widget callbacks of notebooks 01 and 03 (pure functions), their panels, and runmode."""

import io

import matplotlib
import pytest
from matplotlib.figure import Figure

matplotlib.use("Agg")

from paged_ref.lab import runmode  # noqa: E402
from paged_ref.lab.fragmentation import compare_reservations, make_workload  # noqa: E402
from paged_ref.lab.widgets.fragmentation import (  # noqa: E402
    BUDGETS,
    PAGE_SIZES,
    STEP_TOKENS,
    default_workload,
    fragmentation_numbers,
    fragmentation_panel,
    fragmentation_view,
)
from paged_ref.lab.widgets.memory import LENGTHS, kv_memory_numbers, kv_memory_panel, kv_memory_view  # noqa: E402


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def test_kv_memory_numbers_llama7b():
    assert kv_memory_numbers("LLaMA-7B", "float16", 2048) == {
        "kv_per_layer": 33_554_432,
        "kv_total": 1_073_741_824,
        "scores_one_layer": 32 * 2048 * 2048 * 2,
    }
    assert kv_memory_numbers("LLaMA-7B", "float32", 2048)["kv_total"] == 2 * 1_073_741_824
    gqa = kv_memory_numbers("Llama-3-8B", "bfloat16", 2048)
    assert gqa["kv_total"] * 4 == 1_073_741_824  # 8 of 32 heads keep K and V
    assert gqa["scores_one_layer"] == 32 * 2048 * 2048 * 2  # scores follow the query heads


def test_kv_memory_view_is_a_new_figure_that_follows_its_inputs():
    a = kv_memory_view("LLaMA-7B", "float16", 2048)
    b = kv_memory_view("LLaMA-7B", "float16", 2048)
    c = kv_memory_view("SmolLM2-135M", "float32", 65536)
    assert isinstance(a, Figure) and a is not b
    assert "LLaMA-7B" in a.axes[0].get_title() and "2,048 tokens" in a.axes[0].get_title()
    assert png(a) == png(b) and png(a) != png(c)


@pytest.mark.parametrize(
    "args, exc",
    [
        (("GPT-9", "float16", 2048), ValueError),
        (("LLaMA-7B", "fp16", 2048), ValueError),
        (("LLaMA-7B", "float16", 0), ValueError),
        (("LLaMA-7B", "float16", 20.5), TypeError),
    ],
)
def test_kv_memory_view_errors(args, exc):
    with pytest.raises(exc):
        kv_memory_view(*args)


def small_workload():
    return make_workload(24, seed=2, mean_prompt=64, mean_output=64, arrival_rate=2.0, max_len=512)


def test_fragmentation_numbers_are_the_engines_dry_runs():
    wl = small_workload()
    got = fragmentation_numbers(8, 2048, wl)
    assert got == compare_reservations(wl, budget_slots=2048, page_size=8, max_batched_tokens=STEP_TOKENS)
    assert [s["reservation"] for s in got] == ["paged", "exact", "max_len"]
    assert default_workload() is default_workload()


def test_fragmentation_view_changes_with_page_size_and_budget():
    wl = small_workload()
    base = png(fragmentation_view(16, 2048, wl))
    assert png(fragmentation_view(16, 2048, wl)) == base
    assert png(fragmentation_view(128, 2048, wl)) != base
    assert png(fragmentation_view(16, 1024, wl)) != base
    assert "page size 128" in fragmentation_view(128, 2048, wl)._suptitle.get_text()


def test_every_slider_combination_is_valid():
    wl = default_workload()
    assert all(b % p == 0 for b in BUDGETS for p in PAGE_SIZES)
    assert 2048 in LENGTHS and 16 in PAGE_SIZES and 4096 in BUDGETS
    # the tightest corners still serve every request under every reservation
    for page, budget in ((max(PAGE_SIZES), min(BUDGETS)), (min(PAGE_SIZES), min(BUDGETS))):
        assert all(s["requests"] == len(wl) for s in fragmentation_numbers(page, budget))


def test_fragmentation_view_errors():
    with pytest.raises(ValueError, match="multiple of page_size"):
        fragmentation_view(3, 4096)
    with pytest.raises(ValueError, match="can never be served"):
        fragmentation_view(16, 256)


def test_panels_use_labelled_sliders_that_update_on_release():
    import ipywidgets as w

    def controls(panel):
        return [c for c in panel.children[0].children]

    page, budget = controls(fragmentation_panel(small_workload()))
    assert page.description == "page size" and page.value == 16
    assert budget.description.startswith("pool") and budget.value == 4096
    assert not page.continuous_update and not budget.continuous_update
    model, dtype, tokens = controls(kv_memory_panel())
    assert (model.value, dtype.value, tokens.value) == ("LLaMA-7B", "float16", 2048)
    assert not tokens.continuous_update
    assert isinstance(kv_memory_panel().children[1], w.Output)


def test_quick_mode_follows_the_environment(monkeypatch):
    monkeypatch.delenv("PAGED_REF_MODE", raising=False)
    assert runmode.quick_mode()
    monkeypatch.setenv("PAGED_REF_MODE", "full")
    assert not runmode.quick_mode()
    monkeypatch.setenv("PAGED_REF_MODE", "quick")
    assert runmode.quick_mode()


def test_figures_dir_is_the_repository_folder():
    path = runmode.figures_dir()
    assert path.name == "figures" and (path.parent / "paged_ref" / "lab" / "runmode.py").exists()


def test_save_figure_writes_only_in_full_mode(monkeypatch, tmp_path):
    monkeypatch.setattr(runmode, "figures_dir", lambda: tmp_path)
    fig = kv_memory_view("LLaMA-7B", "float16", 128)
    monkeypatch.setenv("PAGED_REF_MODE", "quick")
    assert runmode.save_figure(fig, "01_test") is None and not list(tmp_path.iterdir())
    monkeypatch.setenv("PAGED_REF_MODE", "full")
    path = runmode.save_figure(fig, "01_test")
    assert path == tmp_path / "01_test.png" and path.read_bytes()[:4] == b"\x89PNG"
    first = path.read_bytes()
    runmode.save_figure(fig, "01_test")
    assert path.read_bytes() == first  # stable bytes: no timestamp in the file


@pytest.mark.parametrize("name", ["", "a/b", "../x", "x.png", "with space", 7])
def test_save_figure_rejects_bad_names(name):
    with pytest.raises(ValueError, match="name must be a file stem"):
        runmode.save_figure(Figure(), name)


def test_save_figure_rejects_non_figures():
    with pytest.raises(TypeError, match="fig must be a matplotlib Figure"):
        runmode.save_figure("not a figure", "01_x")
