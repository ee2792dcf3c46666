"""The LlamaIndex example for real: VectorStoreIndex with MiniLM embeddings, SmolLM2-135M answering."""

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent


class LastCall(BaseEventHandler):
    prompt: str = ""
    stats: dict = {}

    def handle(self, event, **kwargs):
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.prompt = event.messages[-1].content
            self.stats = event.response.raw["spec_prefill"]


@pytest.fixture(scope="module")
def index(example):
    return example.build_index()


@pytest.fixture
def last_call():
    handler = LastCall()
    get_dispatcher().add_event_handler(handler)
    yield handler
    get_dispatcher().event_handlers.remove(handler)


def test_query_engine_answers_from_one_node(example, index, last_call):
    engine = index.as_query_engine(llm=example.build_llm(), similarity_top_k=4)
    response = engine.query(example.QUESTION)
    assert sum("1883" in n.node.get_content() for n in response.source_nodes) == 1
    assert "1883" in str(response)
    stats = last_call.stats
    assert stats["n_documents"] == len(response.source_nodes)  # each retrieved node is its own span
    assert stats["compressed"] and stats["kept_document_tokens"] < stats["document_tokens"]
    assert stats["kept_tokens"] - stats["kept_document_tokens"] == stats["prompt_tokens"] - stats["document_tokens"]
    assert example.QUESTION in last_call.prompt


def test_context_chat_engine(example, index, last_call):
    chat = index.as_chat_engine(chat_mode="context", llm=example.build_llm(), similarity_top_k=4)
    reply = chat.chat(example.QUESTION)
    assert "1883" in str(reply)
    assert last_call.stats["document_source"] == "argument-located" and last_call.stats["compressed"]


def test_the_agent_example_runs_a_tool_loop_with_the_embedded_model():
    """examples/llamaindex_agent.py in-process: a forced search, its result compressed, a structured answer."""
    path = Path(__file__).resolve().parents[3] / "examples" / "llamaindex_agent.py"
    spec = importlib.util.spec_from_file_location("llamaindex_agent_example", path)
    agent = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = agent  # pydantic resolves the example's annotations through its module
    spec.loader.exec_module(agent)
    recorder = agent.LastStats()
    get_dispatcher().add_event_handler(recorder)
    try:
        reply, calls, answer = asyncio.run(agent.ask(agent.build_llm(), agent.search_tool()))
    finally:
        get_dispatcher().event_handlers.remove(recorder)
    assert [c.tool_name for c in calls][:1] == ["search_documents"] and reply
    assert recorder.after_tool["document_source"] == "tool-results" and recorder.after_tool["compressed"]
    assert isinstance(answer, agent.Answer)
