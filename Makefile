# The README's two commands: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1

.PHONY: install lint test test-fast demo bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU wheel of torch is on disk; pin it first so nothing pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,dask]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check tmem flows tasks tests bench deployments
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest

test-fast: install
	$(VENV)/bin/pytest -m 'not slow' -x -q

demo: install
	$(PY) -m tmem.demo

clean:
	rm -rf tmem-store .pytest_cache .mypy_cache .ruff_cache
