"""The package's exports and settings, listed: a refactor may add to them, never drop one."""

import langchain_specprefill
from langchain_specprefill import ChatSpecPrefill, SpecPrefillLLM
from specprefill_rag.config import CompressionSettings

EXPORTS = {
    "ChatSpecPrefill",
    "SpecPrefillDocumentWarmer",
    "SpecPrefillLLM",
    "__version__",
    "document_prompt",
    "format_docs",
}
SETTINGS = {
    "model",
    "draft_model",
    "backend",
    "timeout",
    "api_key",
    "keep_rate",
    "auto_keep_share",
    "auto_keep_floor",
    "auto_keep_ceiling",
    "max_document_tokens",
    "look_ahead",
    "min_prompt_tokens",
    "protect_tail_tokens",
    "positions",
    "tokenizer",
    "device",
    "dtype",
    "temperature",
    "max_tokens",
    "top_p",
    "seed",
    "stop",
    "streaming",
}


def test_exports_and_settings_stay():
    assert EXPORTS <= set(langchain_specprefill.__all__)
    for model in (ChatSpecPrefill, SpecPrefillLLM):
        assert SETTINGS <= set(model.model_fields)


def test_compression_settings_are_the_engines_own():
    for name, info in CompressionSettings.model_fields.items():
        assert ChatSpecPrefill.model_fields[name].default == info.default
        assert ChatSpecPrefill.model_fields[name].description == info.description
