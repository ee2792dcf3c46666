"""The gateway in front of vLLM's CPU server with the plugin (the production layout): built from its
settings alone, it answers OpenAI requests with the in-process transformers engine's tokens."""

import openai
import pytest

from specprefill_rag import GenerationParams, SpecPrefillEngine
from specprefill_rag.prompt.chat import ChatMessage, chat_layout
from specprefill_rag.serve import GatewaySettings, create_app
from specprefill_rag.serve.server import BackgroundServer
from specprefill_rag.testing import random_documents
from tests.vllm.server import openai_server

QUESTION = "When did the bridge open?"
DOCUMENTS = random_documents(3, 80, seed=11)
SETTINGS = {"keep_rate": 0.3, "min_prompt_tokens": 0, "look_ahead": 2, "dtype": "float32"}  # as the vLLM server


@pytest.fixture(scope="module")
def vllm_server(tiny_folder):
    with openai_server(tiny_folder) as url:
        yield url


@pytest.fixture(scope="module")
def gateway(vllm_server, tiny_folder):
    settings = GatewaySettings(main=vllm_server, draft=str(tiny_folder), device="cpu", **SETTINGS)
    with BackgroundServer(create_app(settings)) as url:
        yield url


def test_gateway_in_front_of_vllm_matches_the_in_process_engine(gateway, tiny_folder):
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == str(tiny_folder)  # the vLLM server's model name
    request = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 12,
        "temperature": 0,
        "extra_body": {"spec_prefill": {"documents": DOCUMENTS}},
    }
    response = client.chat.completions.create(**request)
    stats = response.model_extra["spec_prefill"]

    local = SpecPrefillEngine(main=str(tiny_folder), draft=str(tiny_folder), **SETTINGS)
    layout = chat_layout(local.tokenizer, [ChatMessage("user", [QUESTION])], DOCUMENTS)
    expected = local.generate_layout(layout.layout, GenerationParams(max_new_tokens=12))
    assert stats["compressed"] and stats["kept_tokens"] == expected.stats.kept_tokens
    assert response.choices[0].message.content == expected.text
    assert response.usage.completion_tokens == len(expected.token_ids)
    streamed = client.chat.completions.create(stream=True, **request)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected.text
