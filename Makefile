# Every target installs what it needs (a .venv with pinned deps) before it runs.
# On a machine without a venv of ours (the GPU box), pass SYSTEM_PYTHON=python3 to use an
# interpreter that already has torch and mpack importable.

VENV  := .venv
STAMP := $(VENV)/.mpack-installed

ifdef SYSTEM_PYTHON
PY   := $(SYSTEM_PYTHON)
DEPS :=
else
PY   := $(VENV)/bin/python
DEPS := $(STAMP)
endif

PYTEST_ARGS ?=

.PHONY: install test test-gpu lint format demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	# torch first and on its own: a plain resolver run would pull a multi-GB CUDA build.
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	# A venv made before the rename holds this checkout as `mpack`; now it is `mpack-marlin`.
	if $(VENV)/bin/python -m pip show -q mpack >/dev/null 2>&1; then $(VENV)/bin/python -m pip uninstall -q -y mpack; fi
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

test: $(DEPS)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# --require-gpu (tests/conftest.py): no CUDA device is an error here, not a run of skips.
test-gpu: $(DEPS)
	$(PY) -m pytest -q -m gpu -rs --require-gpu $(PYTEST_ARGS)

lint: $(DEPS)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(DEPS)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

demo: $(DEPS)
	PY=$(PY) bash scripts/demo.sh

BENCH_OUT ?= bench-out
BENCH_WORK ?= /tmp/mpack-bench

# On a GPU machine: every benchmark, its JSON in $(BENCH_OUT)/, the plot in docs/.
bench: $(DEPS)
	mkdir -p $(BENCH_OUT)
	$(PY) scripts/bench_repack.py --json $(BENCH_OUT)/repack.json
	$(PY) scripts/bench_convert.py --workdir $(BENCH_WORK) --json $(BENCH_OUT)/convert.json --plot docs/bench_convert.png
	$(PY) scripts/bench_runtime.py --sidecar $(BENCH_WORK)/out-cuda --json $(BENCH_OUT)/runtime.json

clean:
	rm -rf $(VENV) build dist *.egg-info demo-out .pytest_cache .ruff_cache
