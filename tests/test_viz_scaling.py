"""viz.scaling on the committed GPU run: each section it lacks is named with the run's reason,
and the figures of the sections it has draw."""

import json
import re

import pytest

from paged_ref.lab.bench.common import DATA_DIR
from paged_ref.lab.viz import scaling as viz

GPU = json.loads((DATA_DIR / "scaling_gpu.json").read_text())


def test_missing_sections_give_the_runs_reason():
    for name, res in GPU["models"].items():
        for section in ("ladder", "batch", "chat", "sweep", "alloc"):
            why = viz.missing_section(GPU, name, section)
            failed = [e for e in res.get("errors", []) if e.startswith(section + ":")]
            if res.get(section):
                assert why is None
            elif failed:
                assert why.startswith("failed in this run: ") and failed[0].split(": ", 1)[1] in why
            else:
                assert why is not None


@pytest.mark.parametrize("kind", sorted(viz.FIGURES))
def test_each_figure_draws_or_says_why_not(kind):
    section, draw = viz.FIGURES[kind]
    for name in GPU["models"]:
        why = viz.missing_section(GPU, name, section)
        if why is None:
            assert draw(GPU, name).axes
        else:
            with pytest.raises(ValueError, match=re.escape(f"no {section!r} section to draw: {why}")):
                draw(GPU, name)
