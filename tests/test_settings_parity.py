"""Every surface's settings come from one declaration: for each setting that the engine's config, the gateway,
the CLI's ``ask`` and ``serve`` and both framework adapters share, the default, bounds, checks and description
are the declaration's (EngineSettings, GenerationParams), except the per-surface defaults listed in
SURFACE_DEFAULTS. A field declared by hand with another default, bound or description fails here."""

import argparse

import pytest
from llama_index.llms.specprefill import SpecPrefillLLM
from pydantic import Field

from langchain_specprefill import ChatSpecPrefill
from specprefill_rag.adapters.settings import ADAPTER_NAMES, AdapterSettings
from specprefill_rag.cli import ASK_DECODING, _described, parser
from specprefill_rag.config import (
    DECODING_DEFAULTS,
    SURFACE_DEFAULTS,
    EngineSettings,
    GenerationParams,
    SpecPrefillConfig,
    declaration_drift,
    declared_field,
)
from specprefill_rag.serve.settings import GatewaySettings

LANGCHAIN_NAMES = {**ADAPTER_NAMES, "max_tokens": "max_new_tokens"}
# (surface, its fields, its SURFACE_DEFAULTS key, its names of settings declared under another name)
SURFACES = [
    ("SpecPrefillConfig", SpecPrefillConfig.model_fields, None, {}),
    ("GatewaySettings", GatewaySettings.model_fields, "gateway", {}),
    ("LangChain ChatSpecPrefill", ChatSpecPrefill.model_fields, "adapters", LANGCHAIN_NAMES),
    ("LlamaIndex SpecPrefillLLM", SpecPrefillLLM.model_fields, "adapters", ADAPTER_NAMES),
]
ENGINE_SETTINGS = set(EngineSettings.model_fields)


def offered(fields, renamed):
    """The declared settings a surface offers, by their declared names."""
    return {renamed.get(name, name) for name in fields}


@pytest.mark.parametrize(("surface", "fields", "defaults", "renamed"), SURFACES, ids=[s[0] for s in SURFACES])
def test_every_shared_setting_is_the_declarations(surface, fields, defaults, renamed):
    assert declaration_drift(fields, defaults, renamed) == []


@pytest.mark.parametrize(("surface", "fields", "defaults", "renamed"), SURFACES, ids=[s[0] for s in SURFACES])
def test_every_surface_offers_every_engine_setting(surface, fields, defaults, renamed):
    assert ENGINE_SETTINGS <= offered(fields, renamed)  # the gateway's tokenizer, the adapters' caches...


def test_the_engines_settings_are_all_declared_in_engine_settings():
    # a setting added to SpecPrefillConfig alone would reach neither the gateway nor the adapters
    assert set(SpecPrefillConfig.model_fields) == ENGINE_SETTINGS


def test_the_adapters_offer_the_decoding_defaults():
    for fields, renamed in [(ChatSpecPrefill.model_fields, LANGCHAIN_NAMES), (SpecPrefillLLM.model_fields, {})]:
        assert set(DECODING_DEFAULTS) <= offered(fields, renamed)


def test_each_surface_default_is_a_setting_that_surface_offers():
    assert set(SURFACE_DEFAULTS["gateway"]) <= set(GatewaySettings.model_fields)
    assert set(SURFACE_DEFAULTS["adapters"]) <= offered(AdapterSettings.model_fields, {}) | {"max_new_tokens"}
    assert GatewaySettings().device == "auto" and SpecPrefillConfig.model_fields["device"].default == "cpu"
    assert ChatSpecPrefill().max_tokens == SpecPrefillLLM().max_new_tokens == 256
    assert GenerationParams().max_new_tokens == 128  # the engine's and `ask`'s


def test_a_field_declared_by_hand_is_drift():
    class HandDeclared(AdapterSettings):
        device: str = Field("cuda", description="torch device.")  # another default and description, no check
        chunk_size: int = Field(32, ge=1, description=EngineSettings.model_fields["chunk_size"].description)
        max_new_tokens: int = declared_field(GenerationParams, "max_new_tokens")  # the engine's 128, not 256

    drift = declaration_drift(HandDeclared.model_fields, "adapters", ADAPTER_NAMES)
    assert [line.split(":")[0] for line in drift] == ["device", "device", "device", "chunk_size", "max_new_tokens"]
    assert "default 'cuda', declared 'cpu'" in drift[0] and "default 128, declared 256" in drift[-1]


def _options(command: str) -> dict[str, argparse.Action]:
    commands = next(action for action in parser()._actions if action.dest == "command")
    return {action.dest: action for action in commands.choices[command]._actions if action.option_strings}


@pytest.mark.parametrize(
    ("command", "model", "names"),
    [
        ("ask", SpecPrefillConfig, SpecPrefillConfig.model_fields),
        ("ask", GenerationParams, ASK_DECODING),
        ("serve", GatewaySettings, GatewaySettings.model_fields),
    ],
)
def test_cli_options_show_the_declarations_description_and_default(command, model, names):
    options = _options(command)
    for name in names:
        assert options[name].help == _described(model.model_fields[name]), name
        assert options[name].default is argparse.SUPPRESS  # unset: the settings class applies the default
    if command == "serve":
        assert "(default: auto)" in options["device"].help and "--tokenizer" in options["tokenizer"].option_strings
    if command == "ask" and model is SpecPrefillConfig:
        assert "(default: cpu)" in options["device"].help


# A value other than the default for every engine setting (with a main model on vLLM, where tokenizer applies).
GIVEN = {
    "main": "http://127.0.0.1:9",
    "draft": "some/draft",
    "tokenizer": "some/tokenizer",
    "device": "cuda:1",
    "max_draft_tokens": 100,
    "self_draft_window": 8,
    "pool_kernel": 7,
    "chunk_size": 16,
    "draft_cache_mb": 1,
    "main_cache_mb": 2,
    "document_cache_mb": 3,
    "keep_rate": "auto",
    "look_ahead": 3,
    "positions": "contiguous",
    "reselect": False,
    "system_context": "after_instructions",
}


def test_every_given_engine_setting_reaches_the_engines_config():
    gateway = GatewaySettings(**GIVEN).engine_config()
    adapter_fields = {"backend": GIVEN["main"], **{k: v for k, v in GIVEN.items() if k not in ADAPTER_NAMES.values()}}
    adapter_fields |= {"model": "served/model", "draft_model": GIVEN["draft"]}
    for config in [gateway, ChatSpecPrefill(**adapter_fields)._config, SpecPrefillLLM(**adapter_fields)._config]:
        for name, value in GIVEN.items():
            if name != "main":  # the adapters' model is the served model's name; their backend the URL
                assert getattr(config, name) == value, name
    assert gateway.main == GIVEN["main"] and ChatSpecPrefill(**adapter_fields)._config.main == "served/model"
    assert SpecPrefillConfig(**GIVEN) == gateway  # nothing added, nothing lost on the way
