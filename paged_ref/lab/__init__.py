"""The lab: everything that measures, draws, grades or feeds the notebooks. The lesson never imports it.

- `bench`: the benchmarks, run as ``python -m paged_ref.lab.bench NAME``: measure, write JSON to
  ``figures/data/``;
- `viz`: matplotlib figures from that JSON or from the lesson's objects;
- `widgets`: the notebooks' sliders, each redrawn by a pure function a test also calls;
- `check`: the coursework checkers students call on their own code (``pr.lab.check``);
- helpers the above share: `runmode` (quick or full runs, where figures go), `provenance`
  (hardware and versions), `textdata` (real text from the standard library), `stats`,
  `texttable`, `sizing` (model presets and byte counts beside the cache's own); `serve_metrics`
  (percentiles and summaries of served requests), `page_trace` (who owns each page after every
  engine step, notebook 09); `likelihood`
  (teacher-forced log-probs through the pages), `mistakes` (wrong backends, its negative controls)
  and `quest_backend` (Quest's decode in a session); the notebooks' simulations and replays:
  `fragmentation` (workloads served by the engine, dry), `scenarios`, `sharing`, `serve_counts`,
  `eviction_analysis`, `eviction_replay`; `csr` (a CSR batch back to page lists, notebooks 02 and
  08); `flex_inspect` (a paged BlockMask replayed token by token, notebook 04) and `softmax_steps`
  (the online softmax's every state, notebook 05).

Submodules load on first use:

    >>> import paged_ref as pr
    >>> pr.lab.stats.wilson(0, 0)
    (0.0, 1.0)
"""

import importlib
import pkgutil

_SUBMODULES = {m.name for m in pkgutil.iter_modules(__path__)}  # every module and folder here


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'paged_ref.lab' has no attribute {name!r}")


__all__ = sorted(_SUBMODULES)
