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
        r"preemptions, paged_ref's readable step ([\d.]+) tokens/s against vLLM's ([\d.]+) \(one turn each, too few "
        r"pairs to quote a ratio; vLLM eager \(`enforce_eager=True`\) with its engine core in the calling process",
    )
    paged, vllm = v["paged"][0], v["vllm"][0]
    assert len(v["throughput_ratio_paired"]) == 1  # one turn each: no ratio is quoted
    want = [
        v["vllm_version"],
        str(v["requests_with_identical_tokens"]),
        str(v["requests"]),
        str(paged["preemptions"]),
        str(vllm["preemptions"]),
        f"{paged['wall_tokens_per_s']:.1f}",
        f"{vllm['wall_tokens_per_s']:.1f}",
    ]
    assert found == want


def test_the_readme_short_vllm_run_matches_its_json():
    """The README's short-answer vLLM clause states serve_cpu_short_peer_vllm.json's tokens, preemptions, tokens/s."""
    v, found = _readme_vllm_clause(
        "serve_cpu_short_peer_vllm.json",
        r"with short answers on (\d+) blocks of (\d+), identical tokens in (\d+) of (\d+) requests, (\d+) vs (\d+) "
        r"preemptions, ([\d.]+) against ([\d.]+) tokens/s \(one turn each, the same conditions",
    )
    paged, vllm = v["paged"][0], v["vllm"][0]
    c = v["config"]
    assert len(v["throughput_ratio_paired"]) == 1
    want = [c["num_pages"], c["page_size"], v["requests_with_identical_tokens"], v["requests"]]
    want += [paged["preemptions"], vllm["preemptions"], f"{paged['wall_tokens_per_s']:.1f}"]
    want += [f"{vllm['wall_tokens_per_s']:.1f}"]
    assert found == [str(x) for x in want]


def _pair_cells(data: dict, mode: str) -> str:
    """``"at <threads> thread(s): <workload> on <blocks> blocks <ratio at each thread count>x / ..., ..."`` for
    every cell of ``mode``, at the thread counts it ran."""
    label = {"chat": "chat", "short": "short answers"}
    counts = [t for t in data["threads"] if any(r["vllm_mode"] == mode and r["threads"] == t for r in data["summary"])]
    out = []
    for workload in data["workloads"]:
        for blocks in data["blocks"]:
            rows = {r["threads"]: r for r in data["summary"]
                    if (r["vllm_mode"], r["workload"], r["blocks"]) == (mode, workload, blocks)}  # fmt: skip
            if rows and set(rows) == set(counts):
                ratios = " / ".join(f"{rows[t]['ratio_median']:.2f}x" for t in counts)
                out.append(f"{label[workload]} on {blocks} blocks {ratios}")
    return f"at {' / '.join(map(str, counts))} thread{'s' if counts != [1] else ''}: " + ", ".join(out)


def test_the_readme_pairs_against_vllm_match_their_json():
    """The README's clause on the faster step against vLLM at its defaults states serve_cpu_peer_vllm_pairs.json:
    vLLM's mode and threads, the warm-up, the pairs, every cell's median ratio at each thread count, the tokens."""
    data = json.loads((ROOT / "figures" / "data" / "serve_cpu_peer_vllm_pairs.json").read_text())
    readme = (ROOT / "README.md").read_text()
    from paged_ref.lab.bench.serve import FAST_OPTIONS

    assert data["paged_ref_fast"] == FAST_OPTIONS and data["dtype"] == "float32"
    starts = {s["settings"]["mode"]: s["settings"] for s in data["vllm_starts"]}
    assert (
        starts["default"]["compilation_mode"] == "DYNAMO_TRACE_ONCE" and starts["default"]["engine_core_in_own_process"]
    )
    assert {len(r["ratio_paired"]) for r in data["summary"]} == {data["pairs"]} and data["pairs"] >= 3
    threads = " / ".join(map(str, data["threads"]))
    busy = " / ".join(
        "/".join(map(str, sorted({x for r in data["summary"] if r["vllm_mode"] == "default" and r["threads"] == t
                                  for x in r["vllm_worker_busy_threads"]})))
        for t in data["threads"]
    )  # fmt: skip
    asked = {
        (s["threads"], s["worker"]["torch_threads"])
        for s in data["vllm_starts"]
        if s["settings"]["mode"] != "eager_in_process"
    }
    assert all(t == n for t, n in asked)  # each worker ran the threads it was bound to
    n = data["summary"][0]["requests"]
    assert all(r["requests_identical_min"] == r["requests"] == n for r in data["summary"])
    command = data["command"].replace("python -m paged_ref.lab.bench ", "bench ")
    assert command.startswith("bench serve --peer vllm --peer-only --fast --pairs ")
    want = [
        "against vLLM at its defaults on CPU (compiled: one Dynamo trace compiled by inductor;",
        f"`VLLM_CPU_OMP_THREADS_BIND` (its worker's `torch.get_num_threads()` {threads}), busy worker threads read "
        f"from /proc {busy})",
        f"start-up excluded and one warm-up generation each, medians of {data['pairs']} alternating pairs",
        f"paged_ref's tokens/s over vLLM's {_pair_cells(data, 'default')};",
        f"against vLLM eager in its own process {_pair_cells(data, 'eager')};",
        f"identical tokens in {n} of {n} requests in every turn, and in vLLM's in-process check the same preemptions",
        f"(`{command}`, {data['environment']['date_utc'][:10]})",
    ]
    checks = data["in_process_checks"]
    assert checks and all(c["paged_ref_preemptions"] == c["vllm_preemptions"] for c in checks)
    want += [f"{c['paged_ref_preemptions']} vs {c['vllm_preemptions']} on" for c in checks]
    for phrase in want:
        assert phrase in " ".join(readme.split()), phrase


def test_the_readme_bfloat16_run_matches_its_json():
    """The README's bfloat16 clause states serve_cpu_peer_vllm_pairs_bfloat16.json (or that it was skipped)."""
    data = json.loads((ROOT / "figures" / "data" / "serve_cpu_peer_vllm_pairs_bfloat16.json").read_text())
    readme = " ".join((ROOT / "README.md").read_text().split())
    if "skipped" in data:
        assert f"bfloat16 skipped: {data['skipped']}" in readme
        return
    rows = [r for r in data["summary"] if r["vllm_mode"] == "default"]
    assert [r["threads"] for r in rows] == data["threads"] and {r["pairs"] for r in rows} == {data["pairs"]} >= {3}
    parts = ", ".join(k for k, v in data["paged_ref_fast"].items() if v)
    want = (
        f"paged_ref with the parts of `Fast` that take it, {parts}) on "
        f"{ {'chat': 'chat', 'short': 'short answers'}[rows[0]['workload']]} and {data['blocks'][0]} blocks at "
        f"{' / '.join(map(str, data['threads']))} threads: " + " / ".join(f"{r['ratio_median']:.2f}x" for r in rows)
        + f", medians of {data['pairs']} pairs, requests with identical tokens "
        + " / ".join(str(r["requests_identical_min"]) for r in rows) + f" of {rows[0]['requests']}, tokens before "
        "each request's first difference " + " / ".join(f"{r['tokens_before_first_difference_min']:.0%}" for r in rows)
        + f" at the least (`{data['command'].replace('python -m paged_ref.lab.bench ', 'bench ')}`)"
    )  # fmt: skip
    assert want in readme, want


def test_the_readme_pairs_without_avx512_match_their_json():
    """The README's clause on the same comparison on a CPU without AVX-512 states serve_cpu_peer_vllm_pairs_256bit.json:
    the CPU's features, every cell's median ratio at each thread count (how many fall below vLLM), the tokens."""
    data = json.loads((ROOT / "figures" / "data" / "serve_cpu_peer_vllm_pairs_256bit.json").read_text())
    readme = " ".join((ROOT / "README.md").read_text().split())
    from paged_ref.fast.prepack import KERNEL_ROWS
    from paged_ref.lab.bench.serve import FAST_OPTIONS

    env = data["environment"]
    assert "avx512f" not in env["cpu_features"] and data.get("vector_floats", 8) == 8  # the kernel's 8-float tile
    assert data["paged_ref_fast"] == FAST_OPTIONS and data["dtype"] == "float32" and data["complete"]
    assert {len(r["ratio_paired"]) for r in data["summary"]} == {data["pairs"]} and data["pairs"] >= 3
    n = data["summary"][0]["requests"]
    assert all(r["requests_identical_min"] == r["requests"] == n for r in data["summary"])
    checks = data["in_process_checks"]
    assert checks and all(c["paged_ref_preemptions"] == c["vllm_preemptions"] for c in checks)
    default = [r for r in data["summary"] if r["vllm_mode"] == "default"]
    below = sum(r["ratio_median"] < 1 for r in default)
    label = {"chat": "chat", "short": "short answers"}

    def cpu(who):  # CPU-seconds a second of wall time at 1 thread, over the cells: one value or a range
        lo, hi = (f"{f(r[f'{who}_cpu_s_per_wall_s'] for r in default if r['threads'] == 1):.2f}" for f in (min, max))
        return lo if lo == hi else f"{lo}-{hi}"

    command = data["command"].replace("python -m paged_ref.lab.bench ", "bench ")
    want = [
        f"on a CPU without AVX-512 ({', '.join(env['cpu_features'])}: the few-rows kernel's "
        f"8-float tile, products of at most {KERNEL_ROWS[8]} rows)",
        f"medians of {data['pairs']} alternating pairs",
        f"paged_ref's tokens/s over vLLM's {_pair_cells(data, 'default')}: below vLLM in {below} of {len(default)} "
        f"cells (at 1 thread vLLM's processes ran {cpu('vllm')} CPU-seconds a second, paged_ref's {cpu('paged_ref')});",
        f"against vLLM eager in its own process {_pair_cells(data, 'eager')};",
        f"identical tokens in {n} of {n} requests in every turn, the same preemptions in vLLM's in-process check ("
        + ", ".join(
            f"{c['paged_ref_preemptions']} vs {c['vllm_preemptions']} on {label[c['workload']]}, {c['blocks']} blocks"
            for c in checks
        )
        + ")",
        f"(`{command}`, {env['date_utc'][:10]}, `figures/data/serve_cpu_peer_vllm_pairs_256bit.json`)",
    ]
    for phrase in want:
        assert phrase in readme, phrase
