"""The README's coursework example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_coursework_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)  # the first block: paging core + attention
    assert scope["out"].shape == (2, 8, 64)
    assert scope["cache"].seq_len(scope["b2"]) == 45


def test_layout_block_matches_the_tree():
    """Every module the README's layout names exists, and every module of the package is named."""
    text = README.read_text()
    block = text[text.index("## Read the code in this order") :]
    block = block[block.index("```") + 3 :]
    block = block[: block.index("```")]
    package = README.parent / "paged_ref"
    named = set(re.findall(r"\b(\w+)\.py\b", block))
    named |= {
        f"{sub}/{m}" for sub, mods in re.findall(r"(\w+)/ \(([^)]*)\)", block) for m in re.split(r"[,\s]+", mods) if m
    }
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__" and p.stem != "_validate"}
    subpackages = {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    for sub in subpackages:
        assert f"{sub}/" in block, f"paged_ref/{sub}/ is missing from the README layout"
    assert modules <= named, f"modules missing from the README layout: {sorted(modules - named)}"
    for name in named:
        path = package / (name + ".py") if "/" not in name else package / f"{name}.py"
        assert path.exists(), f"the README layout names {path.relative_to(README.parent)}, which does not exist"
