"""The package as a student installs it: build a wheel, install it into a fresh venv in another
folder, import it from there and run the coursework example (no make, no network)."""

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
    assert pr.__file__.startswith(sys.argv[1]), pr.__file__  # the wheel's copy, not the repository's
    cache = pr.PagedKVCache(num_layers=1, num_pages=64, page_size=16, num_kv_heads=2, head_dim=64)
    a, b = cache.add_sequence(), cache.add_sequence()
    ks, vs = {}, {}
    for seq, n in ((a, 19), (b, 45)):
        slots = cache.reserve(seq, n)
        ks[seq], vs[seq] = torch.randn(n, 2, 64), torch.randn(n, 2, 64)  # [num_tokens, Hkv, D]
        cache.write(0, slots, ks[seq], vs[seq])
    table, lens = cache.block_table([a, b])
    q = torch.randn(2, 8, 64)  # [batch, Hq, D]
    out = pr.paged_attention_reference(q, cache.k_cache[0], cache.v_cache[0], table, lens)
    for i, seq in enumerate((a, b)):
        k = ks[seq].repeat_interleave(4, dim=1).transpose(0, 1)  # [Hq, n, D]
        v = vs[seq].repeat_interleave(4, dim=1).transpose(0, 1)
        p = torch.softmax(q[i][:, None] @ k.transpose(1, 2) / 8, -1)  # [Hq, 1, n]
        torch.testing.assert_close(out[i], (p @ v)[:, 0])
    assert pr.check.check_allocator(pr.PageAllocator).passed
    print("coursework example ok")
    """
)


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs_the_coursework_example(tmp_path):
    dist = tmp_path / "dist"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist)]
    subprocess.run([*build, str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = dist.glob("paged_ref-*.whl")

    names = zipfile.ZipFile(wheel).namelist()
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "paged_ref").rglob("__init__.py")}
    shipped = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert packages <= shipped, f"subpackages missing from the wheel: {sorted(packages - shipped)}"
    assert not [n for n in names if n.startswith(("tests/", "notebooks/"))]

    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.check_output([python, "-c", where], text=True).strip())
    # the heavy dependencies (torch, transformers) come from this interpreter's site-packages as a plain
    # path: its .pth files, among them the repository's editable install, are not processed there
    (site / "_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, cwd=tmp_path)

    (tmp_path / "example.py").write_text(EXAMPLE)
    run = subprocess.run([python, "example.py", str(site)], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "coursework example ok" in run.stdout
