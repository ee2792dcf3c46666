"""Defaults that pay: with no draft named an in-process main model drafts with its own first layers, and
the prompt length below which nothing is compressed follows the pair's costs (draft/cost.py)."""

import logging

import pytest
from pydantic import ValidationError

from specprefill_rag import GenerationParams, InvalidRequestError, SpecPrefillConfig, SpecPrefillEngine
from specprefill_rag.draft.cost import REMOTE_MAIN_MIN_PROMPT_TOKENS, parameter_count, pays_from
from specprefill_rag.serve.settings import GatewaySettings
from specprefill_rag.testing import build_model, random_documents


def test_the_cost_model_reproduces_the_measured_crossovers():
    assert pays_from(0.4, 1) == 448  # 'self', 12 of 30 / 11 of 28 layers: measured ~340-470
    assert pays_from(494 / 1544, 8) == 1024  # the 0.5B sibling drafting for the 1.5B: measured ~1,000
    assert pays_from(135 / 1544, 8) == 640  # SmolLM2-135M drafting for the 1.5B: measured ~470
    assert pays_from(1.0, 8) is None and pays_from(0.7, 1) is None  # the draft costs all the prefill saves
    assert pays_from(0.2, 1) < pays_from(0.4, 1) < pays_from(0.6, 1)
    assert pays_from(0.3, 2) < pays_from(0.3, 8)


@pytest.fixture(scope="module")
def five_layers(tokenizer):
    return build_model(tokenizer, layers=5)


def test_no_draft_named_means_self_in_process(tiny_model_dir):
    engine = SpecPrefillEngine(main=str(tiny_model_dir), keep_rate=0.3)
    assert SpecPrefillConfig().draft is None
    assert engine.config.draft == "self" and engine.draft_path == "self"
    assert engine.min_prompt_tokens == pays_from(0.5, 1)  # 1 of the tiny model's 2 layers
    # draft=None given explicitly, as the adapters and the gateway's settings pass it
    explicit = SpecPrefillEngine(main=str(tiny_model_dir), draft=None, keep_rate=0.3)
    assert explicit.config.draft == "self" and explicit.config.keep_rate == 0.3
    assert SpecPrefillConfig(draft=None, keep_rate=0.2).with_default_draft().keep_rate == 0.2


def test_the_gateway_and_the_adapters_without_a_draft_build_a_self_engine(tiny_model_dir):
    from specprefill_rag.config import adapter_config
    from specprefill_rag.serve.app import build_engine

    engine = build_engine(GatewaySettings(main=str(tiny_model_dir), device="cpu"))  # specprefill-rag serve
    assert engine.draft_path == "self"
    config = adapter_config("transformers", None, main=str(tiny_model_dir), keep_rate=0.3)  # both adapters
    assert SpecPrefillEngine(config).draft_path == "self"


def test_a_self_draft_compresses_a_top_4_retrieval(tokenizer, five_layers):
    engine = SpecPrefillEngine.from_models(five_layers, tokenizer, draft="self", keep_rate=0.3)
    assert engine.min_prompt_tokens == 448  # 2 of 5 layers
    long = engine.layout("Which color?", random_documents(4, 120, seed=1))
    short = engine.layout("Which color?", random_documents(4, 40, seed=1))
    assert len(short) < 448 <= len(long) < 1024, (len(short), len(long))  # 1,024 was the old fixed floor
    compressed, whole = engine.generate_layout(long).stats, engine.generate_layout(short).stats
    assert compressed.keep_rate < 1.0 and compressed.uncompressed_reason is None
    assert whole.keep_rate == 1.0 and whole.uncompressed_reason == "short_prompt"
    assert engine.generate_layout(long, keep_rate=1.0).stats.uncompressed_reason == "keep_all"


def test_an_explicit_min_prompt_tokens_wins(tokenizer, five_layers):
    engine = SpecPrefillEngine.from_models(five_layers, tokenizer, draft="self", min_prompt_tokens=2000)
    assert engine.min_prompt_tokens == 2000
    assert (
        SpecPrefillEngine.from_models(five_layers, tokenizer, draft="self", min_prompt_tokens=0).min_prompt_tokens == 0
    )


def test_a_separate_draft_pays_from_its_share_of_the_main_models_parameters(tokenizer, five_layers, tiny_draft):
    engine = SpecPrefillEngine.from_models(five_layers, tokenizer, tiny_draft, look_ahead=4)
    share = parameter_count(tiny_draft) / parameter_count(five_layers)
    assert 0 < share < 0.7 and engine.min_prompt_tokens == pays_from(share, 4)


def test_a_draft_as_large_as_the_main_model_never_compresses_and_says_why(tokenizer, tiny_model, caplog):
    with caplog.at_level(logging.WARNING, logger="specprefill_rag"):
        engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, keep_rate=0.3)  # the main model drafts whole
    assert engine.min_prompt_tokens > engine.main.context_length
    assert "cannot save time" in caplog.text and "min_prompt_tokens" in caplog.text
    layout = engine.layout("Which color?", random_documents(4, 150))
    assert engine.generate_layout(layout, GenerationParams(max_new_tokens=4)).stats.keep_rate == 1.0
    assert SpecPrefillEngine.from_models(tiny_model, tokenizer, min_prompt_tokens=0).min_prompt_tokens == 0


def test_a_vllm_main_needs_a_draft_named():
    with pytest.raises(InvalidRequestError, match="needs a draft named: pass draft="):
        SpecPrefillEngine.for_vllm("http://127.0.0.1:9")  # refused before any connection
    with pytest.raises(ValidationError, match="needs a draft named: --draft"):
        GatewaySettings(main="http://127.0.0.1:9")
    assert GatewaySettings().draft is None  # in-process main: 'self'
    assert REMOTE_MAIN_MIN_PROMPT_TOKENS == 1024


def test_look_ahead_without_a_draft_model_asks_for_one(tiny_model_dir):
    with pytest.raises(InvalidRequestError, match="name a draft model"):
        SpecPrefillEngine(main=str(tiny_model_dir), look_ahead=4)


@pytest.mark.parametrize("value", [-5, "many", True, 2.5, None])
def test_min_prompt_tokens_refuses_what_is_not_a_token_count(value):
    with pytest.raises(ValidationError, match="min_prompt_tokens must be") as error:
        SpecPrefillConfig(min_prompt_tokens=value)
    assert error.value.error_count() == 1
    assert SpecPrefillConfig(min_prompt_tokens="512").min_prompt_tokens == 512
