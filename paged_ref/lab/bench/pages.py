"""Reading fewer pages: cascade attention over a shared prompt, and Quest's page selection beside eviction.

    python -m paged_ref.lab.bench pages [--quick | --smoke] [--out DIR] [--threads N]

* **Cascade.** ``samples`` requests share a ``prompt``-token prefix (whole pages) and each holds
  1..``suffix_max`` tokens of its own, in SmolLM2-135M's geometry (9 query heads, 3 KV heads,
  head_dim 64, float32, pages of 16): CPU time of one layer's decode attention, plain
  (`reference_paged_decode`, `sdpa_paged_decode`) against `reference_cascade_decode`, medians of
  interleaved rounds; the results are checked equal. K/V bytes read per step, counted by
  `paged_ref.lab.bench._reads.ReadCounter` (what the code copies out of the pages) next to the
  formula, for n requests sharing the prompt. The Triton path is checked against the reference
  (interpreter on CPU); on a GPU it is timed too.
* **Cascade in a real model.** SmolLM2 sampling ``samples`` continuations of one ``prompt``-token
  prompt through `paged_ref.hf.generate` with the ``sdpa`` and ``cascade`` backends: milliseconds
  per decode step (the whole model) and whether the seeded tokens are the same.
* **Quest against eviction.** On SmolLM2 (float32, CPU), notebook 07's tasks (the texts of
  ``python -m paged_ref.lab.bench eviction``: continuation perplexity, retention, pass-key) at each
  token budget C: Quest reading C / 16 pages a step (`paged_ref.hf.attention.quest_backend`;
  prefill and the first two layers, as in Quest's paper, read everything), PagedEviction and
  StreamingLLM holding C tokens, the full cache.
  Mean NLL with 95% t intervals, pass-key accuracy with Wilson intervals, and the K/V (and
  summary) bytes one decode step reads, counted over all layers.

Results: ``figures/data/pages_{quick,full,smoke}.json`` (notebook 10 reads them) and tables printed.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from pathlib import Path

import torch

from ..._arith import cdiv
from ...attention.cascade import reference_cascade_decode
from ...attention.reference import reference_paged_decode
from ...attention.sdpa import sdpa_paged_decode
from ...cache import PagedKVCache
from ..stats import mean_ci, wilson
from ..textdata import paragraphs
from . import eviction as ev
from ._eviction_passkey import PASSKEY_DEPTHS, answer_is_correct, passkey_prompt
from ._eviction_runs import close_session, policy_groups, policy_runs, prefilled_batch
from ._reads import ReadCounter
from .common import DATA_DIR, bench_parser, command_line, environment, result_file, table

__all__ = ["FULL", "QUICK", "SMOKE", "cascade_bytes", "cascade_case", "cascade_speed", "cascade_tables", "load_results"]
__all__ += ["main", "quality", "quality_tables", "quest_vs_eviction"]

POLICIES = ["full", "paged_eviction", "streaming_llm"]  # the eviction peers of Quest
PAGE_SIZE = 16
DENSE_LAYERS = 2  # Quest's paper reads every page in the first two layers
SMOLLM2 = dict(num_q_heads=9, num_kv_heads=3, head_dim=64)  # SmolLM2-135M's attention geometry
# each setting as (quick, smoke, full); the task texts follow the eviction benchmark's sizes
_SIZES = dict(
    samples=(32, 4, 32),
    prompt=(1024, 64, 1024),
    suffix_max=(32, 8, 32),
    rounds=(5, 2, 21),
    generate_steps=(9, 3, 17),  # SmolLM2 sampling: decode steps timed per backend (the first is not timed)
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


# ------------------------------------------------------------------------------------- cascade
def cascade_case(samples: int, prompt: int, suffix_max: int, *, seed: int = 0, dtype=torch.float32) -> dict:
    """``samples`` requests sharing ``prompt`` tokens (whole pages of 16), each with 1..``suffix_max``
    tokens of its own, scattered over a shuffled cache of SmolLM2's geometry; the arguments of
    `reference_cascade_decode` as a dict (``group_indptr``, ``prefix_lens``: one group)."""
    g = torch.Generator().manual_seed(seed)
    suffix = torch.randint(1, suffix_max + 1, (samples,), generator=g)  # [samples]
    prefix_pages, own = prompt // PAGE_SIZE, [cdiv(int(s), PAGE_SIZE) for s in suffix]
    num_pages = prefix_pages + sum(own) + 1
    shape = (num_pages, PAGE_SIZE, SMOLLM2["num_kv_heads"], SMOLLM2["head_dim"])
    k_cache = torch.randn(shape, generator=g, dtype=dtype)  # [num_pages, page_size, Hkv, D]
    v_cache = torch.randn(shape, generator=g, dtype=dtype)
    perm = torch.randperm(num_pages, generator=g).tolist()
    shared = [perm.pop() for _ in range(prefix_pages)]
    rows = [shared + [perm.pop() for _ in range(n)] for n in own]
    width = max(map(len, rows))
    return dict(
        q=torch.randn(samples, SMOLLM2["num_q_heads"], SMOLLM2["head_dim"], generator=g, dtype=dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], dtype=torch.int32),
        seq_lens=(prompt + suffix).int(),
        group_indptr=torch.tensor([0, samples]),
        prefix_lens=torch.tensor([prompt]),
    )


def _plain(case):
    return {k: case[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens")}


PATHS = {
    "reference": lambda c: reference_paged_decode(**_plain(c)),
    "sdpa": lambda c: sdpa_paged_decode(**_plain(c)),
    "cascade": lambda c: reference_cascade_decode(**c),
}


def cascade_speed(cfg, log) -> dict:
    """Median CPU seconds per call of each path on one case, rounds interleaved; ratios against cascade."""
    case = cascade_case(cfg["samples"], cfg["prompt"], cfg["suffix_max"])
    ref = PATHS["reference"](case).double()
    errors = {n: float((f(case).double() - ref).norm() / ref.norm()) for n, f in PATHS.items()}
    times = {n: [] for n in PATHS}
    for _ in range(cfg["rounds"]):
        for name, f in PATHS.items():
            t0 = time.perf_counter()
            f(case)
            times[name].append(time.perf_counter() - t0)
    median = {n: statistics.median(t) for n, t in times.items()}
    log(f"cascade speed: {', '.join(f'{n} {1e3 * t:.2f} ms' for n, t in median.items())}")
    return dict(
        samples=cfg["samples"],
        prompt=cfg["prompt"],
        suffix_tokens=(case["seq_lens"] - cfg["prompt"]).tolist(),
        median_ms={n: 1e3 * t for n, t in median.items()},
        rounds_ms={n: [1e3 * x for x in t] for n, t in times.items()},
        speedup_vs={n: median[n] / median["cascade"] for n in PATHS if n != "cascade"},
        rel_error_vs_reference=errors,
    )


def cascade_bytes(cfg) -> list[dict]:
    """K/V bytes one layer's decode step reads, counted, for n = each of ``sharing`` requests sharing
    the prompt, plain and cascade, beside the formulas (whole pages: what a paged read touches)."""
    rows = []
    token_bytes = 2 * SMOLLM2["num_kv_heads"] * SMOLLM2["head_dim"] * 4  # K and V of one token, float32
    for n in cfg["sharing"]:
        case = cascade_case(n, cfg["prompt"], cfg["suffix_max"], seed=n)
        counted = {}
        for name, f in PATHS.items():
            with ReadCounter([case["k_cache"], case["v_cache"]]) as reads:
                f(case)
            counted[name] = reads.bytes
        own_pages = [cdiv(int(s) - cfg["prompt"], PAGE_SIZE) for s in case["seq_lens"]]
        prefix_pages = cfg["prompt"] // PAGE_SIZE
        rows.append(
            dict(
                requests=n,
                prompt=cfg["prompt"],
                bytes_counted=counted,
                bytes_formula=dict(
                    plain=sum(prefix_pages + p for p in own_pages) * PAGE_SIZE * token_bytes,
                    cascade=(prefix_pages + sum(own_pages)) * PAGE_SIZE * token_bytes,
                ),
                prefix_bytes_plain_over_cascade=n,
            )
        )
    return rows


def triton_check(cfg, log) -> dict:
    """The Triton cascade against the reference (interpreter on CPU: a small case); timed on a GPU."""
    try:
        from ...attention.triton_cascade import triton_cascade_decode
        from ...attention.triton_decode import triton_paged_decode
    except ImportError as err:  # pragma: no cover - no triton wheel
        return dict(skipped=str(err))
    cuda = torch.cuda.is_available()
    samples, prompt = (cfg["samples"], cfg["prompt"]) if cuda else (4, 64)
    case = cascade_case(samples, prompt, cfg["suffix_max"], seed=1)
    if cuda:
        case = {k: v.cuda() for k, v in case.items()}
    ref = reference_paged_decode(**{k: v.double() if v.is_floating_point() else v for k, v in _plain(case).items()})
    out = triton_cascade_decode(**case)
    result = dict(
        device=torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
        samples=samples,
        prompt=prompt,
        rel_error=float((out.double() - ref).norm() / ref.norm()),
    )
    if cuda:
        from .common import gpu_median

        plain = gpu_median(lambda: triton_paged_decode(**_plain(case), check_values=False))
        cascade = gpu_median(lambda: triton_cascade_decode(**case))
        result.update(plain_us=plain * 1e6, cascade_us=cascade * 1e6, speedup=plain / cascade)
    log(f"triton cascade: {result}")
    return result


def generate_speed(model, tok, cfg, log) -> dict:
    """SmolLM2 sampling ``samples`` continuations of one ``prompt``-token prompt (they fork its pages)
    with the ``sdpa`` and the ``cascade`` backends: median seconds per decode step (all layers,
    the whole model) and whether the tokens are the same (seeded)."""
    from ...hf import generate

    ids = ev.lm_text_ids(tok, 3, cfg["prompt"])[None]  # [1, prompt]
    out = {}
    for backend in ("sdpa", "cascade"):
        stamps = []
        torch.manual_seed(0)
        seqs = generate(
            model,
            ids,
            max_new_tokens=cfg["generate_steps"],
            do_sample=True,
            num_return_sequences=cfg["samples"],
            backend=backend,
            eos_token_id=[],
            callback=lambda step, tokens: stamps.append(time.perf_counter()),
        )
        steps = [b - a for a, b in zip(stamps, stamps[1:])]  # decode steps (the first stamp follows the prefill)
        out[backend] = dict(ms_per_step=1e3 * statistics.median(steps), steps_ms=[1e3 * t for t in steps])
        out[backend]["tokens"] = seqs[:, cfg["prompt"] :].tolist()
    same = out["sdpa"].pop("tokens") == out["cascade"].pop("tokens")
    result = dict(samples=cfg["samples"], prompt=cfg["prompt"], same_tokens=same, **out)
    result["speedup"] = out["sdpa"]["ms_per_step"] / out["cascade"]["ms_per_step"]
    log(f"sampling {cfg['samples']} x SmolLM2: sdpa {out['sdpa']['ms_per_step']:.0f} ms/step, cascade "
        f"{out['cascade']['ms_per_step']:.0f} ms/step, same tokens: {same}")  # fmt: skip
    return result


# ------------------------------------------------------------------------------- Quest vs eviction
class QuestRun:
    """One sequence decoding with Quest at ``budget`` tokens (``budget // 16`` pages), its own session."""

    def __init__(self, model, prompt: torch.Tensor, budget: int, longest: int, dense_layers: int = DENSE_LAYERS):
        from ...hf import PagedSession
        from ...hf.attention import quest_backend

        self.budget = budget
        kv = PagedKVCache.for_model(
            model, num_pages=cdiv(longest, PAGE_SIZE) + 1, page_size=PAGE_SIZE, page_summaries=True
        )
        self.session = PagedSession(
            model, kv_cache=kv, backend=quest_backend(budget // PAGE_SIZE, dense_layers=dense_layers)
        ).open()
        self.seq = self.session.add()
        self.session.extend([self.seq], [prompt])  # prefill reads every page (SDPA)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one token ``[]``; log-probs ``[vocab]`` of the next."""
        logits = self.session.extend([self.seq], [token.view(1)])  # [1, vocab]
        return torch.log_softmax(logits[0].float(), -1)

    def bytes_per_step(self, token: torch.Tensor) -> int:
        """K/V and summary bytes one decode step reads, all layers (the step is taken)."""
        kv = self.session.kv
        with ReadCounter([*kv.k_cache, *kv.v_cache, *kv.summaries.k_min, *kv.summaries.k_max]) as reads:
            self.step(token)
        return reads.bytes

    def close(self):
        close_session(self.session)


def _eviction_bytes_per_step(model, prompt, token, runs) -> dict:
    """K/V bytes one decode step of each eviction run reads (all layers), each alone in a batch."""
    out = {}
    for run in runs:
        batch = prefilled_batch(model, prompt, [run], PAGE_SIZE, prompt.numel() + 2, False)
        kv = batch.session.kv
        with ReadCounter([*kv.k_cache, *kv.v_cache]) as reads:
            batch.step(token.view(1))
        out[(run[0], run[2])] = reads.bytes
        close_session(batch.session)
    return out


def _quest_continuation(model, ids, n_ctx, first_scored, budgets, ref_lp):
    """Quest's rows on one text, as `ev.score_continuation`'s: NLL and KL(full || Quest) per budget."""
    targets = ids[n_ctx + 1 :]  # fed token i predicts ids[n_ctx + i + 1]
    counted = torch.arange(targets.numel()) >= first_scored - 1  # [n_fed]
    rows = []
    for c in budgets:
        run = QuestRun(model, ids[:n_ctx], c, ids.numel())
        nll = kl = 0.0
        for i, token in enumerate(ids[n_ctx:-1]):
            lp = run.step(token)
            if counted[i]:
                nll -= float(lp[targets[i]])
                kl += float((ref_lp[i].exp() * (ref_lp[i] - lp)).sum())
        run.close()
        n = int(counted.sum())
        rows.append(
            dict(policy="quest", budget=c, page_size=PAGE_SIZE, nll=nll / n, kl_vs_full=kl / n, scored_tokens=n)
        )
    return rows


def _score_text(model, ids, n_ctx, first_scored, cfg, log, label):
    """Every policy's and Quest's rows on one text."""
    groups = policy_groups(cfg["budgets"], [PAGE_SIZE], POLICIES)
    rows, _ = ev.score_continuation(model, ids, n_ctx, first_scored, groups, log, label)
    with torch.inference_mode():
        logits = model(ids.view(1, -1), use_cache=False).logits[0].float()  # [n, vocab]
    ref_lp = torch.log_softmax(logits[n_ctx:-1], -1)  # [n_fed, vocab]
    t0 = time.perf_counter()
    rows += _quest_continuation(model, ids, n_ctx, first_scored, cfg["budgets"], ref_lp)
    log(f"{label}, quest at {cfg['budgets']}: {time.perf_counter() - t0:.1f} s")
    return [{k: r[k] for k in ("policy", "budget", "page_size", "nll", "kl_vs_full", "scored_tokens")} for r in rows]


def _summarize(rows):
    groups = {}
    for r in rows:
        groups.setdefault((r["policy"], r["budget"]), []).append(r)
    out = []
    for (policy, c), rs in groups.items():
        nll, lo, hi = mean_ci([r["nll"] for r in rs])
        out.append(
            dict(
                policy=policy,
                budget=c,
                texts=len(rs),
                nll=nll,
                nll_ci95=[lo, hi],
                ppl=math.exp(nll),
                ppl_ci95=[math.exp(lo), math.exp(hi)],
                kl_vs_full=statistics.fmean(r["kl_vs_full"] for r in rs),
            )
        )
    return out


def _lm_texts(tok, cfg):
    """``texts`` passages whose continuation does not copy their context (as the eviction benchmark)."""
    out, n = [], cfg["context"] + cfg["continuation"]
    for start in range(0, len(paragraphs(20)), cfg["text_stride"]):
        ids = ev.lm_text_ids(tok, start, n)
        if ids.numel() == n and ev.copy_fraction(ids, cfg["context"]) <= ev.MAX_COPIED:
            out.append((start, ids))
        if len(out) == cfg["texts"]:
            return out
    raise RuntimeError(f"fewer than {cfg['texts']} passages without copying")


def _passkey(model, tok, cfg, log, answer_tokens=7):
    """Pass-key trials: the eviction runs (forked from one prefill, the question fed through the
    evicted cache) and Quest at each budget; one row per (trial, policy, budget)."""
    rows = []
    runs = policy_runs(cfg["budgets"], policies=POLICIES)
    for trial in range(cfg["passkey_trials"]):
        rng = random.Random(1000 + trial)
        depth = PASSKEY_DEPTHS[trial % len(PASSKEY_DEPTHS)]
        ctx, question, key, _, _ = passkey_prompt(tok, rng, cfg["passkey_context"], depth)
        longest = ctx.numel() + question.numel() + answer_tokens
        batch = prefilled_batch(model, ctx, runs, PAGE_SIZE, longest, False)
        for _ in batch.feed(question[:-1]):
            pass
        nxt, answers = question[-1].repeat(len(runs)), []
        for _ in range(answer_tokens):
            nxt = batch.step(nxt).argmax(-1)  # [runs]
            answers.append(nxt)
        for (label, _, c), answer in zip(runs, torch.stack(answers, 1)):
            text = tok.decode(answer)
            rows.append(dict(policy=label, budget=c, trial=trial, answer=text, correct=answer_is_correct(text, key)))
        close_session(batch.session)
        for c in cfg["budgets"]:
            run = QuestRun(model, ctx, c, longest)
            for token in question:  # the question one token at a time: Quest chooses pages at every step
                lp = run.step(token)
            answer = []
            for _ in range(answer_tokens):
                answer.append(lp.argmax())
                lp = run.step(answer[-1])
            run.close()
            text = tok.decode(torch.stack(answer))
            rows.append(dict(policy="quest", budget=c, trial=trial, answer=text, correct=answer_is_correct(text, key)))
        log(
            f"pass-key trial {trial}: key {key}; "
            + ", ".join(f"{r['policy']}@{r['budget']} {r['correct']}" for r in rows[-len(runs) - len(cfg["budgets"]) :])
        )
    groups = {}
    for r in rows:
        groups.setdefault((r["policy"], r["budget"]), []).append(r["correct"])
    summary = [
        dict(
            policy=p,
            budget=c,
            trials=len(v),
            correct=sum(v),
            accuracy=sum(v) / len(v),
            ci95=list(wilson(sum(v), len(v))),
        )
        for (p, c), v in groups.items()
    ]
    return rows, summary


def quality(model, tok, cfg, log, result, out) -> None:
    """Quest against eviction on the three tasks and the bytes each reads per step; saved as it goes."""
    lm_rows = []
    texts = _lm_texts(tok, cfg)
    for t, (_, ids) in enumerate(texts):
        lm_rows += [dict(r, text=t) for r in _score_text(model, ids, cfg["context"], 1, cfg, log, f"text {t}")]
    result.update(lm_texts=[s for s, _ in texts], language_modelling=_summarize(lm_rows), lm_rows=lm_rows)
    out.save(result)
    ret_rows = []
    for t in range(cfg["retention_texts"]):
        ids, n_ctx, opening, _ = ev.retention_ids(tok, cfg, t)
        ret_rows += [dict(r, text=t) for r in _score_text(model, ids, n_ctx, opening, cfg, log, f"retention {t}")]
    result.update(retention=_summarize(ret_rows), retention_rows=ret_rows)
    out.save(result)
    pk_rows, pk_summary = _passkey(model, tok, cfg, log)
    result.update(passkey=pk_summary, passkey_rows=pk_rows)
    out.save(result)
    # bytes one decode step reads (all layers) after the first text's context
    ids = texts[0][1]
    prompt, token = ids[: cfg["context"]], ids[cfg["context"]]
    eviction = _eviction_bytes_per_step(model, prompt, token, policy_runs(cfg["budgets"], policies=POLICIES))
    rows = [dict(policy=p, budget=c, bytes_per_step=b) for (p, c), b in eviction.items()]
    for c in cfg["budgets"]:
        run = QuestRun(model, prompt, c, ids.numel())
        rows.append(dict(policy="quest", budget=c, bytes_per_step=run.bytes_per_step(token)))
        run.close()
    result["bytes_per_step"] = dict(context=cfg["context"], layers=model.config.num_hidden_layers, rows=rows)
    out.save(result)


# ------------------------------------------------------------------------------------------ main
def main(argv=None):
    parser = bench_parser("pages", __doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (notebook 10's quick mode, a few minutes)")
    size.add_argument("--smoke", action="store_true", help="toy sizes: checks the harness runs (the tests' run)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "smoke" if args.smoke else "full"
    out = result_file(parser, args.out, f"pages_{mode}.json")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, argv, mode, out, {"quick": QUICK, "smoke": SMOKE, "full": FULL}[mode])
    finally:
        torch.set_num_threads(threads)


def _run(args, argv, mode, out, cfg):
    start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - start:7.1f} s] {msg}", flush=True)

    result = dict(
        mode=mode,
        command=command_line("pages", argv),
        config=dict(cfg, page_size=PAGE_SIZE, quest_dense_layers=DENSE_LAYERS),
        environment=dict(environment(), torch_threads=args.threads),
    )
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
    speed = [
        dict(path=n, ms=t, x=t / s["median_ms"]["cascade"], err=s["rel_error_vs_reference"][n])
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
    sampling = [] if g is None else [
        "",
        f"SmolLM2 sampling {g['samples']} continuations of a {g['prompt']}-token prompt (whole model, median ms per "
        f"decode step): sdpa {g['sdpa']['ms_per_step']:.0f}, cascade {g['cascade']['ms_per_step']:.0f} "
        f"({g['speedup']:.2f}x); same tokens: {g['same_tokens']}",
    ]  # fmt: skip
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
    better; pass-key: accuracy, higher is better), with each side's interval."""
    out = []
    for task, key, ci in (
        ("language_modelling", "nll", "nll_ci95"),
        ("retention", "nll", "nll_ci95"),
        ("passkey", "accuracy", "ci95"),
    ):
        rows = {(r["policy"], r["budget"]): r for r in result[task]}
        for c in result["config"]["budgets"]:
            quest = rows[("quest", c)]
            for peer in ("paged_eviction", "streaming_llm"):
                other = rows[(peer, c)]
                out.append(
                    dict(
                        task=task,
                        budget=c,
                        peer=peer,
                        metric=key,
                        quest=quest[key],
                        quest_ci=quest[ci],
                        other=other[key],
                        other_ci=other[ci],
                        difference=quest[key] - other[key],
                    )
                )
    return out  # fmt: skip


def print_report(result) -> None:
    """The benchmark's tables, from its JSON."""
    print("\nCascade\n" + cascade_tables(result))
    print("\nQuest beside eviction\n" + quality_tables(result))


if __name__ == "__main__":
    main()
