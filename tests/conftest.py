"""Shared fixtures: a tiny random Llama and a small byte-level BPE tokenizer, built offline."""

from __future__ import annotations

import os

import pytest

from specprefill_rag.testing import build_model, build_tokenizer
from tests.serve_helpers import running_gateway, tiny_engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return build_model(tokenizer, layers=2)


@pytest.fixture(scope="session")
def tiny_draft(tokenizer):
    return build_model(tokenizer, layers=1, seed=1)


@pytest.fixture(scope="session")
def position_sensitive_model(tokenizer):
    """A tiny main model whose greedy tokens change with position ids (``tiny_model``'s hardly do)."""
    return build_model(tokenizer, initializer_range=0.2)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer, tiny_model):
    """The tiny model and tokenizer saved as a model folder, as a user would pass one."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def engine(tokenizer, tiny_model, tiny_draft):
    """The gateway tests' tiny engine (keep 0.3, no prompt floor, look-ahead 2), one per module; a module
    that needs another defines its own ``engine``.
    """
    return tiny_engine(tokenizer, tiny_model, tiny_draft)


@pytest.fixture(scope="module")
def gateway(engine):
    """A gateway over the module's ``engine`` on 127.0.0.1: its base URL."""
    with running_gateway(engine) as url:
        yield url
