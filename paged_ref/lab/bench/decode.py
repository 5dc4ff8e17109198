"""Decode attention over a paged KV cache: the Triton kernel against its peers.

    python -m paged_ref.lab.bench decode [--quick] [--out DIR]          (CUDA GPU, < 4 min)
    python -m paged_ref.lab.bench decode --cpu [--quick] [--out DIR]    (no GPU, seconds)

GPU (bfloat16, 32 query heads over 8 KV heads of 128: Llama-3-8B's attention, 32 layers;
batch x length (1, 131072), (8, 32768), (64, 4096), (256, 2048); pages of 16, 64, 128). A
device-to-device copy first (the bandwidth ceiling: bytes read + written / time), then per case,
in this order: SDPA on a contiguous cache; ``triton_paged_decode`` on shuffled pages (with the
host seconds one call takes to return, `host_median`); the same call captured in a CUDA graph and
replayed (the kernels alone: a plain call's time includes the host's whenever the host is the
slower of the two); the kernel on an identity block table (the cost of paging itself); while
``--budget-s`` lasts (and from batches of ``--flex-min-batch`` on), compiled ``flex_paged_decode``
as a model calls it, its BlockMask built once per step and reused by every layer (the call with
the mask given, and the mask's build time), then as a user calling it alone pays, building its
BlockMask per call; ``triton_paged_decode`` again (the run-to-run spread); with ``--eight-bit``, at page size
``EIGHT_BIT_PAGE_SIZE`` only, the kernel on the same pages stored in float8_e4m3fn with a scale per
page and KV head (``paged_decode fp8``: its bytes are a byte a value plus the scales; its error is
against float32 attention on the values those bytes hold). Each: median time
(``triton.testing.do_bench``: CUDA events, L2 flushed before each run), bandwidth = bytes of K and
V read / time, its share of the copy's, the error against float32, and the ratios between
implementations (`summarize_gpu`; flex per step counts the mask's build once per ``LAYERS``
calls; ``fp8/paged``: the 8-bit kernel's time over the 16-bit one's). JSON: ``figures/data/decode_gpu.json``.

CPU (``--cpu``): small float32 sizes; the reference, eager FlexAttention and SDPA are timed
(`cpu_median`); the Triton kernel runs once through the interpreter for correctness, untimed (with
``--eight-bit``, on float8_e4m3fn pages too).
JSON: ``figures/data/decode_cpu.json``.
"""

from __future__ import annotations

import time
from functools import partial

import torch
import torch.nn.functional as F

from ... import quant
from ...attention import triton_decode as td
from ...attention.reference import reference_paged_decode
from ._decode_report import summarize_gpu
from .common import (
    bench_parser,
    command_line,
    copy_bandwidth,
    cpu_median,
    environment,
    gpu_median,
    graph_median,
    host_median,
    print_table,
    result_file,
)

try:
    from ...attention.flex import flex_paged_decode, paged_block_masks
except ImportError:  # flex module missing or this torch lacks FlexAttention
    flex_paged_decode = paged_block_masks = None

GPU_SHAPES = [(1, 131072), (8, 32768), (64, 4096), (256, 2048)]
GPU_PAGE_SIZES = [16, 64, 128]
GPU_HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
CPU_SHAPES = [(1, 2048), (8, 512)]
CPU_PAGE_SIZES = [16, 64]
CPU_HEADS = dict(num_q_heads=8, num_kv_heads=2, head_dim=64)
EIGHT_BIT = torch.float8_e4m3fn  # `--eight-bit`: vLLM's "fp8" format
EIGHT_BIT_PAGE_SIZE = 16  # the one page size `--eight-bit` measures (the GPU plan's time)
LAYERS = 32  # decoder layers of the model whose attention GPU_HEADS is (Llama-3-8B): calls per BlockMask
GPU_CALLS = dict(  # how the GPU run times and calls, recorded in its config
    timing="triton.testing.do_bench median (CUDA events, L2 flushed)",
    bandwidth="bytes of K and V read / median time",
    paged_decode_call="check_values=False, num_splits=None",
    graph_call="the paged_decode call captured in a CUDA graph, replays timed: the kernels without host time",
    host_time="host_s: median seconds a paged_decode call takes to return on the host (GPU queue not full)",
    flex_call="flex_paged_decode as a user calls it: builds the BlockMask on every call",
    flex_reused_call=(
        "flex_paged_decode(block_mask=...) as a model calls it: the mask built once per step (block_mask_s) "
        f"and reused by its {LAYERS} layers"
    ),
    layers=LAYERS,
)
FLEX_KW = {"check_values": False}  # no host-side value checks inside timed loops


def make_inputs(batch, seq_len, *, num_q_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    """Random q: [batch, Hq, D] and a contiguous k, v: [batch * seq_len, Hkv, D] (sequence b in
    rows b*seq_len .. (b+1)*seq_len - 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, num_q_heads, head_dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(batch * seq_len, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(batch * seq_len, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    return q, k, v


def page_layouts(k, v, batch, seq_len, page_size, seed=0):
    """The same K/V as pages in order (identity block table) and shuffled: two tuples
    (k_cache, v_cache, block_table), caches [num_pages, page_size, Hkv, D], tables int32."""
    num_pages = batch * seq_len // page_size
    k_pages = k.view(num_pages, page_size, *k.shape[1:])  # a view: no copy
    v_pages = v.view(num_pages, page_size, *v.shape[1:])
    identity = torch.arange(num_pages, dtype=torch.int32, device=k.device).view(batch, -1)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    where = torch.randperm(num_pages, generator=gen).to(k.device)  # logical page i -> where[i]
    k_shuffled, v_shuffled = torch.empty_like(k_pages), torch.empty_like(v_pages)
    k_shuffled[where], v_shuffled[where] = k_pages, v_pages
    shuffled = where.to(torch.int32).view(batch, -1)
    return (k_pages, v_pages, identity), (k_shuffled, v_shuffled, shuffled)


def eight_bit_pages(k_cache, v_cache, block_table, batch, seq_len):
    """``(k8, v8, k_scale, v_scale)``: the pages in float8_e4m3fn with a scale per page and KV head
    (`paged_ref.quant.calibrate`), and the values they hold as contiguous float32 ``k, v [batch * seq_len,
    Hkv, D]`` (logical order, through ``block_table``) for the reference."""
    out, held = [], []
    for cache in (k_cache, v_cache):
        scale = quant.calibrate(cache, EIGHT_BIT, dim=(1, 3))  # [num_pages, Hkv]
        pages = quant.quantize(cache, scale[:, None, :, None], EIGHT_BIT)  # [num_pages, P, Hkv, D]
        out.append((pages, scale))
        values = quant.dequantize(pages, scale[:, None, :, None])[block_table.flatten().long()]  # logical order
        held.append(values.view(batch * seq_len, *cache.shape[2:]))
    (k8, ks), (v8, vs) = out
    return (k8, v8, ks, vs), held


def reference_attention(q, k, v, batch, seq_len, dtype=torch.float32):
    """Attention of equal-length sequences from the contiguous K/V, in ``dtype``: [batch, Hq, D]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    group = q.shape[1] // num_kv_heads
    qg = q.to(dtype).view(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    kk = k.to(dtype).view(batch, seq_len, num_kv_heads, head_dim)  # [B, L, Hkv, D]
    vv = v.to(dtype).view(batch, seq_len, num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, kk) * head_dim**-0.5  # [B, Hkv, G, L]
    out = torch.einsum("bhgl,blhd->bhgd", scores.softmax(-1), vv)  # [B, Hkv, G, D]
    return out.reshape(q.shape)


def rel_err(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _sdpa(q, k4, v4, num_q_heads, num_kv_heads):
    """SDPA decode: q [B, Hq, D], k4/v4 [B, Hkv, L, D] -> [B, Hq, D]."""
    return F.scaled_dot_product_attention(q.unsqueeze(2), k4, v4, enable_gqa=num_q_heads != num_kv_heads).squeeze(2)


def _contiguous_4d(k, v, batch, seq_len):
    """k, v as [B, Hkv, L, D] copies, SDPA's layout."""
    return [t.view(batch, seq_len, *t.shape[1:]).transpose(1, 2).contiguous() for t in (k, v)]


def _planned_splits(batch, seq_len, heads, dtype, device):
    """The split count triton_paged_decode(num_splits=None, check_values=False) picks here."""
    group = heads["num_q_heads"] // heads["num_kv_heads"]
    device = torch.device(device)
    cfg = td._tile_config(dtype, heads["head_dim"], group, interpret=td.interpreted(device))
    return td._default_num_splits(batch, heads["num_kv_heads"], seq_len, device, cfg)


def run_gpu(
    shapes,
    page_sizes,
    *,
    budget_s,
    rep_ms,
    flex_min_batch=1,
    eight_bit=False,
    heads=GPU_HEADS,
    dtype=None,
    device="cuda",
    checkpoint=None,
):
    """Measure every implementation on every (shape, page size), in the module docstring's order.

    ``eight_bit``: also the kernel on float8_e4m3fn pages at page size `EIGHT_BIT_PAGE_SIZE`.
    ``heads``, ``dtype`` (None: the GPU's native 16-bit type) and ``device`` let tests run the
    harness on small CPU sizes. ``checkpoint(part)``, if given, receives ``{"copy", "results",
    "notes", "errors"}`` measured so far after each (shape, page size).
    """
    if dtype is None:
        dtype = td.native_half(device)
    started = time.perf_counter()
    copy = copy_bandwidth()
    print(
        f"device-to-device copy: {copy['bandwidth_GBps']:.0f} GB/s "
        f"({copy['bytes'] / 1e9:.2f} GB in {copy['median_s'] * 1e3:.3f} ms)",
        flush=True,
    )
    results, notes, errors = [], [], []
    if flex_paged_decode is None:
        notes.append("flex_paged_decode not importable: not measured")
    elem = torch.empty((), dtype=dtype).element_size()

    def measure(page_size, impl, fn, out=None, seconds=None, kv_bytes=None, against=None, **extra):
        """Time ``fn`` for the current (batch, seq_len) (unless ``seconds`` is given); check ``out``
        (None: ``fn()`` after timing) against ``against`` (None: ``ref``); ``kv_bytes``: None for 16-bit K/V."""
        seconds = gpu_median(fn, rep_ms=rep_ms) if seconds is None else seconds
        out = fn() if out is None else out
        kv_bytes = (
            2 * batch * seq_len * heads["num_kv_heads"] * heads["head_dim"] * elem if kv_bytes is None else kv_bytes
        )
        bandwidth = kv_bytes / seconds / 1e9
        row = dict(batch=batch, seq_len=seq_len, page_size=page_size, impl=impl, median_s=seconds, kv_bytes=kv_bytes)
        error = rel_err(out, ref if against is None else against)
        row.update(bandwidth_GBps=bandwidth, frac_of_copy=bandwidth / copy["bandwidth_GBps"], rel_err=error)
        results.append(row | extra)
        print(
            f"  {impl:<24} page {str(page_size):>4}: {seconds * 1e6:9.1f} us {bandwidth:7.0f} GB/s "
            f"({row['frac_of_copy']:.0%} of copy) rel_err {row['rel_err']:.1e}",
            flush=True,
        )

    def peer(page_size, impl, fn, **extra):
        """Time a peer implementation after a first call (flex compiles); a failure is noted."""
        try:
            measure(page_size, impl, fn, out=fn(), **extra)
        except Exception as exc:
            where = f"({batch}, {seq_len}, page {page_size})"
            errors.append(f"{impl} failed at {where}: {type(exc).__name__}: {str(exc)[:300]}")
            print(f"  {impl} failed: {type(exc).__name__}", flush=True)

    for batch, seq_len in shapes:
        print(f"batch {batch} x length {seq_len}:", flush=True)
        q, k, v = make_inputs(batch, seq_len, dtype=dtype, device=device, **heads)
        ref = reference_attention(q, k, v, batch, seq_len)  # float32
        lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        k4, v4 = _contiguous_4d(k, v, batch, seq_len)  # SDPA: independent of the page size
        peer(None, "sdpa contiguous", lambda: _sdpa(q, k4, v4, heads["num_q_heads"], heads["num_kv_heads"]))
        k4 = v4 = None  # free the contiguous copies before the paged runs
        splits = _planned_splits(batch, seq_len, heads, dtype, device)
        for page_size in page_sizes:
            contiguous, paged = page_layouts(k, v, batch, seq_len, page_size)
            paged_out = td.triton_paged_decode(q, *paged, lens)  # values checked once, untimed
            run_paged = partial(td.triton_paged_decode, q, *paged, lens, check_values=False)
            run_contig = partial(td.triton_paged_decode, q, *contiguous, lens, check_values=False)
            host_s = host_median(run_paged)
            measure(page_size, "paged_decode", run_paged, out=paged_out, num_splits=splits, host_s=host_s)
            try:
                seconds, graph_out = graph_median(run_paged, rep_ms=rep_ms)
                measure(page_size, "paged_decode (CUDA graph)", run_paged, graph_out, seconds, num_splits=splits)
            except Exception as exc:
                errors.append(
                    f"CUDA graph of paged_decode failed at ({batch}, {seq_len}, page {page_size}): {exc!r}"[:400]
                )
            measure(page_size, "paged_decode contiguous", run_contig, num_splits=splits)
            if eight_bit and page_size == EIGHT_BIT_PAGE_SIZE:
                (k8, v8, ks, vs), held = eight_bit_pages(*paged, batch, seq_len)
                ref8 = reference_attention(q, *held, batch, seq_len)  # float32 on what the bytes hold
                run8 = partial(td.triton_paged_decode, q, k8, v8, paged[2], lens, check_values=False)
                run8 = partial(run8, k_scale=ks, v_scale=vs)
                kv8 = k8.numel() + v8.numel() + 4 * (ks.numel() + vs.numel())  # a byte a value, float32 scales
                measure(page_size, "paged_decode fp8", run8, kv_bytes=kv8, against=ref8, num_splits=splits)
                del k8, v8, ks, vs, held, ref8, run8
            if flex_paged_decode is not None:
                where = f"({batch}, {seq_len}, page {page_size})"
                if batch < flex_min_batch:
                    notes.append(f"flex left out at {where}: batch below --flex-min-batch {flex_min_batch}")
                elif time.perf_counter() - started > budget_s:
                    notes.append(f"flex skipped at {where}: time budget {budget_s:.0f} s used")
                else:
                    num_pages = paged[0].shape[0]
                    build = partial(paged_block_masks, paged[2], lens, num_pages, page_size)
                    try:
                        mask = build().physical  # once per step in a model, shared by its layers
                        mask_s = gpu_median(build, rep_ms=rep_ms)
                    except Exception as exc:
                        errors.append(f"BlockMask failed at ({batch}, {seq_len}, page {page_size}): {exc!r}"[:400])
                    else:
                        reused = partial(flex_paged_decode, q, *paged, lens, block_mask=mask, **FLEX_KW)
                        peer(page_size, "flex_paged_decode (mask reused)", reused, block_mask_s=mask_s)
                        del mask, reused
                    peer(page_size, "flex_paged_decode", partial(flex_paged_decode, q, *paged, lens, **FLEX_KW))
            measure(page_size, "paged_decode (again)", run_paged, num_splits=splits)  # the spread is the noise
            del contiguous, paged, run_paged, run_contig
            if checkpoint is not None:
                checkpoint(dict(copy=copy, results=results, notes=notes, errors=errors))
        q = k = v = ref = None  # free before the next shape
        if device == "cuda":
            torch.cuda.empty_cache()
    return dict(copy=copy, results=results, notes=notes, errors=errors, elapsed_s=time.perf_counter() - started)


def run_cpu(shapes, page_sizes, *, repeats, eight_bit=False):
    heads = CPU_HEADS
    results, correctness, notes, errors = [], [], [], []
    if flex_paged_decode is None:
        notes.append("flex_paged_decode not importable: not measured")
    for batch, seq_len in shapes:
        q, k, v = make_inputs(batch, seq_len, dtype=torch.float32, device="cpu", **heads)
        ref = reference_attention(q, k, v, batch, seq_len, torch.float64)
        lens = torch.full((batch,), seq_len, dtype=torch.int32)
        k4, v4 = _contiguous_4d(k, v, batch, seq_len)
        impls = [("sdpa contiguous", None, partial(_sdpa, q, k4, v4, heads["num_q_heads"], heads["num_kv_heads"]))]
        for page_size in page_sizes:
            _, paged = page_layouts(k, v, batch, seq_len, page_size)
            impls.append(("reference", page_size, partial(reference_paged_decode, q, *paged, lens)))
            if flex_paged_decode is not None:
                impls.append(
                    ("flex_paged_decode (eager)", page_size, partial(flex_paged_decode, q, *paged, lens, **FLEX_KW))
                )
            out = td.triton_paged_decode(q, *paged, lens)  # the interpreter: once, for correctness only
            case = dict(batch=batch, seq_len=seq_len, page_size=page_size)
            correctness.append(dict(case, impl="paged_decode (interpreter)", rel_err=rel_err(out, ref)))
            if eight_bit:
                (k8, v8, ks, vs), held = eight_bit_pages(*paged, batch, seq_len)
                out = td.triton_paged_decode(q, k8, v8, paged[2], lens, k_scale=ks, v_scale=vs)
                ref8 = reference_attention(q, *held, batch, seq_len, torch.float64)
                correctness.append(dict(case, impl="paged_decode fp8 (interpreter)", rel_err=rel_err(out, ref8)))
        for impl, page_size, fn in impls:
            try:
                out = fn()
                timing = cpu_median(fn, repeats=repeats)
            except Exception as exc:
                errors.append(f"{impl} at ({batch}, {seq_len}, page {page_size}) failed: {type(exc).__name__}: {exc}")
                continue
            case = dict(batch=batch, seq_len=seq_len, page_size=page_size, impl=impl)
            results.append(dict(case, median_s=timing["median_s"], rel_err=rel_err(out, ref)))
    table = []
    for r in results + correctness:
        ms = f"{r['median_s'] * 1e3:.2f}" if "median_s" in r else "not timed"
        table.append([f"({r['batch']}, {r['seq_len']})", r["page_size"] or "-", r["impl"], ms, f"{r['rel_err']:.1e}"])
    print_table(["batch x len", "page", "implementation", "median ms", "rel err vs fp64"], table)
    return dict(results=results, correctness=correctness, notes=notes, errors=errors)


def main(argv=None):
    parser = bench_parser("decode", __doc__)
    parser.add_argument("--cpu", action="store_true", help="small float32 sizes on the CPU (reference, flex, SDPA)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes, shorter timing")
    parser.add_argument(
        "--budget-s", type=float, default=150.0, help="GPU: stop starting flex measurements after this many seconds"
    )
    parser.add_argument(
        "--flex-min-batch", type=int, default=1, help="GPU: measure flex only at batches of at least this many"
    )
    parser.add_argument(
        "--eight-bit", action="store_true", help=f"also float8_e4m3fn pages (page size {EIGHT_BIT_PAGE_SIZE} on GPU)"
    )
    args = parser.parse_args(argv)
    command = command_line("decode", argv)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA GPU: run with --cpu for the CPU harness")
    result = result_file(parser, args.out, "decode_cpu.json" if args.cpu else "decode_gpu.json")
    data = dict(benchmark="decode", mode="cpu" if args.cpu else "gpu", command=command, environment=environment())
    if args.cpu:
        shapes, pages = ([(2, 256)], [16]) if args.quick else (CPU_SHAPES, CPU_PAGE_SIZES)
        data["config"] = dict(dtype="float32", shapes=shapes, page_sizes=pages, **CPU_HEADS)
        data.update(run_cpu(shapes, pages, repeats=3 if args.quick else 7, eight_bit=args.eight_bit))
    else:
        shapes, pages = ([(8, 32768), (64, 4096)], [16, 128]) if args.quick else (GPU_SHAPES, GPU_PAGE_SIZES)
        dtype = str(td.native_half("cuda")).removeprefix("torch.")
        data["config"] = dict(dtype=dtype, shapes=shapes, page_sizes=pages, **GPU_CALLS, **GPU_HEADS)

        def checkpoint(part):
            data.update(part)
            result.save(data)

        rep_ms = 50 if args.quick else 100
        measured = run_gpu(
            shapes,
            pages,
            budget_s=args.budget_s,
            rep_ms=rep_ms,
            flex_min_batch=args.flex_min_batch,
            eight_bit=args.eight_bit,
            checkpoint=checkpoint,
        )
        data.update(measured)
        data["ratios"], data["goals"] = summarize_gpu(data)
    for n in data["notes"]:
        print("note:", n)
    for e in data["errors"]:
        print("error:", e)
    path = result.save(data, complete=True)
    print(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()
