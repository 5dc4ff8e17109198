"""The tests' shared ``model`` fixture, and the run order for the test session: the slowest files first.

`make test` spreads whole files over pytest-xdist's workers (`--dist loadfile`) in collection
order (`--no-loadscope-reorder`); handing out the long files first lets the workers finish
together instead of one waiting for a long file that came last.
"""

import pytest
import torch


@pytest.fixture(scope="module")
def model():
    """The tiny random Llama (seed 0), torch on one thread while the module runs: tiny tensors,
    thread hand-offs cost more than they give. A module defining its own ``model`` uses that."""
    from paged_ref.models import tiny_llama  # on first use, not when pytest loads this file

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_llama(seed=0)
    torch.set_num_threads(threads)


# Slowest first, from `pytest -n 2 --dist loadfile tests --durations=0` summed per file with
# empty compile caches; files not listed keep their order after these.
SLOWEST_FIRST = [
    "test_hf_generate.py",
    "test_hf_smollm2.py",
    "test_serve_smollm2.py",
    "test_eviction.py",
    "test_hf_sampling.py",
    "test_hf_beam.py",
    "test_flex_compiled.py",
    "test_bench_gpu.py",
    "test_generate_heap.py",
    "test_browser.py",
    "test_triton_compile.py",
    "test_triton_launch_replay.py",
    "test_cache_properties.py",
    "test_attention_backends.py",
    "test_nonfinite_slots.py",
    "test_serve.py",
    "test_serve_property.py",
    "test_bench_pages.py",
    "test_cascade.py",
    "test_bench_serve.py",
    "test_triton_decode.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept
