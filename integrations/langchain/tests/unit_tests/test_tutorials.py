"""LangChain's own tutorial chains, written as the tutorials write them, with ChatSpecPrefill swapped in.

No helper, marker or ``documents=``: the documents the retriever returned earlier in the same run are
found verbatim in the messages (see ``langchain_specprefill/retrievers.py``) and only they are
compressed; the instructions and the question stay whole. Tiny random models: fast and offline.
"""

from __future__ import annotations

import importlib.util
import threading

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough
from langchain_core.tracers import context as tracer_context
from langchain_core.vectorstores import InMemoryVectorStore

import langchain_specprefill._settings as settings_module
from langchain_specprefill import ChatSpecPrefill, install_retriever_recorder, remove_retriever_recorder
from langchain_specprefill import format_docs as marking_format_docs
from langchain_specprefill.retrievers import RetrievedDocumentRecorder, active_recorder
from specprefill_rag.testing import random_documents

QUESTION = "When did the bridge open?"
SYSTEM_PROMPT = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, say that you don't know. Use three sentences maximum and keep the "
    "answer concise.\n\n{context}"
)


def format_docs(docs):  # the tutorial's own, no markers
    return "\n\n".join(doc.page_content for doc in docs)


class Stats(BaseCallbackHandler):
    """The SpecPrefill stats of every chat model call in a run (chains that end in a parser drop them)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def on_llm_end(self, response, **kwargs) -> None:
        self.calls.append(response.generations[0][0].message.response_metadata["spec_prefill"])


def _assert_compressed(stats: dict) -> None:
    assert stats["document_source"] == "retriever-located"
    assert stats["compressed"] and 0 < stats["kept_document_tokens"] < stats["document_tokens"]
    # everything that is not a document was kept: instructions, chat template, the question
    assert stats["kept_tokens"] - stats["kept_document_tokens"] == stats["prompt_tokens"] - stats["document_tokens"]


@pytest.fixture
def llm(tiny_engine):
    install_retriever_recorder()
    return ChatSpecPrefill.from_engine(tiny_engine, keep_rate=0.3, max_tokens=4)


def _store(texts: list[str]) -> InMemoryVectorStore:
    return InMemoryVectorStore.from_documents(
        [Document(page_content=t, metadata={"source": f"doc{i}"}) for i, t in enumerate(texts)],
        DeterministicFakeEmbedding(size=32),
    )


@pytest.fixture
def retriever():
    return _store(random_documents(4, 60)).as_retriever(search_kwargs={"k": 3})


def test_rag_tutorial_lcel_chain(llm, retriever):
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{question}")])
    rag_chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    message = rag_chain.invoke(QUESTION)
    _assert_compressed(message.response_metadata["spec_prefill"])


async def test_rag_tutorial_lcel_chain_async_and_stream(llm, retriever):
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{question}")])
    rag_chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    message = await rag_chain.ainvoke(QUESTION)
    _assert_compressed(message.response_metadata["spec_prefill"])
    chunks = list(rag_chain.stream(QUESTION))
    _assert_compressed(chunks[-1].response_metadata["spec_prefill"])
    chunks = [chunk async for chunk in rag_chain.astream(QUESTION)]
    _assert_compressed(chunks[-1].response_metadata["spec_prefill"])


def test_rag_tutorial_context_in_the_human_message(llm, retriever):
    # the hub prompt "rlm/rag-prompt" puts everything in one human message
    prompt = ChatPromptTemplate.from_messages(
        [("human", "Use the context to answer.\nQuestion: {question}\nContext: {context}\nAnswer:")]
    )
    rag_chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    _assert_compressed(rag_chain.invoke(QUESTION).response_metadata["spec_prefill"])


def test_create_stuff_documents_chain_and_create_retrieval_chain(llm, retriever):
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain

    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{input}")])
    question_answer_chain = create_stuff_documents_chain(llm, prompt)
    rag_chain = create_retrieval_chain(retriever, question_answer_chain)
    stats = Stats()
    output = rag_chain.invoke({"input": QUESTION}, config={"callbacks": [stats]})
    assert isinstance(output["answer"], str) and len(output["context"]) == 3
    (call,) = stats.calls
    _assert_compressed(call)


def test_create_stuff_documents_chain_alone_is_one_run_without_a_retriever(llm, retriever):
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain

    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{input}")])
    docs = retriever.invoke(QUESTION)  # its own run, ended before the chain starts: not "this run"
    stats = Stats()
    create_stuff_documents_chain(llm, prompt).invoke({"input": QUESTION, "context": docs}, {"callbacks": [stats]})
    assert (
        stats.calls[0]["document_source"] == "system-context"
    )  # not this run's retrieval: the known template's context


@pytest.mark.parametrize("history", [False, True])
def test_history_aware_retriever_and_create_retrieval_chain(llm, retriever, history):
    from langchain_classic.chains import create_history_aware_retriever, create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain

    contextualize_q_system_prompt = (
        "Given a chat history and the latest user question which might reference context in the chat history, "
        "formulate a standalone question which can be understood without the chat history. Do NOT answer the "
        "question, just reformulate it if needed and otherwise return it as is."
    )
    contextualize_q_prompt = ChatPromptTemplate.from_messages(
        [("system", contextualize_q_system_prompt), MessagesPlaceholder("chat_history"), ("human", "{input}")]
    )
    history_aware_retriever = create_history_aware_retriever(llm, retriever, contextualize_q_prompt)
    qa_prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM_PROMPT), MessagesPlaceholder("chat_history"), ("human", "{input}")]
    )
    question_answer_chain = create_stuff_documents_chain(llm, qa_prompt)
    rag_chain = create_retrieval_chain(history_aware_retriever, question_answer_chain)
    chat_history = [HumanMessage("What is the bridge?"), AIMessage("A suspension bridge in New York.")]
    stats = Stats()
    rag_chain.invoke({"input": QUESTION, "chat_history": chat_history if history else []}, {"callbacks": [stats]})
    if history:  # the rephrasing call comes first, before anything was retrieved
        assert len(stats.calls) == 2 and stats.calls[0]["document_source"] == "none"
    _assert_compressed(stats.calls[-1])


@pytest.mark.skipif(importlib.util.find_spec("langchain.agents") is None, reason="needs langchain>=1 (create_agent)")
def test_create_agent_with_dynamic_prompt_middleware(llm, retriever):
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelRequest, dynamic_prompt

    @dynamic_prompt
    def prompt_with_context(request: ModelRequest) -> str:
        """Inject context into state messages."""
        last_query = request.state["messages"][-1].text
        retrieved_docs = retriever.invoke(last_query)
        docs_content = "\n\n".join(doc.page_content for doc in retrieved_docs)
        return f"You are a helpful assistant. Use the following context in your response:\n\n{docs_content}"

    agent = create_agent(llm, tools=[], middleware=[prompt_with_context])
    result = agent.invoke({"messages": [{"role": "user", "content": QUESTION}]})
    _assert_compressed(result["messages"][-1].response_metadata["spec_prefill"])


@pytest.mark.skipif(importlib.util.find_spec("langchain.agents") is None, reason="needs langchain>=1 (create_agent)")
def test_create_agent_with_vector_store_search_finds_the_context_in_the_system_prompt(llm, retriever):
    # the current tutorial's middleware calls vector_store.similarity_search(): no retriever run, so no callback
    # says what was retrieved; its system prompt is a known template (system_context="delimited", the default)
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelRequest, dynamic_prompt

    vector_store = retriever.vectorstore

    @dynamic_prompt
    def prompt_with_context(request: ModelRequest) -> str:
        retrieved_docs = vector_store.similarity_search(request.state["messages"][-1].text)
        docs_content = "\n\n".join(doc.page_content for doc in retrieved_docs)
        return f"You are a helpful assistant. Use the following context in your response:\n\n{docs_content}"

    agent = create_agent(llm, tools=[], middleware=[prompt_with_context])
    result = agent.invoke({"messages": [{"role": "user", "content": QUESTION}]})
    stats = result["messages"][-1].response_metadata["spec_prefill"]
    assert stats["document_source"] == "system-context"
    assert stats["compressed"] and 0 < stats["kept_document_tokens"] < stats["document_tokens"]
    assert stats["kept_tokens"] - stats["kept_document_tokens"] == stats["prompt_tokens"] - stats["document_tokens"]


def test_reformatted_documents_are_not_found(llm, retriever):
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{question}")])
    upper = {
        "context": retriever | (lambda docs: format_docs(docs).replace(" ", "\n")),
        "question": RunnablePassthrough(),
    }
    message = (upper | prompt | llm).invoke(QUESTION)
    assert (
        message.response_metadata["spec_prefill"]["document_source"] == "system-context"
    )  # found by the template instead


def test_helpers_and_documents_argument_still_win(llm, retriever):
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{question}")])
    marked = {"context": retriever | marking_format_docs, "question": RunnablePassthrough()} | prompt | llm
    assert marked.invoke(QUESTION).response_metadata["spec_prefill"]["document_source"] == "markers"
    extra = [Document(page_content=t) for t in random_documents(1, 40)]
    bound = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm.bind(documents=extra)
    assert bound.invoke(QUESTION).response_metadata["spec_prefill"]["document_source"] == "argument-inserted"


def test_records_are_dropped_when_the_run_ends(llm, retriever):
    recorder = active_recorder()
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{question}")])
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()
    chain.batch([QUESTION, "Who built it?"])
    assert recorder is not None and recorder.tracked_roots() == 0


def test_recorder_never_raises_and_ignores_unknown_runs():
    recorder = RetrievedDocumentRecorder()
    recorder.on_retriever_end(object(), run_id=None)  # type: ignore[arg-type]
    recorder.on_chain_start(None, None, run_id=object())  # type: ignore[arg-type]
    assert recorder.documents(None, None) == ()


def test_remove_recorder_stops_finding_documents(llm, retriever):
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{question}")])
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    assert chain.invoke(QUESTION).response_metadata["spec_prefill"]["document_source"] == "retriever-located"
    recorder = active_recorder()
    try:
        remove_retriever_recorder()
        assert active_recorder() is None
        assert not any(var.get() is recorder for var, *_ in tracer_context._configure_hooks)
        new_chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
        stats = new_chain.invoke(QUESTION).response_metadata["spec_prefill"]
        assert stats["document_source"] == "system-context"  # the template's context, not the recorder's
    finally:
        install_retriever_recorder()
    assert chain.invoke(QUESTION).response_metadata["spec_prefill"]["document_source"] == "retriever-located"


class _BarrierRetriever(BaseRetriever):
    """Returns fixed documents once the other thread's retriever is running too."""

    texts: list[str]
    barrier: threading.Barrier

    def _get_relevant_documents(self, query, *, run_manager):
        self.barrier.wait(timeout=30)
        return [Document(page_content=t) for t in self.texts]


def test_concurrent_runs_see_only_their_own_documents(llm, monkeypatch):
    barrier = threading.Barrier(2)
    texts = random_documents(4, 50)
    corpora = {"a": texts[:2], "b": texts[2:]}
    assert not set(corpora["a"]) & set(corpora["b"])
    seen: dict[str, tuple[str, ...]] = {}
    original = settings_module.retrieved_documents

    def spy(run_manager):
        found = original(run_manager)
        seen[threading.current_thread().name] = found
        return found

    monkeypatch.setattr(settings_module, "retrieved_documents", spy)
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{question}")])
    results: dict[str, dict] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            retriever = _BarrierRetriever(texts=corpora[name], barrier=barrier)
            chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
            results[name] = chain.invoke(QUESTION).response_metadata["spec_prefill"]
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(name,), name=name) for name in corpora]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    for name in corpora:
        assert seen[name] == tuple(corpora[name])
        _assert_compressed(results[name])


def test_text_llm_in_the_rag_chain(tiny_engine, retriever):
    from langchain_core.prompts import PromptTemplate

    from langchain_specprefill import SpecPrefillLLM

    llm = SpecPrefillLLM.from_engine(tiny_engine, keep_rate=0.3, max_tokens=4)
    prompt = PromptTemplate.from_template("Answer from the context.\n{context}\nQuestion: {question}")
    stats: list[dict] = []

    class TextStats(BaseCallbackHandler):
        def on_llm_end(self, response, **kwargs) -> None:
            stats.append(response.generations[0][0].generation_info["spec_prefill"])

    rag_chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    assert isinstance(rag_chain.invoke(QUESTION, {"callbacks": [TextStats()]}), str)
    list(rag_chain.stream(QUESTION, {"callbacks": [TextStats()]}))
    assert len(stats) == 2
    for call in stats:
        _assert_compressed(call)


@pytest.fixture(scope="module")
def gateway(tiny_engine):
    from specprefill_rag.serve import GatewaySettings, create_app
    from specprefill_rag.serve.server import BackgroundServer

    settings = GatewaySettings(served_model_name="tiny", min_prompt_tokens=0, look_ahead=2)
    with BackgroundServer(create_app(settings, tiny_engine)) as url:
        yield url


def test_through_a_gateway_the_same_documents_are_located(gateway, llm, retriever):
    remote = ChatSpecPrefill(backend=gateway, keep_rate=0.3, max_tokens=4)
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{question}")])
    remote_stats = (
        ({"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | remote)
        .invoke(QUESTION)
        .response_metadata["spec_prefill"]
    )
    local_stats = (
        ({"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm)
        .invoke(QUESTION)
        .response_metadata["spec_prefill"]
    )
    _assert_compressed(remote_stats)
    for key in ("prompt_tokens", "document_tokens", "kept_tokens", "kept_document_tokens"):
        assert remote_stats[key] == local_stats[key]


def test_recorder_is_bounded(monkeypatch):
    import uuid

    import langchain_specprefill.retrievers as retrievers

    monkeypatch.setattr(retrievers, "MAX_ROOTS", 4)
    monkeypatch.setattr(retrievers, "MAX_DOCUMENTS_PER_ROOT", 2)
    recorder = RetrievedDocumentRecorder()
    roots = [uuid.uuid4() for _ in range(10)]
    for root in roots:  # roots that never end: the oldest are dropped
        recorder.on_chain_start({}, {}, run_id=root)
    assert recorder.tracked_roots() == 4
    child = uuid.uuid4()
    recorder.on_retriever_start({}, "q", run_id=child, parent_run_id=roots[-1])
    texts = random_documents(3, 20)
    recorder.on_retriever_end([Document(page_content=t) for t in texts], run_id=child, parent_run_id=roots[-1])
    assert recorder.documents(None, roots[-1]) == tuple(texts[:2])
    assert recorder.documents(None, roots[0]) == ()  # dropped, so nothing is found
    recorder.on_chain_end({}, run_id=roots[-1])
    assert recorder.tracked_roots() == 3 and recorder.documents(None, roots[-1]) == ()
