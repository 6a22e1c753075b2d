# Set-up is `make demo` (environment + main job) and `make test` (environment + test suite).
PYTHON ?= python3
VENV ?= .venv
# torch is installed first and pinned so pip takes the CPU wheel; override, e.g. TORCH_SPEC="torch==2.13.0" or a CUDA build.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: env demo test clean

env: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sattn train lm --config configs/lm-default.yaml

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
