"""ChatSpecPrefill with backend=<gateway URL>: the same answers as in-process, and an application
process that never imports torch (checked in a subprocess where importing torch fails)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage

from langchain_specprefill import ChatSpecPrefill, SpecPrefillLLM, format_docs
from specprefill_rag.serve import GatewaySettings, create_app
from specprefill_rag.serve.server import BackgroundServer
from specprefill_rag.testing import random_documents

QUESTION = "When did the bridge open?"
TEXTS = random_documents(3, 70, seed=3)
ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def gateway(tiny_engine):
    settings = GatewaySettings(served_model_name="tiny", min_prompt_tokens=0, look_ahead=2)
    with BackgroundServer(create_app(settings, tiny_engine)) as url:
        yield url


def messages():
    return [SystemMessage("Answer briefly."), HumanMessage(QUESTION)]


def test_gateway_answers_equal_the_in_process_answers(gateway, tiny_engine):
    remote = ChatSpecPrefill(backend=gateway, max_tokens=8, keep_rate=0.2)
    local = ChatSpecPrefill.from_engine(tiny_engine, max_tokens=8)
    documents = [Document(page_content=t, metadata={"title": f"doc {i}"}) for i, t in enumerate(TEXTS)]
    got = remote.invoke(messages(), documents=documents, keep_rate=0.2)
    expected = local.invoke(messages(), documents=documents, keep_rate=0.2)
    assert got.content == expected.content
    stats = got.response_metadata["spec_prefill"]
    assert stats["document_source"] == "argument-inserted" and stats["compressed"] and "queue_ms" in stats
    assert stats["kept_tokens"] == expected.response_metadata["spec_prefill"]["kept_tokens"]
    assert got.usage_metadata == expected.usage_metadata
    assert remote.get_num_tokens(QUESTION) == local.get_num_tokens(QUESTION)


def test_the_engine_of_a_gateway_backend_runs_there_not_here(gateway):
    from specprefill_rag.errors import InvalidRequestError

    for adapter in (ChatSpecPrefill, SpecPrefillLLM):
        with pytest.raises(InvalidRequestError, match="is a SpecPrefill gateway: the engine runs there"):
            _ = adapter(backend=gateway).engine


def test_markers_and_blocks_become_document_parts(gateway, tiny_engine):
    remote = ChatSpecPrefill(backend=gateway, max_tokens=6)
    marked = HumanMessage(f"Context:\n{format_docs(TEXTS)}\n\nQuestion: {QUESTION}")
    got = remote.invoke([marked])
    expected = ChatSpecPrefill.from_engine(tiny_engine, max_tokens=6).invoke([marked])
    assert got.response_metadata["spec_prefill"]["document_source"] == "blocks"  # markers never cross the network
    assert got.response_metadata["spec_prefill"]["n_documents"] == 3
    assert got.usage_metadata["input_tokens"] > 0 and expected.content is not None
    blocks = [{"type": "text-plain", "text": t, "title": "doc"} for t in TEXTS] + [{"type": "text", "text": QUESTION}]
    assert (
        remote.invoke([HumanMessage(content=blocks)]).response_metadata["spec_prefill"]["document_source"] == "blocks"
    )


async def test_async_and_streaming_through_the_gateway(gateway):
    remote = ChatSpecPrefill(backend=gateway, max_tokens=8)
    whole = remote.invoke(messages(), documents=TEXTS).content
    assert "".join(chunk.content for chunk in remote.stream(messages(), documents=TEXTS)) == whole
    assert (await remote.ainvoke(messages(), documents=TEXTS)).content == whole
    llm = SpecPrefillLLM(backend=gateway, max_tokens=8)
    assert llm.invoke(QUESTION, documents=TEXTS) == (await llm.ainvoke(QUESTION, documents=TEXTS))


def test_the_application_process_needs_no_torch(gateway, tiny_engine):
    script = textwrap.dedent(f"""
        import json, sys
        sys.modules["torch"] = None  # any import of torch now fails
        from langchain_core.messages import HumanMessage
        from langchain_specprefill import ChatSpecPrefill, SpecPrefillLLM
        chat = ChatSpecPrefill(backend={gateway!r}, max_tokens=8)
        message = chat.invoke([HumanMessage({QUESTION!r})], documents={TEXTS!r})
        text = SpecPrefillLLM(backend={gateway!r}, max_tokens=8).invoke({QUESTION!r}, documents={TEXTS!r})
        loaded = sorted(m for m in sys.modules if m.startswith(("transformers", "specprefill_rag.engine")))
        print(json.dumps({{"chat": message.content, "llm": text, "loaded": loaded,
                          "stats": message.response_metadata["spec_prefill"]}}))
    """)
    path = f"{ROOT}:{ROOT / 'integrations' / 'langchain'}"
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["loaded"] == [] and answer["stats"]["compressed"]
    expected = ChatSpecPrefill.from_engine(tiny_engine, max_tokens=8).invoke([HumanMessage(QUESTION)], documents=TEXTS)
    assert answer["chat"] == expected.content


def test_keep_rate_auto_reaches_the_gateway(gateway, tiny_engine):
    documents = [Document(page_content=t) for t in TEXTS]
    local = ChatSpecPrefill.from_engine(tiny_engine, max_tokens=4, keep_rate="auto")
    expected = local.invoke(messages(), documents=documents).response_metadata["spec_prefill"]
    for remote, call in (
        (ChatSpecPrefill(backend=gateway, max_tokens=4, keep_rate="auto"), {}),
        (ChatSpecPrefill(backend=gateway, max_tokens=4, keep_rate=0.9), {"keep_rate": "auto"}),
    ):
        stats = remote.invoke(messages(), documents=documents, **call).response_metadata["spec_prefill"]
        assert stats["keep_policy"] == "auto" and stats["kept_tokens"] == expected["kept_tokens"]
        assert stats["keep_rate"] == expected["keep_rate"] < 0.9
