# Set-up is `make demo` (environment + main job) and `make test` (environment + test suite).
PYTHON ?= python3
VENV ?= .venv
# torch is installed first and pinned so pip takes the CPU wheel; override, e.g. TORCH_SPEC="torch==2.13.0" or a CUDA build.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Test processes: most of the suite is single-threaded Python (the Triton interpreter, subprocess
# runs), so one per core; each takes its share of torch's threads (tests/conftest.py).
TEST_WORKERS ?= 2

.PHONY: env demo test clean

env: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sattn train lm --config lm-default

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
