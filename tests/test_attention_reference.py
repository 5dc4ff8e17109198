"""The plain-PyTorch reference's own parts: the gather it is built on and its argument checks.

Its agreement with the float64 oracle, next to every other backend, is in
test_attention_backends.py; unowned NaN slots in test_nonfinite_slots.py.
"""

import pytest
import torch
from attention_cases import (
    valid_inputs,
)

from paged_ref.attention.reference import (
    gather_sequence,
    reference_paged_decode,
)

F32_TOL = 1e-4


def test_gather_sequence_follows_the_block_table():
    cache = torch.arange(5 * 4, dtype=torch.float32).view(5, 4, 1, 1)  # slot id as value
    row = torch.tensor([3, 0, 4, -1], dtype=torch.int32)
    got = gather_sequence(cache, row, 9).flatten().tolist()
    assert got == [12, 13, 14, 15, 0, 1, 2, 3, 16]


# ---- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scale,error", [("0.1", TypeError), (True, TypeError), (float("inf"), ValueError), (float("nan"), ValueError)]
)
def test_rejects_bad_scale(scale, error):
    with pytest.raises(error, match="scale must be"):
        reference_paged_decode(*valid_inputs(decode=True).values(), scale=scale)


def test_rejects_other_device():
    args = list(valid_inputs(decode=True).values())
    with pytest.raises(ValueError, match="seq_lens must be on the same device as q"):
        reference_paged_decode(*args[:4], args[4].to("meta"))
