"""The README's coursework example runs as written."""

import json
import math
import re
from pathlib import Path

import pytest

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
        f"{sub}/{m}"
        for sub, mods in re.findall(r"([\w/]+)/ \(([^)]*)\)", block)
        for m in re.split(r"[,\s]+", mods)
        if m
    }
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__" and p.stem != "_validate"}
    modules |= {f"lab/{p.stem}" for p in (package / "lab").glob("*.py") if p.stem != "__init__"}
    subpackages = {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    subpackages |= {f"lab/{p.name}" for p in (package / "lab").iterdir() if (p / "__init__.py").exists()}
    for sub in subpackages:
        assert f"{sub.removeprefix('lab/')}/" in block, f"paged_ref/{sub}/ is missing from the README layout"
    assert modules <= named, f"modules missing from the README layout: {sorted(modules - named)}"
    for name in named:
        path = package / (name + ".py") if "/" not in name else package / f"{name}.py"
        assert path.exists(), f"the README layout names {path.relative_to(README.parent)}, which does not exist"


def _gpu_facts() -> list[str]:
    """Every number the README's GPU rows quote, formatted as they are quoted, computed from the
    committed GPU run (figures/data/decode_gpu.json, scaling_gpu.json, gpu_run.json)."""
    data = README.parent / "figures" / "data"
    decode = json.loads((data / "decode_gpu.json").read_text())
    scaling = json.loads((data / "scaling_gpu.json").read_text())
    run = json.loads((data / "gpu_run.json").read_text())
    env = decode["environment"]
    big = [r for r in decode["ratios"] if r["batch"] >= 8]
    one = sorted((r for r in decode["ratios"] if r["batch"] == 1), key=lambda r: r["page_size"])
    flex = [r["flex_over_paged"] for r in decode["ratios"] if r["flex_over_paged"] is not None]

    def span(values, fmt):
        return f"{fmt.format(min(values))}-{fmt.format(max(values))}"

    res = scaling["models"]["llama1b"]
    ratios = res["ratios"]
    static = ratios["contiguous (StaticCache)"]
    assert all(s["status"] == "ok" for s in run["sections"])
    assert len(flex) == 1 and [e.split(":")[0] for e in res["errors"]] == ["batch"]
    return [
        env["gpu"],
        f"torch {env['torch']}",
        f"triton {env['triton']}",
        env["date_utc"][:10],
        f"{decode['copy']['bandwidth_GBps']:.0f} GB/s",
        f"{span([r['paged_frac_of_copy'] * 100 for r in big], '{:.0f}')}% of the copy",
        f"{span([r['paged_over_contiguous'] for r in big], '{:.3f}')}x",
        f"SDPA on a contiguous cache takes {span([r['sdpa_over_paged'] for r in big], '{:.2f}')}x",
        " / ".join(f"{r['paged_frac_of_copy']:.0%}" for r in one) + " of the copy",
        "SDPA " + " / ".join(f"{r['sdpa_over_paged']:.2f}x" for r in one),
        f"differed by {one[0]['repeat_spread']:.0%}",
        f"compiled flex {flex[0]:.1f}x",
        f"skipped {sum('flex skipped' in n for n in decode['notes'])} others",
        f"paged (triton) {span(ratios['paged (triton)'].values(), '{:.2f}')}x",
        f"StaticCache {span(static.values(), '{:.2f}')}x",
        f"paged (flex) {span(ratios['paged (flex)'].values(), '{:.2f}')}x",
        f"no cache {span(ratios['no cache (recompute)'].values(), '{:.2f}')}x",
        f"paged (triton) over StaticCache {span([ratios['paged (triton)'][c] / static[c] for c in static], '{:.2f}')}x",
        res["errors"][0].split(": ")[1],
        f"--time-budget {scaling['time_budget_s']:.0f}",
    ]


def test_gpu_rows_quote_the_committed_gpu_run():
    """Each GPU number in "Measured so far" is the one the committed JSON gives."""
    text = README.read_text()
    section = text[text.index("Measured so far") : text.index("## On a GPU")]
    missing = [fact for fact in _gpu_facts() if fact not in section]
    assert not missing, f"README's GPU rows do not quote these, computed from figures/data/*gpu*.json: {missing}"
    assert "no GPU has been lent" not in section


def _serve_facts() -> list[str]:
    """Every number the README's serving row quotes, formatted as quoted, computed from the
    committed run (figures/data/serve_cpu.json) at its highest request rate."""
    data = json.loads((README.parent / "figures" / "data" / "serve_cpu.json").read_text())
    top = max(data["rates"], key=lambda r: r["rate"])
    paged, exact, max_len, evict = (top["policies"][k] for k in ("paged", "exact", "max_len", "paged_eviction"))
    tps = {name: f"{policy['tokens_per_s']:.1f}" for name, policy in top["policies"].items()}
    running = {name: f"{policy['mean_running']:.1f}" for name, policy in top["policies"].items()}
    peer = data["peer"]
    loads = [x for r in data["rates"] for x in r["load_before"] + r["load_after"]]
    return [
        f"at {top['rate']:.0f} requests/s: paged {paged['tokens_per_s']:.1f} tokens/s",
        f"{paged['tokens_per_s'] / max_len['tokens_per_s']:.2f}x max-length reservation ({tps['max_len']})",
        f"{paged['tokens_per_s'] / exact['tokens_per_s']:.2f}x the exact reservation ({exact['tokens_per_s']:.1f},",
        f"p90 TTFT {paged['ttft_p90_s']:.1f} s vs {exact['ttft_p90_s']:.1f} s and {max_len['ttft_p90_s']:.1f} s",
        f"{running['paged']} requests at once vs {running['exact']} and {running['max_len']}",
        f"{paged['preemptions']} preemptions that recompute {paged['recomputed_tokens']} tokens "
        f"({paged['recomputed_tokens'] / paged['prompt_tokens']:.0%} of the prompt tokens)",
        f"{evict['tokens_per_s']:.1f} tokens/s with {evict['mean_running']:.1f} at once, "
        f"{evict['requests_with_paged_tokens']} of {evict['requests']} requests with unchanged tokens",
        f"decode step {data['overhead']['overhead_share_median']:.2%}",
        ", ".join(f"{r:.2f}x" for r in peer["throughput_ratio_paired"])
        + f" in {len(peer['throughput_ratio_paired'])} repeats",
        f"median {peer['throughput_ratio_median']:.2f}x",
        f"identical greedy tokens in {peer['requests_with_identical_tokens']} of {peer['requests']} requests",
        f"{data['torch_threads']} thread, load average {min(loads):.1f}-{max(loads):.1f}",
        f"{data['seconds']:.0f} s, {data['environment']['date_utc'][:10]}",
        *_profile_facts(),
    ]


def _profile_facts() -> list[str]:
    """The serving row's profile gains, from `bench serve --profile` (figures/data/serve_profile_cpu.json):
    the eager step to the last variant, and the last variant's own gain."""
    data = json.loads((README.parent / "figures" / "data" / "serve_profile_cpu.json").read_text())
    gains = {(g["before"], g["after"]): g["step_ratio_median"]["all"] for g in data["gains"]}
    names = list(data["variants"])
    from paged_ref.lab.bench.serve import FAST_OPTIONS

    assert data["variants"][names[-1]]["options"] == FAST_OPTIONS
    assert all(g["requests_with_identical_tokens"] == g["requests"] for g in data["gains"])
    return [
        f"the faster step {gains[names[0], names[-1]]:.2f}x the eager step",
        f"prepacked linears {gains['eager', 'prepacked_linears']:.2f}x",
        f"the paged kernel {gains['prepacked_linears', 'paged_kernel']:.2f}x",
        f"the flat loop {gains['paged_kernel', 'flat_forward']:.2f}x",
        f"the C++ ops {gains['flat_forward', 'cpu_ops']:.2f}x",
        f"the few-rows kernel {gains['cpu_ops', 'few_rows']:.2f}x",
        f"whose product, {math.prod(g for k, g in gains.items() if k != (names[0], names[-1])):.2f}, is not the "
        f"{gains[names[0], names[-1]]:.2f}x measured directly",
        *_few_rows_256bit_facts(),
    ]


def _few_rows_256bit_facts() -> list[str]:
    """The kernel's limit without AVX-512, from `bench serve --profile --few-rows` (few_rows_256bit.json)."""
    from paged_ref.fast.prepack import KERNEL_ROWS

    data = json.loads((README.parent / "figures" / "data" / "few_rows_256bit.json").read_text())
    rows = {r["rows"]: r["speedup"] for r in data["few_rows"]["rows"]}
    ahead = [x for r, x in rows.items() if r <= data["rows_ahead"]]
    assert data["vector_floats"] == 8 and KERNEL_ROWS[8] == data["rows_ahead"] and min(rows) == 1
    behind = min(r for r in rows if r > data["rows_ahead"])
    late = {r: x for r, x in rows.items() if r > behind}
    return [
        f"products of at most {KERNEL_ROWS[8]} rows, as far as `bench serve --profile --few-rows` measured it ahead",
        f"{min(ahead):.2f}x-{max(ahead):.2f}x at 1-{data['rows_ahead']} rows, {rows[behind]:.2f}x at {behind}, "
        f"{min(late.values()):.2f}x-{max(late.values()):.2f}x from {min(late)} rows on",
        "`figures/data/few_rows_256bit.json`",
    ]


def _pages_facts() -> list[str]:
    """Every number the README's reading-fewer-pages row quotes, formatted as quoted, computed from the
    committed full run (figures/data/pages_full.json)."""
    from paged_ref.lab.bench import pages

    data = json.loads((README.parent / "figures" / "data" / "pages_full.json").read_text())
    ms, sampling = data["cascade_speed"]["median_ms"], data["generate_speed"]
    shared = next(r for r in data["cascade_bytes"] if r["requests"] == data["cascade_speed"]["samples"])
    vs = {(d["task"], d["budget"], d["peer"]): d for d in pages.quest_vs_eviction(data)}
    reads = {(r["policy"], r["budget"]): r["bytes_per_step"] / 1e6 for r in data["bytes_per_step"]["rows"]}
    trials = data["config"]["passkey_trials"]
    full_key = next(r for r in data["passkey"] if r["policy"] == "full")
    vs_full = {d["policy"]: d["discordant"] for d in pages.passkey_vs_full(data) if d["budget"] == 1024}

    def nll(d, who):
        lo, hi = d[f"{who}_ci"]
        return f"{d[who]:.2f} [{lo:.2f}, {hi:.2f}]"

    def keys(d, who):
        return f"{round(d[who] * trials)}/{trials}"

    ret, key, lm = (
        vs["retention", 256, "paged_eviction"],
        vs["passkey", 256, "paged_eviction"],
        vs["language_modelling", 256, "paged_eviction"],
    )
    long_key, streaming = vs["passkey", 1024, "paged_eviction"], vs["language_modelling", 256, "streaming_llm"]
    assert sampling["same_tokens"] and data["complete"]
    assert sampling["rerun"]["command"].endswith("--sampling --threads 1")
    runs, pairs = (
        sampling["sdpa"]["runs_ms_per_step"],
        zip(*(sampling[b]["runs_ms_per_step"] for b in ("sdpa", "cascade"))),
    )
    each = [a / b for a, b in pairs]
    return [
        f"{data['cascade_speed']['speedup_vs']['reference']:.2f}x faster than the plain reference "
        f"({ms['cascade']:.2f} vs {ms['reference']:.2f} ms",
        f"SDPA {ms['sdpa']:.2f} ms",
        f"{shared['bytes_counted']['cascade'] / 1e6:.2f} MB instead of "
        f"{shared['bytes_counted']['reference'] / 1e6:.2f} MB",
        f"{sampling['speedup']:.2f}x faster per decode step, the median of the ratios of {sampling['pairs']} pairs of "
        f"runs taken in turns ({min(each):.2f}x to {max(each):.2f}x; the medians of all their steps "
        f"{sampling['cascade']['ms_per_step']:.0f} vs {sampling['sdpa']['ms_per_step']:.0f} ms, sdpa's runs "
        f"{min(runs):.0f} to {max(runs):.0f} ms a step)",
        f"(`bench pages --sampling --threads 1`, {sampling['rerun']['environment']['date_utc'][:10]}",
        f"retention NLL {nll(ret, 'quest')} vs PagedEviction {nll(ret, 'other')}",
        f"pass-key {keys(key, 'quest')} vs {keys(key, 'other')}",
        f"continuation {lm['quest']:.2f} vs {lm['other']:.2f} (StreamingLLM {streaming['other']:.2f})",
        f"{reads['quest', 256]:.2f} MB a step vs {reads['paged_eviction', 256]:.2f} MB "
        f"(full cache {reads['full', None]:.2f} MB)",
        f"at 1024 tokens PagedEviction answers {keys(long_key, 'other')} pass-keys, Quest {keys(long_key, 'quest')} "
        f"and the full cache {full_key['correct']}/{trials}: PagedEviction answered {vs_full['paged_eviction'][0]} "
        f"trials the full cache missed, Quest missed {vs_full['quest'][1]} it answered",
        f"{data['seconds']:.0f} s, {data['environment']['date_utc'][:10]}",
        *_breakdown_facts(),
    ]


def _breakdown_facts() -> list[str]:
    """The reading-fewer-pages row's breakdown clause, from `bench pages --breakdown` (pages_breakdown_full.json)."""
    data = json.loads((README.parent / "figures" / "data" / "pages_breakdown_full.json").read_text())
    ref, cas = (data["cascade_breakdown"]["paths"][p] for p in ("reference", "cascade"))
    return [
        f"({ref['read_ms_at_sum_rate']:.2f} of the reference's {ref['ms']:.2f} ms and {cas['read_ms_at_sum_rate']:.2f} "
        f"of cascade's {cas['ms']:.2f} ms at the rate a plain sum reads memory)",
        f"the reference's copies ({ref['math_ms']:.2f} ms of math",
        f"Python loop over requests ({cas['per_request_ms']:.2f} ms of it with almost no data)",
        f"(`bench pages --breakdown`, {data['environment']['date_utc'][:10]})",
    ]


def _generate_facts() -> list[str]:
    """Every number the README's row on paged generate quotes, from figures/data/generate_cpu.json: each ratio
    the median of the per-repeat ratios (``ratios_tokens_per_s_paired``), not the ratio of the medians."""
    data = json.loads((README.parent / "figures" / "data" / "generate_cpu.json").read_text())
    single, mixed = (data[w]["ratios_tokens_per_s_paired"] for w in ("single", "mixed"))
    repeats = {data[w]["workload"]["repeats"] for w in ("single", "mixed")}
    assert repeats == {3} and all(r["tokens_match_hf_generate"] for w in ("single", "mixed")
                                  for r in data[w]["results"].values())  # fmt: skip
    return [
        f"the default (`auto`, SDPA on CPU) {single['paged_auto/hf_generate']:.2f}x `model.generate`'s tokens/s on "
        f"one sequence and {mixed['paged_auto/hf_generate']:.2f}x on a mixed batch, "
        f"{mixed['paged_auto/hf_generate_batch']:.2f}x `generate_batch`",
        f"the same code, {single['paged_sdpa/hf_generate']:.2f}x and {mixed['paged_sdpa/hf_generate']:.2f}x",
        f"flex with compiled decode {single['paged_flex/hf_generate']:.2f}x and {mixed['paged_flex/hf_generate']:.2f}x",
        f"medians of {repeats.pop()} alternating pairs; `bench generate`, {data['torch_threads']} threads, "
        f"{data['environment']['date_utc'][:10]}",
    ]


def _contexts_facts() -> list[str]:
    """The row on prefill and decode apart, from generate_cpu.json's ``contexts``: the paired ratios."""
    data = json.loads((README.parent / "figures" / "data" / "generate_cpu.json").read_text())
    c = data["contexts"]
    rows = {r["context"]: r["methods"] for r in c["rows"]}
    auto = [rows[n]["paged_auto"] for n in c["contexts"]]
    scattered = [rows[n]["paged_auto_scattered"] for n in c["contexts"]]
    plans = [r["plan_share_of_decode_step"] for r in auto]
    reference = {n: m["paged_reference"] for n, m in rows.items() if "paged_reference" in m}
    top = max(reference)

    def span(values):
        return f"{min(values):.2f}x-{max(values):.2f}x"

    assert all(r["tokens_match_hf"] for m in rows.values() for r in m.values())
    assert len({len(r["prefill_times_s"]) for m in rows.values() for r in m.values()}) == 1
    return [
        " / ".join(map(str, c["contexts"])) + "-token prompts",
        f"one prompt per length run {c['repeats']} times",
        f"({c['repeats']} prefills, {c['repeats'] * c['decode_steps']} decode steps)",
        "prefill " + " / ".join(f"{r['prefill_over_hf_paired']:.2f}x" for r in auto),
        "decode per token " + " / ".join(f"{r['decode_over_hf_paired']:.2f}x" for r in auto),
        f"plan {100 * min(plans):.1f}-{100 * max(plans):.1f}% of a decode step",
        f"prefill {span([r['prefill_over_hf_paired'] for r in scattered])} "
        f"({scattered[-1]['prefill_over_hf_paired']:.2f}x at {c['contexts'][-1]})",
        f"decode {span([r['decode_over_hf_paired'] for r in scattered])}",
        f"prefills {reference[top]['prefill_over_hf_paired']:.2f}x slower at {top}",
    ]


def _memory_facts() -> list[str]:
    """The row on peak memory, from generate_cpu.json's ``memory``: paired ratios and the medians in MiB."""
    mem = json.loads((README.parent / "figures" / "data" / "generate_cpu.json").read_text())["memory"]
    rows = [r["methods"] for r in mem["rows"]]
    first, last = rows[0], rows[-1]

    def mib(r):
        return f"{r['peak_rss_rise_bytes'] / 2**20:.1f}"

    return [
        "pool and activations " + " / ".join(f"{r['paged_auto']['over_hf_generate_paired']:.2f}x" for r in rows),
        f"medians of {mem['repeats']} alternating pairs",
        f"{mib(first['paged_auto'])} vs {mib(first['hf_generate'])} MiB at {mem['contexts'][0]} tokens",
        f"{mib(last['paged_auto'])} vs {mib(last['hf_generate'])} MiB at {mem['contexts'][-1]}",
        f"{mem['new_tokens']} new tokens",
    ]


def _data(name: str) -> dict:
    return json.loads((README.parent / "figures" / "data" / name).read_text())


def _alloc_facts() -> list[str]:
    """The allocator row, from figures/data/alloc_cpu.json."""
    data = _data("alloc_cpu.json")
    a, c = data["results"]["paged_ref.PageAllocator"], data["results"]["paged_ref.PagedKVCache"]
    repeats = data["workload"]["repeats"]
    assert len(a["ns_per_page_op_repeats"]) == repeats  # the implementations took turns: the ratio is of pairs
    return [
        f"{a['ns_per_page_op']:.0f} ns, {a['torch_over_this']:.2f}x faster than torch's",
        f"{c['ns_per_page_op']:.0f} ns, {c['torch_over_this']:.2f}x",
        f"(medians of {repeats} repeats, pairs",
        f"`bench alloc`, {data['environment']['date_utc'][:10]})",
    ]


def _zeroing_facts() -> list[str]:
    """The row on zeroing free pages, from alloc_cpu.json's ``zeroing``."""
    data = _data("alloc_cpu.json")
    z = data["zeroing"]
    assert len(z["zero_page_ns_repeats"]) == data["workload"]["repeats"]  # taken in turns with the writes
    return [
        f"medians of {data['workload']['repeats']} repeats, the median of pairs",
        f"{z['geometry']['num_layers']} layers",
        f"zeroing a page costs {z['zero_over_write']:.2f}x of writing its tokens once "
        f"({z['zero_page_ns'] / 1e3:.0f} µs vs {z['write_page_ns'] / 1e3:.0f} µs",
    ]


def _sharing_facts() -> list[str]:
    """The sharing row, from figures/data/sharing_cpu.json."""
    data = _data("sharing_cpu.json")
    runs = data["runs"]
    beam4 = next(r for r in runs if (r["prompt"], r["kind"], r["width"]) == ("long", "beam", 4))
    saved = {k: [r["saving_vs_no_sharing"]["fork_cow"]["over_steps"] for r in runs if r["kind"] == k]
             for k in ("beam", "sample")}  # fmt: skip
    cpu = {p: [r["time"]["cpu"]["ratio_paged_over_transformers"] for r in runs if r["prompt"] == p]
           for p in ("short", "long")}  # fmt: skip
    wall = [r["time"]["wall"]["ratio_paged_over_transformers"] for r in runs]
    assert all(r["same_as_transformers"]["tokens"] for r in runs)
    assert all(r["same_as_transformers"].get("max_score_diff", 0) < 1e-4 for r in runs)

    def span(xs, fmt="{:.2f}"):
        return f"{fmt.format(min(xs))}-{fmt.format(max(xs))}"

    widths = sorted({r["width"] for r in runs})
    return [
        "n / k = " + ", ".join(map(str, widths)),
        f"{runs[0]['new_tokens']} new tokens; pages of {data['page_size']}",
        f"in all {len(runs)} runs",
        f"{beam4['peak']['fork_cow']} pages at the peak against {beam4['peak']['no_sharing']} without sharing "
        f"({beam4['peak']['fork_cow'] / beam4['peak']['no_sharing']:.2f}x)",
        f"also {beam4['peak']['prefix_caching']} but computes {beam4['tokens_computed']['prefix_caching']} tokens "
        f"instead of {beam4['tokens_computed']['fork_cow']}",
        f"over the steps {span([100 * x for x in saved['beam']], '{:.0f}')}% for beams",
        f"{span([100 * x for x in saved['sample']], '{:.0f}')}% for samples",
        f"CPU time {span(cpu['short'])}x `model.generate`'s on the short prompt and {span(cpu['long'])}x",
        f"wall time {span(wall)}x",
        f"{data['torch_threads']} thread, {data['environment']['date_utc'][:10]}",
    ]


def _scaling_facts() -> list[str]:
    """The row on the paged decode step, from figures/data/scaling_cpu.json (torch's default threads, all
    cores here) and figures/data/scaling_cpu_threads1.json (1 thread): ratios of paired steps."""

    def facts(name):
        data = _data(name)
        res = data["models"]["smollm2"]
        assert res["ratio_kind"] == "median of paired steps", name
        contexts = sorted({c for r in res["ratios"].values() for c in r}, key=int)
        pairs = {label: set(by_context.values()) for label, by_context in res["ratio_pairs"].items()}

        def span(label):
            values = res["ratios"][label].values()
            return f"{min(values):.2f}x-{max(values):.2f}x"

        return data, contexts, pairs, span

    data, contexts, pairs, span = facts("scaling_cpu.json")
    one, _, _, span1 = facts("scaling_cpu_threads1.json")
    (sdpa_pairs,), (none_pairs,) = pairs["paged (sdpa)"], pairs["no cache (recompute)"]
    assert pairs["paged (flex)"] == pairs["paged (reference)"] == {sdpa_pairs}
    return [
        f"{span('paged (sdpa)')} of `DynamicCache`'s step from {contexts[0]} to {contexts[-1]} tokens",
        f"differ by {span('contiguous (StaticCache)')}",
        f"reference {span('paged (reference)')}",
        f"flex with compiled decode {span('paged (flex)')}",
        f"no cache {span('no cache (recompute)')}",
        f"the median of the ratios of {sdpa_pairs} pairs of steps per point (no cache {none_pairs})",
        f"(`bench scaling --cpu`, {data['torch_threads']} threads, {data['environment']['date_utc'][:10]})",
        f"at {one['torch_threads']} thread: sdpa {span1('paged (sdpa)')}, reference {span1('paged (reference)')}",
        f"(`bench scaling --cpu --threads 1`, {one['environment']['date_utc'][:10]})",
    ]


def _overhead_facts() -> list[str]:
    """The row on paging's memory overhead, from scaling_cpu.json's mixed batch."""
    batch = _data("scaling_cpu.json")["models"]["smollm2"]["batch"]
    return [
        f"page size {batch['overhead_ps16']['page_size']}",
        f"{100 * batch['overhead_ps16']['overhead']:.2f}% over the minimum",
        f"admits {batch['fit']['paged']} requests vs {batch['fit']['max_len']} for max-length reservation",
    ]


def _eviction_facts() -> list[str]:
    """The PagedEviction row, from figures/data/eviction_full.json: perplexities (page size 16) and the
    decode time against the full cache, the median of per-round ratios."""
    data = _data("eviction_full.json")
    budgets = data["config"]["budgets"]

    def ppl(task, policy):
        by = {r["budget"]: r["ppl"] for r in data[task] if r["policy"] == policy and r["page_size"] == 16}
        return " / ".join(f"{by[c]:.2f}" for c in budgets)

    def full(task):
        return next(r["ppl"] for r in data[task] if r["policy"] == "full")

    speed = {r["context"]: r for r in data["speed"] if r["policy"] == "paged_eviction" and r["batch"] == 1}
    lm, ret, long = "language_modelling", "retention", "long_context"
    return [
        f"{data['config']['texts']} texts per cell, page size 16, budgets C = " + " / ".join(map(str, budgets)),
        f"(full cache {full(lm):.2f}): as its authors run it (first and newest page reserved) "
        f"{ppl(lm, 'paged_eviction')}, per-layer decisions {ppl(lm, 'paged_eviction_per_layer')}",
        f"{ppl(lm, 'paged_eviction_literal')}, a recent window (StreamingLLM) {ppl(lm, 'streaming_llm')}",
        f"(a {data['config']['retention_passage']}-token passage, {data['config']['retention_other']} tokens of other "
        f"prose, then the passage's opening again; full cache {full(ret):.2f}): "
        f"reserved {ppl(ret, 'paged_eviction')}, per layer {ppl(ret, 'paged_eviction_per_layer')}, "
        f"1/‖K‖ {ppl(ret, 'inverse_key_norm')}, StreamingLLM {ppl(ret, 'streaming_llm')}",
        f"after {data['config']['long_context']} tokens (full cache {full(long):.2f}): reserved "
        f"{ppl(long, 'paged_eviction')}, per layer {ppl(long, 'paged_eviction_per_layer')}, StreamingLLM "
        f"{ppl(long, 'streaming_llm')}",
        f"at C = {data['config']['speed_budget']} "
        + " / ".join(f"{speed[n]['time_per_token_vs_full_paired']:.2f}x" for n in sorted(speed))
        + " of the full cache at "
        + " / ".join(map(str, sorted(speed)))
        + " tokens, one sequence",
        f"one sequence (medians of {data['config']['speed_rounds']} alternating rounds)",
        f"(`bench eviction`, {data['seconds']:.0f} s;",
    ]


@pytest.mark.parametrize(
    "start, facts, source",
    [
        ("| serving a stream", _serve_facts, "serve_cpu.json"),
        ("| reading fewer pages", _pages_facts, "pages_full.json"),
        ("| paged generate vs transformers", _generate_facts, "generate_cpu.json"),
        ("| prefill and decode apart", _contexts_facts, "generate_cpu.json"),
        ("| peak memory of one generate call", _memory_facts, "generate_cpu.json"),
        ("| allocator cost per page", _alloc_facts, "alloc_cpu.json"),
        ("| keeping free slots at zero", _zeroing_facts, "alloc_cpu.json"),
        ("| sharing pages between samples", _sharing_facts, "sharing_cpu.json"),
        ("| paged decode step vs a contiguous cache", _scaling_facts, "scaling_cpu.json"),
        ("| memory overhead of paging", _overhead_facts, "scaling_cpu.json"),
        ("| PagedEviction on SmolLM2", _eviction_facts, "eviction_full.json"),
    ],
)
def test_measured_rows_quote_their_committed_runs(start, facts, source):
    row = next(line for line in README.read_text().splitlines() if line.startswith(start))
    missing = [fact for fact in facts() if fact not in row]
    assert not missing, f"README's row {start!r} does not quote these, computed from {source}: {missing}"
