"""Agentic RAG in LangChain with ChatSpecPrefill: the model calls a retriever tool, the retrieved chunks come
back as a ToolMessage (the only text SpecPrefill compresses), and a structured answer cites its source.

Three steps, as LangChain's agentic RAG tutorial has them: the model writes a search call (forced here with
``tool_choice``, which constrained decoding makes a valid call even for the embedded SmolLM2-135M), the tool
runs, and ``with_structured_output`` answers over the history. Through a gateway (``specprefill-rag serve``)
only the chat model changes: ``ChatOpenAI`` pointed at its URL.

Run: python examples/langchain_agentic_rag.py [--gateway http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage
from langchain_core.prompts import PromptTemplate
from langchain_core.tools import BaseTool, create_retriever_tool
from langchain_core.vectorstores import InMemoryVectorStore
from pydantic import BaseModel, Field

from langchain_specprefill import ChatSpecPrefill

DOCUMENTS = Path(__file__).parent / "documents"
QUESTION = "In what year did the Brooklyn Bridge open to traffic?"
SYSTEM = "You answer questions about historic places. Search the articles first, then answer briefly."


class CitedAnswer(BaseModel):
    """An answer and the article it is taken from."""

    answer: str = Field(description="The answer, in a few words.", max_length=80)
    source: str = Field(description="Title of the article the answer comes from.", max_length=60)


def search_tool(k: int = 3) -> BaseTool:
    """The example articles in chunks, all-MiniLM-L6-v2 embeddings (offline package), as a retriever tool."""
    import all_minilm_l6_v2
    from langchain_huggingface import HuggingFaceEmbeddings
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    articles = []
    for path in sorted(DOCUMENTS.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        articles.append(Document(page_content=text, metadata={"title": text.splitlines()[0]}))
    chunks = RecursiveCharacterTextSplitter(chunk_size=900, chunk_overlap=0).split_documents(articles)
    embeddings = HuggingFaceEmbeddings(model_name=str(all_minilm_l6_v2.get_model_path()))
    retriever = InMemoryVectorStore.from_documents(chunks, embeddings).as_retriever(search_kwargs={"k": k})
    titled = PromptTemplate.from_template("{title}\n{page_content}")  # so an answer can cite its article
    description = "Search the articles about historic places."
    return create_retriever_tool(retriever, "search_articles", description, document_prompt=titled)


def build_llm(gateway: str | None = None, model: str = "smollm2-135m", draft: str | None = None) -> Any:
    """ChatSpecPrefill in this process, or ChatOpenAI pointed at a SpecPrefill gateway."""
    if gateway is None:
        return ChatSpecPrefill(model=model, draft_model=draft, keep_rate=0.3, min_prompt_tokens=256, max_tokens=64)
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=gateway + "/v1", api_key="unused", model=model, max_tokens=64, include_response_headers=True
    )


def agentic_answer(llm: Any, search: BaseTool) -> tuple[list[BaseMessage], dict[str, Any]]:
    """The conversation (system, question, the model's search call, its result) and the structured answer
    (``{"raw", "parsed", "parsing_error"}``).
    """
    messages: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
    call = llm.bind_tools([search], tool_choice=search.name).invoke(messages)
    messages += [call, *(search.invoke(tool_call) for tool_call in call.tool_calls)]
    answer = llm.with_structured_output(CitedAnswer, method="json_schema", include_raw=True).invoke(messages)
    return messages, answer


def kept_share(message: BaseMessage) -> str:
    """What SpecPrefill did on the step that read the tool result (in-process: response_metadata)."""
    stats = message.response_metadata.get("spec_prefill") or {}
    if not stats:
        return "stats: see the x-specprefill-* response headers"
    return (
        f"kept {stats['kept_document_tokens']}/{stats['document_tokens']} tool-result tokens "
        f"({stats['document_source']}), TTFT {stats['ttft_ms']:.0f} ms"
    )


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__)
    options.add_argument("--gateway", help="base URL of a running `specprefill-rag serve` (default: in-process)")
    options.add_argument("--model", default="smollm2-135m", help="e.g. qwen2.5-coder-1.5b after `make models`")
    options.add_argument("--draft", help="e.g. qwen2.5-coder-0.5b (default: the main model's own first layers)")
    args = options.parse_args()
    messages, answer = agentic_answer(build_llm(args.gateway, args.model, args.draft), search_tool())
    for tool_call in messages[2].tool_calls:
        print(f"tool call: {tool_call['name']}({tool_call['args']})")
    print(f"tool result: {len(str(messages[3].content))} characters")
    print(f"answer: {answer['parsed']!r}  (parsing error: {answer['parsing_error']})")
    print(kept_share(answer["raw"]))


if __name__ == "__main__":
    main()
