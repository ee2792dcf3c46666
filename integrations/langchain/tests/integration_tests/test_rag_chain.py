"""The LangChain RAG example, run for real: retrieval with local embeddings, then ChatSpecPrefill."""

import importlib.util
import sys

import pytest
from langchain_core.messages import HumanMessage

from ..conftest import EXAMPLES

spec = importlib.util.spec_from_file_location("langchain_rag_example", EXAMPLES / "langchain_rag.py")
example = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = example
spec.loader.exec_module(example)


@pytest.fixture(scope="module")
def retriever():
    return example.build_retriever(k=4)


@pytest.fixture(scope="module")
def llm():
    return example.build_llm()


def test_lcel_chain_answers_from_one_retrieved_document(retriever, llm):
    retrieved = retriever.invoke(example.QUESTION)
    assert sum("1883" in d.page_content for d in retrieved) == 1  # the answer is in exactly one chunk
    message = example.lcel_chain(retriever, llm).invoke(example.QUESTION)
    assert "1883" in message.content
    stats = message.response_metadata["spec_prefill"]
    assert stats["document_source"] == "markers"
    assert stats["compressed"] and stats["kept_document_tokens"] < stats["document_tokens"]
    # everything that is not a document was kept: the question among it
    assert stats["kept_tokens"] - stats["kept_document_tokens"] == stats["prompt_tokens"] - stats["document_tokens"]


def test_create_retrieval_chain(retriever, llm):
    recorder = example.StatsRecorder()
    output = example.retrieval_chain(retriever, llm).invoke(
        {"input": example.QUESTION}, config={"callbacks": [recorder]}
    )
    assert "1883" in output["answer"]
    assert recorder.stats["document_source"] == "markers" and recorder.stats["compressed"]


def test_documents_argument_with_real_model(retriever, llm):
    documents = retriever.invoke(example.QUESTION)
    message = llm.invoke([HumanMessage(example.QUESTION)], documents=documents)
    assert "1883" in message.content
    assert message.response_metadata["spec_prefill"]["document_source"] == "argument-inserted"
