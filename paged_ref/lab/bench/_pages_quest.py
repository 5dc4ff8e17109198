"""`bench pages`, the Quest half: Quest beside PagedEviction and StreamingLLM on notebook 07's tasks
(continuation, retention, pass-key) and the bytes one decode step of each reads."""

from __future__ import annotations

import math
import random
import statistics
import time

import torch

from ..._arith import cdiv
from ...cache import PagedKVCache
from ..stats import mean_ci, wilson
from ..textdata import paragraphs
from . import eviction as ev
from ._eviction_passkey import PASSKEY_DEPTHS, answer_is_correct, passkey_prompt
from ._eviction_runs import close_session, policy_groups, policy_runs, prefilled_batch
from ._pages_cascade import PAGE_SIZE
from ._reads import ReadCounter

__all__ = ["DENSE_LAYERS", "POLICIES", "QuestRun", "quality"]

POLICIES = ["full", "paged_eviction", "streaming_llm"]  # the eviction peers of Quest
DENSE_LAYERS = 2  # Quest's paper reads every page in the first two layers


class QuestRun:
    """One sequence decoding with Quest at ``budget`` tokens (``budget // 16`` pages), its own session
    (``kv_format``: the cache's, `PagedKVCache`'s argument; default floating pages)."""

    def __init__(
        self, model, prompt: torch.Tensor, budget: int, longest: int, dense_layers: int = DENSE_LAYERS, kv_format=None
    ):
        from ...hf import PagedSession
        from ..quest_backend import quest_backend

        self.budget = budget
        fmt = {} if kv_format is None else {"kv_format": kv_format}
        kv = PagedKVCache.for_model(
            model, num_pages=cdiv(longest, PAGE_SIZE) + 1, page_size=PAGE_SIZE, page_summaries=True, **fmt
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
