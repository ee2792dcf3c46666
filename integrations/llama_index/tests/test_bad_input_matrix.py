"""The bad-input matrix of the LlamaIndex adapter (issue 14; the core's is tests/test_bad_input_matrix.py).

Every bad call raises exactly the typed error of its row (``SpecPrefillError`` subclasses naming the
argument and the fix; pydantic's ``ValidationError`` for constructor settings), never a bare
``TypeError``/``KeyError``/``IndexError``/``UnicodeEncodeError``. The errors are deliberately not
``ValueError`` (LlamaIndex's refine step catches those). Afterwards the same LLM answers. Completion rows
run through ``complete``, ``stream_complete``, ``acomplete`` and ``astream_complete``; chat rows through
``chat``, ``stream_chat``, ``achat`` and ``astream_chat``. The docs page "Bad input" is generated from these rows.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from llama_index.core.base.llms.types import ImageBlock, MessageRole, ToolCallBlock
from llama_index.core.llms import ChatMessage
from llama_index.core.schema import TextNode
from llama_index.llms.specprefill import SpecPrefillDocumentWarmer, SpecPrefillLLM
from pydantic import ValidationError

from specprefill_rag.errors import ContextLengthError, InvalidRequestError, SpecPrefillError
from specprefill_rag.testing import random_documents

pytestmark = pytest.mark.timeout(120)

QUESTION = "When did the bridge open?"
DOCUMENTS = ["The bridge opened in 1883 after thirteen years of work.", "Paris is the capital of France."]
SURROGATE = "caf\udce9"
FIX = re.compile(r"\b(pass|use|lower|send|decode|drop|wrap|build|leave|retrieve|give|end|change)\b")
LONG = random_documents(8, 160)  # ~1,300 tokens: over the tiny model's 1,024-token context
TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}


@dataclass(frozen=True)
class Row:
    surface: str
    case: str
    call: Callable[[Any], Any]
    error: type[BaseException]
    message: str

    @property
    def id(self) -> str:
        return f"{self.surface}: {self.case}"


COMPLETE_CASES: list[tuple[str, Any, dict, type, str]] = [
    # (case, prompt, call options, error, message)
    (
        "draft_document_cache: str",
        QUESTION,
        {"documents": DOCUMENTS, "draft_document_cache": "yes"},
        InvalidRequestError,
        "draft_document_cache must be True or False, got str",
    ),
    ("prompt: int", 5, {}, InvalidRequestError, "prompt must be a str .* got int"),
    ("prompt: None", None, {}, InvalidRequestError, "prompt must be a str .* got NoneType"),
    ("prompt: empty", "", {}, InvalidRequestError, "prompt is empty"),
    ("prompt: whitespace only", "\n  ", {}, InvalidRequestError, "prompt is empty or only whitespace"),
    ("prompt: lone surrogate", SURROGATE, {}, InvalidRequestError, "prompt is not valid Unicode"),
    ("documents=: int", QUESTION, {"documents": 5}, InvalidRequestError, "documents must be a list .* got int"),
    ("documents=: empty list", QUESTION, {"documents": []}, InvalidRequestError, "documents=\\[\\] is empty"),
    (
        "documents=: mapping text None",
        QUESTION,
        {"documents": [{"text": None}]},
        InvalidRequestError,
        "document 0's text must be a str",
    ),
    ("documents=: bytes not UTF-8", QUESTION, {"documents": [b"\xff"]}, InvalidRequestError, "not valid UTF-8"),
    (
        "documents=: lone surrogate",
        QUESTION,
        {"documents": [SURROGATE]},
        InvalidRequestError,
        "document 0's text is not valid Unicode",
    ),
    ("query=: int", QUESTION, {"query": 5}, InvalidRequestError, "question must be a str"),
    ("query=: whitespace only", QUESTION, {"query": "  "}, InvalidRequestError, "question is empty"),
    (
        "keep_rate: str",
        QUESTION,
        {"documents": DOCUMENTS, "keep_rate": "half"},
        InvalidRequestError,
        "keep_rate must be a number or 'auto', got str",
    ),
    (
        "keep_rate: NaN",
        QUESTION,
        {"documents": DOCUMENTS, "keep_rate": float("nan")},
        InvalidRequestError,
        "keep_rate must be finite",
    ),
    ("keep_rate: 0", QUESTION, {"documents": DOCUMENTS, "keep_rate": 0}, InvalidRequestError, "keep_rate must be in"),
    (
        "unknown option",
        QUESTION,
        {"temperature": 0.5},
        InvalidRequestError,
        "unknown call options \\['temperature'\\]; use the supported ones",
    ),
    (
        "huge: prompt over the context",
        QUESTION,
        {"documents": LONG},
        ContextLengthError,
        "the prompt has \\d{4} tokens but the main model's context is 1024 tokens",
    ),
]

CHAT_CASES: list[tuple[str, Any, dict, type, str]] = [
    (
        "draft_document_cache: int",
        [ChatMessage(role="user", content=QUESTION)],
        {"documents": DOCUMENTS, "draft_document_cache": 1},
        InvalidRequestError,
        "draft_document_cache must be True or False, got int",
    ),
    ("messages: empty list", [], {}, InvalidRequestError, "no messages given"),
    (
        "message: lone surrogate",
        [ChatMessage(role="user", content=SURROGATE)],
        {},
        InvalidRequestError,
        "message 0 is not valid Unicode",
    ),
    (
        "message: whitespace only",
        [ChatMessage(role="user", content=" ")],
        {},
        InvalidRequestError,
        "last user message is empty",
    ),
    (
        "message: last from the assistant",
        [ChatMessage(role="assistant", content="hi")],
        {},
        InvalidRequestError,
        "last message is from 'assistant'",
    ),
    (
        "message: function role",
        [ChatMessage(role=MessageRole.FUNCTION, content="x")],
        {},
        InvalidRequestError,
        "chat role 'function' is not supported; use system, developer, user, assistant or tool",
    ),
    (
        "tool message: no tool_call_id",
        [ChatMessage(role="user", content=QUESTION), ChatMessage(role=MessageRole.TOOL, content="x")],
        {},
        InvalidRequestError,
        "messages\\[1\\] is a tool message without additional_kwargs\\['tool_call_id'\\]",
    ),
    (
        "tool message: unknown call id",
        [
            ChatMessage(role="user", content=QUESTION),
            ChatMessage(role=MessageRole.TOOL, content="x", additional_kwargs={"tool_call_id": "call_9"}),
        ],
        {},
        InvalidRequestError,
        "tool result for call id 'call_9', which no earlier assistant message made",
    ),
    (
        "tool message: spec_prefill_compress not a bool",
        [
            ChatMessage(role="user", content=QUESTION),
            ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [CALL]}),
            ChatMessage(
                role=MessageRole.TOOL, content="x", additional_kwargs={"tool_call_id": "c1", "spec_prefill_compress": 0}
            ),
        ],
        {},
        InvalidRequestError,
        "additional_kwargs\\['spec_prefill_compress'\\] must be True or False, got int",
    ),
    (
        "assistant tool_calls: arguments not JSON",
        [
            ChatMessage(role="user", content=QUESTION),
            ChatMessage(
                role="assistant",
                content="",
                additional_kwargs={"tool_calls": [{**CALL, "function": {"name": "search", "arguments": "{q:"}}]},
            ),
            ChatMessage(role=MessageRole.TOOL, content="x", additional_kwargs={"tool_call_id": "c1"}),
        ],
        {},
        InvalidRequestError,
        "messages\\[1\\].additional_kwargs\\['tool_calls'\\]\\[0\\].function.arguments is not valid JSON",
    ),
    (
        "assistant tool_calls: no id",
        [
            ChatMessage(role="user", content=QUESTION),
            ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [{**CALL, "id": None}]}),
            ChatMessage(role="user", content=QUESTION),
        ],
        {},
        InvalidRequestError,
        "tool_calls'\\]\\[0\\] has no id; give each call its id",
    ),
    (
        "ToolCallBlock in a user message",
        [ChatMessage(role="user", blocks=[ToolCallBlock(tool_call_id="c1", tool_name="search")])],
        {},
        InvalidRequestError,
        "ToolCallBlock outside an assistant message is not supported",
    ),
    (
        "tools=: one schema, not a list",
        [ChatMessage(role="user", content=QUESTION)],
        {"tools": TOOL},
        InvalidRequestError,
        "tools must be a list, got dict",
    ),
    (
        "tools=: a function",
        [ChatMessage(role="user", content=QUESTION)],
        {"tools": [print]},
        InvalidRequestError,
        "tools\\[0\\] is a builtin_function_or_method; pass a LlamaIndex BaseTool",
    ),
    (
        "tool_choice=: an int",
        [ChatMessage(role="user", content=QUESTION)],
        {"tools": [TOOL], "tool_choice": 1},
        InvalidRequestError,
        "tool_choice must be a str or OpenAI's dict form, got 1",
    ),
    (
        "parallel_tool_calls=: a str",
        [ChatMessage(role="user", content=QUESTION)],
        {"tools": [TOOL], "parallel_tool_calls": "no"},
        InvalidRequestError,
        "parallel_tool_calls must be True or False, got str",
    ),
    (
        "tools=: the same tool twice",
        [ChatMessage(role="user", content=QUESTION)],
        {"tools": [TOOL, TOOL]},
        InvalidRequestError,
        "tools names the tool 'search' twice; give each tool once",
    ),
    (
        "message: image block",
        [ChatMessage(role="user", blocks=[ImageBlock(url="http://127.0.0.1/x.png")])],
        {},
        InvalidRequestError,
        "ImageBlock is not supported; pass text blocks only",
    ),
    (
        "documents=: one str",
        [ChatMessage(role="user", content=QUESTION)],
        {"documents": "text"},
        InvalidRequestError,
        "documents must be a list .* got str",
    ),
    (
        "keep_rate: +inf",
        [ChatMessage(role="user", content=QUESTION)],
        {"documents": DOCUMENTS, "keep_rate": float("inf")},
        InvalidRequestError,
        "keep_rate must be finite",
    ),
    # LlamaIndex's own instrumentation validates the messages' type before this package sees them
    ("messages: a str", QUESTION, {}, ValidationError, "messages\n.*valid list"),
]

CONSTRUCTOR_CASES: list[tuple[str, dict, str]] = [
    ("top_logprobs: 21", {"logprobs": True, "top_logprobs": 21}, "top_logprobs\n.*less than or equal to 20"),
    ("top_logprobs: -1", {"logprobs": True, "top_logprobs": -1}, "top_logprobs\n.*greater than or equal to 0"),
    ("top_logprobs: bool", {"logprobs": True, "top_logprobs": True}, "top_logprobs\n.*valid integer"),
    ("top_logprobs: str", {"logprobs": True, "top_logprobs": "3"}, "top_logprobs\n.*valid integer"),
    ("top_logprobs without logprobs", {"top_logprobs": 3}, "top_logprobs\n.*needs logprobs=True; set logprobs=True"),
    ("keep_rate: NaN", {"keep_rate": float("nan")}, "keep_rate\n.*finite number"),
    ("keep_rate: 1.5", {"keep_rate": 1.5}, "keep_rate\n.*must be in \\(0, 1\\]"),
    ("temperature: +inf", {"temperature": float("inf")}, "temperature\n.*finite number"),
    ("max_new_tokens: 0", {"max_new_tokens": 0}, "max_new_tokens\n.*greater than or equal to 1"),
    ("seed: negative", {"seed": -1}, "seed\n.*greater than or equal to 0"),
    ("timeout: NaN", {"timeout": float("nan")}, "timeout\n.*finite number"),
    ("timeout: 0", {"timeout": 0}, "timeout\n.*greater than 0"),
    ("backend: not a URL", {"backend": "ftp://x"}, "neither 'transformers'"),
    ("device: not a device", {"device": "gpu0"}, "device 'gpu0' is not a torch device"),
    (
        "tokenizer: in-process",
        {"tokenizer": "smollm2-135m"},
        "tokenizer names the served model's tokenizer of a vLLM backend",
    ),
    (
        "auto_keep_floor: above the ceiling",
        {"auto_keep_floor": 0.6, "auto_keep_ceiling": 0.5},
        "auto_keep_floor \\(0.6\\) is above auto_keep_ceiling",
    ),
    ("unknown setting", {"max_tokens": 8}, "max_tokens\n.*Extra inputs are not permitted"),
]


# (where, case, call over the row's LLM, error, message)
WARMER_CASES: list[tuple[str, str, Callable[[Any], Any], type, str]] = [
    ("(...)", "llm: str", lambda llm: SpecPrefillDocumentWarmer(llm="smollm2-135m"), ValidationError, "llm\n"),
    (
        "(...)",
        "instructions: whitespace only",
        lambda llm: SpecPrefillDocumentWarmer(llm=llm, instructions=" "),
        ValidationError,
        "instructions\n.*instructions is empty",
    ),
    (
        "(nodes)",
        "nodes: one str",
        lambda llm: SpecPrefillDocumentWarmer(llm=llm)("one text"),
        InvalidRequestError,
        "nodes must be a list of LlamaIndex nodes, got str",
    ),
    (
        ".acall",
        "node: str",
        lambda llm: asyncio.run(SpecPrefillDocumentWarmer(llm=llm).acall([TextNode(text="ok"), "text"])),
        InvalidRequestError,
        "node 1 is a str, not a LlamaIndex node; wrap",
    ),
]


async def _acollect(responses):
    return [response async for response in await responses]


def _call(style: str, argument: Any, options: dict) -> Callable[[Any], Any]:
    def call(llm):
        method = getattr(llm, style)
        if style.startswith("astream"):
            return asyncio.run(_acollect(method(argument, **options)))
        if style.startswith("a"):
            return asyncio.run(method(argument, **options))
        result = method(argument, **options)
        return list(result) if style.startswith("stream") else result

    return call


ROWS = (
    [
        Row(f"SpecPrefillLLM.{style}", case, _call(style, prompt, options), error, message)
        for case, prompt, options, error, message in COMPLETE_CASES
        for style in ("complete", "stream_complete", "acomplete", "astream_complete")
    ]
    + [
        Row(f"SpecPrefillLLM.{style}", case, _call(style, messages, options), error, message)
        for case, messages, options, error, message in CHAT_CASES
        for style in ("chat", "stream_chat", "achat", "astream_chat")
    ]
    + [
        Row(
            "SpecPrefillLLM(...)",
            case,
            lambda llm, settings=settings: SpecPrefillLLM(**settings),
            ValidationError,
            message,
        )
        for case, settings, message in CONSTRUCTOR_CASES
    ]
    + [
        Row(f"SpecPrefillDocumentWarmer{where}", case, call, error, message)
        for where, case, call, error, message in WARMER_CASES
    ]
)


@pytest.fixture(scope="module")
def llm(tiny_engine):
    return SpecPrefillLLM.from_engine(tiny_engine, max_new_tokens=2)


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_bad_input_gets_a_typed_error_and_the_engine_keeps_serving(row, llm):
    with pytest.raises(row.error) as raised:
        row.call(llm)
    message = str(raised.value)
    assert re.search(row.message, message, re.S), message
    if isinstance(raised.value, SpecPrefillError):
        assert FIX.search(message), f"the message names no fix: {message}"
    response = llm.complete(QUESTION, documents=DOCUMENTS)
    assert response.raw["spec_prefill"]["prompt_tokens"] > 0


def test_matrix_size():
    assert len({row.case for row in ROWS}) >= 30
