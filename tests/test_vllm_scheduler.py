"""paged_ref's scheduler against vLLM's own, step by step (runs in .venv-vllm: `make test-vllm`).

The same request streams go through vLLM's V1 ``Scheduler`` (driven without a model, as vLLM's own
tests do) and through paged_ref's engine over a `DrySession`, in vLLM's configuration (reservation
"paged", watermark 0, preemption by recompute; see `paged_ref.serve.scheduler`). At every step both
must schedule the same requests with the same numbers of tokens, preempt the same requests and
leave the same number of free blocks.
"""

import pytest
from vllm_peer import Arrival, paged_ref_steps, random_stream, require_vllm, vllm_steps

require_vllm()

NUM_STREAMS = 300


def _assert_same_steps(stream, limits, **options):
    ours = paged_ref_steps(stream, **limits, **options)
    theirs = vllm_steps(stream, **limits, **options)
    for i, (a, b) in enumerate(zip(theirs, ours)):
        assert a == b, f"step {i} of {len(theirs)} under {limits}: vLLM {a}, paged_ref {b}"
    assert len(ours) == len(theirs), f"paged_ref took {len(ours)} steps, vLLM {len(theirs)}"
    return theirs


@pytest.mark.parametrize("first", range(0, NUM_STREAMS, 50))
def test_random_streams_are_scheduled_as_vllm_schedules_them(first):
    steps = preempting = 0
    for seed in range(first, first + 50):
        stream, limits = random_stream(seed)
        done = _assert_same_steps(stream, limits)
        steps += len(done)
        preempting += any(s.preempted for s in done)
    assert preempting >= 10, f"only {preempting} of 50 streams preempt: the pools are too large to test preemption"
    assert steps > 50 * 20


def _stream(*requests):
    return [Arrival(step, tuple(range(1, n + 1)), new) for step, n, new in requests]


EDGE_CASES = {
    # a prompt that fills the pool: its last token's page is the pool's last page
    "prompt fills the pool": (_stream((0, 127, 2), (0, 5, 3)), dict(num_blocks=4, block_size=32)),
    # one long prompt fed 16 tokens a step for 64 steps, decodes of others beside it
    "long prompt in chunks": (_stream((0, 40, 30), (0, 1000, 3), (5, 20, 10)), dict(num_blocks=40, block_size=32)),
    # ties in arrival: six requests in one step, three more in a later one, tiny pool
    "ties in arrival": (
        _stream(*[(0, 20 + i, 25) for i in range(6)], *[(7, 30, 10)] * 3),
        dict(num_blocks=6, block_size=32),
    ),
    "one sequence at a time": (_stream((0, 50, 20), (0, 10, 5), (3, 64, 1)), dict(num_blocks=5, max_num_seqs=1)),
    "pages of one token": (_stream((0, 9, 9), (0, 7, 12), (2, 12, 4)), dict(num_blocks=24, block_size=1)),
    "a request that needs the whole pool": (_stream((0, 60, 69), (0, 3, 3)), dict(num_blocks=4, block_size=32)),
}


@pytest.mark.parametrize("name", EDGE_CASES)
def test_edge_cases_are_scheduled_as_vllm_schedules_them(name):
    stream, overrides = EDGE_CASES[name]
    limits = dict(num_blocks=8, block_size=32, max_num_seqs=8, max_batched_tokens=16, max_model_len=4096) | overrides
    _assert_same_steps(stream, limits)
