"""The frameworks' RAG tutorials through the gateway (issue 29): retrieved context in a system message.

LangChain's ``ChatOpenAI`` (the RAG tutorial's LCEL chain; ``create_stuff_documents_chain`` +
``create_retrieval_chain``) and LlamaIndex's ``OpenAILike`` (the ``context`` and ``condense_plus_context``
chat engines) send the context as plain text in a system message, with the frameworks' exact prompts. With
``spec_prefill.system_context`` (per request, or the gateway's ``system_context`` default) that context is
documents and is compressed; off, the same request is not. Tiny random models, fake embeddings: no download.
The stats come from each response's JSON body, read by an httpx event hook on the client's own HTTP client.
"""

from __future__ import annotations

import json

import httpx
import pytest

from specprefill_rag.serve.layouts import chat_request_layout
from specprefill_rag.serve.schema import ChatCompletionRequest
from specprefill_rag.testing import LANGCHAIN_RETRIEVAL_CHAIN, LANGCHAIN_TUTORIAL, random_documents
from tests.serve_helpers import MODEL, running_gateway

pytestmark = pytest.mark.timeout(300)

DOCUMENTS = random_documents(4, 50, seed=11)
QUESTION = "When did the bridge open?"
DELIMITED = {"spec_prefill": {"system_context": "delimited"}}


class Recorder:
    """An httpx client whose chat-completion answers' ``spec_prefill`` objects (and requests) are kept."""

    def __init__(self) -> None:
        self.stats: list[dict] = []
        self.client = httpx.Client(event_hooks={"response": [self._record]}, timeout=60)

    def _record(self, response: httpx.Response) -> None:
        streaming = response.headers.get("content-type", "").startswith("text/event-stream")
        if response.request.url.path.endswith("/chat/completions") and not streaming:
            response.read()
            self.stats.append(response.json()["spec_prefill"])

    @property
    def last(self) -> dict:
        return self.stats[-1]


def assert_compressed(stats: dict, documents: int = len(DOCUMENTS)) -> None:
    assert stats["document_source"] == "system-context", stats
    assert stats["n_documents"] == documents
    assert stats["compressed"] is True
    assert 0 < stats["kept_document_tokens"] < stats["document_tokens"]


def assert_whole(stats: dict) -> None:
    assert stats["document_source"] == "none", stats
    assert stats["compressed"] is False
    assert stats["kept_tokens"] == stats["prompt_tokens"]


# -- LangChain -------------------------------------------------------------------------------------


def chat_openai(url: str, recorder: Recorder, extra_body: dict | None):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=url + "/v1",
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=4,
        max_retries=0,
        timeout=60,
        http_client=recorder.client,
        extra_body=extra_body,
    )


def langchain_retriever():
    from langchain_core.documents import Document
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.vectorstores import InMemoryVectorStore

    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    store.add_documents([Document(page_content=text) for text in DOCUMENTS])
    return store.as_retriever(search_kwargs={"k": len(DOCUMENTS)})


def tutorial_chain(llm):
    """The RAG tutorial's LCEL chain: format_docs joins the retrieved documents with blank lines."""
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    def format_docs(docs):
        return "\n\n".join(doc.page_content for doc in docs)

    prompt = ChatPromptTemplate.from_messages([("system", LANGCHAIN_TUTORIAL), ("human", "{question}")])
    chain = {"context": langchain_retriever() | format_docs, "question": RunnablePassthrough()} | prompt | llm
    return chain | StrOutputParser()


def retrieval_chain(llm, system_prompt):
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_core.prompts import ChatPromptTemplate

    prompt = ChatPromptTemplate.from_messages([("system", system_prompt), ("human", "{input}")])
    return create_retrieval_chain(langchain_retriever(), create_stuff_documents_chain(llm, prompt))


@pytest.mark.parametrize("extra_body", [DELIMITED, {"spec_prefill": {"system_context": "after_instructions"}}])
def test_langchain_rag_tutorial_chain(gateway, extra_body):
    recorder = Recorder()
    answer = tutorial_chain(chat_openai(gateway, recorder, extra_body)).invoke(QUESTION)
    assert isinstance(answer, str)
    assert_compressed(recorder.last)
    tutorial_chain(chat_openai(gateway, recorder, None)).invoke(QUESTION)
    assert_whole(recorder.last)


@pytest.mark.parametrize("system_prompt", [LANGCHAIN_TUTORIAL, LANGCHAIN_RETRIEVAL_CHAIN])
def test_langchain_create_retrieval_chain(gateway, system_prompt):
    recorder = Recorder()
    result = retrieval_chain(chat_openai(gateway, recorder, DELIMITED), system_prompt).invoke({"input": QUESTION})
    assert isinstance(result["answer"], str) and len(result["context"]) == len(DOCUMENTS)
    assert_compressed(recorder.last)
    retrieval_chain(chat_openai(gateway, recorder, None), system_prompt).invoke({"input": QUESTION})
    assert_whole(recorder.last)


def test_langchain_streaming_carries_the_stats_too(gateway):
    """Streaming through ChatOpenAI works with the option; the stats then sit in the last SSE chunk."""
    recorder = Recorder()
    streamed = "".join(tutorial_chain(chat_openai(gateway, recorder, DELIMITED)).stream(QUESTION))
    assert isinstance(streamed, str)
    assert recorder.stats == []  # the hook leaves streams alone


# -- LlamaIndex ------------------------------------------------------------------------------------


def openai_like(url: str, recorder: Recorder, extra_body: dict | None):
    from llama_index.llms.openai_like import OpenAILike

    return OpenAILike(
        api_base=url + "/v1",
        api_key="unused",
        model=MODEL,
        is_chat_model=True,
        temperature=0,
        max_tokens=4,
        context_window=1024,
        max_retries=0,
        timeout=60,
        http_client=recorder.client,
        additional_kwargs={"extra_body": extra_body} if extra_body else {},
    )


def llama_chat_engine(llm, chat_mode: str):
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding

    embed = MockEmbedding(embed_dim=8)
    index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCUMENTS], embed_model=embed)
    return index.as_chat_engine(chat_mode=chat_mode, llm=llm, similarity_top_k=len(DOCUMENTS))


@pytest.mark.parametrize("chat_mode", ["context", "condense_plus_context"])
def test_llama_index_chat_engines(gateway, chat_mode):
    recorder = Recorder()
    response = llama_chat_engine(openai_like(gateway, recorder, DELIMITED), chat_mode).chat(QUESTION)
    assert isinstance(response.response, str) and len(response.source_nodes) == len(DOCUMENTS)
    assert_compressed(recorder.last)
    llama_chat_engine(openai_like(gateway, recorder, None), chat_mode).chat(QUESTION)
    assert_whole(recorder.last)


# -- the gateway's default, explicit documents, the layout ---------------------------------------------


def test_the_gateway_default_applies_without_extra_body(engine):
    recorder = Recorder()
    with running_gateway(engine, system_context="delimited") as url:
        tutorial_chain(chat_openai(url, recorder, None)).invoke(QUESTION)
        assert_compressed(recorder.last)
        off = {"spec_prefill": {"system_context": "off"}}
        tutorial_chain(chat_openai(url, recorder, off)).invoke(QUESTION)  # a request turns it off
        assert_whole(recorder.last)


def tutorial_request(**spec_prefill) -> ChatCompletionRequest:
    system = LANGCHAIN_TUTORIAL.replace("{context}", "\n\n".join(DOCUMENTS))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages, "spec_prefill": spec_prefill})


def test_the_layout_takes_the_server_default_and_the_request_wins(engine):
    tokenizer = engine.tokenizer
    layout = chat_request_layout(tokenizer, tutorial_request(), 64, 1024, system_context="delimited")
    assert (layout.document_source, layout.n_documents) == ("system-context", len(DOCUMENTS))
    off = chat_request_layout(tokenizer, tutorial_request(system_context="off"), 64, 1024, "delimited")
    assert off.document_source == "none"
    assert chat_request_layout(tokenizer, tutorial_request(), 64, 1024).document_source == "none"


def test_delimited_finds_the_rag_agent_tutorials_system_prompt(engine):
    # LangChain's RAG agent tutorial: create_agent with a @dynamic_prompt middleware over similarity_search()
    system = "You are a helpful assistant. Use the following context in your response:\n\n" + "\n\n".join(DOCUMENTS)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages})
    layout = chat_request_layout(engine.tokenizer, body, 64, 1024, system_context="delimited")
    assert (layout.document_source, layout.n_documents) == ("system-context", len(DOCUMENTS))
    assert chat_request_layout(engine.tokenizer, body, 64, 1024).document_source == "none"  # the gateway's default


def test_the_rendered_prompt_is_the_clients_text(engine):
    """Documents are rendered as the core renders document parts, followed by a blank line: the prompt is the
    client's text, plus that blank line after the last document when the template has none there.
    """
    tokenizer = engine.tokenizer
    whole = chat_request_layout(tokenizer, tutorial_request(), 64, 1024).layout.text
    split = chat_request_layout(tokenizer, tutorial_request(system_context="delimited"), 64, 1024).layout.text
    assert split.replace(DOCUMENTS[-1] + "\n\n", DOCUMENTS[-1], 1) == whole


def test_explicit_documents_win(engine):
    tokenizer = engine.tokenizer
    named = tutorial_request(system_context="delimited", documents=DOCUMENTS[:1])
    assert chat_request_layout(tokenizer, named, 64, 1024).document_source == "argument-located"
    system = LANGCHAIN_TUTORIAL.replace("{context}", "\n\n".join(DOCUMENTS))
    parts = [{"type": "text", "text": system}, {"type": "document", "text": "An extra document."}]
    body = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [{"role": "system", "content": parts}, {"role": "user", "content": QUESTION}],
            "spec_prefill": {"system_context": "delimited"},
        }
    )
    layout = chat_request_layout(tokenizer, body, 64, 1024)
    assert (layout.document_source, layout.n_documents) == ("blocks", 1)


def test_an_unknown_mode_is_a_400_naming_the_field_and_the_values(gateway):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "spec_prefill": {"system_context": "on"},
    }
    response = httpx.post(gateway + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "spec_prefill.system_context"
    assert "'off', 'after_instructions' or 'delimited'" in error["message"]


def test_the_serve_flag():
    from specprefill_rag.cli import parser, serve_settings

    args = parser().parse_args(["serve", "--system-context", "delimited"])
    assert serve_settings(args).system_context == "delimited"  # type: ignore[attr-defined]
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--system-context", "on"])


def test_a_streamed_answer_carries_the_system_context_stats_in_headers_and_its_last_chunk(gateway):
    body = tutorial_request(system_context="delimited").model_dump(exclude_unset=True)
    body.update(stream=True, max_tokens=4, temperature=0)
    with httpx.stream("POST", gateway + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        headers = response.headers
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert headers["x-specprefill-document-source"] == "system-context"
    assert headers["x-specprefill-compressed"] == "true"
    assert headers["x-specprefill-n-documents"] == str(len(DOCUMENTS))
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert_compressed(last["spec_prefill"])
