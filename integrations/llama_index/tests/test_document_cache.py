"""The per-document draft cache from LlamaIndex: the flag per LLM and per call, and SpecPrefillDocumentWarmer
warming it in an IngestionPipeline, in this process and in a gateway."""

import asyncio

import pytest
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.llms import ChatMessage
from llama_index.core.schema import TextNode
from llama_index.llms.specprefill import SpecPrefillDocumentWarmer, SpecPrefillLLM

from specprefill_rag.serve import GatewaySettings, create_app
from specprefill_rag.serve.server import BackgroundServer
from specprefill_rag.testing import random_documents

pytestmark = pytest.mark.timeout(300)

SYSTEM = "Answer from the documents."


def ask(llm, documents, question="When did the bridge open?", **options):
    messages = [ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content=question)]
    return llm.chat(messages, documents=documents, **options).raw["spec_prefill"]["draft_documents_cached"]


@pytest.fixture(scope="module")
def gateway(tiny_engine):
    settings = GatewaySettings(served_model_name="tiny", min_prompt_tokens=0, look_ahead=2)
    with BackgroundServer(create_app(settings, tiny_engine)) as url:
        yield url


def test_a_call_asks_for_the_cache(tiny_engine):
    llm = SpecPrefillLLM.from_engine(tiny_engine, max_new_tokens=1)
    documents = random_documents(2, 60, seed=61)
    assert ask(llm, documents, draft_document_cache=True) == 0
    assert ask(llm, documents[::-1], "Who built it?", draft_document_cache=True) == 2
    assert ask(llm, documents[::-1], "Who built it?") == 0  # the engine's setting: off
    # a completion has no system message: another prefix, so its documents are drafted (and stored) once more
    completions = [llm.complete("Why?", documents=d, draft_document_cache=True) for d in (documents, documents[::-1])]
    assert [c.raw["spec_prefill"]["draft_documents_cached"] for c in completions] == [0, 2]


def test_the_constructor_turns_it_on_and_a_call_off(tiny_engine):
    llm = SpecPrefillLLM.from_engine(tiny_engine, max_new_tokens=1, draft_document_cache=True)
    documents = random_documents(2, 60, seed=62)
    ask(llm, documents)
    assert ask(llm, documents[::-1], "Why?") == 2
    assert ask(llm, documents[::-1], "Why?", draft_document_cache=False) == 0


def test_an_ingestion_pipeline_warms_the_nodes(tiny_engine):
    llm = SpecPrefillLLM.from_engine(tiny_engine, max_new_tokens=1, draft_document_cache=True)
    texts = random_documents(3, 50, seed=63)
    nodes = [TextNode(text=text) for text in texts] + [TextNode(text=" ")]  # an empty chunk is no document
    pipeline = IngestionPipeline(transformations=[SpecPrefillDocumentWarmer(llm=llm, instructions=SYSTEM)])
    assert [node.text for node in pipeline.run(nodes=nodes)] == [*texts, " "]
    assert ask(llm, texts[::-1]) == 3


def test_the_async_pipeline_and_other_instructions(tiny_engine):
    llm = SpecPrefillLLM.from_engine(tiny_engine, max_new_tokens=1, draft_document_cache=True)
    texts = random_documents(2, 50, seed=64)
    other = IngestionPipeline(transformations=[SpecPrefillDocumentWarmer(llm=llm, instructions="Reply in French.")])
    asyncio.run(other.arun(nodes=[TextNode(text=text) for text in texts]))
    assert ask(llm, texts) == 0  # warmed after another prefix: drafted now
    fresh = random_documents(2, 50, seed=65)
    asyncio.run(SpecPrefillDocumentWarmer(llm=llm, instructions=SYSTEM).acall([TextNode(text=t) for t in fresh]))
    assert ask(llm, fresh[::-1]) == 2


def test_a_gateway_is_warmed_over_http(gateway):
    llm = SpecPrefillLLM(backend=gateway, max_new_tokens=1)
    texts = random_documents(3, 50, seed=66)
    nodes = [TextNode(text=text) for text in texts]
    assert SpecPrefillDocumentWarmer(llm=llm, instructions=SYSTEM)(nodes) is nodes
    assert ask(llm, texts[::-1], draft_document_cache=True) == 3
    assert ask(llm, texts[::-1]) == 0  # the gateway's default: off
