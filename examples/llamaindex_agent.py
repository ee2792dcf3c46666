"""A LlamaIndex agent with SpecPrefill: a FunctionAgent searches examples/documents with a retriever tool,
the retrieved nodes come back as a tool result (the only text SpecPrefill compresses), and a structured
answer with its source follows.

In-process, the embedded SmolLM2-135M answers (it writes no tool calls on its own, so the first call is
forced with ``initial_tool_choice``: constrained decoding makes it a valid one). Through a gateway
(``specprefill-rag serve``), only the LLM changes: ``OpenAILike`` pointed at its URL.

Run: python examples/llamaindex_agent.py [--gateway http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.tools import RetrieverTool, ToolMetadata
from llama_index.llms.specprefill import SpecPrefillLLM
from pydantic import BaseModel, Field

DOCUMENTS = Path(__file__).parent / "documents"
QUESTION = "In what year did the Brooklyn Bridge open to traffic?"
SYSTEM = "You answer questions about historic places. Search the documents first, then answer briefly."


class Answer(BaseModel):
    """The agent's answer and the article it came from."""

    year: int = Field(description="The year asked for.")
    source: str = Field(description="Title of the article the year comes from.", max_length=60)


def search_tool(similarity_top_k: int = 3) -> RetrieverTool:
    """A retriever over the example articles (MiniLM embeddings, offline) as the agent's tool."""
    import all_minilm_l6_v2
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    documents = [Document(text=path.read_text(encoding="utf-8")) for path in sorted(DOCUMENTS.glob("*.txt"))]
    embed_model = HuggingFaceEmbedding(model_name=str(all_minilm_l6_v2.get_model_path()))
    splitter = SentenceSplitter(chunk_size=160, chunk_overlap=0, paragraph_separator="\n\n\n")
    index = VectorStoreIndex.from_documents(documents, embed_model=embed_model, transformations=[splitter])
    metadata = ToolMetadata(name="search_documents", description="Search the articles; input: a search query.")
    return RetrieverTool(retriever=index.as_retriever(similarity_top_k=similarity_top_k), metadata=metadata)


def build_llm(gateway: str | None = None, model: str = "smollm2-135m", draft: str | None = None) -> Any:
    """SpecPrefillLLM in this process, or any OpenAI-compatible client pointed at a SpecPrefill gateway."""
    if gateway is None:
        return SpecPrefillLLM(model=model, draft_model=draft, keep_rate=0.3, min_prompt_tokens=256, max_new_tokens=64)
    from llama_index.llms.openai_like import OpenAILike

    return OpenAILike(
        model=model,
        api_base=gateway + "/v1",
        api_key="unused",
        is_chat_model=True,
        is_function_calling_model=True,
        max_tokens=64,
    )


class LastStats(BaseEventHandler):
    """The SpecPrefill stats of the last LLM call that read a tool result."""

    after_tool: dict[str, Any] = {}

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None and event.response.raw:
            stats = dict(event.response.raw).get("spec_prefill") or {}
            if stats.get("document_source") == "tool-results":
                self.after_tool = stats


async def ask(llm: Any, tool: RetrieverTool) -> tuple[str, list[ToolCallResult], Answer]:
    """The agent's reply, the tool calls it made, and the structured answer over the same retrieved text."""
    agent = FunctionAgent(llm=llm, tools=[tool], system_prompt=SYSTEM, initial_tool_choice="search_documents")
    handler = agent.run(user_msg=QUESTION)
    calls = [event async for event in handler.stream_events() if isinstance(event, ToolCallResult)]
    reply = await handler
    context = "\n\n".join(str(call.tool_output.content) for call in calls)
    structured = await llm.as_structured_llm(Answer).acomplete(f"{context}\n\nQuestion: {QUESTION}")
    return str(reply).strip(), calls, structured.raw


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__)
    options.add_argument("--gateway", help="base URL of a running `specprefill-rag serve` (default: in-process)")
    options.add_argument("--model", default="smollm2-135m", help="e.g. qwen2.5-coder-1.5b after `make models`")
    options.add_argument("--draft", help="e.g. qwen2.5-coder-0.5b (default: the main model's own first layers)")
    args = options.parse_args()
    recorder = LastStats()
    get_dispatcher().add_event_handler(recorder)
    reply, calls, answer = asyncio.run(ask(build_llm(args.gateway, args.model, args.draft), search_tool()))
    for call in calls:
        print(f"tool call: {call.tool_name}({call.tool_kwargs}) -> {len(str(call.tool_output.content))} characters")
    print(f"agent: {reply}")
    if recorder.after_tool:  # in-process, or through a gateway with OpenAILike's raw response
        stats = recorder.after_tool
        print(
            f"the step after the tool result: kept {stats['kept_document_tokens']}/{stats['document_tokens']} "
            f"tool-result tokens ({stats['document_source']}), TTFT {stats.get('ttft_ms', 0):.0f} ms"
        )
    print(f"structured: {answer!r}")


if __name__ == "__main__":
    main()
