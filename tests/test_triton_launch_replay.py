"""Every Triton launch of the GPU run (`bench gpu`), replayed without a GPU and compiled for sm_90.

A kernel launch compiles once per *specialization*: Triton's argument binding turns each call's
arguments into a key (dtypes, constexprs, and for integers and pointers whether they equal 1 or
are multiples of 16), and every new key is a compile on the GPU. Here the GPU run's calls of
`triton_paged_decode` are recorded on the CPU with the launcher told it is on an H200 (tile sizes and
split counts as on sm_90 with 132 SMs, nothing launched), passed through Triton's own binder
for a CUDA sm_90 target, and every distinct key is compiled for sm_90 (Triton's cache makes
reruns fast). Recorded calls:

* ``tests``: the `gpu`-marked tests of tests/test_triton_decode.py, called as they are;
* ``decode``: `bench decode`'s `run_gpu` on its GPU shapes and page sizes (inputs left
  uninitialized, timing and peers stubbed: only the launches matter);
* ``scaling``: `bench scaling --gpu` decodes through the session's ``triton`` backend
  (``check_values=False``, default split count) on Llama-3.2-1B's geometry in bf16; its calls
  are built from the GPU profile (every context of the ladder and its steps, the 100k-token
  sequence, the mixed batch's sizes, the page-size sweep) rather than recorded from a run of a
  1B model on this CPU.

The counts feed `paged_ref.lab.bench.gpu`'s budgets (`gpu.TRITON_COMPILES`), checked here.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor

import attention_cases
import pytest
import test_triton_decode as gpu_tests
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from paged_ref._arith import cdiv
from paged_ref.attention import triton_decode as td
from paged_ref.attention.occupancy import choose_num_splits
from paged_ref.lab.bench import decode, gpu
from paged_ref.lab.bench._scaling_models import LLAMA_1B_SHAPES
from paged_ref.lab.bench.scaling import PAGE_SIZE, PROFILES
from paged_ref.lab.bench.scaling_report import mixed_lengths

TARGET = GPUTarget("cuda", 90, 32)
H200_SMS = 132


class Recorder:
    """Stands in for the kernels while a GPU run is replayed: each launch's arguments are kept."""

    def __init__(self):
        self.launches = []  # (kernel name, args, kwargs) per launch

    def kernel(self, fn, interpret):
        recorder = self

        class Capture:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: recorder.launches.append((fn.__name__, args, kwargs))

        return Capture()

    def launch(self, q, k_cache, v_cache, block_table, seq_lens, out, scale, num_splits, keep_partials=False, **cfg):
        out.zero_()  # written, as a launch would (the tests look for NaN)
        return _LAUNCH(q, k_cache, v_cache, block_table, seq_lens, out, scale, num_splits, keep_partials, **cfg)


_LAUNCH = td._launch


def _as_h200(monkeypatch, recorder):
    """The launcher believes it runs on an H200 (sm_90, 132 SMs), and launches nothing."""
    monkeypatch.setattr(td, "interpreted", lambda device: False)
    monkeypatch.setattr(td, "_capability", lambda device: 90)
    monkeypatch.setattr(td, "_num_sms", lambda device: H200_SMS)
    monkeypatch.setattr(td, "native_half", lambda device: torch.bfloat16)
    monkeypatch.setattr(td, "_kernel", recorder.kernel)
    monkeypatch.setattr(td, "_launch", recorder.launch)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())


def record_tests(monkeypatch):
    recorder = Recorder()
    _as_h200(monkeypatch, recorder)
    # nothing runs, so nothing to compare: the tests' own checks are stubbed out, and their caches
    # are made at full shape without values (the pages and block tables are the real generator's)
    monkeypatch.setattr(gpu_tests, "rel_err", lambda out, ref: 0.0)
    monkeypatch.setattr(attention_cases.PagedCase, "expected", lambda self, scale=None: None)
    scatter = attention_cases.scatter_sequences

    def shapes_only(seq_lens, page_size, num_kv_heads, head_dim, *, dtype, **kwargs):
        k, _, table, k_logical, v_logical = scatter(seq_lens, page_size, 1, 1, dtype=dtype, **kwargs)
        full = (k.shape[0], page_size, num_kv_heads, head_dim)
        return torch.empty(full, dtype=dtype), torch.empty(full, dtype=dtype), table, k_logical, v_logical

    monkeypatch.setattr(attention_cases, "scatter_sequences", shapes_only)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for page_size in (1, 16, 128, 256):
            gpu_tests.test_gpu_dtypes(dtype, page_size)
    gpu_tests.test_gpu_large([65536], 8)
    gpu_tests.test_gpu_large([1, 20000, 4096, 777], 2)
    return recorder.launches


def record_decode(monkeypatch):
    recorder = Recorder()
    _as_h200(monkeypatch, recorder)

    def layouts(k, v, batch, seq_len, page_size, seed=0):  # same shapes, strides and dtypes; no copies
        num_pages = batch * seq_len // page_size
        k_pages = k.view(num_pages, page_size, *k.shape[1:])
        table = torch.arange(num_pages, dtype=torch.int32).view(batch, -1)
        return (k_pages, v.view_as(k_pages), table), (torch.empty_like(k_pages), torch.empty_like(k_pages), table)

    def empty_inputs(batch, seq_len, *, num_q_heads, num_kv_heads, head_dim, dtype, device, seed=0):
        q = torch.empty(batch, num_q_heads, head_dim, dtype=dtype)
        k = torch.empty(batch * seq_len, num_kv_heads, head_dim, dtype=dtype)
        return q, k, torch.empty_like(k)

    monkeypatch.setattr(decode, "make_inputs", empty_inputs)
    monkeypatch.setattr(decode, "page_layouts", layouts)
    monkeypatch.setattr(decode, "reference_attention", lambda q, *a, **k: torch.zeros(q.shape))
    monkeypatch.setattr(decode, "rel_err", lambda out, ref: 0.0)
    monkeypatch.setattr(decode, "_sdpa", lambda q, *a: q)
    monkeypatch.setattr(decode, "copy_bandwidth", lambda: dict(bandwidth_GBps=1.0, bytes=1, median_s=1.0))
    monkeypatch.setattr(decode, "gpu_median", lambda fn, rep_ms: (fn(), 1e-3)[1])
    monkeypatch.setattr(decode, "graph_median", lambda fn, rep_ms: (1e-3, fn()))  # the captured call, launched once
    monkeypatch.setattr(decode, "host_median", lambda fn: (fn(), 1e-5)[1])
    monkeypatch.setattr(decode.torch.cuda, "empty_cache", lambda: None)
    # flex is compiled by inductor, not launched through this kernel: left out (budget_s < 0)
    decode.run_gpu(decode.GPU_SHAPES, decode.GPU_PAGE_SIZES, budget_s=-1, rep_ms=1, dtype=torch.bfloat16, device="cpu")
    return recorder.launches


def scaling_calls():
    """(batch lengths, page size) of each decode step `bench scaling --gpu` runs on the triton backend."""
    profile = PROFILES[("gpu", "full")]
    steps = profile["warmup"] + profile["steps"]
    calls = set()
    for context in profile["contexts"] + [profile["long"]]:  # the ladder and the long sequence, batch 1
        calls.update(((context + i,), PAGE_SIZE) for i in range(1, steps + 1))
    b = profile["batch"]
    lengths = mixed_lengths(b["num"], max_len=b["max_len"] - b["warmup"] - b["steps"] - 1, mean_len=b["mean_len"])
    admitted, pages = [], b["budget_tokens"] // PAGE_SIZE
    for n in lengths:  # the paged pool admits requests in order until its pages run out
        if sum(cdiv(m + b["warmup"] + b["steps"], PAGE_SIZE) for m in admitted + [n]) > pages:
            break
        admitted.append(n)
    for i in range(1, b["warmup"] + b["steps"] + 1):
        calls.add((tuple(n + i for n in admitted), PAGE_SIZE))
    c = profile["chat"]
    for turn in range(c["turns"]):
        for i in range(1, c["reply_tokens"] + 1):
            calls.add(((turn * (c["user_tokens"] + c["reply_tokens"]) + c["user_tokens"] + i,), PAGE_SIZE))
    for page_size in profile["sweep"]["page_sizes"]:  # the sweep times one decode of the admitted batch
        calls.add((tuple(admitted), page_size))
    return sorted(calls)


def record_scaling(monkeypatch):
    recorder = Recorder()
    _as_h200(monkeypatch, recorder)
    heads, kv_heads, head_dim = (LLAMA_1B_SHAPES[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    for lengths, page_size in scaling_calls():
        widths = [cdiv(n, page_size) for n in lengths]
        num_pages = sum(widths) + 1
        cache = torch.empty(num_pages, page_size, kv_heads, head_dim, dtype=torch.bfloat16).as_strided(
            (num_pages, page_size, kv_heads, head_dim),
            (page_size * kv_heads * head_dim, kv_heads * head_dim, head_dim, 1),
        )
        table = torch.zeros(len(lengths), max(widths), dtype=torch.int32)
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
        q = torch.empty(len(lengths), heads, head_dim, dtype=torch.bfloat16)
        td.triton_paged_decode(q, cache, cache, table, seq_lens, check_values=False)
    return recorder.launches


def specialize(name, args, kwargs):
    """Triton's own binding of one launch for sm_90: (key, what `triton.compile` needs)."""
    kernel = td.compiled_kernels()[name]
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound, specialization, options = binder(*args, **kwargs)
    key = (
        name,
        str(specialization),
        str(sorted(options.__dict__.items()) if hasattr(options, "__dict__") else options),
    )
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return key, (name, signature, constexprs, attrs, options.__dict__)


def _compile(job):
    name, signature, constexprs, attrs, options = job
    kernel = td.compiled_kernels()[name]
    start = time.perf_counter()
    try:
        triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options)
    except Exception as err:  # a compile error is a result
        return f"{type(err).__name__}: {str(err)[:500]}", time.perf_counter() - start
    return None, time.perf_counter() - start


@pytest.fixture(scope="module")
def replay():
    sections = {}
    with pytest.MonkeyPatch.context() as mp:
        for section, record in (("tests", record_tests), ("decode", record_decode), ("scaling", record_scaling)):
            sections[section] = record(mp)
    jobs, keys, launchers = {}, {}, {}
    for section, launches in sections.items():
        keys[section], launchers[section] = set(), set()
        for launch in launches:
            key, job = specialize(*launch)
            keys[section].add(key)
            jobs.setdefault(key, job)
            launchers[section].add(str(job[1]))  # the C launcher is built per argument signature
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 2) as pool:  # compiles are single-threaded
        results = dict(zip(jobs, pool.map(_compile, jobs.values())))
    seconds = time.perf_counter() - start
    return sections, keys, launchers, results, seconds


def test_every_launch_of_the_gpu_run_compiles_for_sm_90(replay):
    sections, keys, launchers, results, seconds = replay
    errors = {k: e for k, (e, _) in results.items() if e}
    assert not errors, errors
    counts = {s: len(launches) for s, launches in sections.items()}
    distinct = {s: len(k) for s, k in keys.items()}
    per_compile = sorted(t for _, t in results.values())[len(results) // 2]
    print(
        f"launches {counts}, distinct compiles {distinct} ({len(results)} in all), launchers "
        f"{ {s: len(v) for s, v in launchers.items()} }, {seconds:.1f} s to compile, median {per_compile:.2f} s"
    )


def test_the_gpu_plan_budgets_for_these_compile_counts(replay):
    """`bench gpu` budgets each section from its compile count: the counts it uses are these."""
    _, keys, launchers, _, _ = replay
    assert gpu.TRITON_COMPILES == {s: len(k) for s, k in keys.items()}
    assert gpu.TRITON_LAUNCHERS == {s: len(v) for s, v in launchers.items()}


def test_split_counts_follow_an_h200():
    """The replay's split counts are the launcher's for 132 SMs (a sanity check on the stubs)."""
    cfg = td._tile_config(torch.bfloat16, 128, 4, interpret=False, capability=90)
    assert choose_num_splits(8, 8, 32768, H200_SMS, block_n=cfg["BLOCK_N"]) == 6
    # bench decode's 64 x 4096 is split in 3 since the occupancy model charges a 29%-full second wave
    assert choose_num_splits(64, 8, 4096, H200_SMS, block_n=cfg["BLOCK_N"]) == 3
    assert math.isfinite(cfg["BLOCK_N"])
