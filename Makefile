# The two commands of the README: `make demo` and `make test`.
# Both create .venv/ on first use (torch CPU build, MPICH from PyPI) and reuse it.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch.  An unpinned torch pulls gigabytes of CUDA wheels.
TORCH  ?= torch==2.13.0
NP     ?= 3

.PHONY: venv demo test test-fast bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[mpich,test]"
	touch $@

demo: venv
	mkdir -p results
	$(VENV)/bin/mpiexec -n $(NP) $(PY) -m mpi4py -m allreduce.bench \
	    --algos ring,tree,halving_doubling,hierarchical,mpi,torch \
	    --ops allreduce,reduce_scatter,allgather,broadcast \
	    --sizes 4K,256K,4M --iters 10 --jsonl results/demo_bench.jsonl

test: venv
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q tests

bench: venv
	mkdir -p results
	$(VENV)/bin/mpiexec -n 2 $(PY) -m mpi4py -m allreduce.bench \
	    --algos ring,mpi --ops allreduce --sizes 4K,16M,64M --iters 20 --jsonl results/bench.jsonl

clean:
	rm -rf $(VENV) results .pytest_cache
