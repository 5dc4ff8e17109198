"""A worker process for tests/test_native_hostile.py: reads one case a line (JSON) on stdin, calls the
native op it names on the tensors it describes, and writes one JSON line: ``{"error": message}`` or
``{"max_err": e}`` (the largest error against the float64 reference; None where the reference cannot be
computed). A crash ends the process: the test that sent the case sees no answer and fails naming it.

A tensor is ``{"shape", "dtype", "layout", "values"?}``: float values are drawn from the case's seed,
``values`` lists an integer tensor's entries; ``layout`` lays the same values out as ``contiguous``,
``transposed`` (dimensions 0 and -1 swapped in memory), ``strided`` (every other float of a buffer twice
as long in the last dimension) or ``expanded`` (dimension 0 a stride-0 copy of its first entry).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}
DTYPES |= {"int16": torch.int16, "bool": torch.bool, "float16": torch.float16, "int8": torch.int8}
DTYPES |= {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def child_env() -> dict:
    """The environment of a process running the ops: the repository on its path; with ``PAGED_REF_SANITIZE=1``,
    libasan preloaded (the kernels are then built under ASan and UBSan, `paged_ref.native`; a finding ends
    the process)."""
    root = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    if env.get("PAGED_REF_SANITIZE") == "1":
        libs = [  # libstdc++ too: ASan's interceptor of C++ throws needs it loaded when it starts
            subprocess.run(["gcc", f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
            for lib in ("libasan.so", "libstdc++.so.6")
        ]
        env |= {"LD_PRELOAD": " ".join(libs), "ASAN_OPTIONS": "detect_leaks=0"}
    return env


def make(spec: dict, gen: torch.Generator) -> torch.Tensor:
    """The tensor ``spec`` describes (see the module docstring)."""
    shape, dtype, layout = list(spec["shape"]), DTYPES[spec["dtype"]], spec.get("layout", "contiguous")
    if "values" in spec:
        t = torch.tensor(spec["values"], dtype=torch.int64).reshape(shape).to(dtype)
    elif layout == "expanded" and shape and shape[0] > 0:
        return torch.randn([1, *shape[1:]], generator=gen).to(dtype).expand(shape)
    else:
        t = torch.randn(shape, generator=gen).to(dtype)
    if layout == "transposed" and t.dim() >= 2:
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    if layout == "strided" and t.dim() >= 1:
        wide = torch.zeros([*shape[:-1], 2 * shape[-1]], dtype=dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    return t


def ref_paged(q, k, v, table, lens, q_lens, scale) -> torch.Tensor:
    """float64 paged attention: token i of sequence b sees its first ``lens[b] - q_lens[b] + i + 1`` tokens."""
    out, row, page_size = torch.zeros_like(q), 0, k.shape[1]
    group = q.shape[1] // k.shape[2]
    for b in range(len(lens)):
        ids = [int(table[b, t // page_size]) * page_size + t % page_size for t in range(int(lens[b]))]
        keys = k.flatten(0, 1)[ids].repeat_interleave(group, 1)  # [len, Hq, D]
        vals = v.flatten(0, 1)[ids].repeat_interleave(group, 1)
        for i in range(int(q_lens[b])):
            seen = int(lens[b]) - int(q_lens[b]) + i + 1
            s = torch.einsum("hd,thd->ht", q[row], keys[:seen]) * scale  # [Hq, seen]
            out[row] = torch.einsum("ht,thd->hd", s.softmax(-1), vals[:seen])
            row += 1
    return out


def run(case: dict):
    """The op's output(s) and the float64 reference, both as lists of tensors."""
    from paged_ref.attention.cpu_paged import kernel
    from paged_ref.fast.cpu_ops import cpu_ops
    from paged_ref.fast.prepack import few_rows_kernel

    gen = torch.Generator().manual_seed(case["seed"])
    t = {name: make(spec, gen) for name, spec in case["tensors"].items()}
    f64 = {name: x.double() for name, x in t.items() if x.dtype in (torch.float32, torch.float64)}
    op = case["op"]
    if op == "paged_attention":
        args = [t[n] for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "q_lens")]
        got = [kernel().paged_attention_scaled(*args, case["scale"], t.get("k_scale"), t.get("v_scale"))]
        lens, q_lens = t["seq_lens"].tolist(), t["q_lens"].tolist()
        caches = [  # 8-bit pages: the bytes times their page scales in float32, as the kernel reads them
            f64[c] if s not in t else (t[c].float() * t[s][:, None, :, None]).double()
            for c, s in (("k_cache", "k_scale"), ("v_cache", "v_scale"))
        ]
        ref = lambda: [ref_paged(f64["q"], *caches, t["block_table"], lens, q_lens, case["scale"])]  # noqa: E731
    elif op == "few_rows":
        got = [few_rows_kernel()(t["x"], t["w"], case["n"])]
        w = f64["w"]
        ref = lambda: [f64["x"] @ w.permute(0, 2, 1).reshape(w.shape[0] * 64, w.shape[1])[: case["n"]].T]  # noqa: E731
    elif op == "add_norm":
        h0, y = f64["h"].clone(), f64.get("y")
        h, out = cpu_ops().add_norm(t["h"], t.get("y"), t["w"], case["eps"])
        got = [h, out]

        def ref():
            s = h0 if y is None else h0 + y
            return [s, f64["w"] * s / (s.pow(2).mean(-1, keepdim=True) + case["eps"]).sqrt()]
    elif op == "rotate":
        x0 = f64["x"].clone()
        got = [cpu_ops().rotate(t["x"], t["cos"], t["sin"])]

        def ref():
            half = x0.shape[-1] // 2
            return [x0 * f64["cos"] + torch.cat((-x0[..., half:], x0[..., :half]), -1) * f64["sin"]]
    elif op == "silu_mul":
        got = [cpu_ops().silu_mul(t["gate"], t["up"])]
        ref = lambda: [torch.nn.functional.silu(f64["gate"]) * f64["up"]]  # noqa: E731
    else:
        raise ValueError(f"unknown op {op}")
    return got, ref


def answer(case: dict) -> dict:
    try:
        got, ref = run(case)
    except Exception as e:  # the op's refusal (or a failure building the case, which names no argument)
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        want = ref()
    except Exception as e:
        return {"max_err": None, "why": f"no reference: {type(e).__name__}: {e}"}
    if [tuple(g.shape) for g in got] != [tuple(w.shape) for w in want]:
        return {"max_err": None, "why": f"shapes {[tuple(g.shape) for g in got]} vs {[tuple(w.shape) for w in want]}"}
    errs = [((g.double() - w).abs() / (1 + w.abs())).max().item() if w.numel() else 0.0 for g, w in zip(got, want)]
    return {"max_err": max(errs, default=0.0)}


def main() -> None:
    torch.set_num_threads(1)
    for line in sys.stdin:
        print(json.dumps(answer(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
