"""How many programs of a kernel an SM holds, how many waves a grid takes, and how many bytes
are in flight: the small model the Triton decode launcher picks its split count with.

A memory-bound kernel reaches the memory's bandwidth only if enough loads are outstanding.
Little's law says how many: bandwidth x latency bytes across the chip, so
``bandwidth * latency / num_sms`` per SM. An SM holds as many programs (CTAs) as its registers,
shared memory, warp slots and block slots allow (`programs_per_sm`); each program keeps its
K/V buffer ring loading while it computes on one tile (`bytes_in_flight`). A grid of more
programs than the GPU holds at once runs in *waves* (`waves`); a wave that leaves slots empty
streams with fewer bytes in flight.

`split_cost` turns that into a cost for cutting each of ``batch x num_kv_heads`` sequences into
``s`` splits: every wave holds its slots for as long as one program takes (its tiles, plus
the tiles' worth of latency its pipeline needs to fill), and a split run pays a second kernel
that merges the partial results. The launcher takes the fewest splits within a few percent of
the cheapest (:func:`paged_ref.attention.triton_decode.choose_num_splits`).

Every number the model needs for a GPU comes from the compile report
(``python -m paged_ref.lab.bench kernels`` -> ``figures/data/kernels.json``: registers, shared
memory, warps, ring depth per configuration) and the target's published per-SM limits; nothing
here needs a GPU.

Example:
    >>> h200 = SM_LIMITS[90]
    >>> programs_per_sm(160, 71680, 4, h200)["programs_per_sm"]   # the bf16 decode tile on sm_90
    3
    >>> waves(384, 132, 3)                                          # 48 splits x 8 KV heads
    (1, 0.9696969696969697)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._arith import cdiv

__all__ = [
    "SM_LIMITS",
    "SmLimits",
    "bytes_in_flight",
    "littles_law_bytes",
    "programs_per_sm",
    "split_cost",
    "waves",
]


@dataclass(frozen=True)
class SmLimits:
    """One GPU target: its SMs, the per-SM limits a program's resources are counted against,
    and the memory's datasheet bandwidth (bytes/s)."""

    name: str
    sms: int
    regs: int  # 32-bit registers per SM
    max_warps: int
    max_blocks: int
    smem: int  # shared memory per SM, bytes
    bandwidth: float


#: Published per-SM limits (CUDA occupancy tables) and datasheet bandwidths of the three targets
#: the compile report covers.
SM_LIMITS = {
    90: SmLimits("sm_90 (H200)", 132, 65536, 64, 32, 228 * 1024, 4.8e12),
    80: SmLimits("sm_80 (A100 80GB)", 108, 65536, 64, 32, 164 * 1024, 2.039e12),
    75: SmLimits("sm_75 (T4)", 40, 65536, 32, 16, 64 * 1024, 320e9),
}
RESERVED_SMEM_PER_BLOCK = 1024  # bytes the driver keeps per resident block (sm_80 and later)


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int, limits: SmLimits) -> dict:
    """Programs (CTAs) one SM holds at once, by each resource; the smallest wins.

    Registers are allocated per warp in units of 256; every resident block also costs
    ``RESERVED_SMEM_PER_BLOCK`` of shared memory.

    Returns:
        ``{"by_registers", "by_shared", "by_warps", "by_blocks", "programs_per_sm"}``.

    Example:
        >>> programs_per_sm(255, 0, 8, SM_LIMITS[90])["by_registers"]   # 8 warps of 256 regs
        1
    """
    if registers < 1 or shared_bytes < 0 or num_warps < 1:
        raise ValueError(
            f"registers >= 1, shared_bytes >= 0 and num_warps >= 1 expected, got {registers}, {shared_bytes}, "
            f"{num_warps}"
        )
    regs_per_warp = math.ceil(registers * 32 / 256) * 256
    by = dict(
        by_registers=limits.regs // (regs_per_warp * num_warps),
        by_shared=limits.smem // (shared_bytes + RESERVED_SMEM_PER_BLOCK) if shared_bytes else limits.max_blocks,
        by_warps=limits.max_warps // num_warps,
        by_blocks=limits.max_blocks,
    )
    return dict(by, programs_per_sm=min(by.values()))


def littles_law_bytes(limits: SmLimits, latency_s: float = 1e-6) -> int:
    """Bytes one SM must keep in flight for the chip to reach its bandwidth at ``latency_s``
    (an assumed DRAM round trip of about a microsecond).

    Example:
        >>> littles_law_bytes(SM_LIMITS[90])       # 4.8 TB/s x 1 us / 132 SMs
        36363
    """
    return int(limits.bandwidth * latency_s / limits.sms)


def bytes_in_flight(tile_bytes: int, ring_depth: int, asynchronous: bool) -> int:
    """K/V bytes one program has loading while it computes: with an asynchronous ring of depth
    ``k`` for K and for V, ``k - 1`` tiles of each; otherwise one tile (it waits on each load).

    Example:
        >>> bytes_in_flight(16384, 2, True)        # 64 x 128 bf16 tiles, two K and two V buffers
        32768
    """
    return 2 * (ring_depth - 1) * tile_bytes if asynchronous and ring_depth > 1 else tile_bytes


def waves(programs: int, num_sms: int, per_sm: int) -> tuple[int, float]:
    """``(waves, fill)``: rounds of ``num_sms * per_sm`` resident programs the grid takes, and the
    share of those slots it fills (1.0: every wave full)."""
    slots = num_sms * per_sm
    count = cdiv(programs, slots)
    return count, programs / (count * slots)


def split_cost(
    batch: int,
    num_kv_heads: int,
    seq_len: int,
    splits: int,
    num_sms: int,
    per_sm: int,
    block_n: int,
    *,
    start_tiles: int = 2,
    merge_tiles: float = 1.0,
    partial_tiles: float = 0.125,
) -> float:
    """Time of one decode launch cut into ``splits`` per sequence, in *slot-tiles* (one program
    slot busy for one tile's load).

    Each program streams ``ceil(ceil(seq_len / splits) / block_n)`` tiles (the kernel rounds a
    split up to whole tiles) after ``start_tiles`` tiles' worth of pipeline fill; every wave holds
    all ``num_sms * per_sm`` slots for one program's time, full or not. With ``splits > 1`` the
    merge kernel adds ``merge_tiles`` per slot (its launch) and ``partial_tiles`` per program (a
    partial ``(m, l, acc)`` written and read back: ~4 KB against a 32 KB K/V tile pair).

    Example:
        >>> split_cost(64, 8, 4096, 1, 132, 3, 64)   # 512 programs: a second wave 29% full
        52272
        >>> split_cost(64, 8, 4096, 3, 132, 3, 64)   # 1536 programs: four waves 97% full
        38604.0
    """
    programs = batch * num_kv_heads * splits
    tiles = cdiv(cdiv(seq_len, splits), block_n)
    count, _ = waves(programs, num_sms, per_sm)
    slots = num_sms * per_sm
    cost = (tiles + start_tiles) * count * slots
    if splits > 1:
        cost += merge_tiles * slots + partial_tiles * programs
    return cost
