"""What the compiler makes of the Triton decode kernel, per GPU target, measured without a GPU.

    python -m paged_ref.lab.bench kernels [--quick] [--jobs N] [--out DIR]

Triton compiles ahead of time for a named target (``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))``) and ships ``cuobjdump``. For every configuration the
launcher can choose (tiles and options from ``triton_decode._tile_config``) on sm_90, sm_80 and
sm_75 (fp16 only), and the defaults with 8-bit pages (16-bit q) on sm_90 and sm_80, with the
signature specialised as the JIT does for a real launch (and once bare, no alignment known), it
records registers, spills, shared memory, asynchronous copies, MMA instructions, the K/V buffer
ring, programs per SM and the K/V bytes in flight per SM against Little's law, and what it takes
to recompile the entry. Output: ``figures/data/kernels.json``.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch

from ..._arith import cdiv, next_pow2
from ...attention.occupancy import SM_LIMITS, programs_per_sm
from .common import bench_parser, environment, print_table, result_file

#: Targets: SMs, per-SM limits and the memory system's datasheet bandwidth (the occupancy
#: model's, :mod:`paged_ref.attention.occupancy`). Little's law asks for bandwidth x latency
#: bytes in flight; LATENCY_S is an assumed ~1 us DRAM round trip.
TARGETS = {arch: asdict(limits) for arch, limits in SM_LIMITS.items()}
TARGET_DTYPES = {90: ("fp16", "bf16", "fp32"), 80: ("fp16", "bf16", "fp32"), 75: ("fp16",)}
EIGHT_BIT_PAGES = ("fp8e4nv", "fp8e5", "i8")  # float8_e4m3fn, float8_e5m2, int8 pages with 16-bit q (sm_90, sm_80)
LATENCY_S = 1e-6
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_DIMS = (64, 80, 128, 256)
GROUPS = (1, 4, 8, 16)
PAGE_SIZES = (1, 16, 64, 256)
NUM_KV_HEADS = 8  # strides of the launch the signature mirrors
CONTEXT = 32768  # block-table width: pages for a 32k-token sequence
SASS_OPS = ("STL", "LDL", "LDGSTS", "UTMALDG", "HMMA", "HGMMA", "LDG", "LDSM")


@dataclass(frozen=True)
class KernelConfig:
    """One configuration of the split kernel for one target."""

    arch: int
    dtype: str  # "fp16" | "bf16" | "fp32"
    head_dim: int
    group: int  # query heads per KV head
    page_size: int
    split: bool  # num_splits > 1 (partials written for the reduction kernel)
    hints: bool = True  # alignment specialisation as the JIT does it (False: bare signature)
    pages: str = ""  # 8-bit K/V pages ("fp8e4nv", "fp8e5", "i8", with page scales) or "": dtype's


def _source(
    name: str, consts: dict, ints: dict, ptr_types: dict, floats: dict, hints: bool, options: dict, kernel=None
):
    """(ASTSource, options, record) of kernel ``name`` (of `triton_decode`, or ``kernel``), its
    signature specialised like a JIT launch."""
    from triton.compiler import ASTSource

    from ...attention import triton_decode as td

    kernel = td.compiled_kernels()[name] if kernel is None else kernel
    sig, attrs, constexprs = {}, {}, dict(consts)
    for i, arg in enumerate(kernel.arg_names):
        if arg in consts:
            sig[arg] = "constexpr"
        elif arg in ptr_types:
            sig[arg] = "*" + ptr_types[arg]
            if hints:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in floats:
            sig[arg] = floats[arg]
        elif hints and ints[arg] == 1:
            sig[arg], constexprs[arg] = "constexpr", 1  # the JIT turns a 1 into a constant
        else:
            sig[arg] = "i32"
            if hints and ints[arg] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    indexed = {(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs, constexprs=indexed)
    attrs = {str(k[0]): v for k, v in attrs.items()}
    record = dict(kernel=kernel.fn.__name__, signature=sig, constexprs=constexprs, attrs=attrs, options=options)
    return src, options, record


def split_kernel_source(cfg: KernelConfig):
    """The ASTSource, launch options and record ``triton_paged_decode`` would compile for ``cfg``."""
    from ...attention import triton_decode as td

    eight_bit = bool(cfg.pages)
    tile = td._tile_config(
        DTYPES[cfg.dtype], cfg.head_dim, cfg.group, interpret=False, capability=cfg.arch, eight_bit=eight_bit
    )
    d, hq = cfg.head_dim, cfg.group * NUM_KV_HEADS
    consts = dict(HEAD_DIM=d, BLOCK_D=tile["BLOCK_D"], GROUP=cfg.group, BLOCK_H=tile["BLOCK_H"])
    consts.update(PAGE_SIZE=cfg.page_size, BLOCK_N=tile["BLOCK_N"], WRITE_PARTIALS=cfg.split)
    # float8 before sm_89: read as uint8 and decoded in the kernel, as the launcher does
    fp8_bits = {"fp8e4nv": 1, "fp8e5": 2}.get(cfg.pages, 0) if cfg.arch < 89 else 0
    consts.update(DOT_PRECISION="ieee" if cfg.dtype == "fp32" else "tf32", SCALED=eight_bit, FP8_BITS=fp8_bits)
    page_dtype = "u8" if fp8_bits else cfg.pages or cfg.dtype
    ints = dict(num_splits=6 if cfg.split else 1, stride_q_batch=hq * d, stride_q_head=d)
    ints.update(stride_cache_page=cfg.page_size * NUM_KV_HEADS * d, stride_cache_token=NUM_KV_HEADS * d)
    ints.update(stride_cache_head=d, stride_bt_batch=cdiv(CONTEXT, cfg.page_size), stride_o_batch=hq * d)
    ints["stride_o_head"] = d
    ptrs = dict.fromkeys(("q_ptr", "out_ptr"), cfg.dtype) | dict.fromkeys(("k_cache_ptr", "v_cache_ptr"), page_dtype)
    ptrs.update(dict.fromkeys(("block_table_ptr", "seq_lens_ptr"), "i32"))
    ptrs.update(dict.fromkeys(("part_m_ptr", "part_l_ptr", "part_acc_ptr"), "fp32"))
    # 8-bit pages: per-page scales [num_pages, NUM_KV_HEADS]; else q stands in for them (strides 0, unused)
    ptrs.update(dict.fromkeys(("k_scale_ptr", "v_scale_ptr"), "fp32" if cfg.pages else cfg.dtype))
    ints.update(stride_ks_page=NUM_KV_HEADS if cfg.pages else 0, stride_ks_head=1 if cfg.pages else 0)
    ints.update(stride_vs_page=ints["stride_ks_page"], stride_vs_head=ints["stride_ks_head"])
    options = {k: v for k, v in tile.items() if not k.startswith("BLOCK_")}
    floats = {"scale_log2": "fp32"}
    src, options, record = _source("_paged_decode_split_kernel", consts, ints, ptrs, floats, cfg.hints, options)
    return src, options, dict(record, tile=tile)


def read_cubin(cubin: bytes) -> dict:
    """Registers, stack, spills and instruction counts of one compiled kernel (cuobjdump)."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name

    def dump(flag):
        return subprocess.run([cuobjdump, flag, path], check=True, capture_output=True, text=True).stdout

    try:
        usage, sass = dump("--dump-resource-usage"), dump("--dump-sass")
    finally:
        os.unlink(path)
    registers, stack, _, local = map(int, re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage).groups())
    counts = {op: len(re.findall(rf"\b{op}(?=[.\s])", sass)) for op in SASS_OPS}
    entry = dict(registers=registers, stack_bytes=stack, local_bytes=local, spill_stores=counts.pop("STL"))
    entry.update(spill_loads=counts.pop("LDL"), async_copies=counts.pop("LDGSTS"), tma_loads=counts.pop("UTMALDG"))
    return dict(entry, mma=counts.pop("HMMA") + counts.pop("HGMMA"), sass=counts)


def kv_buffers(ttgir: str) -> list[int]:
    """Depth of each buffer ring the pipeliner allocated in shared memory (``NxBLOCK_NxD``)."""
    return [int(n) for n in re.findall(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)]


def occupancy(arch: int, registers: int, shared: int, num_warps: int) -> dict:
    """Programs (CTAs) per SM allowed by each resource; the smallest one wins."""
    return programs_per_sm(registers, shared, num_warps, SM_LIMITS[arch])


def littles_law_bytes(arch: int) -> int:
    """Bytes one SM must keep in flight for the chip to reach its datasheet bandwidth at LATENCY_S
    (bandwidth x latency over the SMs): 36,363 on sm_90."""
    limits = SM_LIMITS[arch]
    return int(limits.bandwidth * LATENCY_S / limits.sms)


def bytes_in_flight(tile_bytes: int, ring_depth: int, asynchronous: bool) -> int:
    """K/V bytes one program has loading while it computes: ``k - 1`` tiles each of K and V with
    an asynchronous ring of depth ``k``, else one tile (it waits on each load)."""
    return 2 * (ring_depth - 1) * tile_bytes if asynchronous and ring_depth > 1 else tile_bytes


def _compile(arch: int, source) -> tuple[dict, object]:
    """(record, compiled kernel or None, with the error in the record) of one source for ``arch``."""
    import triton
    from triton.backends.compiler import GPUTarget

    src, options, record = source
    try:
        return record, triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as err:  # a compile error is a result
        return dict(record, error=f"{type(err).__name__}: {err}"[:2000]), None


def compile_config(cfg: KernelConfig) -> dict:
    """Compile ``cfg`` for its target and read what came out."""
    source = split_kernel_source(cfg)
    start = time.perf_counter()
    record, ck = _compile(cfg.arch, source)
    if ck is None:
        return dict(asdict(cfg), **record)
    entry = dict(asdict(cfg), **record, compile_s=round(time.perf_counter() - start, 2))
    entry.update(read_cubin(ck.asm["cubin"]))
    entry["shared_bytes"] = ck.metadata.shared
    entry["kv_buffers"] = kv_buffers(ck.asm["ttgir"])
    entry.update(occupancy(cfg.arch, entry["registers"], entry["shared_bytes"], record["options"]["num_warps"]))
    tile = record["tile"]
    tile_bytes = tile["BLOCK_N"] * tile["BLOCK_D"] * (1 if cfg.pages else DTYPES[cfg.dtype].itemsize)
    # With an asynchronous ring of depth k per K and V, k - 1 tiles of each are loading while
    # one is consumed; without asynchronous copies a program waits on one K tile at a time.
    depth = max(entry["kv_buffers"], default=1)
    asynchronous = entry["async_copies"] + entry["tma_loads"] > 0
    per_program = bytes_in_flight(tile_bytes, depth, asynchronous)
    entry["tile_bytes"] = tile_bytes
    entry["kv_bytes_in_flight_per_sm"] = per_program * entry["programs_per_sm"]
    entry["littles_law_bytes_per_sm"] = littles_law_bytes(cfg.arch)
    return entry


def compile_reduce(arch: int, dtype: str, head_dim: int) -> dict:
    """Compile the reduction kernel as ``triton_paged_decode`` launches it after a split run."""
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_S=8)
    ints = dict(num_splits=6, stride_o_batch=NUM_KV_HEADS * 4 * head_dim, stride_o_head=head_dim)
    ptrs = dict(part_m_ptr="fp32", part_l_ptr="fp32", part_acc_ptr="fp32", out_ptr=dtype)
    record, ck = _compile(arch, _source("_reduce_splits_kernel", consts, ints, ptrs, {}, True, dict(num_warps=4)))
    entry = dict(arch=arch, dtype=dtype, head_dim=head_dim, **record)
    if ck is not None:
        entry.update(shared_bytes=ck.metadata.shared, **read_cubin(ck.asm["cubin"]))
    return entry


def compile_prefix(arch: int, dtype: str, head_dim: int = 128, group: int = 4, page_size: int = 16) -> dict:
    """Compile the cascade's prefix kernel (`paged_ref.attention.triton_cascade`) as it launches
    for a group of 32 requests (block-table and group tensors int32)."""
    from ...attention import triton_cascade as tc
    from ...attention._triton_interpreter import runnable

    tile = tc.prefix_tile_config(DTYPES[dtype], head_dim, 32 * group, interpret=False)
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=tile["BLOCK_D"], GROUP=group, BLOCK_M=tile["BLOCK_M"])
    consts.update(PAGE_SIZE=page_size, BLOCK_N=tile["BLOCK_N"], DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
    hq = group * NUM_KV_HEADS
    ints = dict(
        stride_q_batch=hq * head_dim, stride_q_head=head_dim, stride_cache_page=page_size * NUM_KV_HEADS * head_dim
    )
    ints.update(stride_cache_token=NUM_KV_HEADS * head_dim, stride_cache_head=head_dim)
    ints["stride_bt_batch"] = cdiv(CONTEXT, page_size)
    ptrs = dict.fromkeys(("q_ptr", "k_cache_ptr", "v_cache_ptr"), dtype)
    ptrs.update(dict.fromkeys(("block_table_ptr", "group_indptr_ptr", "prefix_lens_ptr"), "i32"))
    ptrs.update(out_ptr="fp32", lse_ptr="fp32")
    options = {k: v for k, v in tile.items() if not k.startswith("BLOCK_")}
    kernel = runnable(tc._prefix_kernel, interpret=False)  # the compiled-mode JITFunction
    source = _source("_prefix_kernel", consts, ints, ptrs, {"scale_log2": "fp32"}, True, options, kernel)
    record, ck = _compile(arch, source)
    entry = dict(arch=arch, dtype=dtype, head_dim=head_dim, group=group, page_size=page_size, **record, tile=tile)
    if ck is not None:
        entry.update(
            shared_bytes=ck.metadata.shared, kv_buffers=kv_buffers(ck.asm["ttgir"]), **read_cubin(ck.asm["cubin"])
        )
        entry.update(occupancy(arch, entry["registers"], entry["shared_bytes"], options["num_warps"]))
    return entry


def all_configs(quick: bool = False) -> list[KernelConfig]:
    """Every configuration the launcher can choose on each target (``quick``: the defaults), then the 8-bit
    pages' defaults."""
    head_dims, groups, pages = ((128,), (4,), (16, 64)) if quick else (HEAD_DIMS, GROUPS, PAGE_SIZES)
    eight_bit = [
        KernelConfig(arch, dt, 128, 4, p, split, pages=fmt)
        for arch in (90, 80)
        for dt in ("fp16", "bf16")
        for fmt in EIGHT_BIT_PAGES
        for p in (16, 64)
        for split in (False, True)
    ]
    return [
        KernelConfig(arch, dt, d, g, p, split)
        for arch, dtypes in TARGET_DTYPES.items()
        for dt in dtypes
        if not (quick and dt == "fp32")
        for d in head_dims
        for g in groups
        for p in pages
        for split in (False, True)
    ] + eight_bit


def run(configs: list[KernelConfig], jobs: int = 2, checkpoint=None, every: int = 32) -> list[dict]:
    """Compile every config in ``jobs`` worker processes (compiles are single-threaded);
    ``checkpoint(entries)``, if given, receives the entries so far every ``every`` configs."""
    pool = ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else None
    entries = []
    try:
        for entry in pool.map(compile_config, configs, chunksize=4) if pool else map(compile_config, configs):
            entries.append(entry)
            if checkpoint is not None and len(entries) % every == 0:
                checkpoint(entries)
    finally:
        if pool is not None:
            pool.shutdown()
    return entries


def summary(entries: list[dict]) -> dict:
    """Per target: configurations, compile errors, 16-bit ones that spill, and the rest."""
    out = {}
    for arch in sorted({e["arch"] for e in entries}, reverse=True):
        mine = [e for e in entries if e["arch"] == arch and e["hints"] and not e.get("pages")]
        ok = [e for e in mine if "error" not in e]
        half = [e for e in ok if e["dtype"] != "fp32"]
        big = [e for e in half if e["page_size"] >= e["tile"]["BLOCK_N"]]
        row = out[TARGETS[arch]["name"]] = dict(configs=len(mine), errors=len(mine) - len(ok))
        row["spilling_16bit"] = sum(e["spill_stores"] + e["spill_loads"] > 0 for e in half)
        row["max_registers"] = max((e["registers"] for e in ok), default=None)
        row["asynchronous_16bit"] = sum(e["async_copies"] + e["tma_loads"] > 0 for e in half)
        row["large_pages_16bit"] = len(big)
        row["large_pages_meeting_littles_law"] = sum(
            e["kv_bytes_in_flight_per_sm"] >= e["littles_law_bytes_per_sm"] for e in big
        )
        q8 = [e for e in entries if e["arch"] == arch and e.get("pages")]  # 8-bit pages
        row["eight_bit"] = dict(configs=len(q8), errors=sum("error" in e for e in q8))
        row["eight_bit"]["spilling"] = sum(e.get("spill_stores", 0) + e.get("spill_loads", 0) > 0 for e in q8)
    return out


SUMMARY_COLUMNS = [  # (header, cell of a summary row)
    ("configs", "{configs}"),
    ("errors", "{errors}"),
    ("16-bit spilling", "{spilling_16bit}"),
    ("max regs", "{max_registers}"),
    ("16-bit async", "{asynchronous_16bit}"),
    ("page>=BLOCK_N at Little", "{large_pages_meeting_littles_law}/{large_pages_16bit}"),
]


def main(argv=None):
    parser = bench_parser("kernels", __doc__)
    parser.add_argument("--quick", action="store_true", help="the default configurations only")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (default: one per core)"
    )
    args = parser.parse_args(argv)
    result = result_file(parser, args.out, "kernels.json")  # checked before anything is compiled
    import triton

    configs = all_configs(args.quick) + [KernelConfig(90, "bf16", 128, 4, 16, True, hints=False)]  # + one bare
    start = time.perf_counter()
    command = "python -m paged_ref.lab.bench kernels" + (" --quick" if args.quick else "")
    head = dict(benchmark="kernels", quick=args.quick, command=command, triton=triton.__version__)
    head["environment"] = environment()
    entries = run(configs, jobs=args.jobs, checkpoint=lambda done: result.save({**head, "split_kernel": done}))
    head_dims = (128,) if args.quick else HEAD_DIMS
    reduce = [compile_reduce(a, dt, d) for a, dtypes in TARGET_DTYPES.items() for dt in dtypes for d in head_dims]
    assumptions = dict(latency_s=LATENCY_S, targets=TARGETS, num_kv_heads=NUM_KV_HEADS, context=CONTEXT)
    data = dict(head, assumptions=assumptions, elapsed_s=round(time.perf_counter() - start, 1))
    prefix = [compile_prefix(a, dt) for a in (90, 80) for dt in ("bf16", "fp16")]  # the cascade's prefix kernel
    data.update(summary=summary(entries), split_kernel=entries, reduce_kernel=reduce, prefix_kernel=prefix)
    rows = [[name] + [cell.format(**s) for _, cell in SUMMARY_COLUMNS] for name, s in data["summary"].items()]
    print_table(["target"] + [header for header, _ in SUMMARY_COLUMNS], rows)
    b = entries[-1]
    print(
        f"bare signature (no alignment known), {b['dtype']} page {b['page_size']} sm_90: "
        f"{b.get('registers')} registers, {b.get('spill_stores')} spill stores, "
        f"{b.get('async_copies')} async copies"
    )
    path = result.save(data, complete=True)
    print(f"wrote {path} in {data['elapsed_s']} s")
    return data


if __name__ == "__main__":
    main()
