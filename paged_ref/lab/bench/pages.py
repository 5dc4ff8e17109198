"""Reading fewer pages: cascade attention over a shared prompt, and Quest's page selection beside eviction.

    python -m paged_ref.lab.bench pages [--quick | --smoke] [--out DIR] [--threads N] [--breakdown | --sampling]

* **Cascade.** ``samples`` requests share a ``prompt``-token prefix (whole pages) and each holds
  1..``suffix_max`` tokens of its own, in SmolLM2-135M's geometry (9 query heads, 3 KV heads,
  head_dim 64, float32, pages of 16): CPU time of one layer's decode attention, plain
  (`reference_paged_decode`, `sdpa_paged_decode`) against `reference_cascade_decode`, medians of
  interleaved rounds; the results are checked equal. K/V bytes read per step, counted by
  `paged_ref.lab.bench._reads.ReadCounter` (what the code copies out of the pages) next to the
  formula, for n requests sharing the prompt. The Triton path is checked against the reference
  (interpreter on CPU); on a GPU it is timed too.
* **Cascade in a real model.** SmolLM2 sampling ``samples`` continuations of one ``prompt``-token
  prompt through `paged_ref.hf.generate` with the ``sdpa`` and ``cascade`` backends, runs of the two
  taken in turns: milliseconds per decode step (the whole model), the median of the pairs' ratios, and
  whether the seeded tokens are the same.
* **Quest against eviction.** On SmolLM2 (float32, CPU), notebook 07's tasks (the texts of
  ``python -m paged_ref.lab.bench eviction``: continuation perplexity, retention, pass-key) at each
  token budget C: Quest reading C / 16 pages a step (`paged_ref.lab.quest_backend`;
  prefill and the first two layers, as in Quest's paper, read everything), PagedEviction and
  StreamingLLM holding C tokens, the full cache.
  Mean NLL with 95% t intervals, pass-key accuracy with Wilson intervals, and the K/V (and
  summary) bytes one decode step reads, counted over all layers.

* **Where the time goes** (``--breakdown``, alone): at ``samples`` requests, one layer, in turns every
  round: the reference and cascade whole, only their K/V gathers, both on a case of the same batch with
  almost no data (their per-request Python and PyTorch calls), and a plain sum over as many bytes as the
  reference gathers; the PyTorch calls each makes. Then SmolLM2 sampling with ``sdpa`` and ``cascade``
  in turns, every layer's attention timed inside the model: per decode step, attention and the rest.

* **Sampling again** (``--sampling``): only cascade in a real model, measured again and written into the
  complete ``pages_{mode}.json`` already in the folder as its ``generate_speed``, with the rerun's own
  command, environment and seconds under ``generate_speed["rerun"]``; the rest of that run is kept.

Results: ``figures/data/pages_{quick,full,smoke}.json`` and ``pages_breakdown_{quick,full,smoke}.json``
(notebook 10 reads them) and tables printed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..stats import mcnemar_p, mean_ci
from . import eviction as ev
from ._pages_cascade import (
    PAGE_SIZE,
    cascade_breakdown,
    cascade_bytes,
    cascade_case,
    cascade_speed,
    generate_breakdown,
    generate_speed,
    triton_check,
)
from ._pages_quest import DENSE_LAYERS, POLICIES, quality
from .common import DATA_DIR, bench_parser, command_line, environment, result_file, stage_log, table

__all__ = ["FULL", "POLICIES", "QUICK", "SMOKE", "cascade_bytes", "cascade_case", "cascade_speed", "cascade_tables"]
__all__ += ["breakdown_tables", "load_breakdown", "paired", "passkey_vs_full"]
__all__ += ["generate_speed", "load_results", "main", "quality", "quality_tables", "quest_vs_eviction"]

# each setting as (quick, smoke, full); the task texts follow the eviction benchmark's sizes
_SIZES = dict(
    samples=(32, 4, 32),
    prompt=(1024, 64, 1024),
    suffix_max=(32, 8, 32),
    rounds=(5, 2, 21),
    generate_steps=(9, 3, 17),  # SmolLM2 sampling: decode steps timed per backend (the first is not timed)
    generate_pairs=(3, 1, 3),  # SmolLM2 sampling: runs of each backend, in turns
    sharing=([1, 2, 4, 8, 16, 32], [1, 2, 4], [1, 2, 4, 8, 16, 32, 64]),
    budgets=([128, 256], [64], [128, 256, 512, 1024]),
    texts=(3, 1, 8),  # quick: three texts and five pass-key trials, so that every mean has an interval
    retention_texts=(3, 1, 8),
    passkey_trials=(5, 1, 20),
)
QUICK, SMOKE, FULL = ({key: values[i] for key, values in _SIZES.items()} for i in range(3))
QUICK.update({k: ev.QUICK[k] for k in ev.QUICK if k not in QUICK})
SMOKE.update({k: ev.SMOKE[k] for k in ev.SMOKE if k not in SMOKE})
FULL.update({k: ev.FULL[k] for k in ev.FULL if k not in FULL})


# ------------------------------------------------------------------------------------------ main
def main(argv=None):
    parser = bench_parser("pages", __doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (notebook 10's quick mode, a few minutes)")
    size.add_argument("--smoke", action="store_true", help="toy sizes: checks the harness runs (the tests' run)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--breakdown", action="store_true", help="only where cascade's and the plain path's time goes")
    only.add_argument(
        "--sampling", action="store_true", help="only SmolLM2 sampling, again, into the complete pages_{mode}.json"
    )
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "smoke" if args.smoke else "full"
    name = f"pages_{'breakdown_' if args.breakdown else ''}{mode}.json"
    before = _complete_run(parser, args.out, name) if args.sampling else None  # read before the file is reopened
    out = result_file(parser, args.out, name)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        cfg = {"quick": QUICK, "smoke": SMOKE, "full": FULL}[mode]
        if before is not None:
            return _run_sampling(args, argv, mode, out, cfg, before)
        run = _run_breakdown if args.breakdown else _run
        return run(args, argv, mode, out, cfg)
    finally:
        torch.set_num_threads(threads)


def _complete_run(parser, out_dir, name: str) -> dict:
    """The complete run in ``out_dir``/``name`` that ``--sampling`` measures part of again."""
    path = (Path(out_dir) if out_dir is not None else DATA_DIR) / name
    data = json.loads(path.read_text()) if path.is_file() else {}
    if not data.get("complete"):
        parser.error(f"--sampling measures a part of a complete {path} again; there is none: run without it first")
    return data


def _begin(args, argv, mode, config):
    """A run's clock, its log (seconds since the start) and the result's provenance."""
    start = time.perf_counter()
    log = stage_log()

    result = dict(
        mode=mode,
        command=command_line("pages", argv),
        config=config,
        environment=dict(environment(), torch_threads=args.threads),
    )
    return start, log, result


def _run(args, argv, mode, out, cfg):
    start, log, result = _begin(args, argv, mode, dict(cfg, page_size=PAGE_SIZE, quest_dense_layers=DENSE_LAYERS))
    result["cascade_speed"] = cascade_speed(cfg, log)
    result["cascade_bytes"] = cascade_bytes(cfg)
    result["triton"] = triton_check(cfg, log)
    out.save(result)
    from ...models import load_smollm2

    model, tok = load_smollm2()
    result["model"] = "SmolLM2-135M-Instruct (GGUF, float32)"
    log("model loaded")
    result["generate_speed"] = generate_speed(model, tok, cfg, log)
    out.save(result)
    quality(model, tok, cfg, log, result, out)
    result["seconds"] = round(time.perf_counter() - start, 1)
    path = out.save(result, complete=True)
    print_report(result)
    print(f"\nwrote {path} ({result['seconds']} s)")
    return result


def _run_sampling(args, argv, mode, out, cfg, before: dict):
    """``--sampling``: `generate_speed` measured again and written into ``before`` (the complete run it
    replaces the section of), the rerun's command, environment and seconds beside it."""
    out.save(before, complete=True)  # the run stays whole on disk while this part is measured
    start, log, begun = _begin(args, argv, mode, cfg)
    from ...models import load_smollm2

    model, tok = load_smollm2()
    g = generate_speed(model, tok, cfg, log)
    rerun = {k: begun[k] for k in ("command", "environment")} | {"seconds": round(time.perf_counter() - start, 1)}
    before["generate_speed"] = dict(g, rerun=rerun)
    path = out.save(before, complete=True)
    print(_sampling_line(before["generate_speed"]))
    print(f"\nwrote {path} ({rerun['seconds']} s)")
    return before


def _run_breakdown(args, argv, mode, out, cfg):
    start, log, result = _begin(args, argv, mode, dict(cfg, page_size=PAGE_SIZE))
    result["cascade_breakdown"] = cascade_breakdown(cfg, log)
    out.save(result)
    from ...models import load_smollm2

    model, tok = load_smollm2()
    result["model"] = "SmolLM2-135M-Instruct (GGUF, float32)"
    result["generate_breakdown"] = generate_breakdown(model, tok, cfg, log)
    result["seconds"] = round(time.perf_counter() - start, 1)
    path = out.save(result, complete=True)
    print(breakdown_tables(result))
    print(f"\nwrote {path} ({result['seconds']} s)")
    return result


def breakdown_tables(result, parts=("layer", "model")) -> str:
    """Where the reference's and cascade's time goes (`bench pages --breakdown`'s JSON), as text: one
    layer's paths taken apart (``"layer"``) and SmolLM2's decode steps with attention timed (``"model"``)."""
    b, g = result["cascade_breakdown"], result["generate_breakdown"]
    rows = [dict(path=n, **p) for n, p in b["paths"].items()]
    steps = [dict(backend=n, **g[n]) for n in ("sdpa", "cascade")]
    text = {
        "layer": [
            f"{b['samples']} requests sharing {b['prompt']} tokens, one layer, medians of {b['rounds']} rounds "
            f"in turns (load {b['load_before'][0]:.1f}); a plain sum reads memory at {b['sum_gb_per_s']:.1f} GB/s",
            table([("path", "{path}"), ("ms", "{ms:.2f}"), ("K/V MB", "{mb:.2f}"), ("GB/s", "{kv_gb_per_s:.2f}"),
                   ("ms at sum rate", "{read_ms_at_sum_rate:.2f}"), ("torch calls", "{torch_calls}"),
                   ("gathers ms", "{gathers_ms:.2f}"), ("no-data ms", "{per_request_ms:.2f}"),
                   ("math ms", "{math_ms:.2f}")], [dict(r, mb=r["kv_bytes"] / 1e6) for r in rows]),
        ],
        "model": [
            f"SmolLM2 sampling {g['samples']} continuations, every layer's attention timed in the model "
            f"({g['layers']} layers; medians of {g['sdpa']['steps']} decode steps, {g['repeats']} runs each in turns)",
            table([("backend", "{backend}"), ("step ms", "{step_ms:.0f}"), ("attention ms", "{attention_ms:.0f}"),
                   ("rest ms", "{rest_ms:.0f}"), ("per layer ms", "{layer_ms:.2f}")], steps),
        ],
    }  # fmt: skip
    return "\n\n".join("\n".join(text[p]) for p in parts)


def load_breakdown(data_dir=None):
    """``(file name, dict)`` of a complete ``pages_breakdown_full.json``, else ``pages_breakdown_quick.json``,
    in ``data_dir`` (default: ``figures/data/``); ``(None, None)`` if neither."""
    folder = Path(data_dir) if data_dir is not None else DATA_DIR
    for name in ("pages_breakdown_full.json", "pages_breakdown_quick.json"):
        if (folder / name).exists():
            data = json.loads((folder / name).read_text())
            if data.get("complete"):
                return name, data
    return None, None


def load_results(data_dir=None):
    """``(file name, dict)`` of a complete ``pages_full.json`` if present, else of a complete
    ``pages_quick.json``, in ``data_dir`` (default: ``figures/data/``); ``(None, None)`` if neither."""
    folder = Path(data_dir) if data_dir is not None else DATA_DIR
    for name in ("pages_full.json", "pages_quick.json"):
        if (folder / name).exists():
            data = json.loads((folder / name).read_text())
            if data.get("complete"):
                return name, data
    return None, None


def cascade_tables(result) -> str:
    """The cascade timing and bytes tables, from the benchmark's JSON."""
    s = result["cascade_speed"]
    speed = [  # time / cascade: the median of the rounds' ratios (speedup_vs)
        dict(path=n, ms=t, x=s["speedup_vs"].get(n, 1.0), err=s["rel_error_vs_reference"][n])
        for n, t in s["median_ms"].items()
    ]
    mb = [
        dict(
            n=r["requests"],
            **{k: v / 1e6 for k, v in r["bytes_counted"].items()},
            fp=r["bytes_formula"]["plain"] / 1e6,
            fc=r["bytes_formula"]["cascade"] / 1e6,
        )
        for r in result["cascade_bytes"]
    ]
    g = result.get("generate_speed")
    sampling = [] if g is None else ["", _sampling_line(g)]
    return "\n".join(
        [
            f"{s['samples']} requests sharing {s['prompt']} tokens, one layer of decode attention, "
            f"SmolLM2 geometry, CPU, median of {len(s['rounds_ms']['cascade'])} rounds",
            table([("path", "{path}"), ("median ms", "{ms:.2f}"), ("time / cascade", "{x:.2f}"),
                   ("rel. error vs reference", "{err:.1e}")], speed),
            "",
            "K/V MB read per step and layer: counted (ReadCounter) and the whole-page formulas",
            table([("requests", "{n}"), ("reference", "{reference:.2f}"), ("sdpa", "{sdpa:.2f}"),
                   ("cascade", "{cascade:.2f}"), ("formula plain", "{fp:.2f}"), ("formula cascade", "{fc:.2f}")], mb),
            *sampling,
        ]
    )  # fmt: skip


def _sampling_line(g: dict) -> str:
    """The SmolLM2 sampling result (`generate_speed`) as one line: each pair's ratio where the runs are kept, and
    the provenance of a rerun (``--sampling``) if any."""
    runs = [g[b].get("runs_ms_per_step") for b in ("sdpa", "cascade")]
    each = ", ".join(f"{a / b:.2f}x" for a, b in zip(*runs)) if all(runs) else ""
    pairs = f", the median of {g['pairs']} pairs of runs: {each}" if "pairs" in g and each else ""
    again = g.get("rerun")
    when = f"; measured again by itself: {again['command']}, {again['environment']['date_utc'][:10]}" if again else ""
    return (
        f"SmolLM2 sampling {g['samples']} continuations of a {g['prompt']}-token prompt (whole model, median ms per "
        f"decode step): sdpa {g['sdpa']['ms_per_step']:.0f}, cascade {g['cascade']['ms_per_step']:.0f} "
        f"({g['speedup']:.2f}x{pairs}); same tokens: {g['same_tokens']}{when}"
    )


def quality_tables(result) -> str:
    """Quest beside eviction: NLL tables, pass-key accuracy and bytes per step, from the JSON."""
    nll = [
        ("policy", "{policy}"),
        ("budget", "{budget}"),
        ("texts", "{texts}"),
        ("NLL", "{nll:.3f}"),
        ("95% CI", "[{nll_ci95[0]:.3f}, {nll_ci95[1]:.3f}]"),
        ("ppl", "{ppl:.2f}"),
        ("KL vs full", "{kl_vs_full:.4f}"),
    ]
    b = result["bytes_per_step"]
    rows = [dict(r, mb=r["bytes_per_step"] / 1e6) for r in b["rows"]]
    return "\n".join(
        [
            "Continuation: mean NLL per token (95% t interval over texts)",
            table(nll, _ordered(result["language_modelling"])),
            "",
            "Retention: NLL of a passage's tokens that are in the context verbatim",
            table(nll, _ordered(result["retention"])),
            "",
            "Pass-key: accuracy (Wilson 95% interval)",
            table([("policy", "{policy}"), ("budget", "{budget}"), ("correct", "{correct}/{trials}"),
                   ("95% CI", "[{ci95[0]:.2f}, {ci95[1]:.2f}]")], _ordered(result["passkey"])),
            "",
            f"MB one decode step reads, all {b['layers']} layers, after {b['context']} tokens (counted)",
            table([("policy", "{policy}"), ("budget", "{budget}"), ("MB", "{mb:.2f}")], _ordered(rows)),
        ]
    )  # fmt: skip


def _ordered(rows):
    order = {p: i for i, p in enumerate([*POLICIES, "quest"])}
    return sorted(rows, key=lambda r: (r["budget"] or 0, order[r["policy"]]))


def quest_vs_eviction(result) -> list[dict]:
    """Per budget and task: Quest's score minus PagedEviction's and StreamingLLM's (NLL: lower is
    better; pass-key: accuracy, higher is better), with each side's interval, whether the two
    intervals overlap, and the paired comparison on the same texts or trials (where the JSON holds
    them): for the NLL, the mean per-text difference with its 95% t interval (``paired_ci``); for
    pass-key, the trials only Quest answered and only the peer answered (``discordant``) and the
    exact McNemar p-value."""
    out = []
    for task, key, ci, per in (
        ("language_modelling", "nll", "nll_ci95", "lm_rows"),
        ("retention", "nll", "nll_ci95", "retention_rows"),
        ("passkey", "accuracy", "ci95", "passkey_rows"),
    ):
        rows = {(r["policy"], r["budget"]): r for r in result[task]}
        each = _per_item(result.get(per, []), "trial" if task == "passkey" else "text", key)
        for c in result["config"]["budgets"]:
            quest = rows[("quest", c)]
            for peer in ("paged_eviction", "streaming_llm"):
                other = rows[(peer, c)]
                row = dict(
                    task=task,
                    budget=c,
                    peer=peer,
                    metric=key,
                    quest=quest[key],
                    quest_ci=quest[ci],
                    other=other[key],
                    other_ci=other[ci],
                    difference=quest[key] - other[key],
                    overlap=quest[ci][0] <= other[ci][1] and other[ci][0] <= quest[ci][1],
                )
                row.update(paired(each.get(("quest", c), {}), each.get((peer, c), {}), task == "passkey"))
                out.append(row)
    return out  # fmt: skip


def passkey_vs_full(result) -> list[dict]:
    """Per policy and budget: the pass-key trials answered and, on the same trials, those only this
    policy answered and those only the full cache answered (``discordant``), with McNemar's exact p."""
    each = _per_item(result.get("passkey_rows", []), "trial", "accuracy")
    full = next(r for r in result["passkey"] if r["policy"] == "full")
    out = []
    for r in _ordered(result["passkey"]):
        if r["policy"] != "full":
            row = dict(policy=r["policy"], budget=r["budget"], correct=r["correct"], trials=r["trials"])
            row.update(
                full_correct=full["correct"],
                **paired(each.get((r["policy"], r["budget"]), {}), each.get(("full", None), {}), True),
            )
            out.append(row)
    return out


def _per_item(rows, item: str, key: str) -> dict:
    """``{(policy, budget): {text or trial: value}}`` from the JSON's per-text or per-trial rows."""
    out = {}
    for r in rows:
        out.setdefault((r["policy"], r["budget"]), {})[r[item]] = r["correct"] if key == "accuracy" else r[key]
    return out


def paired(a: dict, b: dict, binary: bool) -> dict:
    """The paired comparison of ``a`` and ``b`` (``{item: value}``) over the items both hold: for
    values, ``paired_ci`` (mean of a - b, its 95% t interval); for right/wrong answers,
    ``discordant`` (items only ``a`` got right, items only ``b`` did) and ``mcnemar_p``; empty if none.

    Example:
        >>> paired({0: True, 1: True, 2: False}, {0: False, 1: True, 2: False}, binary=True)
        {'discordant': [1, 0], 'mcnemar_p': 1.0}
    """
    items = sorted(set(a) & set(b))
    if not items:
        return {}
    if binary:
        only = [sum(a[i] and not b[i] for i in items), sum(b[i] and not a[i] for i in items)]
        return dict(discordant=only, mcnemar_p=mcnemar_p(*only))
    mean, lo, hi = mean_ci([a[i] - b[i] for i in items])
    return dict(paired_ci=[lo, hi], paired_mean=mean)


def print_report(result) -> None:
    """The benchmark's tables, from its JSON."""
    print("\nCascade\n" + cascade_tables(result))
    print("\nQuest beside eviction\n" + quality_tables(result))


if __name__ == "__main__":
    main()
