"""Paged generation with a real model against transformers' own generate and generate_batch.

    python -m paged_ref.lab.bench generate [--quick] [--threads N] [--model smollm2|tiny] [--out DIR]

Greedy, EOS ignored so that every method does the same work. ``single``: one prompt of English prose
-> ``pr.hf.generate`` per backend against ``model.generate`` (``DynamicCache``, SDPA). ``mixed``: prompts
of different lengths -> the same, plus ``model.generate_batch`` (16-token pages, just enough blocks).
``contexts``: prefill and decode timed apart at 128 to 8192 tokens (`._generate_contexts`). ``memory``:
the peak RSS rise of one call, a fresh process per run (`._generate_memory`).

Per method (single, mixed): median wall time of the whole call after one warm-up, the methods
interleaved in each repeat; tokens/s and its ratio to each peer's, of the medians and as the median of
per-repeat ratios; whether the tokens equal ``model.generate``'s; KV bytes (``DynamicCache``: padded
size; paged: peak pages in use and the pool; generate_batch: its pool); the peak RSS rise (sampled
every 2 ms; approximate in a process that ran the other methods). JSON: ``figures/data/generate_cpu.json``
(``_gpu`` on CUDA). The Triton backend is not timed on CPU (it is the interpreter).
"""

from __future__ import annotations

import time
from statistics import median_high

import torch

from .. import textdata
from ._generate_contexts import measure_contexts
from ._generate_memory import measure_memory
from ._model_bench import PAGE_SIZE, PeakRSS, generation_methods, model_parser, paired_ratio, start_run
from .common import environment, result_file, table

FULL = dict(single_words=96, single_new=48, mixed_prompts=8, mixed_new=32, repeats=3)
QUICK = dict(single_words=24, single_new=8, mixed_prompts=3, mixed_new=6, repeats=1)
CONTEXTS_FULL = dict(
    contexts=(128, 512, 2048, 8192),
    decode_steps=16,
    repeats=3,
    backends=("auto", "reference"),
    scattered=("auto",),
    skip_above={"paged_reference": 2048},
)
CONTEXTS_QUICK = dict(contexts=(16, 64), decode_steps=3, repeats=1, backends=("auto", "reference"), scattered=("auto",))
MEMORY_FULL = dict(contexts=(128, 512, 2048, 8192), new=32, repeats=3)
MEMORY_QUICK = dict(contexts=(64,), new=4, repeats=1)
BACKENDS = ("auto", "reference", "flex", "sdpa")

METHOD_COLUMNS = [
    ("method", "{method}"),
    ("median s", "{median_s:.3f}"),
    ("tokens/s", "{tokens_per_s:.1f}"),
    ("same tokens", "{tokens_match_hf_generate}"),
    ("KV MiB", "{kv_mib:.2f}"),
    ("RSS rise MiB", "{rss_mib:.1f}"),
]
CONTEXT_COLUMNS = [
    ("context", "{context}"),
    ("method", "{method}"),
    ("prefill s", "{prefill_s:.3f}"),
    ("decode ms/token", "{decode_ms:.1f}"),
    ("prefill ratio", "{prefill_over_hf:.2f}x"),
    ("paired", "{prefill_over_hf_paired:.2f}x"),
    ("decode ratio", "{decode_over_hf:.2f}x"),
    ("paired", "{decode_over_hf_paired:.2f}x"),
    ("plan share", "{plan_share_of_decode_step:.1%}"),
    ("same tokens", "{tokens_match_hf}"),
]
MEMORY_COLUMNS = [
    ("context", "{context}"),
    ("method", "{method}"),
    ("peak rise MiB (median)", "{peak_mib:.1f}"),
    ("runs MiB", "{runs_mib}"),
    ("vs hf_generate", "{over_hf_generate:.2f}x"),
    ("paired", "{over_hf_generate_paired:.2f}x"),
]


def _run_workload(name, model, rows, new, backends, repeats, with_generate_batch):
    methods = generation_methods(model, rows, new, backends, with_generate_batch)
    tokens = {m: run()[0] for m, run in methods.items()}  # warm-up, and the tokens to compare
    times, rss, kv = {m: [] for m in methods}, dict.fromkeys(methods, 0), {}
    for _ in range(repeats):
        for m, run in methods.items():
            with PeakRSS() as probe:
                start = time.perf_counter()
                _, kv[m] = run()
                times[m].append(time.perf_counter() - start)
            rss[m] = max(rss[m], probe.rise_bytes)
    expected = tokens["hf_generate"]
    generated = sum(len(t) for t in expected)
    results = {}
    for m in methods:
        median = median_high(times[m])
        results[m] = {
            "median_s": median,
            "times_s": times[m],
            "tokens_per_s": generated / median,
            "tokens_match_hf_generate": tokens[m] == expected,
            "peak_rss_rise_bytes": rss[m],
            **kv[m],
        }
    ratios, paired = {}, {}
    for m in methods:
        for peer in ("hf_generate", "hf_generate_batch"):
            if m.startswith("paged_") and peer in results:
                ratios[f"{m}/{peer}"] = results[m]["tokens_per_s"] / results[peer]["tokens_per_s"]
                paired[f"{m}/{peer}"] = paired_ratio(times[peer], times[m])  # runs minutes apart see other loads
    workload = dict(name=name, prompt_lens=[len(r) for r in rows], new_tokens=new, generated_tokens=generated)
    workload.update(page_size=PAGE_SIZE, repeats=repeats)
    return {
        "workload": workload,
        "results": results,
        "ratios_tokens_per_s": ratios,
        "ratios_tokens_per_s_paired": paired,
    }


def measure(model, tokenizer=None, *, single_words, single_new, mixed_prompts, mixed_new, repeats, backends=BACKENDS):
    """Run both workloads on ``model``; without a tokenizer, prompts are seeded random ids."""
    if tokenizer is not None:
        single = [tokenizer(textdata.english_text(single_words)).input_ids]
        texts = textdata.prompts(mixed_prompts, min_words=max(4, single_words // 6), max_words=single_words)
        mixed = [tokenizer(t).input_ids for t in texts]
    else:
        g = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        single = [torch.randint(3, vocab, (single_words,), generator=g).tolist()]
        lengths = torch.linspace(max(2, single_words // 6), single_words, mixed_prompts).long().tolist()
        mixed = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    return {
        "single": _run_workload("single", model, single, single_new, backends, repeats, with_generate_batch=False),
        "mixed": _run_workload("mixed", model, mixed, mixed_new, backends, repeats, with_generate_batch=True),
    }


def _report(data: dict) -> None:
    for name in ("single", "mixed"):
        w = data[name]
        print(f"\n{name}: prompts {w['workload']['prompt_lens']} tokens, {w['workload']['new_tokens']} new each")
        mib = {"kv_mib": "kv_bytes", "rss_mib": "peak_rss_rise_bytes"}
        rows = [{"method": m, **r, **{k: r[v] / 2**20 for k, v in mib.items()}} for m, r in w["results"].items()]
        print(table(METHOD_COLUMNS, rows))
        for ratio, value in w["ratios_tokens_per_s"].items():
            print(
                f"  tokens/s {ratio}: {value:.2f}x (of medians), "
                f"{w['ratios_tokens_per_s_paired'][ratio]:.2f}x (median of per-repeat ratios)"
            )
    if "contexts" in data:
        print("\ncontexts: prefill and decode per token, paged / DynamicCache")
        rows = [
            {"context": row["context"], "method": m, "decode_ms": r["decode_s_per_token"] * 1e3, **r}
            for row in data["contexts"]["rows"]
            for m, r in row["methods"].items()
        ]
        print(table(CONTEXT_COLUMNS, rows))
    if "memory" in data:
        mem = data["memory"]
        print(f"\nmemory: peak RSS rise of one generate call ({mem['new_tokens']} new tokens), fresh process per run")
        rows = [
            {"context": row["context"], "method": m, "peak_mib": r["peak_rss_rise_bytes"] / 2**20, **r}
            for row in mem["rows"]
            for m, r in row["methods"].items()
        ]
        for r in rows:
            r["runs_mib"] = " ".join(f"{b / 2**20:.1f}" for b in r["runs_bytes"])
        print(table(MEMORY_COLUMNS, rows))


def main(argv=None):
    parser = model_parser("generate", __doc__, repeats="timed repeats per method (default 3; quick 1)")
    parser.add_argument("--skip-contexts", action="store_true", help="leave out the prefill/decode-by-context workload")
    parser.add_argument("--skip-memory", action="store_true", help="leave out the fresh-process memory workload")
    args = parser.parse_args(argv)
    device = "gpu" if torch.cuda.is_available() else "cpu"
    result = result_file(parser, args.out, f"generate_{device}.json")  # checked before anything is measured
    model, tokenizer, sizes, data = start_run(args, QUICK, FULL)
    data["environment"] = environment()
    data.update(measure(model, tokenizer, **sizes))
    result.save(data)
    if not args.skip_contexts:
        contexts = CONTEXTS_QUICK if args.quick else CONTEXTS_FULL
        data["contexts"] = measure_contexts(model, tokenizer, page_size=PAGE_SIZE, **contexts)
        result.save(data)
    if not args.skip_memory:
        memory = MEMORY_QUICK if args.quick else MEMORY_FULL
        data["memory"] = measure_memory(model=args.model, threads=args.threads, **memory)
        result.save(data)
    _report(data)
    path = result.save(data, complete=True)
    print(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()
