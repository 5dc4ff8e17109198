"""Ratios of two methods measured in turns: `paired_ratio` (the median of the pairs' ratios) and the
benchmarks that take turns, on synthetic timings (a fake clock and a load that drifts during the run:
a ratio of two medians taken one method after the other reads the drift, a paired ratio does not)."""

from __future__ import annotations

import pytest

from paged_ref.lab.bench import _model_bench
from paged_ref.lab.bench.common import paired_ratio


# --- paired_ratio ---------------------------------------------------------------------------------
def test_paired_ratio_is_the_true_median_for_an_even_count():
    # ratios 1, 2, 3, 4: the median is 2.5 (the upper middle would be 3)
    assert paired_ratio([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]) == 2.5
    assert paired_ratio([2.0, 9.0, 4.0], [1.0, 3.0, 1.0]) == 3.0
    assert _model_bench.paired_ratio is paired_ratio  # the model benchmarks use the same one


@pytest.mark.parametrize("num, den", [([1.0, 2.0], [1.0]), ([], [])])
def test_paired_ratio_refuses_values_that_do_not_pair_up(num, den):
    with pytest.raises(ValueError, match="numerators and denominators must pair up"):
        paired_ratio(num, den)


def test_speed_vs_full_and_alloc_take_paired_ratio(monkeypatch):
    from paged_ref.lab.bench import alloc
    from paged_ref.lab.bench.eviction import speed_vs_full

    assert speed_vs_full([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0])["time_per_token_vs_full_paired"] == 2.5
    data = alloc.measure(num_seqs=4, max_len=64, repeats=4)
    peer = data["results"][alloc.PEER]["ns_per_page_op_repeats"]
    for r in data["results"].values():
        assert r["torch_over_this"] == paired_ratio(peer, r["ns_per_page_op_repeats"])
    z = alloc.zeroing_cost(num_layers=2, pages=4, repeats=4)
    assert z["zero_over_write"] == paired_ratio(z["zero_page_ns_repeats"], z["write_page_ns_repeats"])
