"""The same requests through vLLM and through paged_ref's engine: identical greedy tokens (runs in
.venv-vllm: `make test-vllm`).

A few of ``bench serve``'s requests (SmolLM2, English prompts, outputs cut short for CI time) go
through ``vllm.LLM.generate`` (`paged_ref.lab.bench._vllm_peer`, the engine core in this process) and
through `paged_ref.serve.Engine`, on the same pool (blocks of 32 tokens, small enough to preempt),
the same ``max_num_seqs`` and token budget, float32, EOS ignored, in vLLM's configuration (watermark
0). Both must generate the same tokens, request by request, and preempt as often.
"""

import pytest
import torch
from vllm_peer import require_vllm

require_vllm()

PAGE, NEW, COUNT = 32, 12, 6
LIMITS = dict(max_num_seqs=32, max_batched_tokens=512)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    from paged_ref.lab.bench._vllm_peer import save_smollm2
    from paged_ref.lab.bench.serve import PROFILES, make_requests
    from paged_ref.models import load_smollm2

    model, tok = load_smollm2()
    cfg = PROFILES["cpu"]
    lengths = {k: cfg[k] for k in ("requests", "mean_prompt", "mean_output", "sigma", "min_prompt", "max_model_len")}
    requests, _ = make_requests(model, tok, **lengths)
    requests = [(p, min(n, NEW)) for p, n in requests[:COUNT]]
    alone = max(-(-(len(p) + n - 1) // PAGE) for p, n in requests)  # pages the longest request needs
    pool = max(alone, sum(len(p) + n for p, n in requests) // PAGE // 2)  # about half of what all need
    return model, save_smollm2(tmp_path_factory.mktemp("smollm2")), requests, pool


def test_vllm_and_the_engine_generate_the_same_tokens(workload):
    from paged_ref.lab.bench._vllm_peer import run_vllm
    from paged_ref.serve import VLLM_ADMISSION, Engine

    model, folder, requests, pool = workload
    limits = dict(LIMITS, max_model_len=pool * PAGE)  # vLLM checks that one request of max_model_len fits
    theirs = run_vllm(folder, requests, page_size=PAGE, num_pages=pool, **limits)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(
            model,
            num_pages=pool,
            page_size=PAGE,
            reservation=VLLM_ADMISSION,
            eos_token_id=[],
            **limits,
        )
        for prompt, new in requests:
            engine.add_request(prompt, max_new_tokens=new)
        ours = [o.token_ids for o in engine.run()]
    finally:
        torch.set_num_threads(threads)
    same = [a == b for a, b in zip(ours, theirs["tokens"])]
    assert all(same), f"requests with other tokens: {[i for i, s in enumerate(same) if not s]}"
    assert [len(t) for t in ours] == [n for _, n in requests]
    assert engine.stats()["preemptions"] > 0, "the pool should force preemption"
    assert engine.stats()["preemptions"] == theirs["preemptions"]


def test_the_peer_refuses_what_vllm_cannot_run(monkeypatch):
    from paged_ref.lab.bench import _vllm_peer

    with pytest.raises(ValueError, match="multiple of 32"):
        _vllm_peer.check_page_size(16)
    monkeypatch.setattr(_vllm_peer.importlib.metadata, "version", lambda dist: "0.31.0")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.32\.0, found 0\.31\.0"):
        _vllm_peer.check_vllm()


@pytest.mark.parametrize("fast", [False, True])
def test_bench_serve_with_vllm_as_its_peer(tmp_path, fast):
    """``bench serve --quick --peer vllm``: vLLM in its own process beside the engine, tokens compared; with
    ``--peer-only --fast`` the engine runs its faster CPU step against vLLM, with the same tokens."""
    import json

    from paged_ref.lab.bench import serve

    options = ["--peer-only", "--fast"] if fast else ["--skip-pools"]
    serve.main(["--quick", "--peer", "vllm", *options, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / f"serve_cpu_quick{'_peer_vllm_fast' if fast else ''}.json").read_text())
    v = saved["peer_vllm"]
    assert saved["config"]["engine_options"] == (serve.FAST_OPTIONS if fast else {})
    assert v["requests_with_identical_tokens"] == v["requests"] == serve.PROFILES["quick"]["requests"]
    assert v["config"]["page_size"] == 32 and v["vllm_version"] == "0.32.0"
    assert v["paged"][0]["preemptions"] == v["vllm"][0]["preemptions"]
    assert v["vllm"][0]["wall_tokens_per_s"] > 0 and v["vllm"][0]["ttft_p50_s"] is not None


def test_bench_serve_pairs_against_vllm_at_its_defaults(tmp_path):
    """``bench serve --quick --peer vllm --peer-only --fast --pairs 1``: vLLM at its defaults (compiled, its
    engine core in its own process) and eager, loaded once, a warm-up each, then a turn each after the engine's;
    the threads each ran read from /proc; tokens identical and preemptions equal in the in-process check."""
    import json

    from paged_ref.lab.bench import serve

    serve.main(["--quick", "--peer", "vllm", "--peer-only", "--fast", "--pairs", "1", "--pair-threads", "1"] +
               ["--out", str(tmp_path)])  # fmt: skip
    from paged_ref.fast.prepack import vector_floats

    floats = vector_floats()  # without AVX-512 the record has a file of its own
    saved = json.loads((tmp_path / f"serve_cpu_quick_peer_vllm_pairs{serve.tile_suffix(floats)}.json").read_text())
    assert saved["vector_floats"] == floats
    assert saved["paged_ref_fast"] == serve.FAST_OPTIONS and saved["goals"]["vllm_default_1x_every_cell"]
    starts = {s["settings"]["mode"]: s for s in saved["vllm_starts"]}
    assert starts["default"]["settings"]["compilation_mode"] == "DYNAMO_TRACE_ONCE"
    assert starts["default"]["settings"]["compilation_backend"] == "inductor"
    assert starts["default"]["settings"]["engine_core_in_own_process"]
    assert starts["eager"]["settings"]["compilation_mode"] == "NONE"
    assert not starts["eager_in_process"]["settings"]["engine_core_in_own_process"]
    assert starts["eager_in_process"]["worker"]["torch_threads"] == 1
    for mode in ("default", "eager"):
        assert starts[mode]["settings"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
        assert starts[mode]["worker"]["torch_threads"] == 1 and starts[mode]["worker"]["cpus"] == [0]
    (cell,) = saved["cells"]
    assert set(cell["warmup"]) == {"paged_ref", "default", "eager", "eager_in_process"}
    for row in saved["summary"]:
        assert row["requests_identical_min"] == row["requests"] == serve.PROFILES["quick"]["requests"]
        assert row["paged_ref_torch_threads"] == [1]
        assert row["pairs"] == 1  # (busy threads: the quick turns are too short for /proc's clock ticks)
    (check,) = saved["in_process_checks"]
    assert check["tokens"]["requests_identical"] == check["tokens"]["requests"]
    assert check["paged_ref_preemptions"] == check["vllm_preemptions"]
