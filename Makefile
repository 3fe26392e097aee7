# The commands the README gives. `make test` and `make bench` set up everything on a fresh
# machine: a venv with the pinned packages (requirements-dev.txt) and the extension build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-requirements
BUILD_STAMP := $(VENV)/.built-extension
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h') setup.py

.PHONY: test bench build gpu-check lint clean

$(STAMP): requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

# --no-build-isolation: the extension must build against the torch already in the venv.
$(BUILD_STAMP): $(STAMP) $(SOURCES)
	$(PY) -m pip install --no-build-isolation --no-deps -e . 2>&1 | tail -n 3
	$(PY) -m remat info
	touch $@

build: $(BUILD_STAMP)

# The main suite runs the Triton kernels under the interpreter on the CPU; tests/test_triton_aot.py
# compiles them for sm_80/sm_90 in a subprocess without the interpreter.
test: $(BUILD_STAMP)
	$(VENV)/bin/ruff check .
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(BUILD_STAMP)
	$(PY) -m benchmarks.run

# On a GPU machine with its own python3 and torch, no venv and no network: build for sm_90, run
# the gpu-marked tests and a short benchmark, write logs and CSVs under $OUT (or gpu-out/).
gpu-check:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf build $(VENV) python/remat/_C*.so python/remat/_build_info.py *.egg-info python/*.egg-info
