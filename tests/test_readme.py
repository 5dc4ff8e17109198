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
