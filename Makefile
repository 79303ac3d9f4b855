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

# tests/vllm (the `--load-format mpack` loader against vLLM's real classes, on CPU) needs vLLM,
# which cannot share a venv with mpack's pins: it gets its own, .venv-vllm (constraints-vllm.txt).
# VLLM_PYTHON=... runs tests/vllm with an interpreter that already has vLLM and mpack importable
# instead (with SYSTEM_PYTHON, the default is SYSTEM_PYTHON itself); no .venv-vllm is built then.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.mpack-installed
ifdef VLLM_PYTHON
VLLM_PY   := $(VLLM_PYTHON)
VLLM_DEPS :=
else ifdef SYSTEM_PYTHON
VLLM_PY   := $(SYSTEM_PYTHON)
VLLM_DEPS :=
else
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_DEPS := $(VLLM_STAMP)
endif
VLLM_PYTEST_ARGS ?=
# What `import vllm` and a CPU model load need, in two groups (see constraints-vllm.txt):
# resolved with their own deps (a dry run first proves none of them pulls torch, CUDA or vllm),
VLLM_REQS := packaging pydantic msgspec pyzmq cachetools blake3 cbor2 pybase64 psutil regex \
	numpy requests tqdm pyyaml cloudpickle einops safetensors huggingface_hub tokenizers \
	sentencepiece py-cpuinfo transformers aiohttp openai pillow uvloop prometheus_client fastapi \
	partial_json_parser
# and installed without theirs (their metadata would pull torch or CUDA builds back in).
VLLM_REQS_NODEPS := compressed-tensors loguru xgrammar llguidance oss-harmony apache-tvm-ffi
# mpack's own light deps and the test runner (mpack itself goes in with --no-deps).
VLLM_REQS_MPACK := typer rich safetensors huggingface_hub numpy pytest

.PHONY: install install-vllm test test-vllm test-gpu lint format demo bench clean

install: $(STAMP)

install-vllm: $(VLLM_STAMP)

$(STAMP): pyproject.toml setup.py convert/_repack.c constraints.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	# torch first and on its own: a plain resolver run would pull a multi-GB CUDA build.
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	# A venv made before the rename holds this checkout as `mpack`; now it is `mpack-marlin`.
	if $(VENV)/bin/python -m pip show -q mpack >/dev/null 2>&1; then $(VENV)/bin/python -m pip uninstall -q -y mpack; fi
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# Venv pieces a step installs, in order: torch (CPU) first, vLLM with --no-deps, then the rest,
# each `-c constraints-vllm.txt` so nothing can swap torch for a CUDA build.
VPIP := $(VLLM_VENV)/bin/python -m pip
$(VLLM_STAMP): pyproject.toml setup.py convert/_repack.c constraints-vllm.txt
	python3 -m venv $(VLLM_VENV)
	$(VPIP) install -q --upgrade pip
	$(VPIP) install -q -c constraints-vllm.txt torch==2.13.0
	$(VPIP) install -q -c constraints-vllm.txt --no-deps vllm==0.33.0
	$(VPIP) install -q -c constraints-vllm.txt --dry-run --report $(VLLM_VENV)/dry-run.json $(VLLM_REQS)
	$(VLLM_VENV)/bin/python tests/vllm/check_dry_run.py $(VLLM_VENV)/dry-run.json
	$(VPIP) install -q -c constraints-vllm.txt $(VLLM_REQS)
	$(VPIP) install -q -c constraints-vllm.txt --no-deps $(VLLM_REQS_NODEPS)
	$(VPIP) install -q --no-deps -e .
	$(VPIP) install -q -c constraints-vllm.txt $(VLLM_REQS_MPACK)
	$(VLLM_VENV)/bin/python -c "import torch, vllm; assert not torch.version.cuda, torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

# Both suites run, and the target fails if either failed. The main venv never collects
# tests/vllm (no vLLM there); the vLLM suite makes its checkpoints with the main venv's CLI.
test: $(DEPS) $(VLLM_DEPS)
	rc=0; \
	$(PY) -m pytest -q --ignore=tests/vllm $(PYTEST_ARGS) || rc=1; \
	MPACK_MAIN_PYTHON=$(PY) $(VLLM_PY) -m pytest -q tests/vllm $(VLLM_PYTEST_ARGS) || rc=1; \
	exit $$rc

# Only the vLLM loader suite.
test-vllm: $(DEPS) $(VLLM_DEPS)
	MPACK_MAIN_PYTHON=$(PY) $(VLLM_PY) -m pytest -q tests/vllm $(VLLM_PYTEST_ARGS)

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

# On a GPU machine: every benchmark, its JSON in $(BENCH_OUT)/, the plot in docs/; bench_vs_tools
# appends its table to docs/BENCHMARKS.md (on bench_convert's checkpoint: one 9 GB copy on disk).
bench: $(DEPS)
	mkdir -p $(BENCH_OUT)
	$(PY) scripts/bench_repack.py --json $(BENCH_OUT)/repack.json
	$(PY) scripts/bench_convert.py --workdir $(BENCH_WORK) --json $(BENCH_OUT)/convert.json --plot docs/bench_convert.png
	$(PY) scripts/bench_runtime.py --sidecar $(BENCH_WORK)/out-cuda --json $(BENCH_OUT)/runtime.json
	$(PY) scripts/bench_vs_tools.py --workdir $(BENCH_WORK) --src $(BENCH_WORK)/llama8b-fp8-32l --json $(BENCH_OUT)/vs_tools.json --md docs/BENCHMARKS.md

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist *.egg-info demo-out .pytest_cache .ruff_cache
