"""The one GPU command, rehearsed on the CPU: same orchestration, toy sizes (`--dry-run`)."""

import json
import sys

import pytest

from paged_ref.lab.bench import gpu


def test_dry_run_runs_every_section_and_fits_the_plan(tmp_path, capsys):
    data = gpu.main(["--dry-run", "--out", str(tmp_path)])
    gpu_plan = gpu.plan(tmp_path, dry_run=False)
    assert data["planned_s"] - gpu.STARTUP_S == gpu.DRY_RUN_SLACK * (gpu.planned_seconds(gpu_plan) - gpu.STARTUP_S)
    statuses = {s["section"]: s["status"] for s in data["sections"]}
    assert statuses == {s: "ok" for s in ("compile", "tests", "flex", "decode", "scaling", "figures")}, data["sections"]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["decode_cpu.json", "gpu.log", "gpu_run.json", "scaling_cpu.json", "scaling_latency_cpu.png"]
    assert len(files) <= gpu.MAX_FILES
    record = json.loads((tmp_path / "gpu_run.json").read_text())
    assert record["dry_run"] and record["environment"]["torch"] and record["complete"]
    assert set(record["precheck"]) == {"driver", "cuda", "torch", "triton", "c_compiler", "python_headers"}
    for name in ("decode_cpu.json", "scaling_cpu.json"):
        assert json.loads((tmp_path / name).read_text())["complete"], name
    printed = capsys.readouterr().out
    assert "section  status" in printed  # the summary table
    assert printed.startswith("pre-check: driver ") and "torch " in printed.splitlines()[0]


def test_the_gpu_plan_runs_the_full_benchmarks_within_six_minutes(tmp_path):
    sections = gpu.plan(tmp_path, dry_run=False)
    assert gpu.planned_seconds(sections) <= 360
    for s in sections:  # every budget is at least 1.5x the section's estimated compile + run time
        assert s.budget_s >= 1.5 * s.estimate_s, (s.name, s.budget_s, s.estimate_s)
    commands = {s.name: s.command for s in sections if s.command}
    assert commands["decode"][3:5] == ["decode", "--budget-s"] and "--quick" not in commands["decode"]
    assert "--gpu" in commands["scaling"] and "--quick" not in commands["scaling"]
    assert "gpu" in commands["tests"] and "gpu" in commands["flex"]
    assert "compiles_for_sm_90" in commands["compile"]
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


def test_a_section_whose_json_lists_errors_is_reported_as_errors(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"models": {"m": {"errors": ["ladder flex: ValueError: boom"]}}}))
    section = gpu.Section("x", 5, [sys.executable, "-c", "pass"], produces=("x.json",))
    errors, incomplete = gpu._read_errors(tmp_path, section)
    assert errors == ["x.json: ladder flex: ValueError: boom"] and incomplete == []
    (tmp_path / "x.json").write_text(json.dumps({"errors": [], "complete": False}))
    assert gpu._read_errors(tmp_path, section) == ([], ["x.json"])


@pytest.mark.parametrize("bad", ["", "file", "file/sub", "x" * 300])
def test_a_bad_out_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys, bad):
    """`--out ''`, a file, a folder under a file, a name too long: refused at once (exit 2)."""
    (tmp_path / "file").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(gpu, "plan", lambda *a, **k: pytest.fail("planned despite a bad --out"))
    with pytest.raises(SystemExit) as exit:
        gpu.main(["--dry-run", "--out", bad])
    assert exit.value.code == 2 and "--out" in capsys.readouterr().err


def test_the_full_plan_fits_eight_minutes_and_leaves_the_standard_plan_alone(tmp_path):
    full = gpu.plan(tmp_path, dry_run=False, which="full")
    assert gpu.planned_seconds(full) <= gpu.FULL_PLAN_LIMIT_S == 480
    assert gpu.planned_seconds(gpu.plan(tmp_path, dry_run=False)) == gpu.PLAN_LIMIT_S == 360
    for s in full:  # budgets over estimates, most of them GPU seconds of the first run
        assert s.budget_s >= gpu.FULL_MARGIN * s.estimate_s, (s.name, s.budget_s, s.estimate_s)
    commands = {s.name: s.command for s in full}
    assert list(commands) == ["compile", "decode", "scaling", "smollm2", "serve", "sharing"]
    assert commands["decode"][3:6] == ["decode", "--budget-s", str(gpu.FULL_DECODE_FLEX_WINDOW_S)]
    assert commands["decode"][6:8] == ["--flex-min-batch", "8"] and "--eight-bit" in commands["decode"]
    assert commands["scaling"][3:7] == ["scaling", "--gpu", "--model", "llama1b"]
    assert commands["smollm2"][3:7] == ["scaling", "--gpu", "--model", "smollm2"]
    assert str(tmp_path / gpu.SMOLLM2_DIR) in commands["smollm2"]
    assert commands["serve"][3:5] == ["serve", "--gpu"] and "--skip-pools" in commands["serve"]
    assert commands["sharing"][3:5] == ["sharing", "--gpu"]
    produced = [f for s in full for f in s.produces]
    assert produced == ["decode_gpu.json", "scaling_gpu.json", "smollm2/scaling_gpu.json", "serve_gpu.json"] + [
        "sharing_gpu.json"
    ]
    assert len(produced) + 2 <= gpu.MAX_FILES  # + gpu_run.json and gpu.log
    with pytest.raises(ValueError, match="which"):
        gpu.plan(tmp_path, dry_run=False, which="fast")


def test_merge_models_puts_the_second_model_into_the_first_json(tmp_path):
    first = dict(command="a", models={"llama1b": {"ladder": []}}, skipped_models=["smollm2"], errors=[], complete=True)
    second = dict(command="b", time_budget_s=25.0, models={"smollm2": {"ladder": [1]}}, errors=["x"], complete=True)
    (tmp_path / "s.json").write_text(json.dumps(first))
    (tmp_path / "t.json").write_text(json.dumps(second))
    assert gpu.merge_models(tmp_path / "s.json", tmp_path / "t.json") == "merged smollm2 into s.json"
    merged = json.loads((tmp_path / "s.json").read_text())
    assert merged["models"]["smollm2"] == {"ladder": [1], "command": "b", "time_budget_s": 25.0}
    assert merged["skipped_models"] == [] and merged["errors"] == ["x"] and merged["complete"]
    assert merged["merged"] == [{"command": "b", "models": ["smollm2"]}]
    assert gpu.merge_models(tmp_path / "s.json", tmp_path / "none.json").startswith("nothing to merge")


def test_full_dry_run_runs_every_section(tmp_path):
    data = gpu.main(["--dry-run", "--plan", "full", "--out", str(tmp_path)])
    assert data["plan"] == "full" and data["limit_s"] == gpu.FULL_PLAN_LIMIT_S
    statuses = {s["section"]: s["status"] for s in data["sections"]}
    assert statuses == dict.fromkeys(("compile", "decode", "scaling", "smollm2", "serve", "sharing"), "ok"), data[
        "sections"
    ]
    smollm2 = next(s for s in data["sections"] if s["section"] == "smollm2")
    assert smollm2["merge"] == "merged tiny into scaling_cpu.json"
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files == [
        "decode_cpu.json",
        "gpu.log",
        "gpu_run.json",
        "scaling_cpu.json",
        "serve_cpu_quick.json",
        "sharing_cpu.json",
        "smollm2/scaling_cpu.json",
    ]
    scaling = json.loads((tmp_path / "scaling_cpu.json").read_text())
    assert scaling["merged"][0]["models"] == ["tiny"] and scaling["complete"]
