"""The notebooks make no GPU claim that committed GPU data, drawn by a cell before it, does not back."""

import json

import pytest
from notebook_text import (
    NOTEBOOKS,
    ROOT,
    gpu_claims,
    gpu_data_cells,
    numbers,
    student_text,
    unbacked_gpu_claims,
)


def test_notebooks_found():
    assert len(NOTEBOOKS) >= 8


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_gpu_claim_without_gpu_data(path):
    hits = unbacked_gpu_claims(path)
    assert not hits, f"{path.name}: reads as measured on a GPU, but no committed GPU data backs it: {hits}"


@pytest.mark.parametrize("name", ["05_triton_decode_kernel.ipynb", "06_latency_scaling.ipynb"])
def test_the_gpu_sections_make_claims_the_check_reads(name):
    """The check above is not vacuous where GPU data is drawn: these notebooks' GPU sections state
    measured results (sentences `gpu_claims` finds), and each is backed."""
    path = ROOT / "notebooks" / name
    cells = json.loads(path.read_text())["cells"]
    assert gpu_data_cells(cells), f"{name}: no cell draws committed GPU data"
    claims = [s for i, text in student_text(path) if i not in gpu_data_cells(cells) for s in gpu_claims(text)]
    assert len(claims) >= 3, claims
    assert not unbacked_gpu_claims(path)


def _notebook(tmp_path, cells, files=("decode_gpu.json",)):
    data = tmp_path / "data"
    data.mkdir()
    for f in files:
        (data / f).write_text("{}")
    nb = {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    for kind, src, *out in cells:
        cell = {"cell_type": kind, "source": src, "metadata": {}}
        if kind == "code":
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": o} for o in out]
        nb["cells"].append(cell)
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    return path, data


LOAD = 'gpu = json.loads((DATA_DIR / "decode_gpu.json").read_text())\nprint(gpu["x"])'
CLAIM = "On the H200 the kernel reaches 4,150 GB/s, 98% of the copy."


@pytest.mark.parametrize(
    "cells, files, why",
    [
        ([("markdown", CLAIM)], (), "no cell before it"),
        ([("code", LOAD, "4150 GB/s, 98%"), ("markdown", CLAIM)], (), "no cell before it"),  # file not committed
        ([("markdown", CLAIM), ("code", LOAD, "4150 GB/s, 98%")], ("decode_gpu.json",), "no cell before it"),
        ([("code", LOAD, "4150 GB/s, 97%"), ("markdown", CLAIM)], ("decode_gpu.json",), "['98']"),
        (
            [("code", LOAD, "4150 GB/s"), ("code", "print(cpu)", "98%"), ("markdown", CLAIM)],
            ("decode_gpu.json",),
            "['98']",
        ),
        (
            [("code", 'print(json.loads(open("scaling_gpu.json").read()))', "4150 98"), ("markdown", CLAIM)],
            ("decode_gpu.json",),
            "no cell before it",
        ),
    ],
    ids=[
        "no data cell",
        "file not committed",
        "claim before the data",
        "number not printed",
        "number printed by a cell that does not draw the data",
        "names another file",
    ],
)
def test_unbacked_claims_are_caught(tmp_path, cells, files, why):
    path, data = _notebook(tmp_path, cells, files)
    hits = unbacked_gpu_claims(path, data)
    assert hits, hits
    assert why in hits[0][2]


def test_an_output_measured_on_the_cpu_is_no_gpu_claim(tmp_path):
    cpu = "Measured on CPU x86_64 (1 thread), torch 2.13.0+cpu\n  1 rows: 37.5 ms (14.3 GB/s)"
    cases = {"cpu_output": [("code", "print(run)", cpu)], "prose": [("markdown", cpu)]}
    cases["bare_output"] = [("code", "print(run)", "  1 rows: 37.5 ms (14.3 GB/s)")]
    hits = {}
    for name, cells in cases.items():
        (tmp_path / name).mkdir()
        hits[name] = unbacked_gpu_claims(*_notebook(tmp_path / name, cells, ()))
    assert hits["cpu_output"] == [] and hits["prose"] and hits["bare_output"]  # prose keeps the rule


def test_numbers_leave_names_alone():
    assert numbers("the H200 reads 4,150 GB/s in bf16 on sm_90 (98%, 1.5x) for Llama-3.2-1B.") == {"4150", "98", "1.5"}


def test_backed_claims_pass_and_the_loaded_names_follow_the_data(tmp_path):
    cells = [
        ("code", 'path = DATA_DIR / "decode_gpu.json"\ngpu = json.loads(path.read_text())', ""),
        ("code", 'cpu = json.loads(open("c.json").read())\nprint(cpu)', "8 7 6"),
        ("code", 'rows = [r for r in gpu["results"]]\nprint(rows)', "4,150 GB/s; 98% of the copy"),
        ("code", "print(rows)", "unrelated"),  # rows came from a later cell: not followed
        ("markdown", CLAIM),
    ]
    path, data = _notebook(tmp_path, cells)
    assert gpu_data_cells(json.loads(path.read_text())["cells"], data) == {0, 2}
    assert unbacked_gpu_claims(path, data) == []


@pytest.mark.parametrize(
    "text",
    [
        "An H200 copies at roughly 4.3 TB/s in this benchmark.",
        "The compiled path is checked by a test on a GPU.",
        "Measured on an H100, the kernel reaches 90% of the copy.",
        "Compiled flex reads 43 GB/s at batch 1.",
    ],
)
def test_gpu_claims_are_found(text):
    assert gpu_claims(text)


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
    assert not gpu_claims(text)


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_wrong_answer_printed_is_named_wrong(path):
    from notebook_text import unflagged_wrong_products

    found = unflagged_wrong_products(path)
    assert not found, f"{path.name}: a wrong answer passed over: {found}"


def test_a_wrong_answer_without_its_correction_is_caught(tmp_path):
    from notebook_text import unflagged_wrong_products

    answer = ("code", "print(a)", "'12 times 12 is equal to 120.'")
    path, _ = _notebook(tmp_path, [answer, ("markdown", "A fine answer.")])
    assert unflagged_wrong_products(path) == [(0, "12 times 12 is 120")]
    (tmp_path / "b").mkdir()
    path, _ = _notebook(tmp_path / "b", [answer, ("markdown", "Wrong: 12 x 12 = 144.")])
    assert unflagged_wrong_products(path) == []


def test_the_readme_short_answer_run_matches_its_json():
    """The README's short-answer sentence states the ratios and concurrency of serve_cpu_short.json."""
    import re

    data = json.loads((ROOT / "figures" / "data" / "serve_cpu_short.json").read_text())
    p = data["rates"][-1]["policies"]
    readme = (ROOT / "README.md").read_text()
    found = re.search(
        r"with short answers .*?paged is ([\d.]+)x exact and ([\d.]+)x max-length reservation, ([\d.]+) requests at "
        r"once vs ([\d.]+) and ([\d.]+)",
        readme,
    )
    assert found, "the README's short-answer sentence"
    want = [
        f"{p['paged']['tokens_per_s'] / p['exact']['tokens_per_s']:.2f}",
        f"{p['paged']['tokens_per_s'] / p['max_len']['tokens_per_s']:.2f}",
        *(f"{p[k]['mean_running']:.1f}" for k in ("paged", "exact", "max_len")),
    ]
    assert list(found.groups()) == want


def _readme_vllm_clause(name: str, pattern: str) -> tuple[dict, list[str]]:
    """The ``peer_vllm`` record of ``figures/data/<name>`` and the groups of ``pattern`` in the README."""
    import re

    v = json.loads((ROOT / "figures" / "data" / name).read_text())["peer_vllm"]
    found = re.search(pattern, (ROOT / "README.md").read_text())
    assert found, f"the README's sentence on {name}"
    return v, list(found.groups())


def test_the_readme_vllm_run_matches_its_json():
    """The README's vLLM sentence states the tokens, preemptions and throughput of serve_cpu_peer_vllm.json."""
    v, found = _readme_vllm_clause(
        "serve_cpu_peer_vllm.json",
        r"against vLLM ([\d.]+)'s CPU build .*?identical greedy tokens in (\d+) of (\d+) requests and (\d+) vs (\d+) "
        r"preemptions, paged_ref at ([\d.]+)x vLLM's tokens/s \(([\d.]+) vs ([\d.]+);",
    )
    paged, vllm = v["paged"][0], v["vllm"][0]
    want = [
        v["vllm_version"],
        str(v["requests_with_identical_tokens"]),
        str(v["requests"]),
        str(paged["preemptions"]),
        str(vllm["preemptions"]),
        f"{v['throughput_ratio_median']:.2f}",
        f"{paged['wall_tokens_per_s']:.1f}",
        f"{vllm['wall_tokens_per_s']:.1f}",
    ]
    assert found == want


def test_the_readme_short_vllm_run_matches_its_json():
    """The README's short-answer vLLM clause states serve_cpu_short_peer_vllm.json's tokens, preemptions, ratio."""
    v, found = _readme_vllm_clause(
        "serve_cpu_short_peer_vllm.json",
        r"with short answers on (\d+) blocks of (\d+), identical tokens in (\d+) of (\d+) requests, (\d+) vs (\d+) "
        r"preemptions, ([\d.]+)x",
    )
    paged, vllm = v["paged"][0], v["vllm"][0]
    c = v["config"]
    want = [c["num_pages"], c["page_size"], v["requests_with_identical_tokens"], v["requests"]]
    want += [paged["preemptions"], vllm["preemptions"], f"{v['throughput_ratio_median']:.2f}"]
    assert found == [str(x) for x in want]


def test_the_readme_fast_vllm_runs_match_their_json():
    """The README's clause on the engine's faster step against vLLM states both pools' JSON: ratio, pairs, tokens."""
    import re

    found = re.search(
        r"faster CPU step .*? at ([\d.]+)x vLLM on (\d+) blocks and ([\d.]+)x on (\d+) blocks, medians of (\d+) "
        r"alternating pairs, identical tokens in (\d+) of (\d+) requests both times",
        (ROOT / "README.md").read_text(),
    )
    assert found, "the README's sentence on serve_cpu_peer_vllm_fast*.json"
    runs = [
        json.loads((ROOT / "figures" / "data" / n).read_text())
        for n in ("serve_cpu_peer_vllm_fast.json", "serve_cpu_peer_vllm_fast_512pages.json")
    ]
    v = [r["peer_vllm"] for r in runs]
    from paged_ref.lab.bench.serve import FAST_OPTIONS

    assert all(r["config"]["engine_options"] == FAST_OPTIONS for r in runs)
    assert {x["requests_with_identical_tokens"] for x in v} == {x["requests"] for x in v} == {int(found[7])}
    assert {len(x["throughput_ratio_paired"]) for x in v} == {int(found[5])}
    want = [f"{v[0]['throughput_ratio_median']:.2f}", str(v[0]["config"]["num_pages"])]
    want += [f"{v[1]['throughput_ratio_median']:.2f}", str(v[1]["config"]["num_pages"])]
    assert list(found.groups()[:4]) == want
