"""KV eviction on SmolLM2-135M: perplexity, retention, pass-key retrieval, KV bytes and decode speed.

    python -m paged_ref.bench eviction [--quick | --smoke] [--out DIR]

One run measures, on the real model (`paged_ref.models.load_smollm2`, float32, CPU):

* Language modelling (plain continuation): ``texts`` passages of real English
  (`paged_ref.textdata`, CPython's documentation prose; a text whose continuation copies its
  context is skipped, see `copy_fraction`). A context of ``context`` tokens is prefilled with
  full attention, each policy evicts down to its budget C, then the next ``continuation``
  tokens are fed one at a time (teacher forcing) while the policy keeps evicting; per
  (policy, C, page size B): mean NLL per token over texts with a 95% t interval, perplexity,
  mean KL(full || policy) of the next-token distributions, pages and KV bytes held, and the
  tokens token-level eviction copies. This mostly measures recency. The same again at
  ``long_context`` tokens (4096; `LONG_POLICIES`, page size 16).
* Retention (`retention_example`): a passage, then other prose, then the passage's opening
  sentence again; the NLL of the passage's next tokens, which sit verbatim ~1000 tokens back.
  The full cache copies them, a recent window cannot: importance, not recency, decides.
  ``region_held`` says how much of the passage each policy still held.
* Pass-key retrieval: a random 5-digit key at fixed depths (`PASSKEY_DEPTHS`) in
  ``passkey_context`` tokens of filler, in SmolLM2's chat template. The context is prefilled and
  evicted first; the question arrives afterwards, token by token through the evicted cache (the
  policy cannot see it coming), then the model answers greedily. Accuracy with a Wilson 95%
  interval, and what of the key was still held when the answer began (`key_evidence`).
* Speed: time per output token and tokens/s at each of ``speed_contexts`` and ``speed_batches``,
  hooks included, median of interleaved rounds, as ratios to the full cache in the same run.
* The tokens the layer-averaged ||V||/||K|| ranks lowest in the first text (`lowest_ratio_tokens`).

Policies (`paged_ref.eviction.make_policy`): full; paged_eviction (||V||/||K||, page eviction,
the first and the newest page reserved, as the authors' code runs it); paged_eviction_literal
(the paper's text: page 0 not reserved); both with per-layer decisions (``*_per_layer``, on a
`paged_ref.layered_cache.LayeredKVCache`); the same page eviction scored by inverse_key_norm,
value_norm, key_norm, key_value_ratio (the authors' vLLM code's swapped score) or random (the
reviewers' ablation: only the score changes); streaming_llm; token_topk (token-level,
||V||/||K||) and token_inverse_key_norm (token-level 1/||K||, the paper's baseline).

Everything runs through `paged_ref.hf.PagedSession` (sdpa backend), the engine under
`paged_ref.hf.generate`: the prompt is prefilled once per cache, then `PagedSession.fork` gives
one sequence per (policy, budget), each under its own policy, and the sequences of one page size
decode together, one forward per step (per-layer policies on a `LayeredKVCache` of their own).
The full-cache sequence's log-probs are checked against the model's own forward over the whole
text (``check_max_abs_logprob_diff`` in the JSON). Results: ``figures/data/eviction_{quick,full}.json``
(``--smoke``: ``eviction_smoke.json``, toy sizes that only show the harness runs) and the tables
printed; notebook 07 draws the figures from the JSON (`paged_ref.viz.eviction`). The engine
(`paged_ref.bench._eviction_runs`) and the pass-key task (`paged_ref.bench._eviction_passkey`) are
modules of their own; this one holds the configurations, the other tasks and the command.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from ..stats import mean_ci
from . import eviction_report as report
from ._eviction_passkey import (
    PASSKEY_DEPTHS,
    answer_is_correct,
    key_evidence,
    passkey_prompt,
    passkey_task,
    summarize_passkey,
)
from ._eviction_runs import (
    PER_LAYER,
    POLICIES,
    TOKEN_LEVEL,
    VARIANTS,
    close_all,
    lowest_ratio_tokens,
    policy_groups,
    policy_runs,
    prefilled_batch,
)
from ._eviction_speed import SPEED_POLICIES, speed_task
from .common import bench_parser, environment, result_file

__all__ = [  # the passkey pieces and the policy lists live in their own modules; named here too
    "FULL",
    "LONG_POLICIES",
    "PASSKEY_DEPTHS",
    "PER_LAYER",
    "POLICIES",
    "QUICK",
    "SMOKE",
    "SPEED_POLICIES",
    "TOKEN_LEVEL",
    "VARIANTS",
    "answer_is_correct",
    "key_evidence",
    "lm_task",
    "main",
    "passkey_prompt",
    "passkey_task",
    "policy_runs",
    "retention_task",
    "score_continuation",
    "speed_task",
    "summarize_lm",
    "summarize_passkey",
]

# the long-context continuation: the method as run and as written, per layer, the paper's baselines
LONG_POLICIES = [
    "full",
    "paged_eviction",
    "paged_eviction_literal",
    "paged_eviction_per_layer",
    "inverse_key_norm",
    "streaming_llm",
    "token_inverse_key_norm",
]
QUICK = dict(
    texts=1,
    text_stride=150,
    context=384,
    continuation=33,
    long_context=512,
    long_texts=1,
    long_text_stride=150,
    budgets=[128],
    page_sizes=[16],
    retention_texts=1,
    retention_passage=192,
    retention_other=160,
    retention_scored=24,
    passkey_trials=2,
    passkey_context=300,
    passkey_budgets=[128],
    speed_contexts=[384],
    speed_batches=[1],
    speed_steps=6,
    speed_rounds=1,
    speed_budget=128,
)
# every task and policy at toy sizes, in seconds: the harness check the tests run (numbers meaningless)
SMOKE = dict(
    QUICK,
    context=160,
    continuation=9,
    long_context=224,
    budgets=[64],
    retention_passage=64,
    retention_other=64,
    retention_scored=8,
    passkey_trials=1,
    passkey_context=160,
    passkey_budgets=[64],
    speed_contexts=[160],
    speed_steps=3,
    speed_budget=64,
)
FULL = dict(
    texts=8,
    text_stride=30,
    context=2048,
    continuation=128,
    long_context=4096,  # SmolLM2-135M takes 8192 positions
    long_texts=8,
    long_text_stride=60,  # 8 texts of ~3300 words from ~23,000 words of prose: contexts overlap a little
    budgets=[128, 256, 512, 1024],
    page_sizes=[16, 32],
    retention_texts=8,
    retention_passage=1024,
    retention_other=1024,
    retention_scored=128,
    passkey_trials=20,
    passkey_context=1100,  # SmolLM2-135M retrieves the key at ~1100 tokens; at ~2000 the full cache fails
    passkey_budgets=[128, 256, 512, 1024],
    speed_contexts=[2048, 4096],
    speed_batches=[1, 8],
    speed_steps=33,
    speed_rounds=3,
    speed_budget=256,
)
MAX_COPIED = 0.05  # skip texts whose continuation repeats more than this fraction of context 8-grams


# ----------------------------------------------------------------------------- scoring a continuation
def score_continuation(model, ids, n_ctx, first_scored, groups, log, label, region=None):
    """Every policy's NLL on the end of one text, in rows (one per policy, budget and page size).

    ``ids[:n_ctx]`` is prefilled with full attention and each policy evicts down to its budget;
    then ``ids[n_ctx:-1]`` are fed one token at a time (teacher forcing) while the policies keep
    evicting, and the NLL per token is averaged over the tokens ``ids[n_ctx + first_scored:]``
    (``first_scored=1``: the whole continuation but its first token, which the prefill itself
    predicts, the same for all). KL(full || policy) is averaged over the same predictions.

    ``groups``: the batches to run (`policy_groups`). ``region=(lo, hi)``: each row also gets
    ``region_held``, the share of the context tokens ``lo .. hi-1`` a policy held after its
    prefill eviction (per-layer: the mean over layers).

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
    # page-granular policies feed chunks; token-level policies act after every token, so they run apart
    rows, check = [], math.nan
    for ps, runs, per_layer in groups:
        t0 = time.perf_counter()
        batch = prefilled_batch(model, ids[:n_ctx], runs, ps, ids.numel(), per_layer)
        held = [batch.region_held(i, region) for i in range(len(runs))] if region else [None] * len(runs)
        nll = torch.zeros(len(runs))
        kl = torch.zeros(len(runs))
        for i, lp in batch.feed(ids[n_ctx:-1]):  # lp: [batch, m, vocab]
            m = lp.shape[1]
            w = counted[i : i + m]  # [m]
            nll -= (lp[:, torch.arange(m), targets[i : i + m]] * w).sum(1)
            ref = ref_lp[i : i + m]  # [m, vocab]
            kl += ((ref.exp() * (ref - lp)).sum(-1) * w).sum(-1)  # KL(full || policy)
        if runs[0][0] == "full":
            full_nll = -(ref_lp.gather(1, targets[:, None])[:, 0] * counted).sum()
            check = float((nll[0] - full_nll).abs()) / n_scored
        for i in range(len(runs)):
            row = batch.row(i)
            row.update(nll=float(nll[i]) / n_scored, kl_vs_full=float(kl[i]) / n_scored, scored_tokens=n_scored)
            if region:
                row["region_held"] = held[i]
            rows.append(row)
        close_all(batch)
        log(
            f"{label}, page size {ps}: {len(runs)} sequences x {targets.numel()} tokens in "
            f"{time.perf_counter() - t0:.1f} s"
            + (f"; full-cache |NLL - model| {check:.2e}" if runs[0][0] == "full" else "")
        )
    return rows, check


# ----------------------------------------------------------------------------- language modelling
def lm_task(model, tok, cfg, log, long: bool = False):
    """Plain continuation of real prose: ``texts`` passages of ``context + continuation`` tokens.

    Mostly a measure of recency: the next sentence of prose depends on the last few hundred
    tokens and on the attention sink, so a recent window does well here. ``long=True``: the same
    at ``long_context`` tokens (``long_texts`` texts, ``long_text_stride``), `LONG_POLICIES` at
    the first page size.
    """
    from ..textdata import paragraphs

    rows, checks, texts = [], [], []
    n_cont = cfg["continuation"]
    if long:
        n_ctx, n_texts, stride = cfg["long_context"], cfg["long_texts"], cfg["long_text_stride"]
        groups = policy_groups(cfg["budgets"], cfg["page_sizes"][:1], LONG_POLICIES)
    else:
        n_ctx, n_texts, stride = cfg["context"], cfg["texts"], cfg["text_stride"]
        groups = policy_groups(cfg["budgets"], cfg["page_sizes"])
    label = "long text" if long else "text"
    starts = iter(range(0, len(paragraphs(20)), stride))  # distinct passages, far apart
    while sum(x["used"] for x in texts) < n_texts:
        start = next(starts, None)
        if start is None:
            raise RuntimeError(f"fewer than {n_texts} passages without copying: {texts}")
        ids = _lm_text_ids(tok, start, n_ctx + n_cont)
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


# ----------------------------------------------------------------------------- retention
def retention_example(tok, start_a: int, start_b: int, cfg):
    """``(ids, n_ctx, first_scored, info)``: passage A, other prose B, then A's opening again.

    The context is A's first ``retention_passage`` tokens followed by ``retention_other`` tokens
    of B (another topic); then A's opening sentence is repeated and the next
    ``retention_scored`` tokens of A are scored. They are in the context verbatim, ~1000 tokens
    back: the full cache copies them (induction), a recent window holds only B, and a score that
    kept A's pages can copy them too. Importance, not recency, decides.
    """
    from ..textdata import english_text

    n_a, n_b, n_score = cfg["retention_passage"], cfg["retention_other"], cfg["retention_scored"]
    text_a = english_text(int(n_a * 1.2), start=start_a)
    enc = tok(text_a, add_special_tokens=False, return_offsets_mapping=True)
    a = torch.tensor(enc["input_ids"][:n_a])
    first_sentence_end = text_a.index(". ") + 1
    opening = sum(1 for _, end in enc["offset_mapping"] if end <= first_sentence_end)  # tokens of sentence 1
    if not 0 < opening < n_a - n_score:
        raise ValueError(f"passage at paragraph {start_a}: opening sentence of {opening} tokens does not fit")
    b = tok(english_text(int(n_b * 1.2), start=start_b), return_tensors="pt", add_special_tokens=False).input_ids[0]
    b = b[:n_b]
    assert a.numel() == n_a and b.numel() == n_b, f"passages at paragraphs {start_a}, {start_b} are too short"
    repeat = a[: opening + n_score]  # A's opening sentence, then the tokens scored
    ids = torch.cat([a, b, repeat])  # [n_a + n_b + opening + n_score]
    info = dict(
        start_paragraph=start_a,
        other_paragraph=start_b,
        opening_tokens=opening,
        scored_tokens=n_score,
        scored_8grams_in_other=copy_fraction(torch.cat([b, repeat[opening:]]), n_b),
    )
    return ids, n_a + n_b, opening, info


def retention_task(model, tok, cfg, log):
    from ..textdata import paragraphs

    n = len(paragraphs(20))
    rows, checks, texts = [], [], []
    for t in range(cfg["retention_texts"]):
        start_a = (t * cfg["text_stride"] + cfg["text_stride"] // 2) % n
        ids, n_ctx, opening, info = retention_example(tok, start_a, (start_a + n // 2) % n, cfg)
        text_rows, check = score_continuation(
            model,
            ids,
            n_ctx,
            opening,
            policy_groups(cfg["budgets"], cfg["page_sizes"]),
            log,
            f"retention text {t}",
            region=(0, cfg["retention_passage"]),
        )
        rows += [dict(r, text=t) for r in text_rows]
        checks.append(check)
        texts.append(info)
    return rows, max(checks), texts


def copy_fraction(ids: torch.Tensor, n_ctx: int, n: int = 8) -> float:
    """Fraction of the continuation's token n-grams that also occur in the context.

    CPython's documentation repeats whole paragraphs across topics; a continuation copied from
    its context measures copying (retrieval), not language modelling, so such texts are skipped.

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


# ----------------------------------------------------------------------------- main
def main(argv=None):
    parser = bench_parser("eviction", __doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (~1 min on 2 cores; notebook 07's quick mode)")
    size.add_argument("--smoke", action="store_true", help="toy sizes: checks the harness runs (the tests' run)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared 2-core machine, multi-threaded small ops "
        "stall waiting for a busy core; measured 1.05 s vs 0.16 s per decode step)",
    )
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "smoke" if args.smoke else "full"
    out = result_file(parser, args.out, f"eviction_{mode}.json")  # checked before anything is measured
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, mode, out)
    finally:
        torch.set_num_threads(threads)


def _run(args, mode, out):
    cfg = {"quick": QUICK, "smoke": SMOKE, "full": FULL}[mode]
    start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - start:7.1f} s] {msg}", flush=True)

    from ..models import load_smollm2

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
        lowest_ratio_tokens=lowest_ratio_tokens(model, tok, _lm_text_ids(tok, first_text, cfg["context"])),
        seconds=round(time.perf_counter() - start, 1),
    )
    lowest = result["lowest_ratio_tokens"]
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
    print(f"\nlowest ||V||/||K|| tokens of text 0: {lowest['lowest_token_counts']}")
    print(f"\nwrote {path} ({result['seconds']} s)")
    return result


def _lm_text_ids(tok, start: int, n: int) -> torch.Tensor:
    """The first ``n`` tokens of the language-modelling text at paragraph ``start``."""
    from ..textdata import english_text

    text = english_text(int(n * 1.2), start=start)
    return tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0][:n]


if __name__ == "__main__":
    main()
