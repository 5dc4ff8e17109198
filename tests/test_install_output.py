"""An installed copy of paged_ref (``pip install``, not editable, imported from another folder)
writes figures and benchmark JSON to a folder the user controls: the current directory, or
``$PAGED_REF_OUTPUT``; never site-packages."""

import os
import subprocess
import sys
from pathlib import Path

import paged_ref

SCRIPT = """
import matplotlib; matplotlib.use("Agg")
import matplotlib.pyplot as plt, paged_ref
from paged_ref.lab.runmode import save_figure
from paged_ref.lab.bench.common import write_json, DATA_DIR
print(paged_ref.__file__)
print(save_figure(plt.figure(), "probe"))
print(write_json({"a": 1}, "probe.json"))
print(DATA_DIR)
"""


def _run(site: Path, cwd: Path, **env) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k != "PAGED_REF_OUTPUT"}
    environ.update(PYTHONPATH=str(site), PAGED_REF_MODE="full", **env)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=cwd, env=environ, text=True, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_installed_copy_writes_to_the_current_folder_or_the_chosen_one(tmp_path):
    site = tmp_path / "site-packages"  # a real, non-editable install of the package
    repo = Path(paged_ref.__file__).resolve().parent.parent
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(repo),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert not (site / "paged_ref" / "__init__.py").is_symlink() and (site / "paged_ref" / "cache.py").is_file()
    work = tmp_path / "work"
    work.mkdir()
    module, fig, data, data_dir = _run(site, work)
    assert module.startswith(str(site))
    assert Path(fig) == work / "figures" / "probe.png" and Path(fig).is_file()
    assert Path(data) == work / "figures" / "data" / "probe.json" and Path(data).is_file()
    assert Path(data_dir) == work / "figures" / "data"
    chosen = tmp_path / "chosen"
    _, fig, data, _ = _run(site, work, PAGED_REF_OUTPUT=str(chosen))
    assert Path(fig).parent == chosen / "figures" and Path(data).parent == chosen / "figures" / "data"
    assert not list((site / "paged_ref").rglob("*.png")) and not list((site / "paged_ref").rglob("*.json"))
    assert not (site / "figures").exists()


def test_the_checkout_keeps_its_own_figures_folder():
    from paged_ref.lab.runmode import output_root

    if os.environ.get("PAGED_REF_OUTPUT"):
        return
    assert output_root() == Path(paged_ref.__file__).resolve().parent.parent
