# Set-up and the project's two jobs. Both create .venv themselves.
#   make demo   - install, then train a small GPT on 2 ranks with torchrun (gloo on CPU, NCCL on GPU)
#   make test   - install, then run the whole test suite
#   make test-fast - install, then run only the tests that start no process (the inner loop; CI runs `make test`)
#   make install-bench - the test venv plus the benchmarks' peers (DeepSpeed, CPU build)
#   make check-cuda - compile-check the CUDA kernels with nvcc and with NVRTC as CuPy does (no GPU needed)
#   make lint  - ruff, pinned, over the whole tree (CI runs it before the tests)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines get the CPU build of torch 2.13.0 (a plain `pip install torch` would pull several GB
# of CUDA libraries); machines with an NVIDIA driver get the ordinary wheel.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
comma := ,
TORCH_SPEC := $(if $(HAS_GPU),torch>=2.13$(comma)<2.15,torch==2.13.0)
CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(if $(HAS_GPU),,$(shell $(PYTHON) -c "import urllib.request as u; u.urlopen('$(CPU_INDEX)/', timeout=5)" >/dev/null 2>&1 && echo $(CPU_INDEX)))

.PHONY: demo test test-fast lint install-test install-bench install-examples check-cuda clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.torch: | $(VENV)/bin/python
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	touch $@

install-test: $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[test]"

# The benchmarks' peers beyond torch's own: DeepSpeed (an sdist whose build imports torch, so it is built
# against the venv's torch instead of pulling another into an isolated build environment; no CUDA ops).
install-bench: install-test
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet --no-build-isolation "deepspeed==0.19.8"

install-examples: $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[examples]"

# pytest-xdist workers, each taking whole test files (a file's shared job runs once). 0 (the default, what CI
# runs) is one process in the files' order: on 2 cores two workers gained little (suite 1390 s for 1479 tests
# against 1246 s serial for 1448) and each of three runs met a test that depends on what ran before it in the
# same worker group (docs/design.md, "Testing"). `make test TEST_WORKERS=2` runs two.
TEST_WORKERS ?= 0
test: install-test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# tests/conftest.py marks `process` every test whose code starts one; the variable makes any process
# started anyway fail its test, so a miss of that analysis shows instead of slowing the inner loop. These
# tests start no worker group, so none can depend on a group's history: two xdist workers split them.
FAST_WORKERS ?= 2
test-fast: install-test
	BMT_TESTS_FORBID_PROCESSES=1 $(PY) -m pytest -q -n $(FAST_WORKERS) --dist loadfile -m "not process"

# Pinned (as in pyproject's dev extra) so that a new ruff release cannot turn a clean tree red between two runs.
RUFF_VERSION ?= 0.17.6
lint: | $(VENV)/bin/python
	$(PY) -m pip install --quiet "ruff==$(RUFF_VERSION)"
	$(VENV)/bin/ruff check .

# NVRTC through CuPy, in a venv of its own (the suite's venv stays without CuPy, as on CPU machines).
CUDA_CHECK_VENV ?= .venv-cuda
check-cuda:
	$(PYTHON) -m venv $(CUDA_CHECK_VENV)
	$(CUDA_CHECK_VENV)/bin/python -m pip install --quiet "cupy-cuda13x==14.2.0" "nvidia-cuda-nvrtc==13.5.37"
	$(CUDA_CHECK_VENV)/bin/python tools/check_cuda.py --require-nvrtc

demo: install-examples
	$(VENV)/bin/torchrun --nproc_per_node=2 examples/train_gpt.py

clean:
	rm -rf $(VENV) $(CUDA_CHECK_VENV) build *.egg-info .pytest_cache .hypothesis
