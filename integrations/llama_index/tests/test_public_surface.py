"""The package's exports and settings, listed: a refactor may add to them, never drop one."""

import llama_index.llms.specprefill as package
from llama_index.llms.specprefill import SpecPrefillLLM

from specprefill_rag.config import CompressionSettings

EXPORTS = {
    "NoToolCallError",
    "SpecPrefillDocumentWarmer",
    "SpecPrefillLLM",
    "install_node_recorder",
    "remove_node_recorder",
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
    "max_new_tokens",
    "top_p",
    "seed",
    "stop",
    "keep_tools_whole",
}


def test_exports_and_settings_stay():
    assert EXPORTS <= set(package.__all__)
    assert SETTINGS <= set(SpecPrefillLLM.model_fields)


def test_compression_settings_are_the_engines_own():
    for name, info in CompressionSettings.model_fields.items():
        assert SpecPrefillLLM.model_fields[name].default == info.default
        assert SpecPrefillLLM.model_fields[name].description == info.description
