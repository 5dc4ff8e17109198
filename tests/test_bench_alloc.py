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
    assert saved["torch_threads"] >= 1 and saved["command"] == "python -m paged_ref.lab.bench alloc --quick"
    assert len(saved["load_before"]) == len(saved["load_after"]) == 3 and saved["environment"]["date_utc"]


def test_workload_orders_pages_like_decode():
    pages = [2, 1, 3]
    assert list(alloc._round_robin(pages)) == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (2, 2)]


def test_implementations_take_turns_and_the_ratio_is_the_median_of_pairs(monkeypatch):
    """Each repeat runs every implementation (the order reversed every other repeat); peer / paged_ref is the
    median of the per-repeat ratios (8/2, 2/4, 3/1: 3.0), not the ratio of the medians (3 / 2)."""
    order = []
    peer = iter([8, 2, 3])  # ns per page op in repeats 0, 1, 2 (one page in all)
    ours = iter([2, 4, 1])

    def fake(name, times):
        def run(pages_per_seq, page_size):
            order.append(name)
            return [next(times)], []

        return run

    monkeypatch.setattr(alloc, "IMPLEMENTATIONS", {"ours": fake("ours", ours), alloc.PEER: fake("peer", peer)})
    monkeypatch.setattr(alloc, "workload", lambda *a, **k: [1])
    data = alloc.measure(repeats=3)
    assert order == ["ours", "peer", "peer", "ours", "ours", "peer"]
    r = data["results"]["ours"]
    assert r["ns_per_page_op_repeats"] == [2, 4, 1] and r["ns_per_page_op"] == 2
    assert r["torch_over_this"] == 3.0
    assert data["results"][alloc.PEER]["torch_over_this"] == 1.0


def test_zeroing_ratio_is_the_median_of_pairs():
    z = alloc.zeroing_cost(num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, pages=2, repeats=3)
    ratios = sorted(a / b for a, b in zip(z["zero_page_ns_repeats"], z["write_page_ns_repeats"]))
    assert z["zero_over_write"] == ratios[1] and len(ratios) == 3
