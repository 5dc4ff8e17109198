"""Paged generation with a real model against transformers' own generate and generate_batch.

    python -m paged_ref.bench generate [--quick] [--threads N] [--model smollm2|tiny] [--out DIR]

Three workloads, greedy decoding, EOS ignored so that every method does the same work:

* ``single``: one prompt of real English (pydoc_data) -> ``pr.hf.generate`` with the
  ``reference``, ``flex`` and ``sdpa`` backends against ``model.generate`` with its default cache
  (``DynamicCache``, SDPA attention).
* ``mixed``: a batch of prompts of different lengths -> the same, plus transformers'
  continuous-batching paged engine ``model.generate_batch`` (``ContinuousBatchingConfig`` sized
  like our cache: 16-token pages, just enough blocks, no CUDA graphs; its default sizing
  reserves most of the machine's free memory, which on CPU takes tens of seconds).

* ``contexts``: prefill and decode timed apart at prompts of 128, 512, 2048 and 8192 tokens,
  the default backend (``auto``; also on scattered pages) and the oracle (``reference``, up to
  2048) against ``DynamicCache`` (`paged_ref.bench._generate_contexts`).
* ``memory``: peak RSS rise of one ``generate`` call at the same prompt lengths, the default
  backend against ``model.generate``, each run in a fresh process so that no earlier run's freed
  memory is reused (`paged_ref.bench._generate_memory`).

Per method (single, mixed): median wall time of the whole call (after one warm-up; methods interleaved in each
repeat so load changes hit them alike), generated tokens/s (ratios given both as the ratio of
the medians and as the median of the per-repeat ratios, which is steadier on a shared machine), whether the tokens equal
``model.generate``'s, KV bytes (``DynamicCache``: its final, padded size; paged_ref: the peak
pages in use and the pool; generate_batch: its pool) and the peak rise of the process RSS
during the call (sampled every 2 ms; in a process that already ran the other methods, allocator
reuse makes it approximate: the ``memory`` workload is the one to read for memory). Ratios are
tokens/s over the peer's measured in the same run. JSON: ``figures/data/generate_cpu.json``
(``generate_gpu.json`` on CUDA). The Triton backend is not timed on CPU (it is the interpreter).
"""

from __future__ import annotations

import time

import torch

from .. import textdata
from ._generate_contexts import measure_contexts
from ._generate_memory import measure_memory
from ._generate_methods import PAGE_SIZE, PeakRSS, generation_methods, start_run
from .common import bench_parser, environment, print_table, result_file

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


def _run_workload(name, model, rows, new, backends, repeats, with_generate_batch):
    methods = generation_methods(model, rows, new, backends, with_generate_batch)
    tokens, times, rss = {}, {m: [] for m in methods}, {}
    for m, (run, _) in methods.items():  # warm-up, and the tokens to compare
        tokens[m] = run()
    for _ in range(repeats):
        for m, (run, _) in methods.items():
            with PeakRSS() as probe:
                start = time.perf_counter()
                run()
                times[m].append(time.perf_counter() - start)
            rss[m] = max(rss.get(m, 0), probe.rise_bytes)
    expected = tokens["hf_generate"]
    generated = sum(len(t) for t in expected)
    results = {}
    for m, (_, kv) in methods.items():
        median = sorted(times[m])[len(times[m]) // 2]
        results[m] = {
            "median_s": median,
            "times_s": times[m],
            "tokens_per_s": generated / median,
            "tokens_match_hf_generate": tokens[m] == expected,
            "peak_rss_rise_bytes": rss[m],
            **kv(),
        }
    ratios, paired = {}, {}
    for m in methods:
        if m.startswith("paged_"):
            for peer in ("hf_generate", "hf_generate_batch"):
                if peer in results:
                    ratios[f"{m}/{peer}"] = results[m]["tokens_per_s"] / results[peer]["tokens_per_s"]
                    # the same ratio within each repeat (runs minutes apart see different load), then the median
                    per_repeat = sorted(tp / tm for tm, tp in zip(times[m], times[peer]))
                    paired[f"{m}/{peer}"] = per_repeat[len(per_repeat) // 2]
    return {
        "workload": {
            "name": name,
            "prompt_lens": [len(r) for r in rows],
            "new_tokens": new,
            "generated_tokens": generated,
            "page_size": PAGE_SIZE,
            "repeats": repeats,
        },
        "results": results,
        "ratios_tokens_per_s": ratios,
        "ratios_tokens_per_s_paired": paired,
    }


def measure(
    model,
    tokenizer=None,
    *,
    single_words,
    single_new,
    mixed_prompts,
    mixed_new,
    repeats,
    backends=("auto", "reference", "flex", "sdpa"),
) -> dict:
    """Run both workloads on ``model``; without a tokenizer, prompts are seeded random ids."""
    if tokenizer is not None:
        single = [tokenizer(textdata.english_text(single_words)).input_ids]
        texts = textdata.prompts(mixed_prompts, min_words=max(4, single_words // 6), max_words=single_words)
        mixed = [tokenizer(t).input_ids for t in texts]
    else:
        g = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        single = [torch.randint(3, vocab, (single_words,), generator=g).tolist()]
        mixed = [
            torch.randint(3, vocab, (n,), generator=g).tolist()
            for n in torch.linspace(max(2, single_words // 6), single_words, mixed_prompts).long().tolist()
        ]
    return {
        "single": _run_workload("single", model, single, single_new, backends, repeats, with_generate_batch=False),
        "mixed": _run_workload("mixed", model, mixed, mixed_new, backends, repeats, with_generate_batch=True),
    }


def main(argv=None):
    parser = bench_parser("generate", __doc__)
    parser.add_argument("--quick", action="store_true", help="short prompts, few tokens, one repeat")
    parser.add_argument(
        "--model",
        choices=["smollm2", "tiny"],
        default="smollm2",
        help="the bundled SmolLM2-135M (default) or the tiny random Llama (harness check)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per method (default 3; quick 1)")
    parser.add_argument(
        "--skip-contexts",
        action="store_true",
        help="leave out the prefill/decode-by-context workload (the longest part)",
    )
    parser.add_argument("--skip-memory", action="store_true", help="leave out the fresh-process memory workload")
    args = parser.parse_args(argv)
    device = "gpu" if torch.cuda.is_available() else "cpu"
    result = result_file(parser, args.out, f"generate_{device}.json")  # checked before anything is measured
    model, tokenizer, sizes, data = start_run(args, QUICK, FULL)
    data["environment"] = environment()
    data.update(measure(model, tokenizer, **sizes))
    result.save(data)
    if not args.skip_contexts:
        data["contexts"] = measure_contexts(
            model, tokenizer, page_size=PAGE_SIZE, **(CONTEXTS_QUICK if args.quick else CONTEXTS_FULL)
        )
        result.save(data)
    if not args.skip_memory:
        data["memory"] = measure_memory(
            model=args.model, threads=args.threads, **(MEMORY_QUICK if args.quick else MEMORY_FULL)
        )
        result.save(data)
    for name in ("single", "mixed"):
        w = data[name]
        print(f"\n{name}: prompts {w['workload']['prompt_lens']} tokens, {w['workload']['new_tokens']} new each")
        rows = [
            [
                m,
                f"{r['median_s']:.3f}",
                f"{r['tokens_per_s']:.1f}",
                r["tokens_match_hf_generate"],
                f"{r['kv_bytes'] / 2**20:.2f}",
                f"{r['peak_rss_rise_bytes'] / 2**20:.1f}",
            ]
            for m, r in w["results"].items()
        ]
        print_table(["method", "median s", "tokens/s", "same tokens", "KV MiB", "RSS rise MiB"], rows)
        for ratio, value in w["ratios_tokens_per_s"].items():
            print(
                f"  tokens/s {ratio}: {value:.2f}x (of medians), "
                f"{w['ratios_tokens_per_s_paired'][ratio]:.2f}x (median of per-repeat ratios)"
            )
    if "contexts" in data:
        print("\ncontexts: prefill and decode per token, paged / DynamicCache")
        rows = [
            [
                row["context"],
                m,
                f"{r['prefill_s']:.3f}",
                f"{r['decode_s_per_token'] * 1e3:.1f}",
                f"{r['prefill_over_hf']:.2f}x" if m != "hf" else "-",
                f"{r['decode_over_hf']:.2f}x" if m != "hf" else "-",
                f"{r['decode_over_hf_paired']:.2f}x" if m != "hf" else "-",
                "-" if r["plan_share_of_decode_step"] is None else f"{r['plan_share_of_decode_step']:.1%}",
                r["tokens_match_hf"],
            ]
            for row in data["contexts"]["rows"]
            for m, r in row["methods"].items()
        ]
        print_table(
            [
                "context",
                "method",
                "prefill s",
                "decode ms/token",
                "prefill ratio",
                "decode ratio",
                "paired",
                "plan share",
                "same tokens",
            ],
            rows,
        )
    if "memory" in data:
        mem = data["memory"]
        print(f"\nmemory: peak RSS rise of one generate call ({mem['new_tokens']} new tokens), fresh process per run")
        rows = [
            [
                row["context"],
                m,
                f"{r['peak_rss_rise_bytes'] / 2**20:.1f}",
                " ".join(f"{b / 2**20:.1f}" for b in r["runs_bytes"]),
                f"{r['over_hf_generate']:.2f}x" if "over_hf_generate" in r else "-",
            ]
            for row in mem["rows"]
            for m, r in row["methods"].items()
        ]
        print_table(["context", "method", "peak rise MiB (median)", "runs MiB", "vs hf_generate"], rows)
    path = result.save(data, complete=True)
    print(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()
