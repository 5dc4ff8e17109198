"""The figures of a `python -m paged_ref.lab.bench gpu` run, drawn from the JSON it wrote.

    python -m paged_ref.lab.viz.run_figures DIR {gpu,cpu}

Writes ``decode_<kind>.png`` (bandwidth of each decode implementation; GPU timings only) and
``scaling_latency_<kind>.png`` (per-token latency vs context) into DIR, and prints what it could
not draw and why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["draw", "main"]


def draw(out: Path, kind: str) -> str:
    """Draw the decode bandwidth and scaling latency figures from this run's JSON."""
    import matplotlib

    matplotlib.use("Agg")
    from . import kernel, scaling

    notes = []
    decode = out / f"decode_{kind}.json"
    if kind == "gpu" and decode.exists():
        fig = kernel.bandwidth_figure(json.loads(decode.read_text()))
        fig.savefig(out / f"decode_{kind}.png", dpi=110, bbox_inches="tight")
    else:
        notes.append("decode figure: bandwidth needs GPU timings" if kind == "cpu" else "decode figure: no decode JSON")
    data_path = out / f"scaling_{kind}.json"
    if data_path.exists():
        data = json.loads(data_path.read_text())
        if data.get("models"):
            model = next(iter(data["models"]))
            fig = scaling.latency_figure(data, model)
            fig.savefig(out / f"scaling_latency_{kind}.png", dpi=110, bbox_inches="tight")
        else:
            notes.append("scaling figure: no model finished")
    else:
        notes.append("scaling figure: no scaling JSON")
    return "; ".join(notes)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[1] not in ("gpu", "cpu"):
        raise SystemExit("usage: python -m paged_ref.lab.viz.run_figures DIR {gpu,cpu}")
    notes = draw(Path(argv[0]), argv[1])
    print(notes or "all figures drawn")


if __name__ == "__main__":
    main()
