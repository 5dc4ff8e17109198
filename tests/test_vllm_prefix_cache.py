"""paged_ref's prefix cache against vLLM's ``KVCacheManager`` with caching on (runs in .venv-vllm:
`make test-vllm`): the same cached tokens found per request, the same cached pages evicted first.

The hash functions differ (vLLM's and `paged_ref.prefix_cache`'s), so decisions are compared, not
keys: how many tokens each admission finds cached, what runs, what is preempted, how many blocks
are free; which cached pages survive pool pressure shows in the later hits. Both take a row's pages
and publish the full ones when they schedule it, so a request admitted later in a step can hit a
page an earlier row of the step fills, and an earlier row's allocation can evict a cached page
before a later lookup: every stream is compared step by step to its end.
"""

import pytest
from vllm_peer import chat_stream, paged_ref_steps, require_vllm, vllm_steps

require_vllm()

NUM_STREAMS = 300


@pytest.mark.parametrize("first", range(0, NUM_STREAMS, 100))
def test_prefix_sharing_streams_find_the_same_cached_tokens_as_vllm(first):
    steps = hit_tokens = 0
    for seed in range(first, first + 100):
        stream, limits = chat_stream(seed)
        theirs = vllm_steps(stream, prefix_caching=True, **limits)
        ours = paged_ref_steps(stream, prefix_caching=True, **limits)
        for i, (a, b) in enumerate(zip(theirs, ours)):
            assert a == b, f"stream {seed}, step {i}, {limits}: vLLM {a}, paged_ref {b}"
        assert len(ours) == len(theirs), f"stream {seed}: paged_ref took {len(ours)} steps, vLLM {len(theirs)}"
        steps += len(theirs)
        hit_tokens += sum(n for s in theirs for n in s.cached.values())
    assert hit_tokens > 10_000 and steps > 100 * 20
