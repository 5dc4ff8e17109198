"""Benchmarks and their output paths: a bad ``--out`` ends a command before it measures anything,
and what a long run measured is on disk before it ends (a killed or failed run keeps it)."""

import importlib
import json

import pytest

from paged_ref.lab.bench import available, scaling
from paged_ref.lab.bench.common import ResultFile

# arguments a benchmark needs on a CPU before it reaches its output (the rest take none)
CPU_ARGS = {"decode": ["--cpu"], "scaling": ["--cpu"], "gpu": ["--dry-run"]}


@pytest.mark.parametrize("name", sorted(available()))
@pytest.mark.parametrize("bad", ["", "a_file", "a_file/sub", "x" * 300])
def test_every_benchmark_refuses_a_bad_out_before_measuring(name, bad, tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("")
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(f"paged_ref.lab.bench.{name}")
    with pytest.raises(SystemExit) as exit:
        module.main([*CPU_ARGS.get(name, []), "--out", bad])
    assert exit.value.code == 2
    assert "--out" in capsys.readouterr().err


def test_result_file_is_written_whole_and_marked_until_complete(tmp_path):
    result = ResultFile("r.json", tmp_path / "new" / "folder")  # parents made
    assert json.loads(result.path.read_text()) == {"complete": False}  # created before measuring
    data = {"rows": [1, 2]}
    result.save(data)
    assert json.loads(result.path.read_text()) == {"rows": [1, 2], "complete": False}
    result.save(data, complete=True)
    assert json.loads(result.path.read_text())["complete"] is True
    assert sorted(p.name for p in result.path.parent.iterdir()) == ["r.json"]  # no temporary left


def _one_section_then(failure):
    def run_model(name, profile, *, device, clock, checkpoint=None):
        checkpoint({"model": {"name": name}, "ladder": [{"label": "dynamic", "points": [1]}], "errors": []})
        raise failure

    return run_model


def test_a_killed_scaling_run_keeps_the_sections_it_finished(tmp_path, monkeypatch):
    monkeypatch.setattr(scaling, "run_model", _one_section_then(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        scaling.main(["--cpu", "--quick", "--model", "tiny", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "scaling_cpu.json").read_text())
    assert data["complete"] is False
    assert data["models"]["tiny"]["ladder"] == [{"label": "dynamic", "points": [1]}]


def test_a_failed_scaling_run_keeps_the_sections_it_finished_and_lists_the_error(tmp_path, monkeypatch):
    monkeypatch.setattr(scaling, "run_model", _one_section_then(RuntimeError("out of memory")))
    scaling.main(["--cpu", "--quick", "--model", "tiny", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "scaling_cpu.json").read_text())
    assert data["complete"] is True and data["errors"] == ["model tiny: RuntimeError: out of memory"]
    assert data["models"]["tiny"]["ladder"] == [{"label": "dynamic", "points": [1]}]
