"""The hostile calls that crashed, read or wrote out of bounds, or answered wrong before the native ops checked
their arguments (issue 57, then lengths whose int64 products overflow, negative views, zero tensors, storages
shrunk after their tensor was made, inputs sharing memory with a tensor written in place, in-place writes autograd
did not see, inputs requiring grad whose gradient was left out; then dual tensors whose forward-mode tangent was
dropped, unaligned addresses, nested tensors, check counts that would hang, and a block table another thread wrote
between its check and its read), each now refused with an error naming the argument or answered right. All run
in one subprocess, in turn: a crash fails the test naming the case it was on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from native_worker import child_env  # noqa: E402

ROOT = Path(__file__).parents[1]

SETUP = """
import torch
from paged_ref.attention.cpu_paged import cpu_paged_decode, kernel
from paged_ref.attention.reference import reference_paged_decode
from paged_ref.attention.triton_cascade import triton_cascade_decode
from paged_ref.attention.triton_decode import triton_paged_decode
from paged_ref.fast.cpu_ops import cpu_ops
from paged_ref.fast.prepack import few_rows_kernel
i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
kc, vc, q = torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8), torch.randn(2, 4, 8)
bt, lens = i32([0, 1], [2, 3]), i32(5, 8)
ones = i32(1, 1)
def attn(q=q, kc=kc, vc=vc, bt=bt, lens=lens, q_lens=ones):
    return kernel().paged_attention(q, kc, vc, bt, lens, q_lens, 0.35)
ops = cpu_ops()
none = lambda *shape: torch.empty(*shape)  # a k_cache or q of no element: its sizes are free
i64 = lambda *v: torch.tensor(v, dtype=torch.int64)
def shrunk(t, nbytes=16):  # t, its storage shrunk to nbytes after it was made: t now reaches past it
    t.untyped_storage().resize_(nbytes)
    return t
def unaligned(*shape):  # float32 values at an address 1 byte past a multiple of 4
    n = torch.Size(shape).numel()
    return torch.frombuffer(bytearray(4 * n + 1), dtype=torch.float32, offset=1, count=n).view(shape).normal_()
neg = lambda *shape: torch.rand(*shape, dtype=torch.cfloat).conj().imag  # a negative view: memory holds -values
"""

#: (name, code, what must come: "error <argument>" or "ok" where the code asserts the result)
CASES = [
    ("page id +2e9", "attn(bt=i32([0, 2_000_000_000], [2, 3]))", "error block_table"),
    ("page id -2e9", "attn(bt=i32([-2_000_000_000, 1], [2, 3]))", "error block_table"),
    ("page id == num_pages", "attn(bt=i32([0, 4], [2, 3]))", "error block_table"),
    ("sequence longer than its row", "attn(lens=i32(5, 9))", "error seq_lens"),
    ("q_lens 200, -199", "attn(q=q[:1], q_lens=i32(200, -199))", "error q_lens"),
    ("zero KV heads", "attn(kc=kc[:, :, :0], vc=vc[:, :, :0])", "error k_cache"),
    ("page_size 0", "attn(kc=kc[:, :0], vc=vc[:, :0])", "error k_cache"),
    ("Hq not a multiple of Hkv", "attn(q=torch.randn(2, 3, 8))", "error q"),
    ("block table with fewer rows", "attn(bt=bt[:1])", "error block_table"),
    (
        "block table of floats: the error says what was given",
        "e = ''\ntry:\n    attn(bt=bt.float())\nexcept RuntimeError as x:\n    e = str(x)\n"
        "assert 'block_table' in e and 'got Float' in e, repr(e)",
        "ok",
    ),
    ("q head_dim larger", "attn(q=torch.randn(2, 4, 9))", "error q"),
    ("v_cache smaller", "attn(vc=vc[:2])", "error v_cache"),
    ("sequence length 0", "attn(lens=i32(0, 8))", "error q_lens"),
    ("q float64", "attn(q=q.double())", "error q"),
    (
        "non-contiguous inputs",
        "torch.testing.assert_close(attn(q=q.transpose(0, 1).contiguous().transpose(0, 1),"
        " kc=kc.transpose(1, 2).contiguous().transpose(1, 2)), attn())",
        "ok",
    ),
    (
        "add_norm C=0",
        "h, o = ops.add_norm(torch.randn(2, 0), None, torch.randn(0), 1e-6); assert o.shape == (2, 0)",
        "ok",
    ),
    ("add_norm empty weight", "ops.add_norm(torch.randn(2, 8), None, torch.randn(0), 1e-6)", "error w"),
    ("add_norm short weight", "ops.add_norm(torch.randn(2, 8), None, torch.randn(7), 1e-6)", "error w"),
    (
        "add_norm expanded h",
        "ops.add_norm(torch.randn(1, 8).expand(4, 8), torch.randn(4, 8), torch.randn(8), 1e-6)",
        "error h",
    ),
    ("add_norm sliced h", "ops.add_norm(torch.randn(4, 16)[:, :8], None, torch.randn(8), 1e-6)", "error h"),
    ("silu_mul I=0", "assert ops.silu_mul(torch.randn(3, 0), torch.randn(3, 0)).shape == (3, 0)", "ok"),
    (
        "silu_mul expanded gate",
        "g, u = torch.randn(1, 8).expand(5, 8), torch.randn(5, 8);"
        " torch.testing.assert_close(ops.silu_mul(g, u), torch.nn.functional.silu(g) * u)",
        "ok",
    ),
    (
        "add_norm y overlapping h (from one float before it)",
        "b = torch.randn(33); h, y = b[1:].view(4, 8), b[:32].view(4, 8); want = h + y;"
        " torch.testing.assert_close(ops.add_norm(h, y, torch.ones(8), 1e-6)[0], want)",
        "ok",
    ),
    (
        "add_norm w a row of h",
        "h, y = torch.randn(4, 8), torch.randn(4, 8); w = h[2]; s = h + y;"
        " want = w.clone() * s / (s.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt();"
        " torch.testing.assert_close(ops.add_norm(h, y, w, 1e-6)[1], want)",
        "ok",
    ),
    (
        "rotate cos, sin views of x's heads 0 and 1",
        "x = torch.randn(1, 1, 3, 8); c, s = x[:, :, :1], x[:, :, 1:2]; c0, s0 = c.clone(), s.clone();"
        " want = x * c0 + torch.cat((-x[..., 4:], x[..., :4]), -1) * s0;"
        " torch.testing.assert_close(ops.rotate(x, c, s), want)",
        "ok",
    ),
    (
        "add_norm's write to h seen by autograd (a backward through h saved before it is refused)",
        "w = torch.randn(2, 8, requires_grad=True); h = torch.randn(2, 8); s = (w * h).sum();"
        " ops.add_norm(h, None, torch.ones(8), 1e-6); e = None\n"
        "try:\n    s.backward()\nexcept RuntimeError as x:\n    e = x\n"
        "assert e is not None and 'inplace' in str(e), 'a backward through the overwritten h ran'",
        "ok",
    ),
    (
        "rotate's write to x seen by autograd (a backward through x saved before it is refused)",
        "w = torch.randn(1, 2, 1, 8, requires_grad=True); x = torch.randn(1, 2, 1, 8); s = (w * x).sum();"
        " ops.rotate(x, torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)); e = None\n"
        "try:\n    s.backward()\nexcept RuntimeError as x:\n    e = x\n"
        "assert e is not None and 'inplace' in str(e), 'a backward through the overwritten x ran'",
        "ok",
    ),
    (
        "rotate cos of the wrong shape",
        "ops.rotate(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 1, 6), torch.randn(1, 2, 1, 8))",
        "error cos",
    ),
    (
        "cpu_paged_decode, check_values=False, page id 2e9",
        "cpu_paged_decode(q, kc, vc, i32([0, 2_000_000_000], [2, 3]), lens, check_values=False)",
        "error block_table",
    ),
    (
        "triton_paged_decode, check_values=False, page id 2e9",
        "triton_paged_decode(q, kc, vc, i32([0, 2_000_000_000], [2, 3]), lens, check_values=False)",
        "error block_table",
    ),
    (
        "triton_cascade_decode, prefix longer than the sequences",
        "triton_cascade_decode(q, kc, vc, i32([0, 1], [0, 1]), lens, i32(0, 2), i32(12), check_values=False)",
        "error prefix_lens",
    ),
    (
        "q_lens adding up past 2^63 (to 0: q's n)",
        "attn(q=none(0, 1, 0), kc=none(1, 2**62, 1, 0), vc=none(1, 2**62, 1, 0), bt=i64([0], [0], [0], [0]),"
        " lens=i64(*[2**62] * 4), q_lens=i64(*[2**62] * 4))",
        "error q_lens",
    ),
    (
        "a row's scores, Hq * seq_len, past 2^63",
        "attn(q=none(1, 2**32, 0), kc=none(1, 2**32, 1, 0), vc=none(1, 2**32, 1, 0), bt=i64([0]), lens=i64(2**32),"
        " q_lens=i64(1))",
        "error seq_lens",
    ),
    (
        "q of no element, a sequence of 2^62 tokens",
        "assert attn(q=none(1, 1, 0), kc=none(1, 2**62, 1, 0), vc=none(1, 2**62, 1, 0), bt=i64([0]), lens=i64(2**62),"
        " q_lens=i64(1)).shape == (1, 1, 0)",
        "ok",
    ),
    (
        "k_scale a negative view (read through its strides)",
        "kernel().paged_attention_scaled(q, kc.to(torch.int8), vc.to(torch.int8), bt, lens, ones, 0.35, neg(4, 2),"
        " torch.rand(4, 2))",
        "error k_scale",
    ),
    ("few_rows x a negative view of one element", "few_rows_kernel()(neg(1, 1), torch.randn(1, 1, 64), 64)", "error x"),
    ("add_norm h a negative view (written in place)", "ops.add_norm(neg(1, 1), None, torch.ones(1), 1e-6)", "error h"),
    ("k_cache past its shrunk storage", "attn(kc=shrunk(kc.clone()))", "error k_cache"),
    (
        "silu_mul gate past its shrunk storage",
        "ops.silu_mul(shrunk(torch.randn(8, 8)), torch.randn(8, 8))",
        "error gate",
    ),
    (
        "add_norm h past its shrunk storage (written)",
        "ops.add_norm(shrunk(torch.randn(8, 8)), None, torch.ones(8), 1e-5)",
        "error h",
    ),
    (
        "silu_mul gate requiring grad (no backward: its gradient would be missing)",
        "ops.silu_mul(torch.randn(2, 8, requires_grad=True), torch.randn(2, 8))",
        "error gate",
    ),
    (
        "add_norm h a leaf requiring grad (written in place)",
        "ops.add_norm(torch.randn(2, 8, requires_grad=True), None, torch.ones(8), 1e-6)",
        "error h",
    ),
    (
        "add_norm w a parameter",
        "ops.add_norm(torch.randn(2, 8), None, torch.nn.Parameter(torch.ones(8)), 1e-6)",
        "error w",
    ),
    (
        "rotate sin requiring grad",
        "ops.rotate(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8, requires_grad=True))",
        "error sin",
    ),
    (
        "few_rows x requiring grad",
        "few_rows_kernel()(torch.randn(2, 5, requires_grad=True), torch.randn(1, 5, 64), 3)",
        "error x",
    ),
    ("paged_attention q requiring grad", "attn(q=q.clone().requires_grad_())", "error q"),
    (
        "tensors requiring grad run under no_grad and inference_mode (nothing recorded)",
        "g, u, w = torch.randn(2, 8, requires_grad=True), torch.randn(2, 8), torch.nn.Parameter(torch.ones(8))\n"
        "with torch.no_grad():\n    a = ops.silu_mul(g, u); n = ops.add_norm(torch.randn(2, 8), None, w, 1e-6)[1]\n"
        "with torch.inference_mode():\n    b = ops.silu_mul(g, u); o = attn(q=q.clone().requires_grad_())\n"
        "torch.testing.assert_close(a, torch.nn.functional.silu(g.detach()) * u); assert torch.equal(a, b)\n"
        "torch.testing.assert_close(o, attn())",
        "ok",
    ),
    ("k_cache of a storage shrunk to 0 bytes", "attn(kc=shrunk(kc.clone(), 0))", "error k_cache"),
    ("k_cache a zero tensor (no memory)", "attn(kc=torch._efficientzerotensor(kc.shape))", "error k_cache"),
    ("silu_mul gate a zero tensor", "ops.silu_mul(torch._efficientzerotensor(3, 8), torch.randn(3, 8))", "error gate"),
    (
        "silu_mul gate a dual tensor (forward-mode AD: its tangent would be dropped)",
        "import torch.autograd.forward_ad as fwAD\nwith fwAD.dual_level():\n"
        "    ops.silu_mul(fwAD.make_dual(torch.randn(2, 8), torch.randn(2, 8)), torch.randn(2, 8))",
        "error gate",
    ),
    (
        "few_rows x a dual tensor",
        "import torch.autograd.forward_ad as fwAD\nwith fwAD.dual_level():\n"
        "    few_rows_kernel()(fwAD.make_dual(torch.randn(2, 5), torch.randn(2, 5)), torch.randn(1, 5, 64), 3)",
        "error x",
    ),
    (
        "paged_attention q a dual tensor",
        "import torch.autograd.forward_ad as fwAD\nwith fwAD.dual_level():\n"
        "    attn(q=fwAD.make_dual(q, torch.randn_like(q)))",
        "error q",
    ),
    ("paged_attention q at an unaligned address", "attn(q=unaligned(2, 4, 8))", "error q"),
    ("few_rows x at an unaligned address", "few_rows_kernel()(unaligned(2, 5), torch.randn(1, 5, 64), 3)", "error x"),
    ("add_norm w at an unaligned address", "ops.add_norm(torch.randn(2, 8), None, unaligned(8), 1e-6)", "error w"),
    (
        "checks run a negative number of times",
        "ops.silu_mul_checks(torch.randn(2, 8), torch.randn(2, 8), -1)",
        "error times",
    ),  # fmt: skip
    (
        "checks run 2^62 times (would hang)",
        "few_rows_kernel(); torch.ops.paged_ref_linear.few_rows_checks("
        "torch.randn(1, 5), torch.randn(1, 5, 64), 10, 2**62)",
        "error times",
    ),  # fmt: skip
    (
        "silu_mul gate a nested tensor",
        "ops.silu_mul(torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)]), torch.randn(2, 8))",
        "error gate",
    ),  # fmt: skip
    (
        "the block table written by another thread during the call: the ids checked are the ids read",
        "import threading, time\n"
        "n, P = 100_000, 64\nkc1, buf = torch.randn(1, P, 1, 64), torch.zeros(48_000_000 + n, dtype=torch.int64)\n"
        "bad = torch.full_like(buf, 2**40)  # page ids far outside the pool of one page\n"
        "q1, table, seq_lens, q_lens = torch.randn(n, 1, 64), buf[-n:].view(n, 1), torch.full((n,), P), torch.ones(n)\n"
        "for trial in range(3):\n"
        "    buf.zero_(); w = threading.Thread(target=lambda: (time.sleep(0.01), buf.copy_(bad))); w.start()\n"
        "    time.sleep(0.03)  # the copy (no GIL held) runs on while the kernel reads the table\n"
        "    try:\n"
        "        kernel().paged_attention(q1, kc1, kc1, table, seq_lens, q_lens.long(), 0.125)\n"
        "    except RuntimeError as e:  # the writer came first: refused\n"
        "        assert 'block_table' in str(e), e\n"
        "    w.join()",
        "ok",
    ),
    (
        "a key far below the maximum weighs 0",
        "v = torch.zeros(4, 4, 2, 8); v[0, 1] = 3e38; k = torch.zeros(4, 4, 2, 8); k[0, 0] = 1e3; k[0, 1] = -1e3;"
        " qq = torch.full((1, 4, 8), 1.0); o = cpu_paged_decode(qq, k, v, i32([0]), i32(2), scale=1.0);"
        " torch.testing.assert_close(o, reference_paged_decode(qq, k, v, i32([0]), i32(2), scale=1.0));"
        " assert o.abs().max() == 0",
        "ok",
    ),
]

RUNNER = """
import json, sys
exec(SETUP)
for i, (name, code, _) in enumerate(CASES):
    print(json.dumps({"case": i, "start": True}), flush=True)
    try:
        exec(code)
        print(json.dumps({"case": i, "ok": True}), flush=True)
    except Exception as e:
        print(json.dumps({"case": i, "error": f"{type(e).__name__}: {e}"}), flush=True)
"""


def test_issue_57_cases_are_refused_or_answered_right():
    program = f"SETUP = {SETUP!r}\nCASES = {CASES!r}\n{RUNNER}"
    run = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT, timeout=600, env=child_env()
    )
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    answers = {x["case"]: x for x in lines if "start" not in x}
    for i, (name, _, expect) in enumerate(CASES):
        assert i in answers, f"the process died (exit code {run.returncode}) on case {name!r}:\n{run.stderr[-3000:]}"
        got = answers[i]
        if expect == "ok":
            assert "ok" in got, f"{name}: {got}"
        else:
            arg = expect.split()[1]
            assert "error" in got and arg in got["error"].replace(":", " ").replace("[", " ").split(), f"{name}: {got}"
