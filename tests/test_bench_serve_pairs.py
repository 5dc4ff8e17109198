"""``bench serve --peer vllm --pairs``'s parts that need no vLLM: the thread binding it asks for, the threads it
reads back from /proc, the bfloat16 check, token agreement, the summary and its goal (vLLM itself runs in
``.venv-vllm``: tests/test_vllm_tokens.py)."""

import json
import os
import threading
import time

import pytest

from paged_ref.lab.bench import _threads, _vllm_pairs


def test_the_binding_names_the_first_cpus_and_refuses_no_threads():
    assert [_vllm_pairs.vllm_binding(n) for n in (1, 2, 8)] == ["0", "0-1", "0-7"]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads must be an int >= 1"):
            _vllm_pairs.vllm_binding(bad)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")
def test_busy_threads_count_the_threads_that_ran():
    """This thread spinning for the wall time is busy; a sleeping one is not."""
    stop = time.perf_counter() + 0.5
    before = _threads.cpu_times(os.getpid())
    start = time.perf_counter()
    sleeper = threading.Thread(target=time.sleep, args=(0.5,))
    sleeper.start()
    while time.perf_counter() < stop:
        pass
    sleeper.join()
    rows = _threads.busy(before, _threads.cpu_times(os.getpid()), wall_s=time.perf_counter() - start, share=0.1)
    mine = next(r for r in rows if r["pid"] == os.getpid())
    assert mine["busy_threads"] == 1 and mine["threads"] >= 1 and mine["cpu_s"] > 0.05


def test_busy_reads_the_difference_of_two_snapshots():
    before = {7: {"name": "w", "cpus": "0", "threads": {7: 1.0, 8: 5.0, 9: 0.0}}}
    after = {7: {"name": "w", "cpus": "0", "threads": {7: 1.1, 8: 9.0, 9: 3.0, 10: 0.5}}}
    (row,) = _threads.busy(before, after, wall_s=4.0, share=0.5)
    assert row == {"pid": 7, "name": "w", "cpus": "0", "threads": 4, "busy_threads": 2, "busy_cpus": ["0"],
                   "cpu_s": 7.6, "top_threads_cpu_s": [4.0, 3.0, 0.5, 0.1]}  # fmt: skip
    after[7]["thread_cpus"] = {7: "0", 8: "0", 9: "1", 10: "0-1"}
    assert _threads.busy(before, after, wall_s=4.0, share=0.5)[0]["busy_cpus"] == ["0", "1"]


def test_bf16_is_read_from_the_cpu_flags(tmp_path):
    with_it, without = tmp_path / "a", tmp_path / "b"
    with_it.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 sse\n")
    without.write_text("processor\t: 0\nflags\t\t: fpu avx2 sse\n")
    assert _vllm_pairs.bf16_supported(str(with_it)) == (True, "the CPU has avx512_bf16")
    ok, why = _vllm_pairs.bf16_supported(str(without))
    assert not ok and "neither avx512_bf16 nor amx_bf16" in why
    ok, why = _vllm_pairs.bf16_supported(str(tmp_path / "missing"))
    assert not ok and "not readable" in why


def test_bfloat16_is_skipped_and_said_where_the_cpu_lacks_it(tmp_path, monkeypatch):
    from paged_ref.lab.bench import serve

    monkeypatch.setattr(_vllm_pairs, "bf16_supported", lambda: (False, "the CPU has neither (test)"))
    data = serve.main(["--quick", "--peer", "vllm", "--peer-only", "--pairs", "3", "--dtype", "bfloat16"] +
                      ["--out", str(tmp_path)])  # fmt: skip
    saved = json.loads((tmp_path / "serve_cpu_quick_peer_vllm_pairs_bfloat16.json").read_text())
    assert saved["skipped"] == data["skipped"] == "the CPU has neither (test)" and "cells" not in saved


def test_pairs_needs_the_vllm_peer_alone():
    from paged_ref.lab.bench import serve

    with pytest.raises(SystemExit):
        serve.main(["--quick", "--pairs", "3"])


def _record(ratios, identical=64):
    cells = []
    for i, r in enumerate(ratios):
        ours = {"wall_tokens_per_s": 100.0 * r, "wall_s": 1.0, "torch_threads": 1}
        ours["processes"] = [{"busy_threads": 1, "cpu_s": 1.0}]
        theirs = {"wall_tokens_per_s": 100.0, "wall_s": 1.0, "processes": []}
        theirs["processes"] = [{"name": "VLLM::Worker", "cpus": "0", "busy_threads": 1, "cpu_s": 1.0}]
        tokens = {"requests_identical": identical, "requests": 64, "tokens_before_first_difference": 90, "tokens": 100}
        default = {"runs": [theirs] * 3, "ratio_paired": [r] * 3, "ratio_median": r, "tokens": [tokens] * 3}
        cells.append({"threads": 1, "blocks": 32, "workload": f"w{i}", "paged_ref": [ours] * 3, "default": default})
    rec = {"cells": cells, "dtype": "float32"}
    rec["summary"] = _vllm_pairs.summarize(rec)
    return rec


def test_the_goal_needs_every_cell_at_1x_and_identical_tokens():
    assert _vllm_pairs.check_pair_goals(_record([1.2, 1.0]))["vllm_default_1x_every_cell"]["met"]
    slow = _vllm_pairs.check_pair_goals(_record([1.2, 0.9]))["vllm_default_1x_every_cell"]
    assert not slow["met"] and slow["worst_ratio"] == 0.9 and slow["cells_at_or_above_1x"] == 1
    assert not _vllm_pairs.check_pair_goals(_record([1.2], identical=63))["vllm_default_1x_every_cell"]["met"]
    row = _record([1.1])["summary"][0]
    assert row["vllm_worker_busy_threads"] == [1] and row["vllm_cpu_s_per_wall_s"] == 1.0 and row["pairs"] == 3
    assert row["tokens_before_first_difference_min"] == 0.9
