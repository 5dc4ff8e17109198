"""The C++ kernels on two threads: their loops split over torch's threads (OpenMP, one runtime), the results
those of one thread, bit for bit, and of the float64 product up to float32 rounding; the fast engine's tokens
the eager engine's."""

from pathlib import Path

import pytest
import torch
from attention_cases import make_decode_case, make_prefill_case, rel_error

from paged_ref.attention import cpu_paged
from paged_ref.attention.cpu_paged import cpu_paged_decode, cpu_paged_packed
from paged_ref.fast.cpu_ops import cpu_ops
from paged_ref.fast.prepack import few_rows_kernel, stream_layout
from paged_ref.native import OPENMP
from paged_ref.serve import VLLM_ADMISSION, Engine


@pytest.fixture
def threads():
    """Runs the test at 1 then 2 threads as asked (``threads(n)``); torch's setting is restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _at(threads, n, fn):
    threads(n)
    return fn()


def _mapped_libraries() -> set[Path]:
    """The shared libraries this process maps (Linux: OPENMP is -fopenmp there only). A library whose file
    was replaced after it was loaded (another process rebuilding the same extension into the same folder)
    is listed as "PATH (deleted)": its path, the suffix dropped."""
    paths = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode, path (may hold spaces)
        name = fields[5].removesuffix(" (deleted)") if len(fields) == 6 else ""
        if name.endswith((".so", ".so.1", ".so.5")):
            paths.add(Path(name))
    return paths


@pytest.mark.skipif(OPENMP != ["-fopenmp"], reason="torch runs its threads without OpenMP here (or not on Linux)")
def test_each_kernel_is_built_to_split_its_loop_over_torch_threads():
    few_rows_kernel(), cpu_ops(), cpu_paged.kernel()  # built and loaded
    libraries = _mapped_libraries()
    ours = [p for p in libraries if p.name.startswith(("paged_ref_linear", "paged_ref_cpu_ops", "paged_ref_cpu_paged"))]
    assert len(ours) == 3 and all(b"GOMP_parallel" in p.read_bytes() for p in ours)
    runtimes = {p.resolve() for p in libraries if p.name.startswith(("libgomp", "libiomp", "libomp"))}
    assert len(runtimes) == 1, f"two OpenMP runtimes loaded: {sorted(map(str, runtimes))}"


@pytest.mark.parametrize("seed", range(2))
def test_few_rows_on_two_threads_is_one_threads_result(threads, seed):
    g = torch.Generator().manual_seed(seed)
    few = few_rows_kernel()
    for rows in (1, 5, 6, 7, 32, 64):
        n, k = 64 * int(torch.randint(3, 9, (1,), generator=g)) + 17, int(torch.randint(1, 300, (1,), generator=g))
        x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)  # [rows, k], [n, k]
        one, two = (_at(threads, t, lambda: few(x, stream_layout(w), n)) for t in (1, 2))  # [rows, n] each
        assert torch.equal(one, two)
        torch.testing.assert_close(two.double(), x.double() @ w.double().T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(2))
def test_paged_attention_on_two_threads_is_one_threads_result(threads, seed):
    case = make_decode_case(seed=seed, batch=9, page_size=8, num_kv_heads=2, group=3, head_dim=64, max_len=300)
    one, two = (_at(threads, t, lambda: cpu_paged_decode(*case.args)) for t in (1, 2))  # [batch, heads, dim]
    assert torch.equal(one, two) and rel_error(two, case.expected()) < 1e-4


@pytest.mark.parametrize("seed", range(2))
def test_packed_rows_on_two_threads_are_one_threads_result(threads, seed):
    """Decode rows beside prompt chunks (rows of very different lengths, taken longest first by whichever thread
    is free): the same bits at one and two threads, and the float64 result up to float32 rounding."""
    case = make_prefill_case(seed=200 + seed, batch=9, page_size=[4, 16][seed], num_kv_heads=2, group=3, head_dim=64,
                             max_len=300, max_q_len=48)  # fmt: skip
    q, kc, vc, bt, lens, q_lens = case.args
    valid = torch.arange(q.shape[2])[None, :] < q_lens[:, None]  # [batch, max_q_len]
    rows = q.transpose(1, 2)[valid]  # [num_new, Hq, D]: each row's tokens after the rows before it
    one, two = (_at(threads, t, lambda: cpu_paged_packed(rows, kc, vc, bt, lens, q_lens, scale=0.125)) for t in (1, 2))
    assert one is not None and torch.equal(one, two)
    assert rel_error(two, case.expected(scale=0.125).transpose(1, 2)[valid]) < 1e-4  # [num_new, Hq, D]


def test_cpu_ops_on_two_threads_are_one_threads_result(threads):
    from paged_ref.fast.flat import EAGER

    g = torch.Generator().manual_seed(0)
    ops = cpu_ops()
    b, t = 3, 160  # rows enough for two threads' shares of 32,768 elements (cpu_ops.cpp's grain)
    h, y, w = torch.randn(b, t, 96, generator=g), torch.randn(b, t, 96, generator=g), torch.randn(96, generator=g)
    x = torch.randn(b, t, 4, 64, generator=g)  # [batch, tokens, heads, dim]
    angles = torch.randn(b, t, 1, 32, generator=g).repeat(1, 1, 1, 2)
    gate, up = torch.randn(b, t, 128, generator=g), torch.randn(b, t, 128, generator=g)

    def run():
        return (*ops.add_norm(h.clone(), y, w, 1e-5), ops.rotate(x.clone(), angles.cos(), angles.sin()),
                ops.silu_mul(gate, up))  # fmt: skip

    one, two = _at(threads, 1, run), _at(threads, 2, run)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    want_h, want_x = EAGER.add_norm(h, y, w, 1e-5)
    assert torch.allclose(two[0], want_h) and torch.allclose(two[1], want_x, atol=1e-5)
    assert torch.allclose(two[2], EAGER.rotate(x.clone(), angles.cos(), angles.sin()), atol=1e-6)
    assert torch.allclose(two[3], EAGER.silu_mul(gate, up), atol=1e-6)


def test_the_fast_engine_on_two_threads_gives_the_eager_tokens(model, threads):
    g = torch.Generator().manual_seed(3)
    requests = [(torch.randint(3, 500, (int(n),), generator=g).tolist(), 6) for n in (9, 1, 14, 30, 5, 21)]

    def tokens(fast):
        engine = Engine(model, num_pages=40, page_size=4, max_num_seqs=6, max_batched_tokens=16, eos_token_id=[],
                        clock="steps", reservation=VLLM_ADMISSION, fast=fast)  # fmt: skip
        for prompt, new in requests:
            engine.add_request(prompt, max_new_tokens=new)
        return [o.token_ids for o in engine.run()]

    eager = _at(threads, 1, lambda: tokens(None))
    assert _at(threads, 2, lambda: tokens(True)) == eager
