"""The package as a student installs it: build a wheel, install it into a fresh venv in another
folder, import it from there and run the coursework example (no make, no network)."""

import importlib.metadata
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

EXAMPLE = textwrap.dedent(
    """
    import sys, torch
    import paged_ref as pr
    import paged_ref.lab.check
    cache = pr.PagedKVCache(num_layers=1, num_pages=64, page_size=16, num_kv_heads=2, head_dim=64)
    a, b = cache.add_sequence(), cache.add_sequence()
    ks, vs = {}, {}
    for seq, n in ((a, 19), (b, 45)):
        slots = cache.reserve(seq, n)
        ks[seq], vs[seq] = torch.randn(n, 2, 64), torch.randn(n, 2, 64)  # [num_tokens, Hkv, D]
        cache.write(0, slots, ks[seq], vs[seq])
    table, lens = cache.block_table([a, b])
    q = torch.randn(2, 8, 64)  # [batch, Hq, D]
    out = pr.reference_paged_decode(q, cache.k_cache[0], cache.v_cache[0], table, lens)
    for i, seq in enumerate((a, b)):
        k = ks[seq].repeat_interleave(4, dim=1).transpose(0, 1)  # [Hq, n, D]
        v = vs[seq].repeat_interleave(4, dim=1).transpose(0, 1)
        p = torch.softmax(q[i][:, None] @ k.transpose(1, 2) / 8, -1)  # [Hq, 1, n]
        torch.testing.assert_close(out[i], (p @ v)[:, 0])
    assert pr.lab.check.check_allocator(pr.PageAllocator).passed
    # every paged_ref module loaded here is the wheel's copy, none the repository's
    elsewhere = {n: m.__file__ for n, m in sys.modules.items() if n.startswith("paged_ref")
                 and not m.__file__.startswith(sys.argv[1])}
    assert not elsewhere, elsewhere
    print("coursework example ok")
    """
)

#: The faster CPU step from the install: its C++ kernels built from the wheel's .cpp files (a kernel that
#: cannot be built warns, and a warning fails here), its tokens those of the eager step.
FAST_EXAMPLE = textwrap.dedent(
    """
    import warnings
    warnings.simplefilter("error", RuntimeWarning)
    import paged_ref as pr
    from paged_ref.models import tiny_llama
    model = tiny_llama(seed=0)
    def tokens(**options):
        engine = pr.serve.Engine(model, num_pages=24, page_size=4, max_num_seqs=4, max_batched_tokens=16,
                                 eos_token_id=[], clock="steps", **options)
        for n in (5, 9, 14):
            engine.add_request(list(range(3, 3 + n)), max_new_tokens=6)
        return [o.token_ids for o in engine.run()]
    assert tokens(fast=True) == tokens(), "the fast step's tokens differ from the eager step's"
    print("fast path ok")
    """
)


def _run(cmd, **kwargs):
    """Run ``cmd``; on failure, fail the test with the command and its output (not just its status)."""
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    if done.returncode:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return done


def _source_copy(dest: Path) -> Path:
    """The files a build reads, copied outside the repository: the build then writes its
    egg-info and build/ folder there, not into the checkout the other tests import from."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    for name in ("paged_ref", "tests", "notebooks"):  # tests and notebooks: to show they stay out
        shutil.copytree(ROOT / name, dest / name, ignore=skip)
    return dest


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs_the_coursework_example(tmp_path):
    try:
        setuptools = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"building the wheel without network needs setuptools>=77 in {sys.executable}")
    assert int(setuptools.split(".")[0]) >= 77, f"pyproject.toml needs setuptools>=77, found {setuptools}"

    src, dist = _source_copy(tmp_path / "src"), tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, src])
    (wheel,) = dist.glob("paged_ref-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "paged_ref").rglob("__init__.py")}
    shipped = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert packages <= shipped, f"subpackages missing from the wheel: {sorted(packages - shipped)}"
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "paged_ref").rglob("*.py") if "__pycache__" not in p.parts}
    code = {n for n in names if n.endswith(".py")}  # equal sets: no module left out, no stale one shipped
    assert code == modules, f"wheel lacks {sorted(modules - code)}, has extra {sorted(code - modules)}"
    sources = {str(p.relative_to(ROOT)) for suffix in ("*.cpp", "*.h") for p in (ROOT / "paged_ref").rglob(suffix)}
    assert sources and sources <= names, f"wheel lacks the C++ sources {sorted(sources - names)}"
    outside = sorted(n for n in names if n.split("/")[0] != "paged_ref" and ".dist-info/" not in n)
    assert not outside, f"the wheel holds more than the package and its .dist-info: {outside}"

    env = tmp_path / "venv"
    venv.create(env, with_pip=False)  # no system site-packages: the base interpreter's are not seen
    python = env / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(_run([python, "-c", where]).stdout.strip())
    # The heavy dependencies (torch, transformers) come from this interpreter's site-packages as a plain
    # sys.path entry: .pth files are processed only in site directories, so the repository's editable
    # install (a .pth and finder in that folder) stays inactive, and the new venv's own site-packages
    # comes first on sys.path.
    (site / "_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    pip = [sys.executable, "-m", "pip", "--python", python]  # pip >= 22.3; the new venv has no pip
    _run([*pip, "install", "--no-deps", "--no-index", wheel], cwd=tmp_path)

    work = tmp_path / "work"  # a working directory that is neither the repository nor the venv
    work.mkdir()
    (work / "example.py").write_text(EXAMPLE)
    run = _run([python, "example.py", site], cwd=work)
    assert "coursework example ok" in run.stdout
    (work / "fast.py").write_text(FAST_EXAMPLE)
    assert "fast path ok" in _run([python, "fast.py"], cwd=work).stdout
