# The two commands of the README:   make run   (opens ShardScope)   ·   make test   (runs the tests)
# make test-fast: unit and property tests only (no rank launches, no window) for the edit-test loop.
# Both build .venv on first use. torch: TORCH_SPEC / TORCH_PIP_ARGS choose the build (see README).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PY := $(VENV)/bin/python
# The launchers' own config parsers judge ShardScope's importers and exporters in the tests:
# torchtitan 0.3.0 (with torchao, and triton, which its MoE kernels import) and DeepSpeed (an sdist built
# against the torch already there) in a venv of their own, since torchtitan pins packages (datasets,
# huggingface_hub) that the product's venv holds at other versions. accelerate judges from the product's venv.
JUDGES ?= .venv-judges

.PHONY: run test test-fast install lint bench

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "ShardScope needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

$(JUDGES)/.installed: Makefile
	$(PYTHON) -m venv $(JUDGES)
	$(JUDGES)/bin/python -m pip install -q $(TORCH_PIP_ARGS) '$(TORCH_SPEC)'
	$(JUDGES)/bin/python -m pip install -q 'torchtitan==0.3.0' 'torchao==0.18.0' triton
	$(JUDGES)/bin/python -m pip install -q --no-build-isolation 'deepspeed==0.19.8'
	$(JUDGES)/bin/python -m pip install -q --no-deps --target $(JUDGES)/torchtitan-0.2.2 'torchtitan==0.2.2'
	touch $@

install: $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/shardscope

test: $(VENV)/.installed $(JUDGES)/.installed
	SHARDSCOPE_JUDGES=$(JUDGES) $(PY) -m pytest -q --durations=20

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m 'not integration and not gui'

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

bench: $(VENV)/.installed
	for f in benchmarks/*.py; do $(PY) $$f || exit 1; done
