"""LangChain's ChatOpenAI and LlamaIndex's OpenAILike against the gateway, unchanged apart from the URL:
a retrieval chain and a query engine (tiny random models, fake embeddings: no download)."""

import httpx

from specprefill_rag.config import GenerationParams
from specprefill_rag.prompt.chat import ChatMessage, chat_layout
from specprefill_rag.testing import random_documents
from tests.serve_helpers import MODEL

DOCUMENTS = random_documents(4, 50, seed=7)
QUESTION = "When did the bridge open?"


def ok_requests(url):
    metrics = httpx.get(url + "/metrics", timeout=10).text
    line = next(
        x for x in metrics.splitlines() if x.startswith('specprefill_requests_total{endpoint="chat",outcome="ok"}')
    )
    return float(line.split()[-1])


def test_langchain_chat_openai_in_a_rag_chain(gateway, engine):
    from langchain_core.documents import Document
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough
    from langchain_openai import ChatOpenAI

    retriever = RunnableLambda(lambda question: [Document(page_content=text) for text in DOCUMENTS])
    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer the question using the context. Be brief."),
            ("human", "Context:\n{context}\n\nQuestion: {question}"),
        ]
    )
    llm = ChatOpenAI(
        base_url=gateway + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=8, max_retries=0, timeout=60
    )
    join = RunnableLambda(lambda docs: "\n\n".join(d.page_content for d in docs))
    chain = {"context": retriever | join, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()
    before = ok_requests(gateway)
    answer = chain.invoke(QUESTION)
    assert ok_requests(gateway) == before + 1

    # the gateway found no marked documents, so the fallback rule applied: the same as in-process
    messages = prompt.invoke({"context": "\n\n".join(DOCUMENTS), "question": QUESTION}).to_messages()
    core = [ChatMessage("system" if m.type == "system" else "user", [m.content]) for m in messages]
    layout = chat_layout(engine.tokenizer, core, None, protect_tail_tokens=64)
    assert answer == engine.generate_layout(layout.layout, GenerationParams(max_new_tokens=8)).text
    streamed = "".join(chain.stream(QUESTION))
    assert streamed == answer


def test_llamaindex_openai_like_in_a_query_engine(gateway):
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(
        api_base=gateway + "/v1",
        api_key="unused",
        model=MODEL,
        is_chat_model=True,
        temperature=0,
        max_tokens=8,
        context_window=1024,
        max_retries=0,
        timeout=60,
    )
    embed = MockEmbedding(embed_dim=8)
    index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCUMENTS], embed_model=embed)
    engine = index.as_query_engine(llm=llm, similarity_top_k=2, embed_model=embed)
    before = ok_requests(gateway)
    response = engine.query(QUESTION)
    assert isinstance(response.response, str) and len(response.source_nodes) == 2
    assert ok_requests(gateway) >= before + 1  # the answer came from the gateway (no OpenAI default LLM)


def test_langchain_chat_openai_shows_the_stats_from_the_response_headers(gateway):
    """ChatOpenAI drops the body's unknown ``spec_prefill`` field; with include_response_headers=True the
    ``x-specprefill-*`` headers reach ``response_metadata["headers"]``, on invoke and on a stream."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=gateway + "/v1",
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=4,
        max_retries=0,
        timeout=60,
        include_response_headers=True,
        extra_body={"spec_prefill": {"documents": DOCUMENTS}},
    )
    headers = llm.invoke(QUESTION).response_metadata["headers"]
    assert headers["x-specprefill-compressed"] == "true"
    assert int(headers["x-specprefill-kept-document-tokens"]) < int(headers["x-specprefill-document-tokens"])
    first = next(iter(llm.stream(QUESTION)))
    assert first.response_metadata["headers"]["x-specprefill-kept-tokens"] == headers["x-specprefill-kept-tokens"]
