"""The per-document draft cache from LangChain: the flag per model and per call, and SpecPrefillDocumentWarmer
warming it at ingestion, in this process and in a gateway."""

import asyncio

import pytest
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage

from langchain_specprefill import ChatSpecPrefill, SpecPrefillDocumentWarmer, SpecPrefillLLM
from specprefill_rag.serve import GatewaySettings, create_app
from specprefill_rag.serve.server import BackgroundServer
from specprefill_rag.testing import random_documents

pytestmark = pytest.mark.timeout(300)

SYSTEM = "Answer from the documents."


def ask(chat, documents, question="When did the bridge open?", **options):
    message = chat.invoke([SystemMessage(SYSTEM), HumanMessage(question)], documents=documents, **options)
    return message.response_metadata["spec_prefill"]["draft_documents_cached"]


@pytest.fixture(scope="module")
def gateway(tiny_engine):
    settings = GatewaySettings(served_model_name="tiny", min_prompt_tokens=0, look_ahead=2)
    with BackgroundServer(create_app(settings, tiny_engine)) as url:
        yield url


def test_a_call_asks_for_the_cache(tiny_engine):
    chat = ChatSpecPrefill.from_engine(tiny_engine, max_tokens=1)
    documents = random_documents(2, 60, seed=51)
    assert ask(chat, documents, draft_document_cache=True) == 0  # drafted now, stored
    assert ask(chat, documents[::-1], "Who built it?", draft_document_cache=True) == 2
    assert ask(chat, documents[::-1], "Who built it?") == 0  # the engine's setting: off


def test_the_constructor_turns_it_on_and_a_call_off(tiny_engine):
    chat = ChatSpecPrefill.from_engine(tiny_engine, max_tokens=1, draft_document_cache=True)
    documents = random_documents(2, 60, seed=52)
    ask(chat, documents)
    assert ask(chat, documents[::-1], "Why?") == 2
    assert ask(chat, documents[::-1], "Why?", draft_document_cache=False) == 0


def test_the_warmer_fills_the_cache_for_the_first_request(tiny_engine):
    chat = ChatSpecPrefill.from_engine(tiny_engine, max_tokens=1, draft_document_cache=True)
    documents = [Document(page_content=text) for text in random_documents(3, 50, seed=53)]
    warmer = SpecPrefillDocumentWarmer(chat, instructions=SYSTEM)
    assert warmer.transform_documents(documents) is documents
    assert ask(chat, documents[::-1]) == 3
    assert warmer.transform_documents([]) == []


def test_the_async_warmer_and_the_llm(tiny_engine):
    llm = SpecPrefillLLM.from_engine(tiny_engine, max_tokens=1)
    texts = random_documents(2, 50, seed=54)
    assert asyncio.run(SpecPrefillDocumentWarmer(llm, SYSTEM).atransform_documents(texts)) is texts
    chat = ChatSpecPrefill.from_engine(tiny_engine, max_tokens=1)
    assert ask(chat, texts[::-1], draft_document_cache=True) == 2


def test_other_instructions_find_nothing(tiny_engine):
    chat = ChatSpecPrefill.from_engine(tiny_engine, max_tokens=1, draft_document_cache=True)
    texts = random_documents(2, 50, seed=55)
    SpecPrefillDocumentWarmer(chat, instructions="Reply in French.").transform_documents(texts)
    assert ask(chat, texts) == 0


def test_a_gateway_is_warmed_over_http(gateway):
    texts = random_documents(3, 50, seed=56)
    documents = [Document(page_content=text) for text in texts]
    warmer = SpecPrefillDocumentWarmer.from_gateway(gateway, instructions=SYSTEM)
    assert warmer.transform_documents(documents) is documents
    remote = ChatSpecPrefill(backend=gateway, max_tokens=1)
    assert ask(remote, texts[::-1], draft_document_cache=True) == 3
    assert ask(remote, texts[::-1]) == 0  # the gateway's default: off
    again = random_documents(2, 50, seed=57)
    asyncio.run(SpecPrefillDocumentWarmer(remote, SYSTEM).atransform_documents(again))
    assert ask(ChatSpecPrefill(backend=gateway, max_tokens=1, draft_document_cache=True), again) == 2


def test_a_full_cache_is_logged(tiny_engine, caplog, monkeypatch):
    chat = ChatSpecPrefill.from_engine(tiny_engine, max_tokens=1)
    monkeypatch.setattr(type(chat.session), "warm", lambda self, documents, instructions: 1)
    SpecPrefillDocumentWarmer(chat).transform_documents(random_documents(3, 20, seed=58))
    assert "warmed 1 of 3 documents" in caplog.text
