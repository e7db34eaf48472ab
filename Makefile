# Two commands do all set-up on a fresh machine: `make run` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: run test lint bench clean system-deps

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

# Debian packages the tests and the benchmark use when present: faketime (moves Redis's clock),
# Redis 7 (second server version), nginx + wrk (benchmark). Installed only when missing and root.
system-deps:
	@bash scripts/system-deps.sh

run: $(STAMP)
	$(PY) -m gateway.example_backend --port 9000 & \
	  BACKEND=$$!; trap "kill $$BACKEND 2>/dev/null" EXIT INT TERM; \
	  $(VENV)/bin/gateway serve --config routes.yaml --port 8080 --admin-port 9090

lint: $(STAMP)
	$(VENV)/bin/ruff check gateway tests bench
	$(VENV)/bin/mypy

test: $(STAMP) system-deps lint
	$(VENV)/bin/pytest -q

bench: $(STAMP) system-deps
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
