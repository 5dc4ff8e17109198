"""The kernel as a GPU will run it: compiled ahead of time for sm_90, sm_80 and sm_75, no GPU; with
8-bit pages (float8_e4m3fn, float8_e5m2, int8) for sm_90 and sm_80.

The interpreter accepts programs the compiler rejects (tl.dot minimum shapes, dtype rules), so
this is the GPU path's first line of defence: the default configurations of every target must
compile, no 16-bit configuration may spill, and on Ampere/Hopper the K/V loads must be
asynchronous copies into a ring of at least two buffers. `python -m paged_ref.lab.bench kernels`
runs the same compiles over every configuration the launcher can choose.
"""

import pytest
import triton
import triton.compiler  # noqa: F401

from paged_ref.lab.bench import kernels as K

DEFAULTS = [
    K.KernelConfig(arch, dtype, 128, 4, page, split)
    for arch, dtypes in ((90, ("bf16", "fp16")), (80, ("bf16", "fp16")), (75, ("fp16",)))
    for dtype in dtypes
    for page in (16, 64)
    for split in (False, True)
]
EIGHT_BIT = [
    K.KernelConfig(arch, "bf16", 128, 4, page, True, pages=fmt)
    for arch in (90, 80)
    for fmt in K.EIGHT_BIT_PAGES
    for page in (16, 64)
]


@pytest.fixture(scope="module")
def compiled():
    # two processes: a compile is single-threaded; Triton's cache makes reruns fast
    return dict(zip(DEFAULTS + EIGHT_BIT, K.run(DEFAULTS + EIGHT_BIT, jobs=2)))


def test_every_default_configuration_compiles(compiled):
    errors = {c: e["error"] for c, e in compiled.items() if "error" in e}
    assert not errors, errors


def test_no_16bit_configuration_spills(compiled):
    spills = {
        (c.arch, c.dtype, c.page_size, c.split): (e["spill_stores"], e["spill_loads"])
        for c, e in compiled.items()
        if e["spill_stores"] + e["spill_loads"]
    }
    assert not spills, f"spill stores/loads: {spills}"


@pytest.mark.parametrize("arch", [90, 80])
def test_kv_loads_are_asynchronous_and_double_buffered(compiled, arch):
    for c, e in compiled.items():
        if c.arch == arch and not c.pages:
            assert e["async_copies"] > 0, (c, "no cp.async (LDGSTS) in the SASS")
            assert e["mma"] > 0, (c, "tl.dot did not become MMA instructions")
            assert sorted(e["kv_buffers"]) == [2, 2], (c, e["kv_buffers"])


@pytest.mark.parametrize("arch", [90, 80])
def test_8bit_pages_compile_to_mma_without_spills(compiled, arch):
    """8-bit loads, the scale applied in registers (float8 decoded from its bits on sm_80, where Triton has no
    float8 conversion): no spills, the dot on MMA, the K/V loads asynchronous into rings of three buffers."""
    for c in EIGHT_BIT:
        e = compiled[c]
        if c.arch == arch:
            assert e["spill_stores"] + e["spill_loads"] == 0 and e["mma"] > 0 and e["async_copies"] > 0, (c, e)
            assert e["signature"]["k_cache_ptr"] == ("*u8" if arch == 80 and c.pages != "i8" else "*" + c.pages)
            assert e["kv_buffers"] and set(e["kv_buffers"]) == {3}, (c, e["kv_buffers"])


def test_large_pages_keep_enough_bytes_in_flight_on_hopper(compiled):
    for c, e in compiled.items():
        if c.arch == 90 and c.page_size >= e["tile"]["BLOCK_N"]:
            assert e["kv_bytes_in_flight_per_sm"] >= e["littles_law_bytes_per_sm"], (c, e)


def test_reduction_kernel_compiles():
    for arch, dtype in ((90, "bf16"), (75, "fp16")):
        entry = K.compile_reduce(arch, dtype, 128)
        assert "error" not in entry and entry["spill_stores"] == 0, entry


@pytest.mark.parametrize("arch,dtype", [(90, "bf16"), (80, "fp16")])
def test_cascade_prefix_kernel_compiles_to_mma_without_spills(arch, dtype):
    entry = K.compile_prefix(arch, dtype)
    assert "error" not in entry, entry.get("error")
    assert entry["spill_stores"] + entry["spill_loads"] == 0 and entry["mma"] > 0, entry


def test_bare_signature_is_what_spills():
    """Without the alignment the JIT proves for real tensors, loads stay scalar and the kernel
    spills: the report records this case so the numbers can be reconciled."""
    entry = K.compile_config(K.KernelConfig(90, "bf16", 128, 4, 16, True, hints=False))
    assert "error" not in entry and entry["async_copies"] == 0


def test_occupancy_arithmetic():
    # 128 threads x 160 registers = 20,480 of 65,536: 3 programs; 70 KB of shared memory: 3
    occ = K.occupancy(90, registers=160, shared=71680, num_warps=4)
    assert occ["by_registers"] == 3 and occ["by_shared"] == 3 and occ["programs_per_sm"] == 3
    assert K.littles_law_bytes(90) == int(4.8e12 * 1e-6 / 132)
