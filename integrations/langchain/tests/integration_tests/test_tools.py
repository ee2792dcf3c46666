"""Tool calling on the real SmolLM2-135M-Instruct. Its chat template has no tool calling, so the core writes the
tools and the ``<tool_call>`` instructions into the messages; a forced call is constrained token by token.

The standard suite's tool tests are off for this model (see test_chat_models_standard.py); these check what it
does do: take tool histories, compress the results, and write a well-formed forced call.
"""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

from langchain_specprefill import ChatSpecPrefill

from ..conftest import EXAMPLES

QUESTION = "In what year did the Brooklyn Bridge open to traffic?"


@tool
def search(query: str) -> str:
    """Search an encyclopedia for a query."""
    return (EXAMPLES / "documents" / "brooklyn_bridge.txt").read_text()


@tool
def magic_function(value: int) -> int:
    """Apply a magic function to an input."""
    return value + 2


def history() -> list[BaseMessage]:
    return [
        HumanMessage(QUESTION),
        AIMessage("", tool_calls=[{"name": "search", "args": {"query": "Brooklyn Bridge"}, "id": "call_1"}]),
        ToolMessage(search.invoke("Brooklyn Bridge"), tool_call_id="call_1", name="search"),
    ]


@pytest.fixture(scope="module")
def llm() -> ChatSpecPrefill:
    return ChatSpecPrefill(model="smollm2-135m", keep_rate=0.3, min_prompt_tokens=256, max_tokens=8)


def test_a_search_result_is_compressed_and_answered(llm):
    message = llm.bind_tools([search]).invoke(history())
    stats = message.response_metadata["spec_prefill"]
    assert stats["document_source"] == "tool-results"
    assert stats["compressed"] and stats["kept_document_tokens"] < stats["document_tokens"]
    assert isinstance(message.content, str) and message.usage_metadata["input_tokens"] == stats["prompt_tokens"]


def test_keep_tools_whole_keeps_the_result(llm):
    stats = llm.bind_tools([search], keep_tools_whole=["search"]).invoke(history()).response_metadata["spec_prefill"]
    assert stats["document_source"] == "none" and stats["kept_tokens"] >= stats["prompt_tokens"] - 64


def test_a_forced_call_is_well_formed_invoked_and_streamed(llm):
    model = llm.bind_tools([magic_function], tool_choice="magic_function", max_tokens=40)  # the call fits
    query = "What is the value of magic_function(3)? Use the tool."
    message = model.invoke(query)
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert [call["name"] for call in message.tool_calls] == ["magic_function"]
    assert isinstance(message.tool_calls[0]["args"]["value"], int)
    full = None
    for chunk in model.stream(query):
        full = chunk if full is None else full + chunk
    assert full is not None
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in message.tool_calls]
