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
    for rows in ("lm_rows", "retention_rows", "passkey_rows"):  # every policy runs in every task
        assert {r["policy"] for r in data[rows]} == set(eviction.POLICIES), rows
    for row in data["retention_rows"]:
        assert 0 <= row["region_held"] <= 1 and (row["policy"] != "full" or row["region_held"] == 1)
    # the retention task's point: the full cache copies the repeated passage, a recent window cannot
    ret = {r["policy"]: r["nll"] for r in data["retention"]}
    assert ret["full"] < ret["streaming_llm"]
    assert {(r["context"], r["batch"]) for r in data["speed"]} == {(384, 1)}
    assert {r["policy"] for r in data["speed"]} == set(eviction.SPEED_POLICIES)
    assert data["lowest_ratio_tokens"]["lowest"] and data["lowest_ratio_tokens"]["first_token_rank"] >= 0
    for row in data["lm_rows"] + data["retention_rows"] + data["passkey_rows"]:
        if row["page_bound"] is not None:  # ceil(C / B) + 1 pages at most, every policy
            assert row["max_pages_held"] <= row["page_bound"]
    for row in data["passkey_rows"]:
        assert row["correct"] == eviction.answer_is_correct(row["answer"], row["key"])
        assert row["key_readable"] or not row["key_held"]  # a whole mention held is readable
        if row["policy"] == "full":
            assert row["key_held"] and row["key_readable"] and row["needle_held"] == 1.0
