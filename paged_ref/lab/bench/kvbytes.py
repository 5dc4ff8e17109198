"""What a byte buys: quality against KV bytes per sequence, 8-bit pages against eviction (SmolLM2-135M).

    python -m paged_ref.lab.bench kvbytes [--quick | --smoke] [--out DIR] [--threads N]

Ways to hold a sequence in fewer bytes, on the eviction benchmark's harness (`paged_ref.lab.bench.eviction`:
one prompt prefilled per batch, forked into one sequence per method; the same texts, tasks and intervals):
store every token in fewer bytes (8-bit pages, `paged_ref.quant`), keep fewer tokens (PagedEviction,
StreamingLLM), read fewer pages (Quest). One batch per cache format, each in a cache of its own
(`_eviction_runs.Group`'s ``kv_format`` and ``cache``):

* ``float32``: the harness's cache as it runs SmolLM2 today (float32 model, float32 pages);
* ``bfloat16 values``: what a 16-bit cache holds: `Bf16ValuesCache`, float32 pages whose every K and V
  value is rounded to bfloat16 when written, its bytes counted at 2 a value (below);
* ``e4m3`` (float8_e4m3fn, what vLLM's ``kv_cache_dtype="fp8"`` stores) with one scale per layer for K
  and one for V: vLLM's default 1.0, and calibrated on the prompt (`quant.calibrate` over the K and V
  a float32 prefill of the same prompt writes, `paged_ref.lab.likelihood.prompt_kv`: the prompt's
  largest magnitude per layer maps to 448; continuation tokens beyond it saturate);
* ``e4m3`` and ``int8`` with one scale per page and KV head (``KVFormat(scales="page")``); ``int8``
  also per layer, calibrated (a scale of 1.0 would round int8's K and V to whole numbers).
  Rounding to nearest (torch's cast; vLLM's CPU cache write truncates instead).

In each format's batch: the full cache, and PagedEviction and StreamingLLM at two token budgets C,
shares of the full cache's pages (the tokens the task ends with): at ``1/2`` the page bound,
ceil(C / B) + 1, is the nearest to half the full cache's pages, at ``1/4`` to a quarter (`share_budget`).
So, at about equal bytes: the 8-bit full caches against 16-bit with eviction at ``1/2`` (the issue's
comparison) and float32 with eviction at ``1/4``; 8-bit plus eviction at ``1/2`` against 16-bit at
``1/4``. Quest (2 dense layers, C / 16 pages a step in the others, `paged_ref.lab.quest_backend`) runs
at the same budgets on the float32 cache and on e4m3 pages with per-page scales (`QUEST_FORMATS`; its
page summaries hold the min / max of the keys as stored): it holds every page (its bytes held are the
full cache's) and reads fewer; its point on the byte axis is the K/V, page-summary and page-scale bytes
its last decode step read (`_reads.ReadCounter`, all layers; the others read every page they hold).

Bytes. Every byte count is a cache's own accounting, ``page_bytes`` (K and V of every layer; with
per-page scales a page's float32 scales too; per-layer scales belong to the pool, 2 x layers float32)
times the pages a sequence holds: ``bytes_per_seq`` is the peak over a task (the most pages a sequence
held, times ``page_bytes``; the largest over its texts or trials). Stored bytes: a float32 page is 4
bytes a value, an 8-bit page 1 plus its scales. 16-bit: the model runs in float32 and a `PagedSession`
cache must store the model's dtype, so no cache here stores bfloat16; ``bfloat16 values`` holds exactly
the values a bfloat16 cache would (attention then runs in float32 over them, as over the 8-bit pages'
``q * scale``) and counts its bytes as a bfloat16 page stores them: its quality is measured, its
bytes are those of a 16-bit cache of this geometry, not of the float32 pages that hold the values.

Quality: continuation NLL over ``texts`` texts (95% t interval), retention NLL (a passage's tokens
repeated after other prose), pass-key accuracy (Wilson 95% interval), each as the eviction benchmark
measures them. The full float32 cache's log-probs are checked against the model's own forward.

Results: ``figures/data/kv_bytes_{smoke,quick,full}.json`` (smoke: toy sizes, a harness check whose
numbers mean nothing) and the table `kvbytes_report.bytes_table` prints; `paged_ref.lab.viz.quality_per_byte`
draws them.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..._arith import cdiv
from ...cache import PagedKVCache
from ...memory import kv_bytes_per_token
from ...quant import KVFormat, calibrate
from ..likelihood import prompt_kv
from ..runmode import data_dir
from ..stats import mean_ci, wilson
from . import eviction as ev
from . import kvbytes_report as report
from ._eviction_passkey import PASSKEY_DEPTHS, answer_is_correct, passkey_prompt, passkey_task
from ._eviction_runs import Group, policy_runs
from ._pages_quest import DENSE_LAYERS, QuestRun
from ._reads import ReadCounter
from .common import bench_parser, environment, result_file, stage_log

__all__ = [
    "Bf16ValuesCache",
    "FORMATS",
    "FULL",
    "METHODS",
    "PAGE_SIZE",
    "QUICK",
    "SHARES",
    "SMOKE",
    "Format",
    "PromptScales",
]
__all__ += ["format_groups", "main", "quest_continuation", "quest_passkey", "share_budget", "summarize"]

PAGE_SIZE = 16
METHODS = ["full", "paged_eviction", "streaming_llm"]  # each format's batch; Quest runs alone, one at a time
SHARES = (2, 4)  # budgets: 1/2 and 1/4 of the full cache's pages
_SIZES = dict(  # (quick, smoke, full): the eviction benchmark's tasks at its sizes (quick: 3 texts, 10 trials)
    texts=(3, 1, 8),
    text_stride=(150, 150, 30),
    context=(384, 160, 2048),
    continuation=(33, 9, 128),
    retention_texts=(3, 1, 8),
    retention_passage=(192, 64, 1024),
    retention_other=(160, 64, 1024),
    retention_scored=(24, 8, 128),
    passkey_trials=(10, 1, 20),
    passkey_context=(300, 160, 1100),
)
QUICK, SMOKE, FULL = ({key: values[i] for key, values in _SIZES.items()} for i in range(3))
_ANSWER_TOKENS = 7


class Bf16ValuesCache(PagedKVCache):
    """A 16-bit cache's contents in float32 pages: every K and V value rounded to bfloat16 as it is written
    (torch's cast: to nearest, ties to even), read back exactly; ``page_bytes`` counts 2 bytes a value, what
    a bfloat16 page of this geometry stores (the model runs in float32: a `PagedSession` cache must store
    its dtype, so a real bfloat16 cache cannot run it)."""

    label = "bfloat16 values"

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> None:
        half = torch.bfloat16
        super().write(layer, slots, k.to(half).to(k.dtype), v.to(half).to(v.dtype), **options)

    @property
    def page_bytes(self) -> int:
        shape = dict(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        return self.page_size * kv_bytes_per_token(**shape, bytes_per_elem=2)


@dataclass(frozen=True)
class Format:
    """One cache format of the comparison: ``dtype`` None for floating pages (``cache``: a lab cache class
    instead of `PagedKVCache`); ``scales`` "layer" or "page"; ``calibrated``: per-layer scales from the
    prompt (else vLLM's 1.0)."""

    label: str
    dtype: torch.dtype | None = None
    scales: str | None = None
    calibrated: bool = False
    cache: type | None = None

    @property
    def scale_source(self) -> str:
        if self.dtype is None:
            return "-"
        return "per page" if self.scales == "page" else "calibrated" if self.calibrated else "1.0"


FORMATS = [
    Format("float32"),
    Format("bfloat16 values", cache=Bf16ValuesCache),
    Format("e4m3 layer 1.0", torch.float8_e4m3fn, "layer"),
    Format("e4m3 layer calibrated", torch.float8_e4m3fn, "layer", calibrated=True),
    Format("e4m3 page", torch.float8_e4m3fn, "page"),
    Format("int8 layer calibrated", torch.int8, "layer", calibrated=True),
    Format("int8 page", torch.int8, "page"),
]
QUEST_FORMATS = [FORMATS[0], FORMATS[4]]  # float32 and e4m3 per page


class PromptScales:
    """A `Group`'s ``kv_format`` for one 8-bit `Format`: called with a prompt ``[n]``, the `KVFormat` to
    store it in; calibrated scales from the K and V of a float32 prefill of that prompt (one prefill per
    prompt, shared by the formats through ``prompts``), recorded in ``log``."""

    def __init__(self, fmt: Format, model, prompts: dict, log: list):
        self.fmt, self.model, self.prompts, self.log = fmt, model, prompts, log
        self.label = fmt.label

    def __call__(self, prompt: torch.Tensor) -> KVFormat:
        if not self.fmt.calibrated:
            return KVFormat(self.fmt.dtype, scales=self.fmt.scales)
        key = tuple(prompt.tolist())
        if key not in self.prompts:
            self.prompts.clear()  # one prompt at a time
            self.prompts[key] = prompt_kv(self.model, prompt, page_size=PAGE_SIZE)  # ks, vs: [n, Hkv, D] per layer
        ks, vs = self.prompts[key]
        k_scale = tuple(float(calibrate(k, self.fmt.dtype)) for k in ks)
        v_scale = tuple(float(calibrate(v, self.fmt.dtype)) for v in vs)
        self.log.append(dict(kv_format=self.label, prompt_tokens=len(key), k_scale=k_scale, v_scale=v_scale))
        return KVFormat(self.fmt.dtype, scales="layer", k_scale=k_scale, v_scale=v_scale)


def share_budget(tokens: int, share: int, page_size: int = PAGE_SIZE) -> int:
    """The token budget C whose page bound, ceil(C / B) + 1, is the nearest to 1/``share`` of the
    ``cdiv(tokens, B)`` pages a full cache holds (at least 2 pages: the first page and one to evict).

    Example:
        >>> share_budget(417, 4), share_budget(417, 2)  # 27 pages: bounds of 7 and 14 pages
        (96, 208)
    """
    pages = math.floor(cdiv(tokens, page_size) / share + 0.5)
    return page_size * max(2, pages - 1)


def format_groups(budgets, model, prompts: dict, log: list, formats=FORMATS) -> list[Group]:
    """One `Group` per format: the full cache and `METHODS` at ``budgets``, in a cache of that format."""
    runs = policy_runs(budgets, policies=METHODS)
    out = []
    for f in formats:
        kv_format = None if f.dtype is None else PromptScales(f, model, prompts, log)
        out.append(Group(PAGE_SIZE, runs, False, kv_format, f.cache))
    return out


def _quest_run(model, prompt, c, longest, fmt: Format) -> QuestRun:
    """A `QuestRun` at budget ``c`` over a cache of format ``fmt`` (not calibrated: no prompt K/V here)."""
    if fmt.calibrated or fmt.cache is not None:
        raise ValueError(f"fmt: Quest runs on float32 or 8-bit pages with fixed or per-page scales, got {fmt.label!r}")
    kv_format = None if fmt.dtype is None else KVFormat(fmt.dtype, scales=fmt.scales)
    return QuestRun(model, prompt, c, longest, kv_format=kv_format)


def _read_step(run: QuestRun, token: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(log-probs, bytes)``: one step of ``run`` and the K/V, page-summary and page-scale bytes it read."""
    kv = run.session.kv
    scales = [t for layer in range(kv.num_layers) for t in kv.kv_scales(layer) if t is not None]
    with ReadCounter([*kv.k_cache, *kv.v_cache, *kv.summaries.k_min, *kv.summaries.k_max, *scales]) as reads:
        lp = run.step(token)
    return lp, reads.bytes


def quest_continuation(model, ids, n_ctx, first_scored, budgets, fmt: Format = FORMATS[0]):
    """Quest on a cache of format ``fmt``, one row per budget: NLL and KL(full || Quest) over the predictions
    of ``ids[n_ctx + first_scored:]``, the bytes it holds and those its last decode step read."""
    with torch.inference_mode():
        ref_lp = torch.log_softmax(model(ids.view(1, -1), use_cache=False).logits[0, n_ctx:-1].float(), -1)
    targets = ids[n_ctx + 1 :]  # fed token i predicts ids[n_ctx + i + 1]
    counted = torch.arange(targets.numel()) >= first_scored - 1  # [n_fed]
    n, rows = int(counted.sum()), []
    for c in budgets:
        run = _quest_run(model, ids[:n_ctx], c, ids.numel(), fmt)
        nll = kl = 0.0
        for i, token in enumerate(ids[n_ctx:-1]):
            if i == targets.numel() - 1:  # the longest step: count what it reads
                lp, read = _read_step(run, token)
            else:
                lp = run.step(token)
            if counted[i]:
                nll -= float(lp[targets[i]])
                kl += float((ref_lp[i].exp() * (ref_lp[i] - lp)).sum())
        rows.append(_quest_row(c, run, fmt, nll=nll / n, kl_vs_full=kl / n, bytes_read_per_step=read, scored_tokens=n))
        run.close()
    return rows


def _quest_row(c, run: QuestRun, fmt: Format, **extra) -> dict:
    kv = run.session.kv
    pages = len(kv.pages(run.seq))
    return dict(
        policy="quest", budget=c, page_size=PAGE_SIZE, page_bytes=kv.page_bytes, pages_held=pages,
        max_pages_held=pages, kv_bytes_held=pages * kv.page_bytes,
        **({} if fmt.dtype is None else {"kv_format": fmt.label}), **extra,
    )  # fmt: skip


def quest_passkey(model, tok, cfg, budgets, fmt: Format = FORMATS[0], answer_tokens: int = _ANSWER_TOKENS):
    """Quest on a cache of format ``fmt`` on the pass-key trials: the question fed one token at a time
    (Quest chooses pages at every step), then ``answer_tokens`` greedy tokens; one row per (trial, budget),
    with the bytes the last step read."""
    rows = []
    for trial in range(cfg["passkey_trials"]):
        depth = PASSKEY_DEPTHS[trial % len(PASSKEY_DEPTHS)]
        ctx, question, key, _, _ = passkey_prompt(tok, random.Random(1000 + trial), cfg["passkey_context"], depth)
        for c in budgets:
            run = _quest_run(model, ctx, c, ctx.numel() + question.numel() + answer_tokens, fmt)
            for token in question:
                lp = run.step(token)
            answer = []
            for j in range(answer_tokens):
                answer.append(lp.argmax())
                if j == answer_tokens - 1:  # the longest step: count what it reads
                    lp, read = _read_step(run, answer[-1])
                else:
                    lp = run.step(answer[-1])
            text = tok.decode(torch.stack(answer))
            row = _quest_row(c, run, fmt, bytes_read_per_step=read)
            rows.append(dict(row, trial=trial, key=key, answer=text, correct=answer_is_correct(text, key)))
            run.close()
    return rows


def _label(r) -> str:
    return r.get("kv_format", "float32")


def summarize(rows, task: str, shares: dict) -> list[dict]:
    """Per (method, format, budget): the bytes a sequence held at its peak (``bytes_per_seq``: the most
    pages, times ``page_bytes``, over the texts or trials), and the NLL's mean with its 95% t interval
    (``task`` "lm", "retention"; and ``dnll_vs_float32_full``, the mean over texts of its NLL minus the
    float32 full cache's on the same text, with its 95% t interval: paired) or the pass-key accuracy
    with its Wilson 95% interval ("passkey"). ``shares``: budget -> its share label."""
    base = {r["text"]: r["nll"] for r in rows if task != "passkey" and r["policy"] == "full" and _label(r) == "float32"}
    groups = {}
    for r in rows:
        groups.setdefault((r["policy"], _label(r), r["budget"]), []).append(r)
    out = []
    for (policy, fmt, c), rs in groups.items():
        row = dict(
            policy=policy,
            kv_format=fmt,
            budget=c,
            share="1" if c is None else shares[c],
            page_bytes=rs[0]["page_bytes"],
            bytes_per_seq=max(r["max_pages_held"] * r["page_bytes"] for r in rs),
            bytes_held_at_end=max(r["kv_bytes_held"] for r in rs),
        )
        if "bytes_read_per_step" in rs[0]:
            row["bytes_read_per_step"] = max(r["bytes_read_per_step"] for r in rs)
        if task == "passkey":
            n, k = len(rs), sum(r["correct"] for r in rs)
            row.update(trials=n, correct=k, accuracy=k / n, ci95=list(wilson(k, n)))
        else:
            nll, lo, hi = mean_ci([r["nll"] for r in rs])
            kl = sum(r["kl_vs_full"] for r in rs) / len(rs)
            row.update(texts=len(rs), nll=nll, nll_ci95=[lo, hi], ppl=math.exp(nll), kl_vs_full=kl)
            d, dlo, dhi = mean_ci([r["nll"] - base[r["text"]] for r in rs])
            row.update(dnll_vs_float32_full=d, dnll_ci95=[dlo, dhi])
        out.append(row)
    return out


def main(argv=None):
    parser = bench_parser("kvbytes", __doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (minutes on 2 cores)")
    size.add_argument("--smoke", action="store_true", help="toy sizes: checks the harness runs (the tests' run)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the stages an unfinished run of the same size measured in the result file; measure the rest",
    )
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "smoke" if args.smoke else "full"
    name = f"kv_bytes_{mode}.json"
    saved = _saved(Path(args.out) if args.out is not None else data_dir(), name) if args.resume else {}
    out = result_file(parser, args.out, name)  # checked before anything is measured (it writes an empty run)
    if saved:
        out.save(saved, complete=False)  # back on disk until this run saves its own
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, mode, out, {"quick": QUICK, "smoke": SMOKE, "full": FULL}[mode], saved)
    finally:
        torch.set_num_threads(threads)


_SAME = ("mode", "config", "budgets", "full_cache_tokens", "formats", "model")  # what a resumed run must share


def _saved(folder: Path, name: str) -> dict:
    """The unfinished run in ``folder / name`` (``{}`` if there is none or it measured nothing yet); a
    finished run is refused: resuming it would measure nothing."""
    path = folder / name
    saved = json.loads(path.read_text()) if path.is_file() and path.stat().st_size else {}
    if saved.get("complete"):
        raise SystemExit(f"--resume: {path} holds a finished run; move it away to measure again")
    return saved if saved.get("stage_seconds") else {}


def _resumed(saved: dict, result: dict) -> dict:
    """The measured part of ``saved`` (every stage it finished, their ``stage_seconds``, its calibrations,
    its environment) to carry on ``result``; a run of another size, budgets, formats or model is refused:
    its stages would not belong with this run's."""
    differ = [key for key in _SAME if saved.get(key) != result[key]]
    if differ:
        raise SystemExit(f"--resume: the unfinished run was measured with other {', '.join(differ)}")
    return {k: v for k, v in saved.items() if k not in _SAME and k != "complete"}


def _budgets(tokens: int) -> dict:
    """budget -> its share label, for a task whose full cache ends with ``tokens`` tokens."""
    return {share_budget(tokens, s): f"1/{s}" for s in SHARES}


def _run(args, mode, out, cfg, saved):
    start = time.perf_counter()
    log = stage_log()

    from ...models import load_smollm2

    model, tok = load_smollm2()
    log("model loaded")
    # the tokens each task's full cache ends with (its first text or trial)
    lm_tokens = cfg["context"] + cfg["continuation"]
    ret_tokens = ev.retention_ids(tok, cfg, 0)[0].numel()
    ctx, question, *_ = passkey_prompt(tok, random.Random(1000), cfg["passkey_context"], PASSKEY_DEPTHS[0])
    pk_tokens = ctx.numel() + question.numel() + _ANSWER_TOKENS
    budgets = dict(lm=_budgets(lm_tokens), retention=_budgets(ret_tokens), passkey=_budgets(pk_tokens))
    calibrations, prompts = [], {}
    result = dict(
        mode=mode,
        config=dict(cfg, page_size=PAGE_SIZE, shares=[f"1/{s}" for s in SHARES], quest_dense_layers=DENSE_LAYERS),
        budgets={task: [dict(budget=c, share=s) for c, s in b.items()] for task, b in budgets.items()},
        full_cache_tokens=dict(lm=lm_tokens, retention=ret_tokens, passkey=pk_tokens),
        formats=[
            dict(label=f.label, dtype=str(f.dtype or torch.float32), scales=f.scales, source=f.scale_source)
            | ({} if f.cache is None else dict(cache=f.cache.__name__, doc=" ".join(f.cache.__doc__.split())))
            for f in FORMATS
        ],
        bytes_basis=(
            "bytes as stored: page_bytes (K and V of every layer, 1 byte a value in 8-bit pages plus a float32 per "
            "page, KV head, K/V and layer with per-page scales; 4 bytes a value in float32 pages) times the most "
            "pages a sequence held (bfloat16 values: 2 bytes a value); per-layer scales (2 x layers float32) "
            "belong to the pool. Quest: held = the full cache's pages; bytes_read_per_step = K/V and "
            "page-summary bytes its last decode step read."
        ),
        sixteen_bit=(
            "16-bit: 'bfloat16 values' (Bf16ValuesCache) holds a bfloat16 cache's values in float32 pages and "
            "counts 2 bytes a value (its page_bytes); the model runs in float32, so no cache here stores bfloat16"
        ),
        environment=dict(environment(), torch_threads=args.threads),
        model="SmolLM2-135M-Instruct (GGUF, float32)",
        calibrations=calibrations,  # the calibrated per-layer scales, one entry per prompt and format
    )
    done = _resumed(saved, result) if saved else {}
    carried = sum(done.get("stage_seconds", {}).values())  # the earlier runs' stages, before this run adds its own
    if done:
        log(f"resuming {out.path}: {', '.join(done['stage_seconds'])} already measured")
        resumes = done.pop("resumes", []) + [dict(environment(), torch_threads=args.threads)]
        result.update(done, resumes=resumes)  # the stages' keys, seconds and calibrations; the first environment
        calibrations = result["calibrations"]
    stages = result.setdefault("stage_seconds", {})

    def stage(name, measure):
        if name in stages:
            return
        t0 = time.perf_counter()
        measure()
        stages[name] = round(time.perf_counter() - t0, 1)
        log(f"{name}: {stages[name]} s")
        out.save(result)

    def lm():
        groups = format_groups(budgets["lm"], model, prompts, calibrations)
        lm_rows, check, texts = ev.lm_task(model, tok, cfg, log, groups=groups)
        result.update(texts=texts, check_max_abs_logprob_diff=check, lm_rows=lm_rows)

    def lm_quest():
        lm_rows = result["lm_rows"]
        for t, info in enumerate(x for x in result["texts"] if x["used"]):
            ids = ev.lm_text_ids(tok, info["start_paragraph"], lm_tokens)
            for fmt in QUEST_FORMATS:
                rows = quest_continuation(model, ids, cfg["context"], 1, list(budgets["lm"]), fmt)
                lm_rows += [dict(r, text=t) for r in rows]
        result.update(language_modelling=summarize(lm_rows, "lm", budgets["lm"]))

    def retention():
        groups = format_groups(budgets["retention"], model, prompts, calibrations)
        ret_rows, ret_check, ret_texts = ev.retention_task(model, tok, cfg, log, groups=groups)
        for t in range(cfg["retention_texts"]):
            ids, n_ctx, opening, _ = ev.retention_ids(tok, cfg, t)
            for fmt in QUEST_FORMATS:
                rows = quest_continuation(model, ids, n_ctx, opening, list(budgets["retention"]), fmt)
                ret_rows += [dict(r, text=t) for r in rows]
        result.update(retention_texts=ret_texts, retention=summarize(ret_rows, "retention", budgets["retention"]))
        check = max(result["check_max_abs_logprob_diff"], ret_check)
        result.update(retention_rows=ret_rows, check_max_abs_logprob_diff=check)

    def passkey():
        groups = format_groups(budgets["passkey"], model, prompts, calibrations)
        result.update(passkey_rows=passkey_task(model, tok, cfg, log, groups=groups))

    def passkey_quest():
        pk_rows = result["passkey_rows"]
        for fmt in QUEST_FORMATS:
            pk_rows += quest_passkey(model, tok, cfg, list(budgets["passkey"]), fmt)
        result.update(passkey=summarize(pk_rows, "passkey", budgets["passkey"]))

    stage("language modelling", lm)
    stage("language modelling, quest", lm_quest)
    stage("retention", retention)
    stage("pass-key", passkey)
    stage("pass-key, quest", passkey_quest)
    result["seconds"] = round(time.perf_counter() - start + carried, 1)
    path = out.save(result, complete=True)
    print(f"\n{report.describe(result)}\n")
    print(report.bytes_table(result))
    print(f"\nwrote {path} ({result['seconds']} s)")
    return result


if __name__ == "__main__":
    main()
