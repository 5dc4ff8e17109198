"""The eviction benchmark's pass-key retrieval: a 5-digit key hidden in filler, asked for at the end."""

from __future__ import annotations

import random
import re
import statistics
import time

import torch

from ..stats import wilson
from ._eviction_runs import close_session, group_batch, policy_groups

PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # trial t hides the key at depth PASSKEY_DEPTHS[t % 5]
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_prompt(tok, rng: random.Random, target_tokens: int, depth: float):
    """(context ids, question ids, key, mentions, needle token indices): the key at ``depth`` (0..1).

    ``mentions`` has one dict per mention of the key: token index -> the key's character
    positions that token covers (a token may straddle the key's edge), so a caller can ask both
    "is a whole mention held" and "can every digit be read from some held token".
    """
    key = str(rng.randint(10000, 99999))
    reps = max(2, int(target_tokens / len(tok(FILLER, add_special_tokens=False).input_ids)))
    before, after = FILLER * int(reps * depth), FILLER * (reps - int(reps * depth))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    content = (
        "There is important information hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about it.\n\n" + before + needle + after + "\n\nWhat is the pass key?"
    )
    text = (
        tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        + "The pass key is"
    )
    cut = text.index("\n\nWhat is the pass key?")
    enc = tok(text[:cut], add_special_tokens=False, return_offsets_mapping=True)
    question = tok(text[cut:], add_special_tokens=False).input_ids
    offsets = enc["offset_mapping"]

    def covering(start, end):  # token index -> covered character positions, relative to start
        return {
            i: range(max(a, start) - start, min(b, end) - start)
            for i, (a, b) in enumerate(offsets)
            if a < end and b > start
        }

    mentions = [covering(m.start(), m.end()) for m in re.finditer(key, text[:cut])]
    n0 = text.index(needle)
    needle_tokens = sorted(covering(n0, n0 + len(needle)))
    return torch.tensor(enc["input_ids"]), torch.tensor(question), key, mentions, needle_tokens


def key_evidence(held: set, mentions: list[dict], needle_tokens: list[int], key_len: int) -> dict:
    """What of the key survives in the held token positions ``held``: ``key_held``, every token of
    some mention; ``key_readable``, every digit in some held token of some mention; ``needle_held``,
    the share of the needle sentence's tokens.

    Example:
        >>> m = [{3: range(0, 2), 4: range(2, 3)}, {9: range(0, 1), 10: range(1, 3)}]
        >>> key_evidence({3, 10}, m, [2, 3, 4, 5], 3)
        {'key_held': False, 'key_readable': True, 'needle_held': 0.25}
    """
    covered = set()
    for m in mentions:
        for t, chars in m.items():
            if t in held:
                covered.update(chars)
    return dict(
        key_held=any(all(t in held for t in m) for m in mentions),
        key_readable=covered >= set(range(key_len)),
        needle_held=sum(t in held for t in needle_tokens) / len(needle_tokens),
    )


def answer_is_correct(text: str, key: str) -> bool:
    """The answer's first run of digits is exactly the key (" 662266" for 66226 is wrong).

    Example:
        >>> answer_is_correct(" 66226.", "66226"), answer_is_correct(" 662266", "66226")
        (True, False)
    """
    found = re.search(r"\d+", text)
    return bool(found) and found.group() == key


def passkey_task(model, tok, cfg, log, answer_tokens=7, groups=None):
    """Every policy (or the batches ``groups``) on ``passkey_trials`` prompts: the context prefilled and
    evicted, the question fed through the evicted cache, then ``answer_tokens`` greedy tokens; one row
    per (trial, policy, budget) and batch."""
    rows = []
    groups = groups or policy_groups(cfg["passkey_budgets"], [16])
    for trial in range(cfg["passkey_trials"]):
        rng = random.Random(1000 + trial)
        depth = PASSKEY_DEPTHS[trial % len(PASSKEY_DEPTHS)]
        ctx, question, key, mentions, needle_tokens = passkey_prompt(tok, rng, cfg["passkey_context"], depth)
        t0 = time.perf_counter()
        for group in groups:
            runs = group.runs
            batch = group_batch(model, ctx, group, ctx.numel() + question.numel() + answer_tokens)
            for _ in batch.feed(question[:-1]):
                pass
            evidence = [  # per-layer decisions: a token counts as held when any layer holds it
                key_evidence(set(p.positions(s).flatten().tolist()), mentions, needle_tokens, len(key))
                for s, p in zip(batch.seqs, batch.policies)
            ]
            nxt, answers = question[-1].repeat(len(runs)), []
            for _ in range(answer_tokens):
                nxt = batch.step(nxt).argmax(-1)  # [batch]
                answers.append(nxt)
            for i, answer in enumerate(torch.stack(answers, 1)):  # answer: [answer_tokens]
                text = tok.decode(answer)
                row = batch.row(i)
                row.update(
                    trial=trial,
                    key=key,
                    depth=round(depth, 3),
                    context_tokens=ctx.numel(),
                    answer=text,
                    correct=answer_is_correct(text, key),
                    **evidence[i],
                )
                rows.append(row)
            close_session(batch.session)
        full = next(r for r in rows[::-1] if r["policy"] == "full")
        log(
            f"pass-key trial {trial}: {ctx.numel()} context tokens, key {key} at depth {depth:.2f}; "
            f"full answered {full['answer']!r}; {time.perf_counter() - t0:.1f} s"
        )
    return rows


def summarize_passkey(rows):
    """Per (policy, budget): accuracy with its Wilson 95% interval, and what of the key was held."""
    groups = {}
    for r in rows:
        groups.setdefault((r["policy"], r["budget"]), []).append(r)
    out = []
    for (policy, c), rs in groups.items():
        n, k, held = len(rs), sum(r["correct"] for r in rs), sum(r["key_held"] for r in rs)
        when_right = [r["needle_held"] for r in rs if r["correct"]]
        when_wrong = [r["needle_held"] for r in rs if not r["correct"]]
        out.append(
            dict(
                policy=policy,
                budget=c,
                trials=n,
                correct=k,
                accuracy=k / n,
                ci95=list(wilson(k, n)),
                key_held=held,
                key_held_rate=held / n,
                correct_when_held=sum(r["correct"] for r in rs if r["key_held"]),
                correct_when_lost=sum(r["correct"] for r in rs if not r["key_held"]),
                key_readable=sum(r["key_readable"] for r in rs),
                correct_when_unreadable=sum(r["correct"] for r in rs if not r["key_readable"]),
                needle_held_mean=statistics.fmean(r["needle_held"] for r in rs),
                answered_number=sum(bool(re.search(r"\d", r["answer"])) for r in rs),
                needle_held_when_correct=statistics.fmean(when_right) if when_right else None,
                needle_held_when_wrong=statistics.fmean(when_wrong) if when_wrong else None,
            )
        )
    return out
