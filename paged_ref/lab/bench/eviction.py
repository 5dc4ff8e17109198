"""KV eviction on SmolLM2-135M: perplexity, retention, pass-key retrieval, KV bytes and decode speed.

    python -m paged_ref.lab.bench eviction [--quick | --smoke] [--out DIR] [--threads N]

Every policy of `POLICIES` (PagedEviction as run and as written, shared and per layer, its score
ablations, StreamingLLM, token-level baselines, the full cache) runs on SmolLM2 (float32, CPU) through
`paged_ref.hf.PagedSession` (sdpa): a prompt is prefilled once, `PagedSession.fork` gives one sequence
per (policy, budget C) that evicts down to C, and those of one page size B decode together. The full
cache's log-probs are checked against the model's own forward over the text.

* Language modelling: ``context`` tokens of prose prefilled and evicted, then ``continuation``
  tokens fed one at a time (teacher forcing) while the policy keeps evicting: mean NLL per token
  over ``texts`` with a 95% t interval, perplexity, KL(full || policy), pages and KV bytes held;
  again at ``long_context`` tokens. Texts whose continuation copies their context are skipped.
* Retention: a passage, other prose, then the passage's opening sentence again; the NLL of the
  passage's next tokens, which are in the context verbatim.
* Pass-key: a 5-digit key at fixed depths in filler; the question is fed through the evicted
  cache, then the model answers greedily: accuracy (Wilson 95% interval), what of the key was held.
* Speed: time per output token and tokens/s, hooks included; rounds interleave the policies and
  the median over rounds is compared with the full cache of the same run, of the medians and as the
  median of the per-round ratios (`speed_vs_full`: each against the full cache's run of the same round).
* The tokens the layer-averaged ||V||/||K|| ranks lowest in the first text.

Results: ``figures/data/eviction_{quick,full,smoke}.json`` (smoke: toy sizes, only a harness check)
and the tables printed; notebook 07 draws them.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from ..stats import mean_ci
from ..textdata import english_text, paragraphs
from . import _eviction_runs as engine
from . import eviction_report as report
from ._eviction_passkey import answer_is_correct, passkey_task, summarize_passkey
from ._eviction_runs import PER_LAYER, POLICIES, TOKEN_LEVEL, policy_groups, policy_runs
from .common import bench_parser, environment, paired_ratio, result_file, stage_log

__all__ = ["FULL", "LONG_POLICIES", "QUICK", "SMOKE", "SPEED_POLICIES", "lm_task", "main", "retention_task"]
__all__ += ["lm_text_ids", "retention_ids", "score_continuation", "speed_task", "summarize_lm"]
__all__ += ["PER_LAYER", "POLICIES", "TOKEN_LEVEL", "answer_is_correct", "policy_runs"]  # from its parts

# the long-context continuation: the method as run and as written, per layer; the paper's baselines
LONG_POLICIES = ["full", "paged_eviction", "paged_eviction_literal", "paged_eviction_per_layer"]
LONG_POLICIES += ["inverse_key_norm", "streaming_llm", "token_inverse_key_norm"]
# the ablations run paged_eviction's code at the same cost
SPEED_POLICIES = ["full", "paged_eviction", "paged_eviction_per_layer", "streaming_llm", *TOKEN_LEVEL]
# each setting as (quick, smoke, full): quick is notebook 07's small run; smoke runs every task and
# policy at toy sizes in seconds, the tests' harness check (its numbers mean nothing)
_SIZES = dict(
    texts=(1, 1, 8),
    text_stride=(150, 150, 30),
    context=(384, 160, 2048),
    continuation=(33, 9, 128),
    long_context=(512, 224, 4096),  # SmolLM2-135M takes 8192 positions
    long_texts=(1, 1, 8),
    long_text_stride=(150, 150, 60),  # full: 8 texts of ~3300 words from ~23,000 words, overlapping a little
    budgets=([128], [64], [128, 256, 512, 1024]),
    page_sizes=([16], [16], [16, 32]),
    retention_texts=(1, 1, 8),
    retention_passage=(192, 64, 1024),
    retention_other=(160, 64, 1024),
    retention_scored=(24, 8, 128),
    passkey_trials=(2, 1, 20),
    passkey_context=(300, 160, 1100),  # SmolLM2-135M retrieves the key at ~1100 tokens, not at ~2000
    passkey_budgets=([128], [64], [128, 256, 512, 1024]),
    speed_contexts=([384], [160], [2048, 4096]),
    speed_batches=([1], [1], [1, 8]),
    speed_steps=(6, 3, 33),
    speed_rounds=(1, 1, 3),
    speed_budget=(128, 64, 256),
)
QUICK, SMOKE, FULL = ({key: values[i] for key, values in _SIZES.items()} for i in range(3))
MAX_COPIED = 0.05  # skip texts whose continuation repeats more than this fraction of context 8-grams


def score_continuation(model, ids, n_ctx, first_scored, groups, log, label, region=None):
    """Every policy's NLL on one text, one row per (policy, budget, page size): ``ids[:n_ctx]``
    prefilled and evicted, ``ids[n_ctx:-1]`` fed one by one, NLL and KL(full || policy) averaged
    over the predictions of ``ids[n_ctx + first_scored:]``. ``region=(lo, hi)``: rows also get
    ``region_held``, the share of context tokens ``lo .. hi-1`` held after the prefill eviction.

    Returns:
        ``(rows, check)``: ``check`` is the full cache's mean |NLL - the model's own forward|.
    """
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = model(ids.view(1, -1), use_cache=False).logits[0].float()  # the model's own forward [n, vocab]
    log(f"{label}: the model's forward over {ids.numel()} tokens in {time.perf_counter() - t0:.1f} s")
    ref_lp = torch.log_softmax(logits[n_ctx:-1], -1)  # [n_fed, vocab], the full cache's
    targets = ids[n_ctx + 1 :]  # [n_fed]: fed token i predicts ids[n_ctx + i + 1]
    counted = (torch.arange(targets.numel()) >= first_scored - 1).float()  # [n_fed]
    n_scored = int(counted.sum())
    rows, check = [], math.nan
    for group in groups:
        t0 = time.perf_counter()
        runs, floating = group.runs, group.kv_format is None and group.cache is None
        batch = engine.group_batch(model, ids[:n_ctx], group, ids.numel())
        held = [{"region_held": batch.region_held(i, region)} if region else {} for i in range(len(runs))]
        nll, kl = torch.zeros(len(runs)), torch.zeros(len(runs))
        for i, lp in batch.feed(ids[n_ctx:-1]):  # lp: [batch, m, vocab]
            m = lp.shape[1]
            w = counted[i : i + m]  # [m]
            nll -= (lp[:, torch.arange(m), targets[i : i + m]] * w).sum(1)
            ref = ref_lp[i : i + m]  # [m, vocab]
            kl += ((ref.exp() * (ref - lp)).sum(-1) * w).sum(-1)  # KL(full || policy)
        if runs[0][0] == "full" and floating:
            full_nll = -(ref_lp.gather(1, targets[:, None])[:, 0] * counted).sum()
            check = float((nll[0] - full_nll).abs()) / n_scored
        for i in range(len(runs)):
            nll_i, kl_i = float(nll[i]) / n_scored, float(kl[i]) / n_scored
            rows.append(dict(batch.row(i), nll=nll_i, kl_vs_full=kl_i, scored_tokens=n_scored, **held[i]))
        engine.close_session(batch.session)
        full = f"; full-cache |NLL - model| {check:.2e}" if runs[0][0] == "full" and floating else ""
        took = f"{len(runs)} sequences x {targets.numel()} tokens in {time.perf_counter() - t0:.1f} s"
        fmt = "" if batch.format_label is None else f" ({batch.format_label})"
        log(f"{label}, page size {group.page_size}{fmt}: {took}{full}")
    return rows, check


def lm_task(model, tok, cfg, log, long: bool = False, groups=None):
    """``(rows, check, texts)``: `score_continuation` on ``texts`` passages (``long=True``: ``long_texts``
    at ``long_context``, `LONG_POLICIES` at the first page size), the largest check, every passage tried.
    ``groups``: these batches instead of every policy's."""
    rows, checks, texts = [], [], []
    n_cont = cfg["continuation"]
    if long:
        n_ctx, n_texts, stride = cfg["long_context"], cfg["long_texts"], cfg["long_text_stride"]
        groups = groups or policy_groups(cfg["budgets"], cfg["page_sizes"][:1], LONG_POLICIES)
    else:
        n_ctx, n_texts, stride = cfg["context"], cfg["texts"], cfg["text_stride"]
        groups = groups or policy_groups(cfg["budgets"], cfg["page_sizes"])
    label = "long text" if long else "text"
    starts = iter(range(0, len(paragraphs(20)), stride))  # distinct passages, far apart
    while sum(x["used"] for x in texts) < n_texts:
        start = next(starts, None)
        if start is None:
            raise RuntimeError(f"fewer than {n_texts} passages without copying: {texts}")
        ids = lm_text_ids(tok, start, n_ctx + n_cont)
        assert ids.numel() == n_ctx + n_cont, f"text at paragraph {start} has only {ids.numel()} tokens"
        copied = copy_fraction(ids, n_ctx)
        texts.append(dict(start_paragraph=start, copied_8grams=copied, used=copied <= MAX_COPIED))
        if copied > MAX_COPIED:
            log(f"text at paragraph {start} skipped: {copied:.0%} of its continuation's 8-grams are in its context")
            continue
        t = sum(x["used"] for x in texts) - 1  # index among the texts used
        text_rows, check = score_continuation(model, ids, n_ctx, 1, groups, log, f"{label} {t}")
        rows += [dict(r, text=t) for r in text_rows]
        checks.append(check)
    return rows, max(checks), texts


def retention_ids(tok, cfg, t: int) -> tuple[torch.Tensor, int, int, dict]:
    """Retention text ``t``: ``(ids, n_ctx, opening, info)``: ``retention_passage`` tokens of a passage A,
    ``retention_other`` of other prose B (``n_ctx`` tokens in all), then A's opening sentence again
    (``opening`` tokens) and the ``retention_scored`` tokens of A that follow it (in the context verbatim)."""
    n = len(paragraphs(20))
    n_a, n_b, n_score = cfg["retention_passage"], cfg["retention_other"], cfg["retention_scored"]
    start_a = (t * cfg["text_stride"] + cfg["text_stride"] // 2) % n
    start_b = (start_a + n // 2) % n
    text_a = english_text(int(n_a * 1.2), start=start_a)
    enc = tok(text_a, add_special_tokens=False, return_offsets_mapping=True)
    a = torch.tensor(enc["input_ids"][:n_a])
    first_sentence_end = text_a.index(". ") + 1
    opening = sum(1 for _, end in enc["offset_mapping"] if end <= first_sentence_end)  # tokens of sentence 1
    if not 0 < opening < n_a - n_score:
        raise ValueError(f"passage at paragraph {start_a}: opening sentence of {opening} tokens does not fit")
    b = lm_text_ids(tok, start_b, n_b)
    assert a.numel() == n_a and b.numel() == n_b, f"passages at paragraphs {start_a}, {start_b} are too short"
    repeat = a[: opening + n_score]  # A's opening sentence, then the tokens scored
    info = dict(
        start_paragraph=start_a,
        other_paragraph=start_b,
        opening_tokens=opening,
        scored_tokens=n_score,
        scored_8grams_in_other=copy_fraction(torch.cat([b, repeat[opening:]]), n_b),
    )
    return torch.cat([a, b, repeat]), n_a + n_b, opening, info  # ids: [n_a + n_b + opening + n_score]


def retention_task(model, tok, cfg, log, groups=None):
    """``(rows, check, texts)`` as `lm_task`, for ``retention_texts`` texts of `retention_ids`; the share
    of passage A each policy holds after the prefill eviction is recorded as ``region_held``."""
    groups = groups or policy_groups(cfg["budgets"], cfg["page_sizes"])
    rows, checks, texts = [], [], []
    for t in range(cfg["retention_texts"]):
        ids, n_ctx, opening, info = retention_ids(tok, cfg, t)
        text_rows, check = score_continuation(
            model, ids, n_ctx, opening, groups, log, f"retention text {t}", (0, cfg["retention_passage"])
        )
        rows += [dict(r, text=t) for r in text_rows]
        checks.append(check)
        texts.append(info)
    return rows, max(checks), texts


def copy_fraction(ids: torch.Tensor, n_ctx: int, n: int = 8) -> float:
    """Fraction of the continuation's token n-grams that also occur in the context (copying, not
    language modelling: CPython's documentation repeats whole paragraphs).

    Example:
        >>> copy_fraction(torch.tensor([1, 2, 3, 1, 2, 3]), 3, n=2)
        1.0
    """
    ctx = ids[:n_ctx].tolist()
    cont = ids[n_ctx:].tolist()
    seen = {tuple(ctx[i : i + n]) for i in range(len(ctx) - n + 1)}
    grams = [tuple(cont[i : i + n]) for i in range(len(cont) - n + 1)]
    return sum(g in seen for g in grams) / max(1, len(grams))


def summarize_lm(rows):
    """Per (policy, budget, page size): mean over texts of NLL and KL, a 95% t interval of the
    mean NLL, and perplexity = exp(mean NLL) with the interval's ends exponentiated likewise."""
    groups = {}
    for r in rows:
        groups.setdefault((r["policy"], r["budget"], r["page_size"]), []).append(r)
    out = []
    for (policy, c, ps), rs in groups.items():
        nll, lo, hi = mean_ci([r["nll"] for r in rs])
        out.append(
            dict(
                policy=policy,
                budget=c,
                page_size=ps,
                texts=len(rs),
                nll=nll,
                nll_ci95=[lo, hi],
                ppl=math.exp(nll),
                ppl_ci95=[math.exp(lo), math.exp(hi)],
                kl_vs_full=statistics.fmean(r["kl_vs_full"] for r in rs),
                max_pages_held=max(r["max_pages_held"] for r in rs),
                page_bound=rs[0]["page_bound"],
                kv_bytes_held=max(r["kv_bytes_held"] for r in rs),
                tokens_moved=sum(r["tokens_moved"] for r in rs),
                max_holes_per_page=max(r["max_holes_per_page"] for r in rs),
            )
        )
        if "region_held" in rs[0]:
            out[-1]["region_held"] = statistics.fmean(r["region_held"] for r in rs)
    return out


def speed_vs_full(seconds, full_seconds) -> dict:
    """A policy's seconds per decode step against the full cache's, round by round (the policies take turns
    in each round): ``time_per_token_vs_full_paired`` (the median of ``seconds / full_seconds`` per round)
    and ``ratio_vs_full_paired`` (of tokens/s: the median of ``full_seconds / seconds``).

    Example:
        >>> speed_vs_full([2.0, 1.0, 4.0], [4.0, 4.0, 4.0])
        {'time_per_token_vs_full_paired': 0.5, 'ratio_vs_full_paired': 2.0}
    """
    if len(seconds) != len(full_seconds) or not seconds:
        raise ValueError(f"seconds and full_seconds must pair up round by round, got {seconds} and {full_seconds}")
    return {
        "time_per_token_vs_full_paired": paired_ratio(seconds, full_seconds),
        "ratio_vs_full_paired": paired_ratio(full_seconds, seconds),
    }


def speed_task(model, tok, cfg, log):
    """Per (context n, batch b), B = 16: b forks of one n-token prompt (prefilled once per n and cache
    type) decode ``speed_steps`` tokens under one policy, the first a warm-up; each round runs every
    policy of `SPEED_POLICIES` in turn; the median over rounds, against the full cache."""
    steps = cfg["speed_steps"]
    text = english_text(int(max(cfg["speed_contexts"]) * 1.3), start=7)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    run = {name: policy_runs([cfg["speed_budget"]], only=(name,))[0] for name in SPEED_POLICIES}
    out = []
    for n in cfg["speed_contexts"]:
        roots = {}  # per_layer -> (session, root): the prompt prefilled once per cache type
        for per_layer in (False, True):
            runs = [run[x] for x in SPEED_POLICIES if (x in PER_LAYER) == per_layer]
            pages = max(engine.pool_pages([r] * max(cfg["speed_batches"]), 16, n + steps) for r in runs)
            roots[per_layer] = engine.prefilled_root(model, ids[:n], 16, pages, per_layer)
        for batch_size in cfg["speed_batches"]:
            times, held = {name: [] for name in SPEED_POLICIES}, {}
            for _ in range(cfg["speed_rounds"]):
                for name in SPEED_POLICIES:
                    batch = engine.Batch(*roots[name in PER_LAYER], [run[name]] * batch_size)
                    batch.step(ids[n : n + 1].expand(batch_size))  # warm-up
                    t0 = time.perf_counter()
                    for j in range(1, steps):
                        batch.step(ids[n + j : n + j + 1].expand(batch_size))
                    times[name].append((time.perf_counter() - t0) / (steps - 1))  # seconds per decode step
                    held[name] = batch.row(0)["kv_bytes_held"]
                    batch.close()
            full = statistics.median(times["full"])
            for name in SPEED_POLICIES:
                step = statistics.median(times[name])
                out.append(
                    dict(
                        policy=name,
                        budget=run[name][2],
                        page_size=16,
                        context=n,
                        batch=batch_size,
                        ms_per_token=1e3 * step,
                        tokens_per_s=batch_size / step,
                        tokens_per_s_rounds=[batch_size / t for t in times[name]],
                        ratio_vs_full=full / step,
                        time_per_token_vs_full=step / full,
                        **speed_vs_full(times[name], times["full"]),
                        kv_bytes_held=held[name],
                    )
                )
            log(f"speed at context {n}, batch {batch_size}: full {batch_size / full:.2f} tokens/s")
        for session, _ in roots.values():
            engine.close_session(session)
    return out


def main(argv=None):
    parser = bench_parser("eviction", __doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (~1 min on 2 cores; notebook 07's quick mode)")
    size.add_argument("--smoke", action="store_true", help="toy sizes: checks the harness runs (the tests' run)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: threaded small ops stall on busy cores)"
    )
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "smoke" if args.smoke else "full"
    out = result_file(parser, args.out, f"eviction_{mode}.json")  # checked before anything is measured
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, mode, out, {"quick": QUICK, "smoke": SMOKE, "full": FULL}[mode])
    finally:
        torch.set_num_threads(threads)


def _run(args, mode, out, cfg):
    start = time.perf_counter()
    log = stage_log()

    from ...models import load_smollm2

    model, tok = load_smollm2()
    log("model loaded")
    result = dict(
        mode=mode,
        config=cfg,
        environment=dict(environment(), torch_threads=args.threads),
        model="SmolLM2-135M-Instruct (GGUF, float32)",
    )
    # each task's rows and summary are saved as soon as it finishes: a run killed later keeps them
    lm_rows, check, texts = lm_task(model, tok, cfg, log)
    result.update(texts=texts, language_modelling=summarize_lm(lm_rows), lm_rows=lm_rows)
    out.save(result)
    long_rows, long_check, long_texts = lm_task(model, tok, cfg, log, long=True)
    result.update(long_context_texts=long_texts, long_context=summarize_lm(long_rows), long_context_rows=long_rows)
    out.save(result)
    ret_rows, ret_check, ret_texts = retention_task(model, tok, cfg, log)
    result.update(retention_texts=ret_texts, retention=summarize_lm(ret_rows), retention_rows=ret_rows)
    out.save(result)
    pk_rows = passkey_task(model, tok, cfg, log)
    result.update(passkey=summarize_passkey(pk_rows), passkey_rows=pk_rows)
    out.save(result)
    result["speed"] = speed_task(model, tok, cfg, log)
    out.save(result)
    first_text = next(t["start_paragraph"] for t in texts if t["used"])
    result.update(
        check_max_abs_logprob_diff=max(check, long_check, ret_check),
        lowest_ratio_tokens=engine.lowest_ratio_tokens(model, tok, lm_text_ids(tok, first_text, cfg["context"])),
        seconds=round(time.perf_counter() - start, 1),
    )
    path = out.save(result, complete=True)

    print(
        f"\nLanguage modelling: {cfg['texts']} text(s), context {cfg['context']}, continuation "
        f"{cfg['continuation']} tokens (NLL over the last {cfg['continuation'] - 1}); full-cache check "
        f"max |log p - model| = {result['check_max_abs_logprob_diff']:.2e}"
    )
    print(report.lm_table(result))
    print(
        f"\nLong context: {cfg['long_texts']} text(s), context {cfg['long_context']}, the same continuation, "
        f"B = {cfg['page_sizes'][0]}"
    )
    print(report.lm_table(result, task="long_context"))
    print(
        f"\nRetention: {cfg['retention_texts']} text(s): {cfg['retention_passage']} tokens of a passage, "
        f"{cfg['retention_other']} of other prose, the passage's opening sentence again; NLL of the next "
        f"{cfg['retention_scored']} tokens of the passage"
    )
    print(report.lm_table(result, task="retention"))
    print(f"\nPass-key retrieval: {cfg['passkey_trials']} trials, ~{cfg['passkey_context']} context tokens, B = 16")
    print(report.passkey_table(result))
    print(f"\nDecode speed (B = 16, C = {cfg['speed_budget']}, median of {cfg['speed_rounds']} rounds)")
    print(report.speed_table(result))
    print(f"\nlowest ||V||/||K|| tokens of text 0: {result['lowest_ratio_tokens']['lowest_token_counts']}")
    print(f"\nwrote {path} ({result['seconds']} s)")
    return result


def lm_text_ids(tok, start: int, n: int) -> torch.Tensor:
    """``[n]`` token ids of English prose from paragraph ``start`` on."""
    text = english_text(int(n * 1.2), start=start)
    return tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0][:n]


if __name__ == "__main__":
    main()
