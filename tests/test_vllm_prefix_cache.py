"""paged_ref's prefix cache against vLLM's ``KVCacheManager`` with caching on (runs in .venv-vllm:
`make test-vllm`): the same cached tokens found per request, the same cached pages evicted first.

The hash functions differ (vLLM's and `paged_ref.prefix_cache`'s), so decisions are compared, not
keys: how many tokens each admission finds cached, what runs, what is preempted, how many blocks
are free; which cached pages survive pool pressure shows in the later hits.

vLLM takes (and caches) a row's blocks when it schedules the row, paged_ref when the forward
reserves them, publishing a page once its K/V is written (a deliberate difference,
`paged_ref.prefix_cache`). A stream is compared step by step up to the first step whose prefix
lookups could see that difference (`vllm_peer.Step.vllm_timing`); most streams never reach one.
"""

import pytest
from vllm_peer import chat_stream, paged_ref_steps, require_vllm, vllm_steps

require_vllm()

NUM_STREAMS = 300


@pytest.mark.parametrize("first", range(0, NUM_STREAMS, 100))
def test_prefix_sharing_streams_find_the_same_cached_tokens_as_vllm(first):
    whole = steps = hit_tokens = 0
    for seed in range(first, first + 100):
        stream, limits = chat_stream(seed)
        theirs = vllm_steps(stream, prefix_caching=True, **limits)
        ours = paged_ref_steps(stream, prefix_caching=True, **limits)
        cut = next((i for i, s in enumerate(theirs) if s.vllm_timing), len(theirs))
        for i in range(cut):
            assert theirs[i] == ours[i], f"stream {seed}, step {i}, {limits}: vLLM {theirs[i]}, paged_ref {ours[i]}"
        whole += cut == len(theirs) == len(ours)
        steps += cut
        hit_tokens += sum(n for s in theirs[:cut] for n in s.cached.values())
    assert whole >= 60, f"only {whole} of 100 streams compared to their end"
    assert hit_tokens > 1000 and steps > 100 * 20
