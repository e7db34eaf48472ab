# Two commands do all set-up on a fresh machine: `make run` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# Two stamps: `run` needs only the runtime dependencies; `test`, `lint` and `bench` need .[dev] too.
# A dev install holds everything run needs, so it renews the run stamp as well; the reverse is not true.
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: run test test-fast lint bench clean system-deps

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(RUN_STAMP): pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q -e .
	touch $(RUN_STAMP)

$(DEV_STAMP): pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q -e '.[dev]'
	touch $(DEV_STAMP) $(RUN_STAMP)

# Debian packages the tests and the benchmark use when present: faketime (moves Redis's clock),
# Redis 7 (second server version), promtool (the chart's alerts), nginx + wrk (benchmark). Installed only
# when missing and root.
system-deps:
	@bash scripts/system-deps.sh

# The backend and the gateway, stopped together by a signal to make, to the script or to the group
# (scripts/run.py says how). RUN_ARGS: e.g. --port 8081 --admin-port 9091 --backend-port 9001; the proxy
# port listens on this machine only unless --host says otherwise (--host 0.0.0.0: every interface)
RUN_ARGS ?= --host 127.0.0.1
run: $(RUN_STAMP)
	exec $(PY) scripts/run.py $(RUN_ARGS)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check gateway tests bench scripts
	$(VENV)/bin/mypy

# Three workers (the tests wait on processes more than they run: two cores stay busy), a test file to a worker (its module fixtures start once); TEST_WORKERS=0 runs it serially
TEST_WORKERS ?= 3
test: $(DEV_STAMP) system-deps lint
	$(VENV)/bin/pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# The in-process slice (tests/conftest.py): against a real Redis, no gateway processes; about 2 minutes
test-fast: $(DEV_STAMP) system-deps
	$(VENV)/bin/pytest -q -m inprocess

bench: $(DEV_STAMP) system-deps
	$(PY) bench/run.py
	$(PY) bench/check.py --docs
	$(PY) bench/rls.py --docs
	$(PY) bench/idle.py --docs
	$(PY) bench/keys.py --docs

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
