# The commands the README gives. `make test` and `make bench` set up everything on a fresh
# machine: a venv with the pinned packages (requirements-dev.txt) and the extension build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-requirements
BUILD_STAMP := $(VENV)/.built-extension
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h') setup.py

.PHONY: test test-slow bench build gpu-check gpu-wheels lint clean mutate

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
# Two pytest workers (pytest-xdist), a test file per worker at a time (--dist loadfile), so a
# module's fixtures, such as the ahead-of-time compile of every Triton kernel, run once.
# The docs site (mkdocs.yml, docs/) builds with --strict first: a broken link or anchor, a page
# missing from the nav or a docstring mkdocstrings cannot render fails the target. It builds into
# site/ (ignored by git); REMAT_DOCS_BUILT=1 tells tests/test_docs.py not to build it again.
test: $(BUILD_STAMP)
	$(VENV)/bin/ruff check .
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site
	REMAT_DOCS_BUILT=1 TRITON_INTERPRET=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" tests

# The slow reference checks make test skips: the composed estimate against the full simulation on
# the Llama-3.1-8B configuration (tests/test_estimate_composed_8b.py; about half an hour here).
test-slow: $(BUILD_STAMP)
	$(PY) -m pytest -q -n 2 -m slow tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(BUILD_STAMP)
	$(PY) -m benchmarks.run

# On a GPU machine with its own python3 and torch, no venv and no network: build for sm_90, run
# the gpu-marked tests and a short benchmark, write logs and CSVs under $OUT (or gpu-out/).
gpu-check:
	bash benchmarks/gpu_check.sh

# Here, before a device run: the pure-Python wheels the GPU machine lacks (Liger-Kernel, the
# baseline of the MLP and cross-entropy benchmarks) into .whl/ (ignored by git; carry it to the
# device). gpu_check.sh installs whatever .whl/ holds into /tmp/site there, without network.
gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: -d .whl liger-kernel==0.8.5

# Mutation testing of one block under the Triton interpreter: `make mutate BLOCK=norm` (or mlp,
# attention). mutation/run.py mutates a copy of the block's Python and Triton sources, runs the
# block's tests on each mutant and prints the survivors; 25 minutes of wall time by default
# (MUTATE_ARGS="--budget-s 0" for no limit, "--only ID ..." to rerun mutants, "--list" to list them).
mutate: $(BUILD_STAMP)
	@test -n "$(BLOCK)" || { echo "usage: make mutate BLOCK=norm|mlp|attention [MUTATE_ARGS=...]"; exit 2; }
	$(PY) mutation/run.py --block $(BLOCK) $(MUTATE_ARGS)

clean:
	rm -rf build $(VENV) python/remat/_C*.so python/remat/_build_info.py *.egg-info python/*.egg-info
