# Two commands on a fresh machine: `make serve` and `make test`. Each creates or updates .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pdserve serve

test: $(STAMP)
	$(VENV)/bin/pytest -q -x --durations=15  # the console script: the checkout is not on sys.path, the installed pdserve is

clean:
	rm -rf $(VENV) build *.egg-info
