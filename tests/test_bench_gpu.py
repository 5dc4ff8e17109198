"""The one GPU command, rehearsed on the CPU: same orchestration, toy sizes (`--dry-run`)."""

import json
import sys

import pytest

from paged_ref.bench import gpu


def test_dry_run_runs_every_section_and_fits_the_plan(tmp_path, capsys):
    data = gpu.main(["--dry-run", "--out", str(tmp_path)])
    assert data["planned_s"] <= gpu.PLAN_LIMIT_S
    statuses = {s["section"]: s["status"] for s in data["sections"]}
    assert statuses == {"tests": "ok", "decode": "ok", "scaling": "ok", "figures": "ok"}, data["sections"]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["decode_cpu.json", "gpu.log", "gpu_run.json", "scaling_cpu.json", "scaling_latency_cpu.png"]
    assert len(files) <= gpu.MAX_FILES
    record = json.loads((tmp_path / "gpu_run.json").read_text())
    assert record["dry_run"] and record["environment"]["torch"]
    assert "section  status" in capsys.readouterr().out  # the summary table


def test_the_gpu_plan_runs_the_full_benchmarks_within_six_minutes(tmp_path):
    sections = gpu.plan(tmp_path, dry_run=False)
    assert gpu.planned_seconds(sections) <= 360
    commands = {s.name: s.command for s in sections if s.command}
    assert commands["decode"][3:5] == ["decode", "--budget-s"] and "--quick" not in commands["decode"]
    assert "--gpu" in commands["scaling"] and "--quick" not in commands["scaling"]
    assert "gpu" in commands["tests"]
    assert [f for s in sections for f in s.produces] == [
        "decode_gpu.json",
        "scaling_gpu.json",
        "decode_gpu.png",
        "scaling_latency_gpu.png",
    ]


def test_a_section_over_budget_is_killed_and_reported(tmp_path):
    section = gpu.Section("sleepy", 1, [sys.executable, "-c", "import time; time.sleep(30)"])
    with open(tmp_path / "log", "w") as log:
        status, why = gpu._run_command(section, log)
    assert (status, why) == ("over budget", "killed after 1 s")


def test_without_a_gpu_the_real_run_refuses_and_points_to_the_dry_run(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        gpu.main(["--out", str(tmp_path)])
