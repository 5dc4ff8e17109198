import json

from paged_ref.lab.bench import alloc


def test_alloc_benchmark_runs_and_writes_json(tmp_path, capsys):
    data = alloc.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "alloc_cpu.json").read_text())
    assert set(saved["results"]) == set(alloc.IMPLEMENTATIONS)
    assert saved["workload"]["total_pages"] == sum(alloc.workload(16, 512, 16))
    for r in data["results"].values():
        assert r["ns_per_page_op"] > 0 and r["call_p99_ns"] >= r["call_median_ns"]
    assert "torch / this" in capsys.readouterr().out


def test_workload_orders_pages_like_decode():
    pages = [2, 1, 3]
    assert list(alloc._round_robin(pages)) == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (2, 2)]
