"""The occupancy model the decode launcher splits with, checked against the compile report.

No GPU: `figures/data/kernels.json` (``python -m paged_ref.lab.bench kernels``) holds what the
compiler made of every tile configuration for sm_90/sm_80/sm_75; the model must agree with it,
and the split counts it picks must fill an H200 (132 SMs) the way its docstrings say.
"""

import json
from pathlib import Path

import pytest
import torch

from paged_ref.attention import occupancy as occ
from paged_ref.attention import triton_decode as td
from paged_ref.lab.bench import kernels

REPORT = json.loads((Path(__file__).resolve().parents[1] / "figures" / "data" / "kernels.json").read_text())
H200 = occ.SM_LIMITS[90]


def _tile_entries(arch):
    """The 16-bit head_dim-128 GQA-4 entries of the compile report for ``arch``."""
    return [
        e
        for e in REPORT["split_kernel"]
        if e["arch"] == arch and e["hints"] and e["dtype"] in ("fp16", "bf16") and e["head_dim"] == 128
        if e["group"] == 4 and "error" not in e
    ]


@pytest.mark.parametrize("arch", [90, 80, 75])
def test_the_launcher_resources_are_the_compile_reports(arch):
    """_TILE_RESOURCES holds the most registers and shared memory the report measured for the
    tile, and the model gives every compiled entry the programs per SM the report computed."""
    entries = _tile_entries(arch)
    assert entries
    registers, shared, warps = occ._TILE_RESOURCES[arch]
    assert registers == max(e["registers"] for e in entries)
    assert shared == max(e["shared_bytes"] for e in entries)
    assert {e["options"]["num_warps"] for e in entries} == {warps}
    for e in entries:
        model = occ.programs_per_sm(e["registers"], e["shared_bytes"], warps, occ.SM_LIMITS[arch])
        assert model["programs_per_sm"] == e["programs_per_sm"] == occ._resident_programs(arch)
    assert occ._resident_programs(90) == occ._PROGRAMS_PER_SM


def test_three_programs_per_sm_meet_littles_law_and_one_does_not():
    """sm_90: 3 programs x 32 KB in flight (two K and two V buffers, one of each loading) is
    2.7x the 36 KB Little's law asks per SM at 4.8 TB/s and 1 us; one program alone falls short."""
    entry = _tile_entries(90)[0]
    per_program = kernels.bytes_in_flight(entry["tile_bytes"], max(entry["kv_buffers"]), entry["async_copies"] > 0)
    need = kernels.littles_law_bytes(90)
    assert need == entry["littles_law_bytes_per_sm"]
    assert per_program * occ._PROGRAMS_PER_SM == entry["kv_bytes_in_flight_per_sm"] >= 2.5 * need
    assert per_program < need


def test_programs_per_sm_takes_the_scarcest_resource():
    assert occ.programs_per_sm(32, 0, 4, H200)["programs_per_sm"] == 16  # warps: 64 / 4
    assert occ.programs_per_sm(32, 100 * 1024, 4, H200)["programs_per_sm"] == 2  # shared memory
    assert occ.programs_per_sm(255, 0, 8, H200)["programs_per_sm"] == 1  # registers
    with pytest.raises(ValueError, match="num_warps"):
        occ.programs_per_sm(32, 0, 0, H200)


def test_one_long_sequence_fills_an_h200():
    """Batch 1 x 131072, 8 KV heads: one wave at least 95% full on 132 SMs x 3, every SM with
    enough programs for Little's law, and no split under the minimum tile count."""
    cfg = td._tile_config(torch.bfloat16, 128, 4, interpret=False, capability=90)  # one tile for every page size
    s = occ.choose_num_splits(1, 8, 131072, H200.sms, programs_per_sm=3, block_n=cfg["BLOCK_N"])
    count, fill = occ.waves(8 * s, H200.sms, 3)
    assert count == 1 and fill >= 0.95, (s, fill)
    per_sm = 8 * s / H200.sms
    assert per_sm * kernels.bytes_in_flight(16384, 2, True) >= kernels.littles_law_bytes(90)
    assert 131072 / s >= occ._MIN_TILES_PER_SPLIT * cfg["BLOCK_N"]


@pytest.mark.parametrize("batch, seq_len", [(8, 32768), (64, 4096), (256, 2048), (16, 8192), (32, 4096)])
def test_batches_of_eight_and_more_keep_their_waves_full(batch, seq_len):
    """Every batch >= 8 of the benchmark (and two between) runs in waves at least 85% full."""
    s = occ.choose_num_splits(batch, 8, seq_len, H200.sms, programs_per_sm=3, block_n=64)
    _, fill = occ.waves(batch * 8 * s, H200.sms, 3)
    assert fill >= 0.85, (s, fill)


def test_the_choice_is_the_cheapest_within_tolerance():
    """choose_num_splits returns the fewest splits whose modelled cost is within 3% of the best."""
    for batch, seq_len in ((1, 131072), (1, 5000), (3, 20000), (64, 4096), (500, 100)):
        tiles = -(-seq_len // 64)
        costs = {s: occ.split_cost(batch, 8, seq_len, s, 132, 3, 64) for s in range(1, min(256, tiles // 4) + 1)}
        chosen = occ.choose_num_splits(batch, 8, seq_len, 132, block_n=64)
        if len(costs) > 1 or chosen != 1:
            assert costs[chosen] <= 1.03 * min(costs.values())
            assert all(costs[s] > 1.03 * min(costs.values()) for s in costs if s < chosen)
