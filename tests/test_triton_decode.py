"""Tests for the Triton paged decode kernel (paged_ref.attention.triton_decode).

Without a GPU the kernel runs through Triton's interpreter (float32); every case is compared
with the plain-PyTorch reference computed in float64 on fresh random inputs. GPU-only checks
(float16/bfloat16, large sizes) are marked `gpu` and skipped without CUDA.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from attention_cases import make_decode_case, rel_error

from paged_ref.attention import triton_decode as td
from paged_ref.attention.occupancy import choose_num_splits
from paged_ref.attention.reference import reference_paged_decode
from paged_ref.attention.triton_decode import triton_paged_decode

REPO = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu(test):
    """GPU-only: marked `gpu` (select with `-m gpu`) and skipped without CUDA."""
    return pytest.mark.gpu(_needs_cuda(test))


def make_case(seed, *, page_size, num_q_heads, num_kv_heads, head_dim, seq_lens, dtype=torch.float32):
    """The shared generator's decode case (`attention_cases`) with its tensors on DEVICE."""
    case = make_decode_case(
        seed,
        len(seq_lens),
        page_size,
        num_kv_heads,
        num_q_heads // num_kv_heads,
        head_dim,
        seq_lens=seq_lens,
        dtype=dtype,
    )
    for name in ("q", "k_cache", "v_cache", "block_table", "seq_lens"):
        setattr(case, name, getattr(case, name).to(DEVICE))
    return case


def reference64(q, k_cache, v_cache, block_table, seq_lens):
    """The plain-PyTorch reference in float64 on the CPU: the oracle where pages are shared."""
    args = [t.cpu().double() if t.is_floating_point() else t.cpu() for t in (q, k_cache, v_cache)]
    return reference_paged_decode(*args, block_table.cpu(), seq_lens.cpu())


def rel_err(out, ref):
    return rel_error(out.cpu(), ref.cpu())


# --- agreement with float64 ------------------------------------------------------------------
def test_page_size_256_spans_many_tiles():
    case = make_case(256, page_size=256, num_q_heads=4, num_kv_heads=1, head_dim=64, seq_lens=[1, 256, 257, 600])
    assert rel_err(triton_paged_decode(*case.args, num_splits=2), case.expected()) < 1e-5


@pytest.mark.parametrize("head_dim", [32, 80])
def test_other_head_dims(head_dim):
    """80 is not a power of two: the kernel pads the head dimension and masks it."""
    case = make_case(head_dim, page_size=16, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, seq_lens=[3, 50])
    assert rel_err(triton_paged_decode(*case.args, num_splits=3), case.expected()) < 1e-5


def test_shared_pages_between_sequences():
    """Two sequences may point at the same physical pages (prefix sharing)."""
    q, kc, vc, bt, lens = make_case(9, page_size=8, num_q_heads=4, num_kv_heads=2, head_dim=64, seq_lens=[20, 20]).args
    bt[1, :2] = bt[0, :2]
    assert rel_err(triton_paged_decode(q, kc, vc, bt, lens), reference64(q, kc, vc, bt, lens)) < 1e-5


def test_int64_block_table_and_seq_lens():
    """The common contract also allows int64 tables and lengths; same result as int32."""
    case = make_case(12, page_size=16, num_q_heads=4, num_kv_heads=2, head_dim=64, seq_lens=[7, 40])
    q, kc, vc, bt, lens = case.args
    out32 = triton_paged_decode(q, kc, vc, bt, lens, num_splits=2)
    out64 = triton_paged_decode(q, kc, vc, bt.long(), lens.long(), num_splits=2)
    torch.testing.assert_close(out64, out32, rtol=0, atol=0)
    assert rel_err(out64, case.expected()) < 1e-5


# --- split-K ---------------------------------------------------------------------------------
SPLIT_LENS = [1, 17, 200, 333]


@pytest.mark.parametrize("num_splits", [2, 3, 7, 16, None])
def test_splits_match_unsplit_and_float64(num_splits):
    """Any split count (also more splits than tiles: empty splits) gives the unsplit result."""
    case = make_case(31, page_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64, seq_lens=SPLIT_LENS)
    unsplit = triton_paged_decode(*case.args, num_splits=1)
    split = triton_paged_decode(*case.args, num_splits=num_splits)
    ref = case.expected()
    assert rel_err(unsplit, ref) < 1e-5
    assert rel_err(split, ref) < 1e-5
    torch.testing.assert_close(split, unsplit, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not td.interpreted(torch.device(DEVICE)), reason="on a GPU these lengths are too short to split")
def test_heuristic_splits_in_the_cases_above():
    """num_splits=None must really split the long case above (on CPU: a pretend 8-SM GPU)."""
    device = torch.device(DEVICE)
    cfg = td._tile_config(torch.float32, 64, 4, interpret=td.interpreted(device))
    assert td._default_num_splits(len(SPLIT_LENS), 2, max(SPLIT_LENS), device, cfg) > 1


def test_choose_num_splits_fills_the_gpu():
    sms = 132
    # One long sequence: enough programs to cover (nearly) every slot.
    s = choose_num_splits(1, 8, 131072, sms, programs_per_sm=3)
    assert 0.9 * 3 * sms <= 8 * s <= 3 * sms
    # A full grid is not split; short sequences are not split below min_tiles_per_split tiles.
    assert choose_num_splits(256, 8, 2048, sms) == 1
    assert choose_num_splits(1, 8, 300, sms, block_n=64, min_tiles_per_split=4) == 1
    assert choose_num_splits(1, 8, 1024, sms, block_n=64, min_tiles_per_split=4) == 4
    # No nearly empty last wave: 64 programs on 396 slots -> 6 splits (one wave), not 7;
    # 512 programs (a second wave 29% full) -> 3 splits, 4 waves 97% full.
    assert choose_num_splits(8, 8, 32768, sms, programs_per_sm=3) == 6
    assert choose_num_splits(8, 8, 32768, sms, programs_per_sm=4) == 8  # 512 of 528
    assert choose_num_splits(64, 8, 4096, sms, programs_per_sm=3) == 3
    for batch in (1, 3, 8, 50, 500):
        for length in (1, 100, 5000, 10**6):
            s = choose_num_splits(batch, 4, length, sms, block_n=64)
            assert 1 <= s <= 256 and (s == 1 or -(-length // 64) // s >= 4)


def test_choose_num_splits_names_a_bad_argument():
    with pytest.raises(ValueError, match="num_sms"):
        choose_num_splits(1, 8, 4096, 0)


# --- every output element written ------------------------------------------------------------
@pytest.mark.parametrize("num_splits", [1, 5])
def test_poisoned_output_fully_written_and_nothing_past_it(num_splits):
    case = make_case(41, page_size=8, num_q_heads=6, num_kv_heads=2, head_dim=80, seq_lens=[1, 8, 9, 70])
    q = case.q
    guard = 64
    buf = torch.full((q.numel() + guard,), float("nan"), dtype=q.dtype, device=q.device)
    out = buf[: q.numel()].view(q.shape)  # contiguous, NaN-filled
    result = triton_paged_decode(*case.args, num_splits=num_splits, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any()
    assert torch.isnan(buf[q.numel() :]).all()  # no write past the end
    assert rel_err(out, case.expected()) < 1e-5


# --- validation ------------------------------------------------------------------------------
def _base_case():
    return make_case(3, page_size=8, num_q_heads=4, num_kv_heads=2, head_dim=64, seq_lens=[5, 17]).args


def _set(i, fn):
    """Replace argument i of the case by fn(argument)."""

    def mutate(case):
        case = list(case)
        case[i] = fn(case[i])
        return case

    return mutate


BAD_INPUTS = {
    "q not a tensor": (_set(0, lambda t: t.tolist()), TypeError, "q must be a torch.Tensor"),
    "q 2-d": (_set(0, lambda t: t[0]), ValueError, r"q must have shape \[batch"),
    "q dtype": (_set(0, lambda t: t.double()), TypeError, "dtype"),
    "caches differ": (_set(2, lambda t: t[:-1]), ValueError, "v_cache must have the same shape"),
    "k_cache dtype": (_set(1, lambda t: t.double()), TypeError, "k_cache must have the same dtype"),
    "head_dim mismatch": (_set(0, lambda t: t[..., :32].contiguous()), ValueError, "head_dim"),
    "gqa not divisible": (_set(0, lambda t: t[:, :3].contiguous()), ValueError, "multiple of num_kv_heads"),
    "block_table dtype": (_set(3, lambda t: t.float()), TypeError, "block_table must be int"),
    "block_table batch": (_set(3, lambda t: t[:1]), ValueError, "block_table must have shape"),
    "seq_lens dtype": (_set(4, lambda t: t.float()), TypeError, "seq_lens must be int"),
    "seq_lens shape": (_set(4, lambda t: t[:1]), ValueError, "seq_lens must have shape"),
    "seq_len zero": (_set(4, lambda t: torch.zeros_like(t)), ValueError, r"seq_lens\[0\]"),
    "seq_len over capacity": (_set(4, lambda t: t + 1000), ValueError, "max_pages"),
    "page id too large": (
        _set(3, lambda t: t.index_fill(1, torch.tensor([0], device=t.device), 10**6)),
        ValueError,
        "num_pages",
    ),
    "page id negative": (
        _set(3, lambda t: t.index_fill(1, torch.tensor([0], device=t.device), -1)),
        ValueError,
        "num_pages",
    ),
    "q not contiguous": (
        _set(0, lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)),
        ValueError,
        "q must be contiguous",
    ),
    "k_cache not contiguous": (
        _set(1, lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)),
        ValueError,
        "k_cache must be contiguous",
    ),
    "block_table not contiguous": (
        _set(3, lambda t: t.t().contiguous().t()),
        ValueError,
        "block_table must be contiguous",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_and_leaves_out_untouched(name):
    mutate, exc, match = BAD_INPUTS[name]
    case = mutate(_base_case())
    out = torch.full((2, 4, 64), float("nan"), device=DEVICE)
    with pytest.raises(exc, match=match):
        triton_paged_decode(*case, out=out)
    assert torch.isnan(out).all()


def _cache_with(page_size=8, head_dim=64):
    q = torch.randn(1, 2, head_dim, device=DEVICE)
    kc = torch.randn(4, page_size, 1, head_dim, device=DEVICE)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    return q, kc, kc.clone(), bt, lens


@pytest.mark.parametrize("page_size", [3, 12, 512])
def test_page_size_must_be_power_of_two_up_to_256(page_size):
    with pytest.raises(ValueError, match=f"power of two in \\[1, 256\\], got {page_size}"):
        triton_paged_decode(*_cache_with(page_size=page_size))


def test_head_dim_limit():
    with pytest.raises(ValueError, match="head_dim must be at most 256, got 512"):
        triton_paged_decode(*_cache_with(head_dim=512))


@pytest.mark.parametrize("num_splits", [0, -2, 1.5, True, "2"])
def test_bad_num_splits(num_splits):
    with pytest.raises(ValueError, match="num_splits must be None or a positive int"):
        triton_paged_decode(*_base_case(), num_splits=num_splits)


@pytest.mark.parametrize(
    "bad_out, match",
    [
        (lambda q: torch.empty(q.shape[0], q.shape[1], 32, device=q.device), "out must match q"),
        (lambda q: torch.empty_like(q, dtype=torch.float64), "out must match q"),
        (lambda q: torch.empty_like(q).transpose(0, 1).contiguous().transpose(0, 1), "out must be contiguous"),
        (lambda q: q.tolist(), "out must be None or a torch.Tensor"),
    ],
)
def test_bad_out(bad_out, match):
    case = _base_case()
    with pytest.raises((TypeError, ValueError), match=match):
        triton_paged_decode(*case, out=bad_out(case[0]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only rule")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_interpreter_is_float32_only(dtype):
    case = [t.to(dtype) if t.is_floating_point() else t for t in _base_case()]
    with pytest.raises(TypeError, match="interpreter.*float32 only.*got torch"):
        triton_paged_decode(*case)


@gpu
def test_cpu_tensors_run_in_the_interpreter_on_a_gpu_machine():
    case = [t.cpu().float() if t.is_floating_point() else t.cpu() for t in _base_case()]
    assert td.interpreted(case[0].device)
    assert rel_err(triton_paged_decode(*case), reference64(*case)) < 1e-5


# --- how the kernel is run: interpreter selection, missing triton ----------------------------
def _run_python(code, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    env.pop("TRITON_INTERPRET", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_interpreter_runs_even_if_triton_imported_first_and_disabled():
    """triton imported before us, TRITON_INTERPRET=0 in the environment and the knob forced
    off: CPU tensors still run through the interpreter, and the knob is off again after."""
    result = _run_python(
        """
        import triton, torch
        if hasattr(triton, "knobs"):
            triton.knobs.runtime.interpret = False
        from paged_ref.attention import triton_decode as td
        q, kc = torch.randn(1, 2, 16), torch.randn(2, 4, 1, 16)
        out = td.triton_paged_decode(q, kc, kc, torch.tensor([[1, 0]], dtype=torch.int32),
                              torch.tensor([6], dtype=torch.int32), num_splits=2)
        if hasattr(triton, "knobs"):
            assert triton.knobs.runtime.interpret is False
        print("ok", out.shape)
    """,
        {"TRITON_INTERPRET": "0"},
    )
    assert result.returncode == 0, result.stderr
    assert "ok torch.Size([1, 2, 16])" in result.stdout


def test_import_and_call_leave_the_process_as_it_was():
    """Importing paged_ref and running the kernel change neither os.environ nor triton.language
    (its @jit helpers stay the objects they were; the interpreter knob keeps its value; the
    interpreter's own `_patch_lang_tensor` is put back and `tl.tensor` has no `__index__` left)."""
    result = _run_python("""
        import os, sys, torch
        import triton, triton.language as tl

        def snapshot():
            mods = {n: m for n, m in sys.modules.items()
                    if m is not None and (n == "triton.language" or n.startswith("triton.language."))}
            return {(n, a): id(v) for n, m in mods.items() for a, v in vars(m).items()}

        from triton.runtime import interpreter
        env, lang = dict(os.environ), snapshot()
        knob = triton.knobs.runtime.interpret if hasattr(triton, "knobs") else None
        patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
        import paged_ref as pr
        q, kc = torch.randn(2, 4, 16), torch.randn(3, 4, 2, 16)
        bt = torch.tensor([[2, 0], [1, 0]], dtype=torch.int32)
        out = pr.triton_paged_decode(q, kc, kc, bt, torch.tensor([5, 3], dtype=torch.int32))
        assert torch.allclose(out, pr.reference_paged_decode(q, kc, kc, bt,
                              torch.tensor([5, 3], dtype=torch.int32)), atol=1e-5)
        assert dict(os.environ) == env, "os.environ changed"
        after = snapshot()
        changed = [k for k in lang if after.get(k) != lang[k]]
        assert not changed, f"triton.language changed: {changed[:5]}"
        assert (triton.knobs.runtime.interpret if hasattr(triton, "knobs") else None) == knob
        assert not isinstance(tl.max, type(None))
        assert getattr(interpreter, "_patch_lang_tensor", None) is patch_tensor, "interpreter changed"
        assert not hasattr(tl.tensor, "__index__"), "tl.tensor kept the interpreter's __index__"
        print("ok")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_without_triton_module_imports_and_call_raises_importerror():
    result = _run_python("""
        import sys
        sys.modules["triton"] = None          # make `import triton` fail
        sys.modules["triton.language"] = None
        import torch
        from paged_ref.attention.triton_decode import triton_paged_decode
        try:
            triton_paged_decode(torch.randn(1, 2, 16), torch.randn(2, 4, 1, 16), torch.randn(2, 4, 1, 16),
                         torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
        except ImportError as e:
            print("ImportError:", e)
    """)
    assert result.returncode == 0, result.stderr
    assert "ImportError: triton_paged_decode needs the `triton` package" in result.stdout


# --- GPU: half precision and large sizes -----------------------------------------------------
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16, 128, 256])
def test_gpu_dtypes(dtype, page_size):
    seed = page_size + 7
    case = make_case(
        seed,
        page_size=page_size,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        seq_lens=[1, page_size, page_size + 1, 2 * page_size, 3000],
        dtype=dtype,
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ref = case.expected()
    for num_splits in (1, None, 7):
        out = triton_paged_decode(*case.args, num_splits=num_splits)
        assert out.dtype == dtype and not torch.isnan(out).any()
        assert rel_err(out, ref) < tol


@gpu
@pytest.mark.parametrize("seq_lens, num_kv_heads", [([65536], 8), ([1, 20000, 4096, 777], 2)])
def test_gpu_large(seq_lens, num_kv_heads):
    case = make_case(
        11,
        page_size=16,
        num_q_heads=4 * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=128,
        seq_lens=seq_lens,
        dtype=torch.bfloat16,
    )
    out = torch.full_like(case.q, float("nan"))
    triton_paged_decode(*case.args, out=out)
    assert not torch.isnan(out).any()
    assert rel_err(out, case.expected()) < 1e-2


def test_native_half_is_float16_before_ampere(monkeypatch):
    """A T4 (sm_75) computes float16, not bfloat16: the GPU benchmarks and notebook 05 take it."""
    from paged_ref.attention import triton_decode as td

    for capability, dtype in (((7, 5), torch.float16), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert td.native_half("cuda") == dtype
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        td.native_half("cpu")
