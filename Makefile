# The README's commands: `make demo`, `make test-all` (what CI runs) and `make test`.
# Each creates .venv/ on first use (torch CPU build, MPICH from PyPI) and reuses it.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch.  An unpinned torch pulls gigabytes of CUDA wheels.
TORCH  ?= torch==2.13.0
NP     ?= 3

.PHONY: venv demo gallery cluster-demo test test-all bench clean cluster-test

venv: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[mpich,test]"
	touch $@

# A short sweep on 2-4 ranks (collectives, parameter server, training), then the
# report with every plot: results/demo/report.html.  Points already done are skipped.
demo: venv
	$(PY) -m experiments.sweep experiments/demo.toml
	$(PY) -m experiments.report results/demo

# The README's gallery: the demo's figures copied into docs/gallery (tracked files,
# so only this target writes them), and report.html drawn into docs/gallery/report.png
# by a headless Chromium where one is installed (Debian: apt-get install chromium).
gallery: demo
	$(PY) -m experiments.report results/demo --gallery docs/gallery \
	    --screenshot docs/gallery/report.png

# The same on emulated clusters (2 and 4 hosts, 1 and 10 Gbit/s links): network
# namespaces, so it needs root; 21 minutes measured on 2 busy cores, 8-10 expected
# on idle ones (experiments/cluster_demo.toml).  results/cluster-demo/report.html.
cluster-demo: venv
	$(PY) -m experiments.sweep experiments/cluster_demo.toml
	$(PY) -m experiments.report results/cluster-demo

# The quick tier, for every change: all but the tests marked `slow` (setup.cfg says
# which ones are; docs/testing.md gives both tiers' times).
test: venv
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q -m "not slow" tests

# Every test, the slow ones too: what CI (.ci/run) runs.
test-all: venv
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q tests

# Collectives and training across emulated hosts (network namespaces, shaped links);
# needs root, skipped without it.  About 90 s.
cluster-test: venv
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q tests/cluster

bench: venv
	mkdir -p results
	$(VENV)/bin/mpiexec -n 2 $(PY) -m mpi4py -m allreduce.bench \
	    --algos ring,mpi --ops allreduce --sizes 4K,16M,64M --iters 20 --jsonl results/bench.jsonl

clean:
	rm -rf $(VENV) results .pytest_cache
