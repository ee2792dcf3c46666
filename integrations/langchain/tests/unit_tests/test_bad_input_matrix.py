"""The bad-input matrix of the LangChain adapter (issue 14; the core's is tests/test_bad_input_matrix.py).

Every bad call raises exactly the typed error of its row (``SpecPrefillError`` subclasses naming the
argument and the fix; pydantic's ``ValidationError`` for constructor settings), never a bare
``TypeError``/``KeyError``/``IndexError``/``UnicodeEncodeError``; afterwards the same engine answers.
Chat rows run through ``invoke``, ``stream``, ``ainvoke`` and ``astream``; LLM rows through ``invoke``
and ``astream``. Input types LangChain itself converts (``invoke(5)``) are refused by LangChain before
this package sees them, so they are not rows here. The docs page "Bad input" is generated from these rows.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from pydantic import ValidationError

from langchain_specprefill import ChatSpecPrefill, SpecPrefillDocumentWarmer, SpecPrefillLLM
from specprefill_rag.config import OutputFormat
from specprefill_rag.errors import ContextLengthError, InvalidRequestError, SpecPrefillError
from specprefill_rag.testing import random_documents

pytestmark = pytest.mark.timeout(120)

QUESTION = "When did the bridge open?"
DOCUMENTS = ["The bridge opened in 1883 after thirteen years of work.", "Paris is the capital of France."]
SURROGATE = "caf\udce9"
FIX = re.compile(r"\b(pass|use|lower|send|decode|drop|wrap|build|leave|retrieve|give|end|change)\b")
LONG = random_documents(8, 160)  # ~1,300 tokens: over the tiny model's 1,024-token context
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
CALL = AIMessage("", tool_calls=[{"name": "add", "args": {}, "id": "c1"}])


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


CHAT_CASES: list[tuple[str, Any, dict, type, str]] = [
    # (case, messages, call options, error, message)
    (
        "draft_document_cache: str",
        QUESTION,
        {"documents": DOCUMENTS, "draft_document_cache": "yes"},
        InvalidRequestError,
        "draft_document_cache must be True or False, got str",
    ),
    ("documents=: int", QUESTION, {"documents": 5}, InvalidRequestError, "documents= must be a list .* got int"),
    (
        "documents=: one str",
        QUESTION,
        {"documents": "text"},
        InvalidRequestError,
        "documents= must be a list .* got str",
    ),
    ("documents=: empty list", QUESTION, {"documents": []}, InvalidRequestError, "documents=\\[\\] is empty"),
    ("documents=: None inside", QUESTION, {"documents": [None]}, InvalidRequestError, "document 0 has type NoneType"),
    (
        "documents=: mapping text None",
        QUESTION,
        {"documents": [{"text": None}]},
        InvalidRequestError,
        "document 0's text must be a str",
    ),
    (
        "documents=: lone surrogate",
        QUESTION,
        {"documents": [Document(page_content=SURROGATE)]},
        InvalidRequestError,
        "document 0's text is not valid Unicode",
    ),
    (
        "documents=: whitespace only",
        QUESTION,
        {"documents": [Document(page_content=" \n")]},
        InvalidRequestError,
        "document 0 is empty",
    ),
    ("message: lone surrogate", [HumanMessage(SURROGATE)], {}, InvalidRequestError, "message 0 is not valid Unicode"),
    ("message: empty", [HumanMessage("")], {}, InvalidRequestError, "last user message is empty"),
    (
        "message: whitespace only",
        [SystemMessage("Be brief."), HumanMessage("  ")],
        {},
        InvalidRequestError,
        "last user message is empty",
    ),
    (
        "message: last from the AI",
        [HumanMessage(QUESTION), AIMessage("1883")],
        {},
        InvalidRequestError,
        "the last message is from 'assistant'.* end with one",
    ),
    (
        "message: tool result without its call",
        [HumanMessage(QUESTION), ToolMessage("x", tool_call_id="1")],
        {},
        InvalidRequestError,
        "messages\\[1\\] is a tool result for call id '1', which no earlier assistant message made",
    ),
    (
        "message: invalid tool calls in the history",
        [
            HumanMessage(QUESTION),
            AIMessage("", invalid_tool_calls=[{"name": "add", "args": "{", "id": "c1", "error": "bad JSON"}]),
            HumanMessage(QUESTION),
        ],
        {},
        InvalidRequestError,
        "an AIMessage has 1 invalid_tool_calls .* drop them",
    ),
    (
        "message: tool result with an image",
        [HumanMessage(QUESTION), CALL, ToolMessage([{"type": "image", "url": "x"}], tool_call_id="c1")],
        {},
        InvalidRequestError,
        "content block of type 'image' is not supported",
    ),
    (
        "tools: one dict",
        QUESTION,
        {"tools": ADD},
        InvalidRequestError,
        "tools must be a list of OpenAI tool schemas, got dict",
    ),
    (
        "tool_choice: not a bound tool",
        QUESTION,
        {"tools": [ADD], "tool_choice": "search"},
        InvalidRequestError,
        "tool_choice names 'search', which is not one of the tools \\['add'\\]",
    ),
    (
        "tool_choice: a call without tools",
        QUESTION,
        {"tool_choice": "any"},
        InvalidRequestError,
        "tool_choice='any' asks for a tool call but no tools are bound",
    ),
    (
        "parallel_tool_calls: str",
        QUESTION,
        {"tools": [ADD], "parallel_tool_calls": "no"},
        InvalidRequestError,
        "parallel_tool_calls must be True, False or None, got 'no'",
    ),
    (
        "keep_tools_whole: not a tool",
        [HumanMessage(QUESTION), CALL, ToolMessage("3", tool_call_id="c1")],
        {"keep_tools_whole": ["search"]},
        InvalidRequestError,
        "keep_tools_whole names \\['search'\\], which are neither bound tools nor called",
    ),
    (
        "keep_tools_whole: one str",
        QUESTION,
        {"keep_tools_whole": "add"},
        InvalidRequestError,
        "keep_tools_whole must be a list of tool names, got str",
    ),
    (
        "output_format: dict",
        QUESTION,
        {"output_format": {"kind": "json_object"}},
        InvalidRequestError,
        "output_format must be a specprefill_rag.config.OutputFormat, got dict",
    ),
    (
        "output_format: with a forced call",
        QUESTION,
        {"tools": [ADD], "tool_choice": "add", "output_format": OutputFormat("json_object")},
        InvalidRequestError,
        "output_format and tool_choice='add' both constrain the answer",
    ),
    (
        "content block: unknown type",
        [HumanMessage([{"type": "image", "url": "x"}])],
        {},
        InvalidRequestError,
        "content block of type 'image' is not supported",
    ),
    (
        "content block: text None",
        [HumanMessage([{"type": "text-plain", "text": None, "mime_type": "text/plain"}])],
        {},
        InvalidRequestError,
        "'text-plain' content block needs its 'text' as a str, got NoneType",
    ),
    (
        "content block: title int",
        [
            HumanMessage(
                [
                    {"type": "text-plain", "text": "x", "title": 3, "mime_type": "text/plain"},
                    {"type": "text", "text": QUESTION},
                ]
            )
        ],
        {},
        InvalidRequestError,
        "document 0's title must be a str",
    ),
    ("question=: int", QUESTION, {"question": 5}, InvalidRequestError, "question must be a str"),
    ("question=: whitespace only", QUESTION, {"question": "  "}, InvalidRequestError, "question is empty"),
    (
        "keep_rate: str",
        QUESTION,
        {"keep_rate": "half"},
        InvalidRequestError,
        "keep_rate must be a number or 'auto', got str",
    ),
    ("keep_rate: NaN", QUESTION, {"keep_rate": float("nan")}, InvalidRequestError, "keep_rate must be finite"),
    ("keep_rate: 2", QUESTION, {"keep_rate": 2}, InvalidRequestError, "keep_rate must be in \\(0, 1\\]"),
    (
        "max_tokens: str",
        QUESTION,
        {"max_tokens": "8"},
        InvalidRequestError,
        "max_tokens: .*valid integer .*max_tokens=128",
    ),
    ("max_tokens: 0", QUESTION, {"max_tokens": 0}, InvalidRequestError, "max_tokens: .*greater than or equal to 1"),
    ("temperature: NaN", QUESTION, {"temperature": float("nan")}, InvalidRequestError, "temperature: .*finite"),
    ("temperature: +inf", QUESTION, {"temperature": float("inf")}, InvalidRequestError, "temperature: .*finite"),
    ("seed: float", QUESTION, {"seed": 1.5}, InvalidRequestError, "seed: .*valid integer"),
    ("stop: int", QUESTION, {"stop": 5}, InvalidRequestError, "stop: stop must be a string or a list of strings"),
    ("stop: list inside", QUESTION, {"stop": [["a"]]}, InvalidRequestError, "stop: stop must be non-empty strings"),
    ("logprobs: str", QUESTION, {"logprobs": "yes"}, InvalidRequestError, "logprobs: .*valid boolean .*logprobs=True"),
    (
        "top_logprobs: 21",
        QUESTION,
        {"logprobs": True, "top_logprobs": 21},
        InvalidRequestError,
        "top_logprobs: .*less than or equal to 20 .*pass an int in \\[0, 20\\]",
    ),
    (
        "top_logprobs: -1",
        QUESTION,
        {"logprobs": True, "top_logprobs": -1},
        InvalidRequestError,
        "top_logprobs: .*greater than or equal to 0",
    ),
    ("top_logprobs: bool", QUESTION, {"logprobs": True, "top_logprobs": True}, InvalidRequestError, "valid integer"),
    ("top_logprobs: str", QUESTION, {"logprobs": True, "top_logprobs": "3"}, InvalidRequestError, "valid integer"),
    (
        "top_logprobs without logprobs",
        QUESTION,
        {"top_logprobs": 3},
        InvalidRequestError,
        "top_logprobs=3 needs logprobs=True; set logprobs=True too",
    ),
    (
        "unknown option",
        QUESTION,
        {"top_k": 5},
        InvalidRequestError,
        "unknown call options \\['top_k'\\]; use the supported ones",
    ),
    (
        "huge: prompt over the context",
        QUESTION,
        {"documents": LONG},
        ContextLengthError,
        "the prompt has \\d{4} tokens but the main model's context is 1024 tokens",
    ),
]

LLM_CASES: list[tuple[str, Any, dict, type, str]] = [
    (
        "draft_document_cache: str",
        QUESTION,
        {"documents": DOCUMENTS, "draft_document_cache": "yes"},
        InvalidRequestError,
        "draft_document_cache must be True or False, got str",
    ),
    ("prompt: lone surrogate", SURROGATE, {}, InvalidRequestError, "prompt is not valid Unicode"),
    ("prompt: whitespace only", " \n ", {}, InvalidRequestError, "last user message is empty"),
    ("documents=: int", QUESTION, {"documents": 3}, InvalidRequestError, "documents= must be a list"),
    ("keep_rate: +inf", QUESTION, {"keep_rate": float("inf")}, InvalidRequestError, "keep_rate must be finite"),
    ("max_tokens: NaN", QUESTION, {"max_tokens": float("nan")}, InvalidRequestError, "max_tokens: "),
    ("unknown option", QUESTION, {"n": 2}, InvalidRequestError, "unknown call options \\['n'\\]"),
    ("logprobs: str", QUESTION, {"logprobs": "yes"}, InvalidRequestError, "logprobs: .*valid boolean"),
    (
        "top_logprobs without logprobs",
        QUESTION,
        {"top_logprobs": 2},
        InvalidRequestError,
        "top_logprobs=2 needs logprobs=True; set logprobs=True too",
    ),
    (
        "huge: prompt over the context",
        QUESTION,
        {"documents": LONG},
        ContextLengthError,
        "main model's context is 1024",
    ),
]

CONSTRUCTOR_CASES: list[tuple[str, dict, str]] = [
    ("keep_rate: NaN", {"keep_rate": float("nan")}, "keep_rate\n.*finite number"),
    ("keep_rate: str", {"keep_rate": "most"}, "keep_rate\n.*a number or 'auto'"),
    ("temperature: +inf", {"temperature": float("inf")}, "temperature\n.*finite number"),
    ("max_tokens: 0", {"max_tokens": 0}, "max_tokens\n.*greater than or equal to 1"),
    ("seed: negative", {"seed": -1}, "seed\n.*greater than or equal to 0"),
    ("timeout: negative", {"timeout": -1}, "timeout\n.*greater than 0"),
    ("timeout: NaN", {"timeout": float("nan")}, "timeout\n.*finite number"),
    ("backend: not a URL", {"backend": "grpc://host:1"}, "neither 'transformers' .* nor the http\\(s\\) URL"),
    ("draft_model: bad self", {"draft_model": "self:x"}, "draft 'self:x': use 'self:<n>'"),
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
    ("unknown setting", {"keeprate": 0.2}, "keeprate\n.*Extra inputs are not permitted"),
]


# (where, case, call over the chat model, message): the warmer is built over the row's ChatSpecPrefill
WARMER_CASES: list[tuple[str, str, Callable[[Any], Any], str]] = [
    ("(...)", "llm: str", lambda m: SpecPrefillDocumentWarmer("smollm2-135m"), "llm must be a ChatSpecPrefill or"),
    ("(...)", "instructions: whitespace only", lambda m: SpecPrefillDocumentWarmer(m, " "), "instructions is empty"),
    (
        ".transform_documents",
        "documents: one str",
        lambda m: SpecPrefillDocumentWarmer(m).transform_documents("one text"),
        "documents= must be a list .* got str",
    ),
    (
        ".transform_documents",
        "document: whitespace only",
        lambda m: SpecPrefillDocumentWarmer(m).transform_documents([Document(page_content="ok"), Document(" ")]),
        "document 1 is empty",
    ),
    (
        ".atransform_documents",
        "unknown option",
        lambda m: asyncio.run(SpecPrefillDocumentWarmer(m).atransform_documents([Document("ok")], k=1)),
        "unknown options \\['k'\\]",
    ),
]


CHAT_CONSTRUCTOR_CASES: list[tuple[str, dict, str]] = [
    ("top_logprobs: 21", {"logprobs": True, "top_logprobs": 21}, "top_logprobs\n.*less than or equal to 20"),
    ("top_logprobs: str", {"logprobs": True, "top_logprobs": "3"}, "top_logprobs\n.*valid integer"),
    ("top_logprobs without logprobs", {"top_logprobs": 3}, "top_logprobs\n.*needs logprobs=True; set logprobs=True"),
    ("logprobs: str", {"logprobs": "yes"}, "logprobs\n.*valid boolean"),
]


async def _acollect(chunks):
    return [chunk async for chunk in chunks]


def _call(style: str, messages: Any, options: dict) -> Callable[[Any], Any]:
    def call(model):
        if style == "invoke":
            return model.invoke(messages, **options)
        if style == "stream":
            return list(model.stream(messages, **options))
        if style == "ainvoke":
            return asyncio.run(model.ainvoke(messages, **options))
        return asyncio.run(_acollect(model.astream(messages, **options)))

    return call


def _construct(cls: type, settings: dict) -> Callable[[Any], Any]:
    return lambda model: cls(**settings)


ROWS = (
    [
        Row(f"ChatSpecPrefill.{style}", case, _call(style, messages, options), error, message)
        for case, messages, options, error, message in CHAT_CASES
        for style in ("invoke", "stream", "ainvoke", "astream")
    ]
    + [
        Row(f"SpecPrefillLLM.{style}", case, _call(style, prompt, options), error, message)
        for case, prompt, options, error, message in LLM_CASES
        for style in ("invoke", "astream")
    ]
    + [
        Row(f"{cls.__name__}(...)", case, _construct(cls, settings), ValidationError, message)
        for case, settings, message in CONSTRUCTOR_CASES
        for cls in (ChatSpecPrefill, SpecPrefillLLM)
    ]
    + [
        Row(f"SpecPrefillDocumentWarmer{where}", case, call, InvalidRequestError, message)
        for where, case, call, message in WARMER_CASES
    ]
    + [
        Row("ChatSpecPrefill(...)", case, _construct(ChatSpecPrefill, settings), ValidationError, message)
        for case, settings, message in CHAT_CONSTRUCTOR_CASES
    ]
)


@pytest.fixture(scope="module")
def models(tiny_engine):
    return {
        "ChatSpecPrefill": ChatSpecPrefill.from_engine(tiny_engine, max_tokens=2),
        "SpecPrefillLLM": SpecPrefillLLM.from_engine(tiny_engine, max_tokens=2),
        "SpecPrefillDocumentWarmer": ChatSpecPrefill.from_engine(tiny_engine, max_tokens=2),  # what it is built over
    }


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_bad_input_gets_a_typed_error_and_the_engine_keeps_serving(row, models):
    model = models[row.surface.split(".")[0].split("(")[0]]
    with pytest.raises(row.error) as raised:
        row.call(model)
    message = str(raised.value)
    assert re.search(row.message, message, re.S), message
    if isinstance(raised.value, SpecPrefillError):
        assert FIX.search(message), f"the message names no fix: {message}"
    assert _good_request(model)["prompt_tokens"] > 0


def _good_request(model):
    """The SpecPrefill stats of a good call through the same adapter object (and engine)."""
    if isinstance(model, ChatSpecPrefill):
        return model.invoke(QUESTION, documents=DOCUMENTS).response_metadata["spec_prefill"]
    generation = model.generate([QUESTION], documents=DOCUMENTS).generations[0][0]
    return generation.generation_info["spec_prefill"]


def test_matrix_size():
    assert len({(row.surface.split(".")[0], row.case) for row in ROWS}) >= 40
