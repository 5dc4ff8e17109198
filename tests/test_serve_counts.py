"""paged_ref.lab.serve_counts: a request's events and TPOT split read from the history, and the
benchmark's requests served dry making the decisions a model-backed engine makes."""

import pytest

from paged_ref.lab import serve_counts
from paged_ref.lab.bench.serve import PROFILES
from paged_ref.serve import Engine


@pytest.fixture(scope="module")
def small_run():
    engine = Engine(None, num_pages=6, page_size=4, max_batched_tokens=8, eos_token_id=[])
    for n, new, at in ((7, 9, 0), (5, 12, 1), (9, 8, 2)):
        engine.add_request(list(range(3, 3 + n)), max_new_tokens=new, arrival_s=at)
    return engine, engine.run()


def test_request_events_read_the_history(small_run):
    engine, outs = small_run
    for o in outs:
        ev = serve_counts.request_events(engine.history, o.request_id)
        assert len(ev["admitted"]) == len(ev["preempted"]) + 1 == o.num_preemptions + 1
        assert ev["finished"] == [round(o.finish_s) - 1]


def test_tpot_breakdown_splits_the_window(small_run):
    engine, outs = small_run
    rows = serve_counts.tpot_breakdown(engine.history, outs)
    assert any(r["preemptions_after_first"] for r in rows) and any(not r["preemptions_after_first"] for r in rows)
    for r, o in zip(rows, outs):
        assert r["decode_steps"] == len(o.token_ids) - 1 and r["tpot_steps"] == pytest.approx(o.tpot_s)
        assert r["window_steps"] == r["decode_steps"] + r["away_steps"]
        assert (r["away_steps"] > 0) == (r["preemptions_after_first"] > 0)


def test_a_dry_run_makes_the_model_backed_engine_s_decisions():
    from paged_ref.lab.bench.serve import _engine, make_requests
    from paged_ref.models import tiny_llama

    cfg = PROFILES["quick"]
    dry = serve_counts.bench_dry("paged", rate=None, profile="quick", num_pages=15)  # the smallest pool that preempts
    model = tiny_llama()
    lengths = {k: cfg[k] for k in ("requests", "mean_prompt", "mean_output", "sigma", "min_prompt", "max_model_len")}
    requests, _ = make_requests(model, None, **lengths)
    real = _engine(model, cfg, "paged", num_pages=15)
    for prompt, new in requests:
        real.add_request(prompt, max_new_tokens=new)
    real.run()
    assert dry.engine.stats()["preemptions"] > 0
    decisions = [[(h.admitted, h.preempted, h.finished, h.tokens) for h in e.history] for e in (dry.engine, real)]
    assert decisions[0] == decisions[1]


def test_watermark_trade_keeps_more_pages_free_as_the_watermark_grows():
    rows = serve_counts.watermark_trade((0.0, 0.25, 0.5), rate=4.0, step_s=0.05, profile="quick")
    assert [r["watermark_pages"] for r in rows] == [0, 10, 20]
    assert rows[0]["preemptions"] >= rows[-1]["preemptions"]
    assert all(r["tokens"] == rows[0]["tokens"] for r in rows)
