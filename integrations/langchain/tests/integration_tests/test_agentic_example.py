"""The agentic RAG example, run for real on the embedded SmolLM2-135M: a forced retriever-tool call, its
result compressed as a document, a structured answer valid for the schema."""

import importlib.util
import sys

from langchain_core.messages import AIMessage, ToolMessage

from ..conftest import EXAMPLES

spec = importlib.util.spec_from_file_location("langchain_agentic_example", EXAMPLES / "langchain_agentic_rag.py")
example = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = example
spec.loader.exec_module(example)


def test_the_agentic_example_searches_compresses_the_result_and_answers_in_the_schema():
    messages, answer = example.agentic_answer(example.build_llm(), example.search_tool())
    call, result = messages[2], messages[3]
    assert isinstance(call, AIMessage) and [c["name"] for c in call.tool_calls] == ["search_articles"]
    assert isinstance(result, ToolMessage) and result.tool_call_id == call.tool_calls[0]["id"]
    assert isinstance(answer["parsed"], example.CitedAnswer) and answer["parsing_error"] is None
    stats = answer["raw"].response_metadata["spec_prefill"]
    assert stats["document_source"] == "tool-results" and stats["compressed"]
    assert stats["kept_document_tokens"] < stats["document_tokens"]
