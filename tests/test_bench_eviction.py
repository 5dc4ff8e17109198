"""The eviction evaluation's quick mode on the real model (what CI runs of `bench eviction`)."""

import json

import pytest

from paged_ref.bench import eviction

pytestmark = pytest.mark.slow


def test_quick_evaluation_runs_on_smollm2(tmp_path):
    eviction.main(["--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "eviction_quick.json").read_text())
    assert data["mode"] == "quick"
    assert data["check_max_abs_logprob_diff"] < 1e-4  # full-cache paged runner == plain model
    policies = {r["policy"] for r in data["lm_rows"]}
    assert {
        "full",
        "paged_eviction",
        "inverse_key_norm",
        "value_norm",
        "key_norm",
        "random",
        "streaming_llm",
        "token_topk",
    } <= policies
    for row in data["lm_rows"] + data["passkey_rows"]:
        if row["page_bound"] is not None:  # ceil(C / B) + 1 pages at most, every policy
            assert row["max_pages_held"] <= row["page_bound"]
    for row in data["passkey_rows"]:
        assert row["correct"] == eviction.answer_is_correct(row["answer"], row["key"])
        assert row["key_readable"] or not row["key_held"]  # a whole mention held is readable
        if row["policy"] == "full":
            assert row["key_held"] and row["key_readable"] and row["needle_held"] == 1.0
