"""How many splits the Triton decode launcher cuts each sequence into: a small occupancy model.

A memory-bound kernel reaches the memory's bandwidth only while enough loads are in flight
(Little's law). An SM holds as many programs as its registers, shared memory, warp and block
slots allow (:func:`programs_per_sm`); a grid larger than the GPU holds runs in waves
(:func:`waves`). :func:`split_cost` prices ``s`` splits per sequence, :func:`choose_num_splits`
takes the fewest within 3% of the cheapest. The tile's resources come from the compile report
(``python -m paged_ref.lab.bench kernels``), the per-SM limits from published tables: no GPU needed.

Example:
    >>> programs_per_sm(160, 71680, 4, SM_LIMITS[90])["programs_per_sm"]   # the bf16 decode tile on sm_90
    3
    >>> waves(384, 132, 3)                                                  # 48 splits x 8 KV heads
    (1, 0.9696969696969697)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .._arith import cdiv

__all__ = ["SM_LIMITS", "SmLimits", "choose_num_splits", "programs_per_sm", "split_cost", "waves"]


@dataclass(frozen=True)
class SmLimits:
    """One GPU target: its SMs, per-SM limits and datasheet bandwidth (bytes/s)."""

    name: str
    sms: int
    regs: int  # 32-bit registers per SM
    max_warps: int
    max_blocks: int
    smem: int  # shared memory per SM, bytes
    bandwidth: float


#: The three targets the compile report covers (CUDA occupancy tables, datasheets).
SM_LIMITS = {
    90: SmLimits("sm_90 (H200)", 132, 65536, 64, 32, 228 * 1024, 4.8e12),
    80: SmLimits("sm_80 (A100 80GB)", 108, 65536, 64, 32, 164 * 1024, 2.039e12),
    75: SmLimits("sm_75 (T4)", 40, 65536, 32, 16, 64 * 1024, 320e9),
}
RESERVED_SMEM_PER_BLOCK = 1024  # bytes the driver keeps per resident block (sm_80 and later)
#: (registers, shared bytes, warps) of the 16-bit head_dim-128 tile per compute capability: the most
#: over its page sizes in figures/data/kernels.json (tests/test_occupancy.py checks them).
_TILE_RESOURCES = {75: (128, 18432, 4), 80: (160, 71680, 4), 90: (160, 71680, 4)}
_PROGRAMS_PER_SM = 3  # sm_90's count for that tile (tests/test_occupancy.py derives it)
_MAX_SPLITS = 256  # partials stay a few MB
_MIN_TILES_PER_SPLIT = 4  # below this a split's fixed cost (pipeline fill, its partial) outweighs the parallelism
_SPLIT_TOLERANCE = 1.03  # take the fewest splits whose modelled cost is within 3% of the cheapest
_START_TILES = 2  # pipeline fill of every wave, in tiles
_MERGE_TILES = 1.0  # the merge kernel, per program slot
_PARTIAL_TILES = 0.125  # the merge, per program: a ~4 KB partial against 32 KB of K/V per tile


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int, limits: SmLimits) -> dict:
    """Programs (CTAs) one SM holds at once, ``{"by_registers", "by_shared", "by_warps",
    "by_blocks", "programs_per_sm"}``: the smallest wins (registers go per warp in units of 256)."""
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


def waves(programs: int, num_sms: int, per_sm: int) -> tuple[int, float]:
    """``(waves, fill)``: rounds of ``num_sms * per_sm`` resident programs the grid takes, and the
    share of those slots it fills (1.0: every wave full)."""
    slots = num_sms * per_sm
    count = cdiv(programs, slots)
    return count, programs / (count * slots)


def split_cost(batch: int, num_kv_heads: int, seq_len: int, splits: int, num_sms: int, per_sm: int, block_n: int):
    """Time of one decode launch cut into ``splits`` per sequence, in slot-tiles: every wave holds
    all ``num_sms * per_sm`` slots for one program's tiles plus the pipeline fill; the merge adds
    a cost per slot and per program.

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
    cost = (tiles + _START_TILES) * count * slots
    if splits > 1:
        cost += _MERGE_TILES * slots + _PARTIAL_TILES * programs
    return cost


@functools.cache
def _resident_programs(capability: int) -> int:
    """Programs of the 16-bit head_dim-128 tile per SM (a target not covered: the nearest older one)."""
    known = max((c for c in _TILE_RESOURCES if c <= capability), default=min(_TILE_RESOURCES))
    registers, shared, warps = _TILE_RESOURCES[known]
    return programs_per_sm(registers, shared, warps, SM_LIMITS[known])["programs_per_sm"]


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    *,
    programs_per_sm: int = _PROGRAMS_PER_SM,
    block_n: int = 64,
    min_tiles_per_split: int = _MIN_TILES_PER_SPLIT,
) -> int:
    """Splits per sequence, in ``[1, 256]``, that keep the GPU full: the fewest whose
    :func:`split_cost` is within 3% of the cheapest, none with fewer than ``min_tiles_per_split``
    tiles of ``block_n`` tokens. Cached per tile count: a growing sequence pays once per tile.

    Example:
        >>> choose_num_splits(1, 8, 131072, 132)     # one long sequence: 8 -> 384 programs, one wave
        48
        >>> choose_num_splits(64, 8, 4096, 132)      # 512 programs: 3 splits, 4 waves 97% full
        3
        >>> choose_num_splits(256, 8, 2048, 132)     # 2048 programs already fill the GPU
        1
    """
    if min(batch, num_kv_heads, max_seq_len, num_sms, programs_per_sm, block_n, min_tiles_per_split) < 1:
        given = dict(batch=batch, num_kv_heads=num_kv_heads, max_seq_len=max_seq_len, num_sms=num_sms)
        given.update(programs_per_sm=programs_per_sm, block_n=block_n, min_tiles_per_split=min_tiles_per_split)
        raise ValueError(f"every argument of choose_num_splits must be >= 1, got {given}")
    tiles = cdiv(max_seq_len, block_n)
    return _cheapest_split(batch, num_kv_heads, tiles, num_sms, programs_per_sm, min_tiles_per_split)


@functools.lru_cache(maxsize=4096)
def _cheapest_split(batch: int, num_kv_heads: int, tiles: int, num_sms: int, per_sm: int, min_tiles: int) -> int:
    max_splits = max(1, min(_MAX_SPLITS, tiles // min_tiles))
    cost = {s: split_cost(batch, num_kv_heads, tiles, s, num_sms, per_sm, 1) for s in range(1, max_splits + 1)}
    good_enough = _SPLIT_TOLERANCE * min(cost.values())  # prefer fewer splits: less to merge
    return min(s for s, c in cost.items() if c <= good_enough)
