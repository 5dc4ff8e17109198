"""Pages shared between the sequences of one request: parallel samples and beam search.

    python -m paged_ref.bench sharing [--quick] [--threads N] [--model smollm2|tiny] [--repeats R] [--out DIR]

For n = 2, 4, 8 samples of one prompt (``do_sample=True``, transformers' defaults, seeded) and
k = 2, 4, 8 beams (``num_beams=k``, all k hypotheses returned), on a short and a 512-token prompt
of English prose (EOS ignored, so that every design and method does the same work), pages of 16:

* **memory**, pages held after every forward under three designs (`paged_ref.sharing`):
  (a) fork + copy-on-write, measured: the distinct pages the live sequences of the real paged
  run hold (`pr.hf.generate` / `pr.hf.beam_search`); (b) one request per sample or beam with
  prefix caching, today's vLLM (its beam search admits every beam again at each step); (c) no
  sharing. (b) and (c) are counted from the same run's tokens. Also the peak, the saving
  ``1 - held / held without sharing`` at the peak and summed over the steps (the vLLM paper's
  measure), the pages copied (a: copy-on-write, measured; c: the least a design without sharing
  copies, each extra child of a beam getting all its pages) and the tokens each design computes;
* **speed**, the same call against ``model.generate`` with the same arguments: wall time and this
  process's CPU time over ``repeats`` pairs (the recorded paged run and the comparison run are the
  first pair; then the order alternates), the median of the per-pair ratios paged / transformers
  (the goal: <= 1.10; with the same tokens, the ratio of times per token), and whether the tokens
  (and beam scores, within 1e-4) are the same. On a machine shared with other work, wall time
  swings from call to call; with one torch thread (``--threads 1``) the CPU time is the steadier
  measure of what a call costs.

JSON: ``figures/data/sharing_cpu.json`` (``sharing_gpu.json`` on CUDA); figure:
`paged_ref.viz.sharing.sharing_figure` (notebook 08).
"""

from __future__ import annotations

import time

import torch

from .. import hf, textdata
from ..block_table import pages_needed
from ..cache import PagedKVCache
from ..sharing import computed_tokens, no_sharing_pages, prefix_caching_pages
from ._generate_methods import start_run
from .common import bench_parser, environment, print_table, result_file

PAGE_SIZE = 16
SEED = 0
FULL = dict(prompts={"short": 40, "long": 512}, widths=(2, 4, 8), new_tokens=64, repeats=5)
QUICK = dict(prompts={"short": 9, "long": 40}, widths=(2, 4), new_tokens=6, repeats=1)
GOAL_PEAK_RATIO = 0.6  # beam search, k = 4, 512-token prompt: (a) holds <= 0.6x the pages of (c)
GOAL_SPEED_RATIO = 1.10  # paged time <= 1.10x model.generate's, same arguments


def _prompt(model, tokenizer, length: int, start: int) -> torch.Tensor:
    """LongTensor ``[1, length]``: English prose (SmolLM2) or seeded random ids (tiny model)."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(length)
        return torch.randint(3, model.config.vocab_size, (1, length), generator=g)
    ids = tokenizer(textdata.english_text(length, start=start), return_tensors="pt").input_ids
    return ids[:, :length]


def _pad_id(model) -> int:
    # transformers' beam search fills with the first EOS id when pad_token_id is 0, and EOS is off here
    pad = model.generation_config.pad_token_id
    return pad if pad else 1


def _sample_run(model, ids, n, new):
    """The paged sampling run, recorded: pages per step (a), the tokens for (b) and (c), copies."""
    width = ids.shape[1]
    kv = PagedKVCache.for_model(model, num_pages=n * pages_needed(width + new, PAGE_SIZE), page_size=PAGE_SIZE)
    snapshots = []
    torch.manual_seed(SEED)
    out = hf.generate(
        model,
        ids,
        max_new_tokens=new,
        do_sample=True,
        num_return_sequences=n,
        eos_token_id=[],
        pad_token_id=_pad_id(model),
        page_size=PAGE_SIZE,
        kv_cache=kv,
        callback=lambda step, tokens: snapshots.append({s: kv.pages(s) for s in kv.seq_ids}),
    )
    rows = out.tolist()
    pages = {"fork_cow": [], "prefix_caching": [], "no_sharing": []}
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


def _beam_run(model, ids, k, new):
    """The paged beam search, recorded through its `BeamStep`s."""
    width = ids.shape[1]
    steps = []
    out = hf.beam_search(
        model,
        ids,
        max_new_tokens=new,
        num_beams=k,
        num_return_sequences=k,
        eos_token_id=[],
        pad_token_id=_pad_id(model),
        page_size=PAGE_SIZE,
        callback=lambda step, beam_step: steps.append(beam_step),
    )
    pages = {"fork_cow": [], "prefix_caching": [], "no_sharing": []}
    copies = {"fork_cow": 0, "prefix_caching": 0, "no_sharing": 0}
    computed = {"fork_cow": width, "prefix_caching": width, "no_sharing": width}
    running = [ids[0].tolist()]  # the beams' tokens held after each forward (one sequence after the prefill)
    for beam_step in steps:
        pages["fork_cow"].append(beam_step.pages_held)
        pages["prefix_caching"].append(
            prefix_caching_pages(running, admitted=[len(r) for r in running], page_size=PAGE_SIZE)
        )
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


def _savings(pages: dict) -> dict:
    base_peak, base_sum = max(pages["no_sharing"]), sum(pages["no_sharing"])
    return {
        design: {"at_peak": 1 - max(held) / base_peak, "over_steps": 1 - sum(held) / base_sum}
        for design, held in pages.items()
        if design != "no_sharing"
    }


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
        ratios = sorted(p / t for p, t in zip(times["paged"], times["transformers"]))
        out[kind] = {
            "seconds": times,
            "median_s": {name: sorted(t)[len(t) // 2] for name, t in times.items()},
            "ratio_paged_over_transformers": ratios[len(ratios) // 2],  # median of the per-pair ratios
        }
    return out


def measure_one(model, ids, kind: str, width: int, new: int, repeats: int) -> dict:
    """One workload: memory under the three designs, and speed against ``model.generate``."""
    common = dict(max_new_tokens=new, eos_token_id=[], pad_token_id=_pad_id(model))
    if kind == "sample":
        with _Clock() as recorded:
            out, pages, copies, computed = _sample_run(model, ids, width, new)
        args = dict(do_sample=True, num_return_sequences=width, **common)
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
        with _Clock() as recorded:
            out, pages, copies, computed = _beam_run(model, ids, width, new)
        args = dict(num_beams=width, num_return_sequences=width, **common)
        with _Clock() as compared:
            expected = model.generate(ids, do_sample=False, output_scores=True, return_dict_in_generate=True, **args)
        same = {"tokens": torch.equal(out.sequences, expected.sequences)}
        if same["tokens"]:
            same["max_score_diff"] = float((out.sequences_scores - expected.sequences_scores).abs().max())

        def paged():
            hf.beam_search(model, ids, page_size=PAGE_SIZE, **args)

        def theirs():
            model.generate(ids, do_sample=False, **args)

    # the recorded run and the comparison run are the first timed pair (their extras cost little)
    return {
        "kind": kind,
        "width": width,
        "prompt_tokens": ids.shape[1],
        "new_tokens": new,
        "pages": pages,
        "peak": {design: max(held) for design, held in pages.items()},
        "saving_vs_no_sharing": _savings(pages),
        "pages_copied": copies,
        "tokens_computed": computed,
        "same_as_transformers": same,
        "time": _timed(paged, theirs, repeats, first=(recorded, compared)),
    }


def measure(model, tokenizer, *, prompts, widths, new_tokens, repeats) -> dict:
    """Every (prompt, kind, width) run; see the module docstring."""
    from tqdm.auto import tqdm

    warm = torch.tensor([[5, 6, 7]])  # one-time costs (lazy initialisation) before the first timed call
    hf.generate(model, warm, max_new_tokens=2, do_sample=True)
    model.generate(warm, max_new_tokens=2, do_sample=True)
    runs = []
    jobs = [(name, kind, w) for name in prompts for kind in ("sample", "beam") for w in widths]
    for name, kind, w in tqdm(jobs, desc="bench sharing", unit="run"):
        ids = _prompt(model, tokenizer, prompts[name], start=3 * list(prompts).index(name))
        runs.append({"prompt": name, **measure_one(model, ids, kind, w, new_tokens, repeats)})
    return {"page_size": PAGE_SIZE, "seed": SEED, "repeats": repeats, "runs": runs, "goals": _goals(runs)}


def _goals(runs) -> dict:
    goal = [r for r in runs if r["kind"] == "beam" and r["width"] == 4 and r["prompt_tokens"] == 512]
    peak = None
    if goal:
        r = goal[0]
        ratio = r["peak"]["fork_cow"] / r["peak"]["no_sharing"]
        peak = {"ratio": ratio, "goal": GOAL_PEAK_RATIO, "met": ratio <= GOAL_PEAK_RATIO}
    speed = {}
    for clock in ("wall", "cpu"):
        worst = max(r["time"][clock]["ratio_paged_over_transformers"] for r in runs)
        speed[clock] = {"worst_ratio": worst, "goal": GOAL_SPEED_RATIO, "met": worst <= GOAL_SPEED_RATIO}
    return {"beam4_prompt512_peak_fork_cow_over_no_sharing": peak, "speed": speed}


def main(argv=None):
    parser = bench_parser("sharing", __doc__)
    parser.add_argument("--quick", action="store_true", help="short prompts, few tokens, one repeat")
    parser.add_argument(
        "--model", choices=["smollm2", "tiny"], default="smollm2", help="SmolLM2-135M (default) or the tiny Llama"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=None, help="timed pairs per run (default 5; quick 1)")
    args = parser.parse_args(argv)
    device = "gpu" if torch.cuda.is_available() else "cpu"
    result = result_file(parser, args.out, f"sharing_{device}.json")  # checked before anything is measured
    model, tokenizer, sizes, data = start_run(args, QUICK, FULL)
    data.update(measure(model, tokenizer, **sizes))
    data["environment"] = environment()
    print(f"\npages held (pages of {PAGE_SIZE}): (a) fork + copy-on-write, (b) prefix caching, (c) no sharing")
    rows = []
    for r in data["runs"]:
        peak, save = r["peak"], r["saving_vs_no_sharing"]
        rows.append(
            [
                f"{r['prompt']} ({r['prompt_tokens']})",
                f"{r['kind']} {r['width']}",
                f"{peak['fork_cow']} / {peak['prefix_caching']} / {peak['no_sharing']}",
                f"{save['fork_cow']['at_peak']:.1%} / {save['prefix_caching']['at_peak']:.1%}",
                f"{save['fork_cow']['over_steps']:.1%} / {save['prefix_caching']['over_steps']:.1%}",
                f"{r['pages_copied']['fork_cow']} / {r['pages_copied']['no_sharing']}",
                " / ".join(str(r["tokens_computed"][d]) for d in ("fork_cow", "prefix_caching", "no_sharing")),
                r["same_as_transformers"]["tokens"],
                f"{r['time']['wall']['ratio_paged_over_transformers']:.2f}x",
                f"{r['time']['cpu']['ratio_paged_over_transformers']:.2f}x",
            ]
        )
    print_table(
        [
            "prompt",
            "run",
            "peak a / b / c",
            "saved at peak a / b",
            "saved over steps a / b",
            "copied a / c",
            "tokens computed a / b / c",
            "same tokens",
            "wall paged / hf",
            "CPU paged / hf",
        ],
        rows,
    )
    goals = data["goals"]
    peak = goals["beam4_prompt512_peak_fork_cow_over_no_sharing"]
    if peak is not None:
        print(
            f"goal, beam search k=4 on the 512-token prompt: (a) holds {peak['ratio']:.3f}x the pages of (c) at "
            f"peak (goal <= {peak['goal']}): {'met' if peak['met'] else 'NOT met'}"
        )
    for clock, speed in goals["speed"].items():
        print(
            f"goal, {clock} time paged / model.generate <= {speed['goal']} in every run: worst "
            f"{speed['worst_ratio']:.2f}x: {'met' if speed['met'] else 'NOT met'}"
        )
    path = result.save(data, complete=True)
    print(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()
