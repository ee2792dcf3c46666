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
CHAT_TEMPLATES = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "chat_templates"


@pytest.fixture(scope="session")
def tiny_engine() -> SpecPrefillEngine:
    tokenizer = build_tokenizer()
    return SpecPrefillEngine.from_models(
        build_model(tokenizer), tokenizer, build_model(tokenizer, layers=1, seed=1), min_prompt_tokens=0, look_ahead=2
    )


@pytest.fixture(scope="session")
def tool_engine() -> SpecPrefillEngine:
    """A tiny engine whose chat template has tool calling (the Qwen2.5-style fixture, ``<tool_call>`` markup);
    its own tokenizer, so the shared ``tiny_engine`` keeps its template.
    """
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (CHAT_TEMPLATES / "qwen2_5.jinja").read_text()
    return SpecPrefillEngine.from_models(
        build_model(tokenizer), tokenizer, build_model(tokenizer, layers=1, seed=1), min_prompt_tokens=0, look_ahead=2
    )
