"""Fixtures: a tiny random engine for fast tests; the shipped example for the real-model tests."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.testing import build_model, build_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "llamaindex_rag.py"


@pytest.fixture(scope="session")
def tiny_engine() -> SpecPrefillEngine:
    tokenizer = build_tokenizer()
    return SpecPrefillEngine.from_models(
        build_model(tokenizer), tokenizer, build_model(tokenizer, layers=1, seed=1), min_prompt_tokens=0, look_ahead=2
    )


@pytest.fixture(scope="session")
def example():
    spec = importlib.util.spec_from_file_location("llamaindex_rag_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
