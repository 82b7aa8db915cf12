# specmesh — two commands set everything up: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specmesh-installed
CONFIG ?= configs/local.yaml
export PYTHONUNBUFFERED := 1

.PHONY: install proto proto-check model lint test test-fast bench demo run-cluster clean

install: $(STAMP)

# torch is pinned first: a loose torch requirement would pull a multi-GB CUDA build on CPU machines
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $@

proto: install
	$(PY) protos/generate.py

proto-check: install
	$(PY) protos/generate.py --check

# fetch + convert the embedded default model once (cached under $$SPECMESH_HOME, ~/.cache/specmesh)
model: install
	$(PY) -m specmesh.models.resolve default

# ruff over the repository, mypy over the library (its protocols are typed)
lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy

# plain `pytest` (pyproject: tests and the library's doctests; the contract suite skips itself there),
# then the contract suite in a pytest process of its own (tests/contract/conftest.py says why).
# pytest exits 5 when it collects nothing: make fails on it like on any other error.
test: install proto-check model
	$(PY) -m pytest -q
	$(PY) -m pytest tests/contract -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"
	$(PY) -m pytest tests/contract -q

bench: install model
	@set -e; for script in bench/[a-z]*.py; do echo "== $$script"; $(PY) $$script; done

demo: install model
	$(PY) -m client.demo

# start every process of $(CONFIG) (services, replicas, the coordinator), wait for health, serve; Ctrl-C stops them all
run-cluster: install model
	$(PY) -m client.cluster --config $(CONFIG)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
