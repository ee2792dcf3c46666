"""Fixtures: a tiny random model engine (fast tests) and paths to the shipped example documents."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.testing import build_model, build_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture(scope="session")
def tiny_engine() -> SpecPrefillEngine:
    tokenizer = build_tokenizer()
    return SpecPrefillEngine.from_models(
        build_model(tokenizer), tokenizer, build_model(tokenizer, layers=1, seed=1), min_prompt_tokens=0, look_ahead=2
    )
