"""SpecPrefillLLM's log-probabilities (issue #30): ``ChatResponse.logprobs`` / ``CompletionResponse.logprobs``,
one list per generated token (its own LogProb first, then the most likely tokens), in-process and through a gateway.
"""

import asyncio

import pytest
from llama_index.core.base.llms.types import ChatMessage
from llama_index.llms.specprefill import SpecPrefillLLM

from specprefill_rag.serve import GatewaySettings, create_app
from specprefill_rag.serve.server import BackgroundServer
from specprefill_rag.testing import random_documents

QUESTION = "When did the bridge open?"
TEXTS = random_documents(3, 60, seed=6)


@pytest.fixture(scope="module")
def gateway(tiny_engine):
    settings = GatewaySettings(served_model_name="tiny", min_prompt_tokens=0, look_ahead=2)
    with BackgroundServer(create_app(settings, tiny_engine)) as url:
        yield url


def messages():
    return [ChatMessage(role="system", content="Answer briefly."), ChatMessage(role="user", content=QUESTION)]


def rows(logprobs):
    """Each token's list as (token, bytes, logprob) triples."""
    return [[(p.token, p.bytes, p.logprob) for p in token] for token in logprobs]


def same(got, want):
    """Equal tokens, log-probabilities within float noise (a later call may reuse the main model's cached KV)."""
    assert [[(t, b) for t, b, _ in token] for token in rows(got)] == [
        [(t, b) for t, b, _ in token] for token in rows(want)
    ]
    assert [[v for *_, v in token] for token in rows(got)] == [
        pytest.approx([v for *_, v in token], abs=1e-4) for token in rows(want)
    ]
    return True


def test_chat_logprobs_per_token_own_first_then_the_alternatives(tiny_engine):
    llm = SpecPrefillLLM.from_engine(tiny_engine, max_new_tokens=5, logprobs=True, top_logprobs=2)
    response = llm.chat(messages(), documents=TEXTS)
    result = response.raw["spec_prefill"]
    assert response.logprobs is not None and len(response.logprobs) == result["completion_tokens"] == 5
    for token in response.logprobs:
        own, *top = token
        assert len(top) == 2 and top[0].logprob >= top[1].logprob
        assert own.logprob == top[0].logprob and own.token == top[0].token  # greedy: the most likely one
    streamed = list(llm.stream_chat(messages(), documents=TEXTS))
    assert [len(r.logprobs) for r in streamed][-1] == 5 and same(streamed[-1].logprobs, response.logprobs)
    plain = SpecPrefillLLM.from_engine(tiny_engine, max_new_tokens=3)
    assert plain.chat(messages(), documents=TEXTS).logprobs is None


def test_completion_logprobs(tiny_engine):
    llm = SpecPrefillLLM.from_engine(tiny_engine, max_new_tokens=4, logprobs=True)
    response = llm.complete(QUESTION, documents=TEXTS)
    assert response.logprobs is not None and [len(token) for token in response.logprobs] == [1, 1, 1, 1]
    assert same(asyncio.run(llm.acomplete(QUESTION, documents=TEXTS)).logprobs, response.logprobs)


def test_through_a_gateway_the_same_logprobs(gateway, tiny_engine):
    local = SpecPrefillLLM.from_engine(tiny_engine, max_new_tokens=5, logprobs=True, top_logprobs=2)
    remote = SpecPrefillLLM(backend=gateway, max_new_tokens=5, logprobs=True, top_logprobs=2)
    assert same(remote.chat(messages(), documents=TEXTS).logprobs, local.chat(messages(), documents=TEXTS).logprobs)
