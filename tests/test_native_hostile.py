"""Every native op called directly with hostile arguments (hypothesis): shapes, strides, dtypes, page ids,
lengths. Each case runs in one long-lived worker process (tests/native_worker.py), so a crash fails the
test naming the case instead of killing pytest. A case either raises an error naming its op and one of the
arguments it breaks (`*_violations`: the contract, written out here) or, where it breaks none, returns the
float64 reference's result (relative error < 1e-4).

``PAGED_REF_NATIVE_CASES=k`` runs k times the cases (CI: 1, 2,200 cases). ``PAGED_REF_SANITIZE=1`` builds the
kernels under AddressSanitizer and UBSan (`paged_ref.native`) and preloads libasan into the worker.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from native_worker import child_env, make  # noqa: E402

ROOT = Path(__file__).parents[1]
SCALE = int(os.environ.get("PAGED_REF_NATIVE_CASES", "1"))
COUNTS: dict[str, int] = {}
BIG = 2_000_000_000


class Worker:
    """The worker process, started on first use and again after a crash."""

    def __init__(self):
        self.proc, self.err = None, None

    def start(self):
        env = child_env()
        self.err = tempfile.TemporaryFile(mode="w+")
        worker = [sys.executable, str(Path(__file__).with_name("native_worker.py"))]
        self.proc = subprocess.Popen(worker, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env=env, cwd=ROOT)  # fmt: skip

    def ask(self, case: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.err.seek(0)
            tail = self.err.read()[-3000:]
            self.proc = None
            raise AssertionError(f"the worker died (exit code {code}) on case {json.dumps(case)}:\n{tail}")
        return json.loads(line)

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def _names(msg: str) -> set[str]:
    """The identifiers in an error message."""
    return set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", msg))


def check(worker: Worker, case: dict, violations: set[str]) -> None:
    """``case``'s answer: an error naming its op and one of ``violations``, or (none) the reference's result."""
    COUNTS[case["op"]] = COUNTS.get(case["op"], 0) + 1
    got = worker.ask(case)
    if "error" in got:
        named = _names(got["error"])
        assert violations, f"a valid case was refused: {got['error']}\ncase {json.dumps(case)}"
        assert case["op"] in named and named & violations, (
            f"the error names none of {sorted(violations)} (or not the op): {got['error']}\ncase {json.dumps(case)}"
        )
    else:
        assert not violations, f"a case breaking {sorted(violations)} was not refused: {got}\ncase {json.dumps(case)}"
        assert got["max_err"] is not None and got["max_err"] < 1e-4, f"{got}\ncase {json.dumps(case)}"


def _settings(n: int):
    return settings(max_examples=n * SCALE, deadline=None, database=None, derandomize=SCALE == 1,
                    phases=[Phase.explicit, Phase.generate],  # a crash is reported as it is, not shrunk
                    suppress_health_check=list(HealthCheck))  # fmt: skip


def _spec(shape, dtype="float32", layout="contiguous", values=None) -> dict:
    spec = {"shape": list(shape), "dtype": dtype, "layout": layout}
    return spec if values is None else {**spec, "values": values}


def _built(case: dict) -> dict:
    """The case's tensors as the worker builds them (for the layout predicates)."""
    gen = torch.Generator().manual_seed(case["seed"])
    return {name: make(spec, gen) for name, spec in case["tensors"].items()}


FLOAT = st.sampled_from(["float32"] * 9 + ["float64"])
INT = st.sampled_from(["int32"] * 4 + ["int64"] * 2 + ["int16", "float32"])
READ = st.sampled_from(["contiguous", "transposed", "strided", "expanded"])
TABLE = st.sampled_from(["contiguous", "transposed", "strided"])
EIGHT_BIT = ("float8_e4m3fn", "float8_e5m2", "int8")
PAGES = st.sampled_from(["float32"] * 9 + ["float64", *EIGHT_BIT * 3])  # K/V pages: float32 or 8-bit
SEED = st.integers(0, 2**31 - 1)


def _size(lo, hi, bad=()):
    return st.one_of(st.integers(lo, hi), st.sampled_from(bad)) if bad else st.integers(lo, hi)


# --- paged_attention --------------------------------------------------------------------------
@st.composite
def paged_cases(draw):
    B, P, pages = draw(st.integers(0, 3)), draw(_size(1, 4, (0,))), draw(st.integers(0, 5))
    Hkv, G, D, M = draw(_size(1, 2, (0,))), draw(st.integers(1, 3)), draw(st.integers(0, 6)), draw(st.integers(0, 3))
    Hq = draw(st.one_of(st.just(Hkv * G), st.integers(0, 5)))
    Dq = draw(st.one_of(st.just(D), st.integers(0, 7)))
    lens = [draw(st.one_of(st.integers(1, max(1, M * P)), st.integers(-3, M * P + 3), st.just(-BIG))) for _ in range(B)]
    q_lens = [draw(st.one_of(st.integers(0, max(0, n)).map(lambda x: min(x, 2)), st.integers(-2, 3))) for n in lens]
    rows = draw(st.one_of(st.just(B), st.integers(0, 4)))
    page_id = st.one_of(st.integers(0, max(0, pages - 1)), st.sampled_from([-1, pages, BIG, -BIG]))
    table = [[draw(page_id) for _ in range(M)] for _ in range(rows)]
    n = draw(st.one_of(st.just(max(0, sum(q_lens))), st.integers(0, 6)))
    q_rank = draw(st.sampled_from([3] * 12 + [2]))
    v_pages = draw(st.one_of(st.just(pages), st.integers(0, 6)))
    int_t = [draw(INT), draw(INT), draw(INT)]
    k_dtype = draw(PAGES)
    v_dtype = draw(st.one_of(st.just(k_dtype), PAGES))
    tensors = {
        "q": _spec([n, Hq, Dq][:q_rank] if q_rank == 2 else [n, Hq, Dq], draw(FLOAT), draw(READ)),
        "k_cache": _spec([pages, P, Hkv, D], k_dtype, draw(READ)),
        "v_cache": _spec([v_pages, P, Hkv, D], v_dtype, draw(READ)),
        "block_table": _spec([rows, M], int_t[0], draw(TABLE), [p for r in table for p in r]),
        "seq_lens": _spec([B], int_t[1], draw(TABLE), lens),
        "q_lens": _spec([len(q_lens)], int_t[2], draw(TABLE), q_lens),
    }
    for name in ("k_scale", "v_scale"):  # 8-bit pages: mostly right (strides of every kind, 0 too), else not
        if draw(st.sampled_from([True] * 8 + [False] * 2)) == (k_dtype in EIGHT_BIT):
            shape = draw(st.sampled_from([[pages, Hkv]] * 8 + [[max(0, pages - 1), Hkv], [Hkv, pages], [pages]]))
            tensors[name] = _spec(shape, draw(st.sampled_from(["float32"] * 8 + ["float64", "float16"])), draw(READ))
    return {"op": "paged_attention", "seed": draw(SEED), "scale": draw(st.sampled_from([0.5, 1.0, 3.0])),
            "tensors": tensors}  # fmt: skip


def scale_violations(t: dict) -> set[str]:
    """The page scales' contract: with 8-bit pages float32 [num_pages, Hkv] (any strides), else none."""
    pages, _, Hkv, _ = t["k_cache"]["shape"]
    if t["k_cache"]["dtype"] not in EIGHT_BIT:
        return {n for n in ("k_scale", "v_scale") if n in t}
    return {
        n for n in ("k_scale", "v_scale") if n not in t or t[n]["dtype"] != "float32" or t[n]["shape"] != [pages, Hkv]
    }


def _int16_or_float(spec) -> bool:
    return spec["dtype"] not in ("int32", "int64")


def paged_violations(case: dict) -> set[str]:
    """The arguments ``case`` breaks: the kernel's contract (`paged_ref.attention.cpu_paged`)."""
    t = case["tensors"]
    bad = {"q"} if t["q"]["dtype"] != "float32" else set()
    bad |= {"k_cache"} if t["k_cache"]["dtype"] not in ("float32", *EIGHT_BIT) else set()
    bad |= {"v_cache"} if t["v_cache"]["dtype"] != t["k_cache"]["dtype"] else set()
    bad |= {n for n in ("block_table", "seq_lens", "q_lens") if _int16_or_float(t[n])}
    bad |= scale_violations(t)
    if len(t["q"]["shape"]) != 3:
        return bad | {"q"}
    (n, Hq, Dq), (pages, P, Hkv, D) = t["q"]["shape"], t["k_cache"]["shape"]
    bad |= {"v_cache"} if t["v_cache"]["shape"] != t["k_cache"]["shape"] else set()
    bad |= {"k_cache"} if P < 1 or Hkv < 1 else set()
    bad |= {"q"} if Dq != D or (Hkv >= 1 and Hq % Hkv) else set()
    lens, q_lens = t["seq_lens"]["values"], t["q_lens"]["values"]
    rows, M = t["block_table"]["shape"]
    if rows != len(lens):
        bad.add("block_table")
    if len(q_lens) != len(lens):
        bad.add("q_lens")
    if bad:
        return bad
    if any(not 0 <= x <= M * P for x in lens):
        return {"seq_lens"}
    if any(not 0 <= m <= x for m, x in zip(q_lens, lens)) or sum(q_lens) != n:
        return {"q_lens"}
    table = t["block_table"]["values"]
    for b, x in enumerate(lens):
        if any(not 0 <= p < pages for p in table[b * M : b * M + -(-x // P)]):
            return {"block_table"}
    return set()


@_settings(1000)
@given(case=paged_cases())
def test_paged_attention_hostile(worker, case):
    check(worker, case, paged_violations(case))


def _scale_case(fmt: str, change: dict) -> dict:
    """A valid call on 8-bit pages (2 sequences, 4 pages of 4 tokens, 2 KV heads, GQA 2) with ``change`` made to
    its tensors' specs (a spec of None: the tensor left out)."""
    pages = _spec([4, 4, 2, 8], fmt)
    tensors = {
        "q": _spec([3, 4, 8]),
        "k_cache": pages,
        "v_cache": pages,
        "k_scale": _spec([4, 2], layout="transposed"),
        "v_scale": _spec([4, 2], layout="expanded"),
        "block_table": _spec([2, 2], "int32", values=[3, 1, 0, 2]),
        "seq_lens": _spec([2], "int32", values=[7, 4]),
        "q_lens": _spec([2], "int32", values=[2, 1]),
    }
    tensors = {n: s for n, s in {**tensors, **change}.items() if s is not None}
    return {"op": "paged_attention", "seed": 7, "scale": 0.5, "tensors": tensors}


SCALE_CHANGES = {
    "valid": {},
    "strided scales": {"k_scale": _spec([4, 2], layout="strided"), "v_scale": _spec([4, 2])},
    "no k_scale": {"k_scale": None},
    "no scales": {"k_scale": None, "v_scale": None},
    "float64 v_scale": {"v_scale": _spec([4, 2], "float64")},
    "float16 k_scale": {"k_scale": _spec([4, 2], "float16")},
    "too short k_scale": {"k_scale": _spec([3, 2])},
    "transposed shape": {"v_scale": _spec([2, 4])},
    "one scale per page": {"k_scale": _spec([4])},
    "scales for float32 pages": {"k_cache": _spec([4, 4, 2, 8]), "v_cache": _spec([4, 4, 2, 8])},
    "v_cache of another format": {"v_cache": None},  # filled in per format
}


@pytest.mark.parametrize("fmt", EIGHT_BIT)
@pytest.mark.parametrize("change", SCALE_CHANGES, ids=str)
def test_paged_attention_page_scales(worker, fmt, change):
    """8-bit pages and their scales, each way the scales can be wrong (and right, through any strides)."""
    other = EIGHT_BIT[(EIGHT_BIT.index(fmt) + 1) % 3]
    case = _scale_case(fmt, {"v_cache": _spec([4, 4, 2, 8], other)} if "another" in change else SCALE_CHANGES[change])
    violations = paged_violations(case)
    assert (change == "valid" or "strided" in change) == (not violations)
    check(worker, case, violations)


# --- few_rows -----------------------------------------------------------------------------------
@st.composite
def few_rows_cases(draw):
    M, K, N = draw(st.integers(0, 9)), draw(st.integers(0, 9)), draw(_size(0, 330, (-1, -64, 2**40)))
    blocks = draw(st.one_of(st.just(max(0, -(-N // 64)) if N < 2**40 else 1), st.integers(0, 6)))
    w_shape = [blocks, draw(st.one_of(st.just(K), st.integers(0, 9))), draw(st.sampled_from([64] * 6 + [32, 65]))]
    x_shape = draw(st.sampled_from([[M, K]] * 8 + [[M * K], [1, M, K]]))
    tensors = {"x": _spec(x_shape, draw(FLOAT), draw(READ)), "w": _spec(w_shape, draw(FLOAT), draw(READ))}
    return {"op": "few_rows", "seed": draw(SEED), "n": N, "tensors": tensors}


def few_rows_violations(case: dict) -> set[str]:
    x, w, n = case["tensors"]["x"], case["tensors"]["w"], case["n"]
    bad = {name for name, s in (("x", x), ("w", w)) if s["dtype"] != "float32"}
    if len(x["shape"]) != 2:
        return bad | {"x"}
    if n < 0:
        return bad | {"n"}
    if w["shape"] != [-(-n // 64), x["shape"][1], 64]:
        bad |= {"w"}
    return bad


@_settings(300)
@given(case=few_rows_cases())
def test_few_rows_hostile(worker, case):
    check(worker, case, few_rows_violations(case))


# --- add_norm, rotate, silu_mul -------------------------------------------------------------------
SHAPE = st.lists(st.integers(0, 4), min_size=0, max_size=3)


@st.composite
def add_norm_cases(draw):
    shape = draw(SHAPE)
    C = shape[-1] if shape else 1
    tensors = {"h": _spec(shape, draw(FLOAT), draw(st.sampled_from(["contiguous"] * 3 + ["transposed", "strided"])))}
    if draw(st.booleans()):
        tensors["y"] = _spec(draw(st.one_of(st.just(shape), SHAPE)), draw(FLOAT), draw(READ))
    tensors["w"] = _spec(
        draw(st.sampled_from([[C]] * 6 + [[C + 1], [max(0, C - 1)], [1, C], []])), draw(FLOAT), draw(READ)
    )
    return {"op": "add_norm", "seed": draw(SEED), "eps": 1e-5, "tensors": tensors}


def add_norm_violations(case: dict) -> set[str]:
    t = case["tensors"]
    bad = {n for n, s in t.items() if s["dtype"] != "float32"}
    h = t["h"]["shape"]
    if not h or not _built(case)["h"].is_contiguous():
        bad.add("h")
    if "y" in t and t["y"]["shape"] != h:
        bad.add("y")
    if t["w"]["shape"] != h[-1:]:
        bad.add("w")
    return bad


@_settings(300)
@given(case=add_norm_cases())
def test_add_norm_hostile(worker, case):
    check(worker, case, add_norm_violations(case))


@st.composite
def rotate_cases(draw):
    B, T, H, D = draw(st.integers(0, 2)), draw(st.integers(0, 3)), draw(st.integers(0, 3)), draw(st.integers(0, 6))
    x_shape = draw(st.sampled_from([[B, T, H, D]] * 6 + [[B, T, D]]))
    table = st.sampled_from([[B, T, 1, D]] * 6 + [[B, T, D], [B, T, 1, D + 2], [1, T, 1, D], [B, T, H, D]])
    x_layout = draw(st.sampled_from(["contiguous"] * 3 + ["transposed", "strided", "expanded"]))
    tensors = {"x": _spec(x_shape, draw(FLOAT), x_layout)}
    tensors |= {n: _spec(draw(table), draw(FLOAT), draw(READ)) for n in ("cos", "sin")}
    return {"op": "rotate", "seed": draw(SEED), "tensors": tensors}


def rotate_violations(case: dict) -> set[str]:
    t = case["tensors"]
    bad = {n for n, s in t.items() if s["dtype"] != "float32"}
    if len(t["x"]["shape"]) != 4:
        return bad | {"x"}
    x = _built(case)["x"]
    B, T, H, D = x.shape
    overlap = t["x"]["layout"] == "expanded" and B > 1 and x.numel() > 0
    if D % 2 or overlap or not (x.numel() == 0 or D == 1 or x.stride(3) == 1):
        bad.add("x")
    return bad | {n for n in ("cos", "sin") if t[n]["shape"] != [B, T, 1, D]}


@_settings(300)
@given(case=rotate_cases())
def test_rotate_hostile(worker, case):
    check(worker, case, rotate_violations(case))


@st.composite
def silu_mul_cases(draw):
    shape = draw(SHAPE)
    tensors = {"gate": _spec(shape, draw(FLOAT), draw(READ))}
    tensors["up"] = _spec(draw(st.one_of(st.just(shape), SHAPE)), draw(FLOAT), draw(READ))
    return {"op": "silu_mul", "seed": draw(SEED), "tensors": tensors}


def silu_mul_violations(case: dict) -> set[str]:
    t = case["tensors"]
    bad = {n for n, s in t.items() if s["dtype"] != "float32"}
    if not t["gate"]["shape"]:
        bad.add("gate")
    if t["up"]["shape"] != t["gate"]["shape"]:
        bad.add("up")
    return bad


@_settings(300)
@given(case=silu_mul_cases())
def test_silu_mul_hostile(worker, case):
    check(worker, case, silu_mul_violations(case))


def test_case_count():
    """The cases above ran (when all of them were selected): at least 2,000 in all."""
    if len(COUNTS) < 5:
        pytest.skip(f"only {sorted(COUNTS)} ran")
    print(f"native hostile cases: {COUNTS}, {sum(COUNTS.values())} in all")
    assert sum(COUNTS.values()) >= 2000 * SCALE
