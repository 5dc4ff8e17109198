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


def test_the_memory_minimum_is_drawn_for_the_most_tokens_a_decoder_held():
    """Decoders that ran fewer steps hold fewer tokens: the dashed minimum is the largest of their minima at each
    context, so a decoder that holds exactly its tokens and the most of them (DynamicCache) lies on it."""
    data = json.loads((DATA_DIR / "scaling_cpu.json").read_text())
    res = data["models"]["smollm2"]
    fig = viz.memory_figure(data, "smollm2")
    line = next(x for x in fig.axes[0].get_lines() if x.get_label() == "minimum for the most tokens held")
    most = {}
    for r in res["ladder"] + res.get("long", []):
        if r["backend"] != "none":
            for p in r["points"]:
                most[p["context"]] = max(most.get(p["context"], 0), p["tokens_held"])
    want = [most[c] * res["kv_bytes_per_token"] / 2**20 for c in sorted(most)]
    assert list(line.get_xdata()) == sorted(most) and line.get_ydata() == pytest.approx(want)
