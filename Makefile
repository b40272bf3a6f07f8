# Two commands on a fresh machine: `make serve` and `make test`. Each creates or updates .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test bench clean prometheus

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pdserve serve

# Debian's prometheus (the server and promtool) for the tests that run a real one: installed
# when missing and allowed (root, as CI is); otherwise those tests are skipped, saying why.
prometheus:
	@if command -v promtool >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends prometheus \
	    || { apt-get update -q && apt-get install -y -q --no-install-recommends prometheus; }; \
	else echo "promtool not found and not root: the Prometheus tests will be skipped"; fi

test: $(STAMP) prometheus
	$(VENV)/bin/pytest -q -x --durations=15  # the console script: the checkout is not on sys.path, the installed pdserve is

clean:
	rm -rf $(VENV) build *.egg-info
