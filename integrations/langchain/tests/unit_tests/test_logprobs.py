"""ChatSpecPrefill's log-probabilities (issue #30), as ChatOpenAI gives them: ``response_metadata["logprobs"]``
in OpenAI's shape on the message and on each stream chunk (its own tokens), in-process and through a gateway.
SpecPrefillLLM's, as LangChain's text ``OpenAI`` gives them: a text completion's legacy shape in
``generation_info["logprobs"]``.
"""

import asyncio

import pytest
from langchain_core.messages import HumanMessage, SystemMessage

from langchain_specprefill import ChatSpecPrefill, SpecPrefillLLM
from specprefill_rag.serve import GatewaySettings, create_app
from specprefill_rag.serve.server import BackgroundServer
from specprefill_rag.testing import random_documents

QUESTION = "When did the bridge open?"
TEXTS = random_documents(3, 60, seed=4)
ENTRY = {"token", "logprob", "bytes", "top_logprobs"}


@pytest.fixture(scope="module")
def gateway(tiny_engine):
    settings = GatewaySettings(served_model_name="tiny", min_prompt_tokens=0, look_ahead=2)
    with BackgroundServer(create_app(settings, tiny_engine)) as url:
        yield url


def messages():
    return [SystemMessage("Answer briefly."), HumanMessage(QUESTION)]


def expected(tiny_engine, top, sent=None):
    """The engine's own logprobs for the same call (``sent``: the messages, by default :func:`messages`), in
    OpenAI's shape."""
    llm = ChatSpecPrefill.from_engine(tiny_engine, max_tokens=5)
    params = llm._call_options(None, {"logprobs": True, "top_logprobs": top})[0]
    request, _ = llm.session._request(sent or messages(), params, {"documents": TEXTS})
    result = tiny_engine.generate_layout(request.chat.layout, request.params)
    return [entry.as_openai() for entry in result.logprobs]


def content(message):
    return message.response_metadata["logprobs"]["content"]


def same(got, want):
    """Equal entries, log-probabilities within float noise (a later call may reuse the main model's cached KV)."""
    tokens = [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in got]
    assert tokens == [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in want]
    values = [[e["logprob"], *(t["logprob"] for t in e["top_logprobs"])] for e in got]
    assert values == [pytest.approx([e["logprob"], *(t["logprob"] for t in e["top_logprobs"])], abs=1e-4) for e in want]
    return True


def test_constructor_and_call_option_put_logprobs_in_the_metadata(tiny_engine):
    want = expected(tiny_engine, 2)
    llm = ChatSpecPrefill.from_engine(tiny_engine, max_tokens=5, logprobs=True, top_logprobs=2)
    message = llm.invoke(messages(), documents=TEXTS)
    assert same(content(message), want) and len(want) == message.usage_metadata["output_tokens"]
    assert all(set(entry) == ENTRY and len(entry["top_logprobs"]) == 2 for entry in want)
    plain = ChatSpecPrefill.from_engine(tiny_engine, max_tokens=5)
    assert "logprobs" not in plain.invoke(messages(), documents=TEXTS).response_metadata
    bound = plain.bind(logprobs=True, top_logprobs=2).invoke(messages(), documents=TEXTS)
    assert same(content(bound), want)


def test_stream_chunks_carry_their_own_tokens_and_merge_to_the_whole(tiny_engine):
    llm = ChatSpecPrefill.from_engine(tiny_engine, max_tokens=5, logprobs=True, top_logprobs=1)
    chunks = list(llm.stream(messages(), documents=TEXTS))
    assert sum(len(content(chunk)) for chunk in chunks) == 5
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert same(content(merged), expected(tiny_engine, 1))


def test_through_a_gateway_the_same_logprobs(gateway, tiny_engine):
    remote = ChatSpecPrefill(backend=gateway, max_tokens=5, logprobs=True, top_logprobs=2)
    want = expected(tiny_engine, 2)
    assert same(content(remote.invoke(messages(), documents=TEXTS)), want)
    chunks = asyncio.run(_collect(remote.astream(messages(), documents=TEXTS)))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert same(content(merged), want)


async def _collect(chunks):
    return [chunk async for chunk in chunks]


# -- the text LLM ------------------------------------------------------------------------------------------


def legacy(want):
    """Chat-shaped entries as a text completion's legacy ``logprobs`` (the sampled token among the top ones)."""
    offsets = [sum(len(e["token"]) for e in want[:i]) for i in range(len(want))]
    return {
        "tokens": [e["token"] for e in want],
        "token_logprobs": [e["logprob"] for e in want],
        "top_logprobs": [
            {**{t["token"]: t["logprob"] for t in e["top_logprobs"]}, e["token"]: e["logprob"]} for e in want
        ],
        "text_offset": offsets,
    }


def same_legacy(got, want):
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)
    assert [set(top) for top in got["top_logprobs"]] == [set(top) for top in want["top_logprobs"]]
    for top, wanted in zip(got["top_logprobs"], want["top_logprobs"]):
        assert top == pytest.approx(wanted, abs=1e-4)
    return True


def test_the_text_llm_puts_legacy_logprobs_in_generation_info(tiny_engine):
    want = legacy(expected(tiny_engine, 2, [HumanMessage(QUESTION)]))
    llm = SpecPrefillLLM.from_engine(tiny_engine, max_tokens=5, logprobs=True, top_logprobs=2)
    generation = llm.generate([QUESTION], documents=TEXTS).generations[0][0]
    assert same_legacy(generation.generation_info["logprobs"], want) and len(want["tokens"]) == 5
    assert "spec_prefill" in generation.generation_info
    plain = SpecPrefillLLM.from_engine(tiny_engine, max_tokens=5)
    assert "logprobs" not in plain.generate([QUESTION], documents=TEXTS).generations[0][0].generation_info
    bound = plain.bind(logprobs=True, top_logprobs=2)
    chunks = list(bound.stream(QUESTION, documents=TEXTS))  # a bound text LLM streams strings
    assert "".join(chunks) == generation.text


def test_the_text_llms_stream_chunks_merge_to_the_whole(tiny_engine):
    want = legacy(expected(tiny_engine, 1, [HumanMessage(QUESTION)]))
    llm = SpecPrefillLLM.from_engine(tiny_engine, max_tokens=5, logprobs=True, top_logprobs=1)
    chunks = list(llm._stream(QUESTION, documents=TEXTS))
    assert sum(len(chunk.generation_info["logprobs"]["tokens"]) for chunk in chunks if chunk.generation_info) == 5
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert same_legacy(merged.generation_info["logprobs"], want)


def test_the_text_llm_through_a_gateway_the_same_logprobs(gateway, tiny_engine):
    want = legacy(expected(tiny_engine, 2, [HumanMessage(QUESTION)]))
    remote = SpecPrefillLLM(backend=gateway, max_tokens=5, logprobs=True, top_logprobs=2)
    generation = remote.generate([QUESTION], documents=TEXTS).generations[0][0]
    assert same_legacy(generation.generation_info["logprobs"], want)
