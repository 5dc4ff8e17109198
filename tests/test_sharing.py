"""Page counts of the sharing designs against a real prefix-caching PagedKVCache; bench sharing and its figure."""

import json

import pytest
import torch

from paged_ref import PagedKVCache
from paged_ref.lab.bench import sharing as bench
from paged_ref.lab.sharing import computed_tokens, no_sharing_pages, prefix_caching_pages
from paged_ref.models import tiny_llama


def _admit(kv, tokens: list[int]) -> int:
    """A request with prefix caching: reuse the cached full pages, compute (write) the rest."""
    seq = kv.add_sequence(token_ids=tokens)
    rest = tokens[kv.seq_len(seq) :]
    slots = kv.reserve(seq, len(rest), token_ids=rest)
    for layer in range(kv.num_layers):
        kv.write(layer, slots, torch.ones(len(rest), 1, 2), torch.ones(len(rest), 1, 2))
    return seq


def _held(kv) -> int:
    return len({p for s in kv.seq_ids for p in kv.pages(s)})


@pytest.mark.parametrize("prompt_len", [1, 7, 8, 9, 20, 24])
@pytest.mark.parametrize("n", [1, 3])
def test_prefix_caching_count_equals_a_real_cache_for_samples(prompt_len, n):
    """n requests of one prompt, then 5 decode steps each: the count is the cache's own."""
    ps = 4
    kv = PagedKVCache(num_layers=2, num_pages=64, page_size=ps, num_kv_heads=1, head_dim=2, prefix_caching=True)
    prompt = list(range(100, 100 + prompt_len))
    seqs = [_admit(kv, prompt) for _ in range(n)]
    held = [list(prompt) for _ in range(n)]
    assert _held(kv) == prefix_caching_pages(held, admitted=[prompt_len] * n, page_size=ps)
    assert kv.prefix_hits == (n - 1) * ((prompt_len - 1) // ps)
    for step in range(5):  # each sample its own token
        for i, seq in enumerate(seqs):
            token = 1000 * i + step
            slots = kv.reserve(seq, 1, token_ids=[token])
            for layer in range(2):
                kv.write(layer, slots, torch.ones(1, 1, 2), torch.ones(1, 1, 2))
            held[i].append(token)
        assert _held(kv) == prefix_caching_pages(held, admitted=[prompt_len] * n, page_size=ps)
    assert no_sharing_pages(held, page_size=ps) == n * -(-(prompt_len + 5) // ps)


def test_prefix_caching_count_equals_a_real_cache_for_beams_admitted_every_step():
    """vLLM's beam search: every beam is a new request each step; the last step's are freed."""
    ps = 4
    kv = PagedKVCache(num_layers=1, num_pages=64, page_size=ps, num_kv_heads=1, head_dim=2, prefix_caching=True)
    g = torch.Generator().manual_seed(0)
    beams = [list(range(50, 59))]  # a 9-token prompt
    live = [_admit(kv, beams[0])]
    for _ in range(8):
        parents = torch.randint(0, len(beams), (3,), generator=g).tolist()
        beams = [beams[p] + [int(t)] for p, t in zip(parents, torch.randint(0, 4, (3,), generator=g))]
        new = [_admit(kv, b) for b in beams]
        for seq in live:
            kv.free(seq)
        live = new
        assert _held(kv) == prefix_caching_pages(beams, admitted=[len(b) for b in beams], page_size=ps)


def test_counts_refuse_bad_lengths():
    with pytest.raises(ValueError, match="admitted"):
        prefix_caching_pages([[1, 2]], admitted=[], page_size=2)
    with pytest.raises(ValueError, match="admitted lengths"):
        prefix_caching_pages([[1, 2]], admitted=[3], page_size=2)
    assert computed_tokens(9, page_size=4) == 1 and computed_tokens(8, page_size=4) == 4


def test_bench_sharing_quick_run_and_figures(tmp_path):
    from paged_ref.lab.viz.sharing import sharing_figure

    model = tiny_llama(seed=0)
    data = bench.measure(model, None, prompts={"short": 6, "long": 21}, widths=(3,), new_tokens=4, repeats=1)
    for run in data["runs"]:
        pages = run["pages"]
        assert len(pages["fork_cow"]) == len(pages["no_sharing"]) == 4  # the prefill and 3 decode forwards
        assert all(a <= b <= c for a, b, c in zip(pages["fork_cow"], pages["prefix_caching"], pages["no_sharing"]))
        assert run["same_as_transformers"]["tokens"]
        if run["kind"] == "beam":
            assert run["same_as_transformers"]["max_score_diff"] < 1e-4
    long_sample = next(r for r in data["runs"] if r["prompt"] == "long" and r["kind"] == "sample" and r["width"] == 3)
    # 21 tokens in pages of 16: the partial page is shared at the prefill only, then each sample copies it
    assert long_sample["pages"]["fork_cow"][:2] == [2, 4] and long_sample["pages_copied"]["fork_cow"] == 2
    assert data["goals"]["beam4_prompt512_peak_fork_cow_over_no_sharing"] is None  # no 512-token run here
    fig = sharing_figure({**data, "model": "tiny", "mode": "test", "environment": {}}, width=3, prompt="long")
    assert len(fig.axes) == 4
    json.dumps(data)  # plain data, ready for the JSON file
