"""The notebooks speak to students: no tracker jargon, no GPU claim without committed GPU data."""

import pytest
from notebook_text import NOTEBOOKS, gpu_claims, gpu_data_committed, jargon, student_text


def test_notebooks_found():
    assert len(NOTEBOOKS) >= 8


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_process_jargon(path):
    hits = [(i, s) for i, text in student_text(path) for s in jargon(text)]
    assert not hits, f"{path.name}: tracker jargon a student cannot follow: {hits}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_gpu_claim_without_gpu_data(path):
    if gpu_data_committed():
        pytest.skip("figures/data/*_gpu.json committed: GPU statements have data behind them")
    hits = [(i, s) for i, text in student_text(path) for s in gpu_claims(text)]
    assert not hits, f"{path.name}: reads as measured on a GPU, but no GPU data is committed: {hits}"


@pytest.mark.parametrize(
    "check, text",
    [
        (jargon, "The issue's goals for an H200 are listed below."),
        (jargon, "This meets the goal."),
        (jargon, "TODO: re-run this cell."),
        (gpu_claims, "An H200 copies at roughly 4.3 TB/s in this benchmark."),
        (gpu_claims, "The compiled path is checked by a test on a GPU."),
        (gpu_claims, "Measured on an H100, the kernel reaches 90% of the copy."),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_the_checks_catch(check, text):
    assert check(text)


@pytest.mark.parametrize(
    "text",
    [
        "When a GPU is present, the cell measures the kernel against a device copy.",
        "The H200's datasheet gives 4.8 TB/s.",
        "No GPU measurement is committed yet.",
        "The kernel tiles K in blocks of 64 tokens.",
    ],
)
def test_plans_and_specs_pass(text):
    assert not gpu_claims(text) and not jargon(text)


def test_a_colon_does_not_shield_a_claim():
    text = "no CUDA device here: the compiled path is checked by a test on a GPU"
    assert gpu_claims(text) == ["the compiled path is checked by a test on a GPU"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_widget_has_a_static_picture(path):
    from notebook_text import panels_without_picture

    assert not panels_without_picture(path), (
        f"{path.name}: widget cells {panels_without_picture(path)} saved no picture; re-execute "
        "the notebook (panels carry a PNG of their default setting)"
    )
