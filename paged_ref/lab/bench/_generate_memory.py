"""Peak memory of one generation, a fresh process per run: the paged pool against DynamicCache.

In a process that ran other methods, an RSS rise says more about the allocator's free blocks than about
the method. So each (method, context, repeat) process loads the model, runs the method once on an
8-token prompt (first-call costs), hands free memory back to the OS (glibc ``malloc_trim``), then runs
one ``generate`` call while `PeakRSS` samples the RSS every 2 ms: the rise is KV cache plus activations.

    python -m paged_ref.lab.bench._generate_memory --method paged_auto --context 2048 --new 32

prints one JSON line; `measure_memory` runs the processes and takes the median of the repeats.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
from statistics import median_high

import torch

from ._model_bench import PeakRSS, generation_methods, load_model, paired_ratio, prompt_tokens

__all__ = ["measure_memory", "memory_row"]

METHODS = ("hf_generate", "paged_auto")


def measure_memory(*, contexts, new, repeats, model="smollm2", threads=None, methods=METHODS) -> dict:
    """Peak RSS rise of ``generate`` per method and prompt length, the methods taking turns in each repeat.

    Returns:
        ``{"contexts", "new_tokens", "repeats", "rows": [{"context", "methods": {m: {...}}}]}`` with,
        per method, ``peak_rss_rise_bytes`` (median) and ``runs_bytes``; paged methods also
        ``over_hf_generate`` (their median over ``hf_generate``'s) and ``over_hf_generate_paired`` (the
        median of the per-repeat ratios, each against ``hf_generate``'s run of the same repeat).
    """
    rows = []
    for n in contexts:
        runs = {m: [] for m in methods}
        for _ in range(repeats):
            for m in methods:
                runs[m].append(_child(m, n, new, model, threads)["peak_rss_rise_bytes"])
        row = memory_row(n, runs)
        rows.append(row)
        rises = ", ".join(f"{m} {r['peak_rss_rise_bytes'] / 2**20:.1f} MiB" for m, r in row["methods"].items())
        print(f"memory at context {n}: {rises}", flush=True)
    return {"contexts": list(contexts), "new_tokens": new, "repeats": repeats, "rows": rows}


def memory_row(context: int, runs: dict) -> dict:
    """One context's row from each method's RSS rises, ``runs[method][repeat]`` (bytes, the methods taking
    turns in each repeat): the median per method and, for each method besides ``hf_generate``, its ratio to
    ``hf_generate``'s, of the medians and paired (`._model_bench.paired_ratio`)."""
    row = {
        "context": context,
        "methods": {m: {"peak_rss_rise_bytes": median_high(r), "runs_bytes": list(r)} for m, r in runs.items()},
    }
    hf = row["methods"].get("hf_generate")
    for m, r in row["methods"].items():
        if m != "hf_generate" and hf and hf["peak_rss_rise_bytes"]:
            r["over_hf_generate"] = r["peak_rss_rise_bytes"] / hf["peak_rss_rise_bytes"]
            if all(hf["runs_bytes"]):
                r["over_hf_generate_paired"] = paired_ratio(r["runs_bytes"], hf["runs_bytes"])
    return row


def _child(method, context, new, model, threads) -> dict:
    cmd = [sys.executable, "-m", __name__, "--method", method, "--context", str(context), "--new", str(new)]
    cmd += ["--model", model] + ([] if threads is None else ["--threads", str(threads)])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.split("\n")[0])
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--context", type=int, required=True, help="prompt tokens")
    parser.add_argument("--new", type=int, required=True, help="tokens generated")
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    warm = generation_methods(model, [prompt_tokens(model, tokenizer, 8).tolist()], 2, ("auto",), False)[args.method]
    warm()  # first-call costs (lazy imports, kernel selection) are not the cache's memory
    gc.collect()  # ... and the warm-up's freed blocks must not serve the measured call
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    prompt = prompt_tokens(model, tokenizer, args.context).tolist()
    run = generation_methods(model, [prompt], args.new, ("auto",), with_generate_batch=False)[args.method]
    with PeakRSS() as probe:
        tokens, _ = run()
    result = dict(vars(args), peak_rss_rise_bytes=probe.rise_bytes, generated=len(tokens[0]))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
