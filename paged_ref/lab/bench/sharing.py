"""Pages shared between the sequences of one request: parallel samples and beam search.

    python -m paged_ref.lab.bench sharing [--quick] [--gpu] [--threads N] [--model smollm2|tiny] [--repeats R]
                                          [--out DIR]

n = 2, 4, 8 seeded samples and k = 2, 4, 8 beams (all returned) of a short and a 512-token prompt of
English prose, EOS ignored, pages of 16. **Memory**: pages held after every forward under (a) fork +
copy-on-write, measured in the paged run (`pr.hf.generate` / `pr.hf.beam_search`), (b) a request per
sample or beam with prefix caching (vLLM) and (c) no sharing, both counted from the same run's tokens
(`paged_ref.lab.sharing`); the peak, the saving ``1 - held / held without sharing`` at the peak and over the
steps, pages copied, tokens computed. **Speed**: the same call against ``model.generate``, wall and CPU
time over ``repeats`` pairs (the recorded runs are the first pair, then the order alternates), the
median of the per-pair ratios paged / transformers (goal <= 1.10; CPU time is steadier with
``--threads 1``), and whether the tokens (and beam scores, within 1e-4) are the same.

``--gpu``: the same on CUDA in float32 (tokens and beam scores stay comparable), the model from
``bench scaling``'s loader: SmolLM2's real weights where its GGUF and ``gguf`` load, else a
random-weight Llama of its shapes with random prompt ids (the JSON's ``model_info`` says which).

JSON: ``figures/data/sharing_cpu.json`` (``sharing_gpu.json`` with ``--gpu``); figure:
`paged_ref.lab.viz.sharing.sharing_figure`.
"""

from __future__ import annotations

import time
from statistics import median_high

import torch

from ... import hf
from ...block_table import pages_needed
from ...cache import PagedKVCache
from ..sharing import computed_tokens, no_sharing_pages, prefix_caching_pages
from ._model_bench import model_parser, paired_ratio, prompt_tokens, start_run
from ._scaling_models import build_model
from .common import environment, result_file, table

PAGE_SIZE = 16
SEED = 0
FULL = dict(prompts={"short": 40, "long": 512}, widths=(2, 4, 8), new_tokens=64, repeats=5)
QUICK = dict(prompts={"short": 9, "long": 40}, widths=(2, 4), new_tokens=6, repeats=1)
GOAL_PEAK_RATIO = 0.6  # beam search, k = 4, 512-token prompt: (a) holds <= 0.6x the pages of (c)
GOAL_SPEED_RATIO = 1.10  # paged time <= 1.10x model.generate's, same arguments
DESIGNS = ("fork_cow", "prefix_caching", "no_sharing")
COLUMNS = [
    ("prompt", "{prompt} ({prompt_tokens})"),
    ("run", "{kind} {width}"),
    ("peak a / b / c", "{peak[fork_cow]} / {peak[prefix_caching]} / {peak[no_sharing]}"),
    ("saved at peak a / b", "{saved[fork_cow][at_peak]:.1%} / {saved[prefix_caching][at_peak]:.1%}"),
    ("saved over steps a / b", "{saved[fork_cow][over_steps]:.1%} / {saved[prefix_caching][over_steps]:.1%}"),
    ("copied a / c", "{pages_copied[fork_cow]} / {pages_copied[no_sharing]}"),
    ("tokens computed a / b / c", "{computed[fork_cow]} / {computed[prefix_caching]} / {computed[no_sharing]}"),
    ("same tokens", "{same_as_transformers[tokens]}"),
    ("wall paged / hf", "{time[wall][ratio_paged_over_transformers]:.2f}x"),
    ("CPU paged / hf", "{time[cpu][ratio_paged_over_transformers]:.2f}x"),
]
#: The memory columns alone (notebook 08's table): pages held, saved, copied, tokens computed.
MEMORY_COLUMNS = COLUMNS[:-3]


def memory_table(data: dict) -> str:
    """The runs of a ``sharing`` result as the memory columns of the command's table."""
    rows = [{**r, "saved": r["saving_vs_no_sharing"], "computed": r["tokens_computed"]} for r in data["runs"]]
    return table(MEMORY_COLUMNS, rows)


def _pad_id(model) -> int:
    # transformers' beam search fills with the first EOS id when pad_token_id is 0, and EOS is off here
    pad = model.generation_config.pad_token_id
    return pad if pad else 1


def _sample_run(model, ids, args):
    """The paged sampling run, recorded: pages per step (a), the tokens for (b) and (c), copies."""
    width, n, new = ids.shape[1], args["num_return_sequences"], args["max_new_tokens"]
    kv = PagedKVCache.for_model(model, num_pages=n * pages_needed(width + new, PAGE_SIZE), page_size=PAGE_SIZE)
    snapshots = []

    def snapshot(step, tokens):
        snapshots.append({s: kv.pages(s) for s in kv.seq_ids})

    torch.manual_seed(SEED)
    out = hf.generate(model, ids, page_size=PAGE_SIZE, kv_cache=kv, callback=snapshot, **args)
    rows = out.tolist()
    pages = {d: [] for d in DESIGNS}
    copies = 0
    for step, snap in enumerate(snapshots):  # step s: after the forward that fed s generated tokens
        held = [row[: width + step] for row in rows]
        pages["fork_cow"].append(len({p for ps in snap.values() for p in ps}))
        pages["prefix_caching"].append(prefix_caching_pages(held, admitted=[width] * n, page_size=PAGE_SIZE))
        pages["no_sharing"].append(no_sharing_pages(held, page_size=PAGE_SIZE))
        if step:
            before = snapshots[step - 1]
            copies += sum(a != b for s in snap for a, b in zip(before.get(s, []), snap[s]))
    decode = n * (len(snapshots) - 1)
    computed = {
        "fork_cow": width + decode,
        "prefix_caching": width + (n - 1) * computed_tokens(width, page_size=PAGE_SIZE) + decode,
        "no_sharing": n * width + decode,
    }
    return out, pages, {"fork_cow": copies, "prefix_caching": 0, "no_sharing": 0}, computed


def _beam_run(model, ids, args):
    """The paged beam search, recorded through its `BeamStep`s."""
    width, k = ids.shape[1], args["num_beams"]
    steps = []
    out = hf.beam_search(model, ids, page_size=PAGE_SIZE, callback=lambda step, s: steps.append(s), **args)
    pages = {d: [] for d in DESIGNS}
    copies = dict.fromkeys(DESIGNS, 0)
    computed = dict.fromkeys(DESIGNS, width)
    running = [ids[0].tolist()]  # the beams' tokens held after each forward (one sequence after the prefill)
    for beam_step in steps:
        pages["fork_cow"].append(beam_step.pages_held)
        admitted = [len(r) for r in running]
        pages["prefix_caching"].append(prefix_caching_pages(running, admitted=admitted, page_size=PAGE_SIZE))
        pages["no_sharing"].append(no_sharing_pages(running, page_size=PAGE_SIZE))
        copies["fork_cow"] += sum(len(c) for c in beam_step.copied.values())
        if not beam_step.beams[0]:
            break  # the last step: nothing is fed again
        parents = [p if len(running) > 1 else 0 for p in beam_step.parents[0].tolist()]
        for p in set(parents):  # without sharing, each extra child copies all its parent's pages
            copies["no_sharing"] += (parents.count(p) - 1) * pages_needed(len(running[p]), PAGE_SIZE)
        running = [running[p] + [t] for p, t in zip(parents, beam_step.tokens[0].tolist())]
        computed["fork_cow"] += k
        computed["no_sharing"] += k
        computed["prefix_caching"] += sum(computed_tokens(len(r), page_size=PAGE_SIZE) for r in running)
    return out, pages, copies, computed


class _Clock:
    """Wall time and this process's CPU time of the ``with`` block."""

    def __enter__(self):
        self.start = (time.perf_counter(), time.process_time())
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.start[0]
        self.cpu = time.process_time() - self.start[1]


def _timed(paged, theirs, repeats, first) -> dict:
    """Both calls' wall and CPU times: ``first`` (the recorded runs' clocks), then ``repeats - 1``
    more pairs, the order alternating (so that a slow drift of the machine favours neither)."""
    clocks = {"paged": [first[0]], "transformers": [first[1]]}
    for r in range(repeats - 1):
        pair = (("transformers", theirs), ("paged", paged))
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            with _Clock() as clock:
                fn()
            clocks[name].append(clock)
    out = {}
    for kind in ("wall", "cpu"):
        times = {name: [getattr(c, kind) for c in cs] for name, cs in clocks.items()}
        out[kind] = {
            "seconds": times,
            "median_s": {name: median_high(t) for name, t in times.items()},
            "ratio_paged_over_transformers": paired_ratio(times["paged"], times["transformers"]),
        }
    return out


def measure_one(model, ids, kind: str, width: int, new: int, repeats: int) -> dict:
    """One workload: memory under the three designs, and speed against ``model.generate``."""
    common = dict(max_new_tokens=new, eos_token_id=[], pad_token_id=_pad_id(model))
    if kind == "sample":
        args = dict(do_sample=True, num_return_sequences=width, **common)
        with _Clock() as recorded:
            out, pages, copies, computed = _sample_run(model, ids, args)
        torch.manual_seed(SEED)
        with _Clock() as compared:
            expected = model.generate(ids, **args)
        same = {"tokens": torch.equal(out, expected)}

        def paged():
            torch.manual_seed(SEED)
            hf.generate(model, ids, page_size=PAGE_SIZE, **args)

        def theirs():
            torch.manual_seed(SEED)
            model.generate(ids, **args)
    else:
        args = dict(num_beams=width, num_return_sequences=width, **common)
        with _Clock() as recorded:
            out, pages, copies, computed = _beam_run(model, ids, args)
        with _Clock() as compared:
            expected = model.generate(ids, do_sample=False, output_scores=True, return_dict_in_generate=True, **args)
        same = {"tokens": torch.equal(out.sequences, expected.sequences)}
        if same["tokens"]:
            same["max_score_diff"] = float((out.sequences_scores - expected.sequences_scores).abs().max())

        def paged():
            hf.beam_search(model, ids, page_size=PAGE_SIZE, **args)

        def theirs():
            model.generate(ids, do_sample=False, **args)

    base_peak, base_sum = max(pages["no_sharing"]), sum(pages["no_sharing"])
    savings = {
        d: {"at_peak": 1 - max(pages[d]) / base_peak, "over_steps": 1 - sum(pages[d]) / base_sum} for d in DESIGNS[:2]
    }
    return {
        "kind": kind,
        "width": width,
        "prompt_tokens": ids.shape[1],
        "new_tokens": new,
        "pages": pages,
        "peak": {design: max(held) for design, held in pages.items()},
        "saving_vs_no_sharing": savings,
        "pages_copied": copies,
        "tokens_computed": computed,
        "same_as_transformers": same,
        "time": _timed(paged, theirs, repeats, first=(recorded, compared)),  # the recorded runs: the first pair
    }


def measure(model, tokenizer, *, prompts, widths, new_tokens, repeats) -> dict:
    """Every (prompt, kind, width) run; see the module docstring."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    warm = torch.tensor([[5, 6, 7]], device=device)  # one-time costs (lazy initialisation) before the first timed call
    hf.generate(model, warm, max_new_tokens=2, do_sample=True)
    model.generate(warm, max_new_tokens=2, do_sample=True)
    runs = []
    jobs = [(name, kind, w) for name in prompts for kind in ("sample", "beam") for w in widths]
    for name, kind, w in tqdm(jobs, desc="bench sharing", unit="run"):
        ids = prompt_tokens(model, tokenizer, prompts[name], start=3 * list(prompts).index(name))[None].to(device)
        runs.append({"prompt": name, **measure_one(model, ids, kind, w, new_tokens, repeats)})
    return {"page_size": PAGE_SIZE, "seed": SEED, "repeats": repeats, "runs": runs, "goals": _goals(runs)}


def _goals(runs) -> dict:
    goal = [r for r in runs if r["kind"] == "beam" and r["width"] == 4 and r["prompt_tokens"] == 512]
    peak = None
    if goal:
        ratio = goal[0]["peak"]["fork_cow"] / goal[0]["peak"]["no_sharing"]
        peak = {"ratio": ratio, "goal": GOAL_PEAK_RATIO, "met": ratio <= GOAL_PEAK_RATIO}
    speed = {}
    for clock in ("wall", "cpu"):
        worst = max(r["time"][clock]["ratio_paged_over_transformers"] for r in runs)
        speed[clock] = {"worst_ratio": worst, "goal": GOAL_SPEED_RATIO, "met": worst <= GOAL_SPEED_RATIO}
    return {"beam4_prompt512_peak_fork_cow_over_no_sharing": peak, "speed": speed}


def main(argv=None):
    parser = model_parser("sharing", __doc__, repeats="timed pairs per run (default 5; quick 1)")
    parser.add_argument("--gpu", action="store_true", help="run on the CUDA GPU in float32 (sharing_gpu.json)")
    args = parser.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA GPU")
    result = result_file(parser, args.out, f"sharing_{'gpu' if args.gpu else 'cpu'}.json")  # checked first
    if args.gpu:
        model, info = build_model(args.model, device="cuda", dtype=torch.float32)
        tokenizer, data_model = info.pop("tokenizer"), info
        _, _, sizes, data = start_run(args, QUICK, FULL, model=(model, tokenizer))
        data["model_info"] = data_model
    else:
        model, tokenizer, sizes, data = start_run(args, QUICK, FULL)
    data.update(measure(model, tokenizer, **sizes))
    data["environment"] = environment()
    print(f"\npages held (pages of {PAGE_SIZE}): (a) fork + copy-on-write, (b) prefix caching, (c) no sharing")
    rows = [{**r, "saved": r["saving_vs_no_sharing"], "computed": r["tokens_computed"]} for r in data["runs"]]
    print(table(COLUMNS, rows))
    peak = data["goals"]["beam4_prompt512_peak_fork_cow_over_no_sharing"]
    if peak is not None:
        print(
            f"goal, beam search k=4 on the 512-token prompt: (a) holds {peak['ratio']:.3f}x the pages of (c) at "
            f"peak (goal <= {peak['goal']}): {'met' if peak['met'] else 'NOT met'}"
        )
    for clock, speed in data["goals"]["speed"].items():
        print(
            f"goal, {clock} time paged / model.generate <= {speed['goal']} in every run: worst "
            f"{speed['worst_ratio']:.2f}x: {'met' if speed['met'] else 'NOT met'}"
        )
    path = result.save(data, complete=True)
    print(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()
