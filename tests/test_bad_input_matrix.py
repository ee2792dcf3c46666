"""The bad-input matrix of the core package (issue 14): every public surface, every kind of bad argument.

A row is (surface, case, call, error type, what the message must say). Each bad call must raise exactly
that typed error: a ``SpecPrefillError`` subclass naming the argument and the fix, pydantic's
``ValidationError`` for configuration, exit status 2 with one error line for the CLI, ``ValueError`` (vLLM's
contract: HTTP 400) for the plugin's admission checks. Never a bare ``TypeError``, ``KeyError``,
``IndexError`` or ``UnicodeEncodeError`` from inside, nothing truncated, and afterwards the same engine
(CLI: the same process, models cached) answers a good request.

The engine rows run through all four entry points (``generate``, ``stream``, ``agenerate``, ``astream``;
the chat rows through ``chat``, ``stream_chat``, ``achat``, ``astream_chat``).
The docs page "Bad input" (docs/reference/bad-input.md) is generated from these rows at build time. The adapters'
rows live in their packages (integrations/langchain/tests/unit_tests/test_bad_input_matrix.py,
integrations/llama_index/tests/test_bad_input_matrix.py), the plugin rows that need vLLM in
tests/vllm/test_bad_input_matrix.py.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from specprefill_rag import (
    ContextLengthError,
    Document,
    DraftLimitError,
    GenerationParams,
    InvalidRequestError,
    PromptLayout,
    SpecPrefillConfig,
    SpecPrefillEngine,
    SpecPrefillError,
)
from specprefill_rag.backends.vllm import VLLMServerBackend
from specprefill_rag.cli import main as cli_main
from specprefill_rag.config import OutputFormat
from specprefill_rag.positions import check_runs, decode_runs
from specprefill_rag.prompt.chat import ChatMessage
from specprefill_rag.serve.errors import GatewayError
from specprefill_rag.testing import random_documents
from specprefill_rag.vllm_plugin.admission import check_kept_count, check_length
from tests.test_vllm_client import MAX_TOKENS_ALLOWED, handler_class, serve

pytestmark = pytest.mark.timeout(120)

QUESTION = "When did the bridge open?"
DOCUMENTS = ["The bridge opened in 1883 after thirteen years of work.", "Paris is the capital of France."]
FORCED_CALL = OutputFormat("tool_call", tools=({"type": "function", "function": {"name": "f"}},), tool_format="hermes")
SURROGATE = "caf\udce9"  # what decoding Latin-1 bytes as UTF-8 with errors='surrogateescape' leaves
FIX = re.compile(
    r"\b(pass|use|lower|send|decode|drop|wrap|build|leave|rebuild|check|raise|retrieve|convert|give|pick|change|install)\b"
)


@dataclass(frozen=True)
class Row:
    surface: str
    case: str
    call: Callable[[Any], Any]
    error: type[BaseException] | str  # "exit 2" for the CLI
    message: str  # a regex the message must match: the argument, and for our errors the fix
    param: str | None = None  # a gateway error's field (checked when given)

    @property
    def id(self) -> str:
        return f"{self.surface}: {self.case}"


# -- the engine: one spec per case, run through generate / stream / agenerate / astream -------------


def _long_documents(s, tokens):
    return s.documents_of(tokens)


ENGINE_CASES: list[tuple[str, Callable[[Any], dict] | dict, type, str]] = [
    ("question: int", {"question": 42}, InvalidRequestError, "question must be a str .* got int 42"),
    ("question: None", {"question": None}, InvalidRequestError, "question must be a str .* got NoneType"),
    ("question: bytes", {"question": b"When?"}, InvalidRequestError, "question must be a str .* got bytes"),
    ("question: empty", {"question": ""}, InvalidRequestError, "question is empty"),
    ("question: whitespace only", {"question": " \n\t"}, InvalidRequestError, "question is empty or only whitespace"),
    ("question: lone surrogate", {"question": SURROGATE}, InvalidRequestError, "question is not valid Unicode"),
    ("documents: None", {"documents": None}, InvalidRequestError, "no documents given"),
    ("documents: empty list", {"documents": []}, InvalidRequestError, "no documents given"),
    (
        "documents: one str",
        {"documents": "just one text"},
        InvalidRequestError,
        "documents must be a list .* got str; wrap",
    ),
    ("documents: int", {"documents": 5}, InvalidRequestError, "documents must be a list .* got int"),
    (
        "documents: one mapping",
        {"documents": {"text": "x"}},
        InvalidRequestError,
        "documents must be a list .* got dict",
    ),
    (
        "documents: generator",
        {"documents": (d for d in DOCUMENTS)},
        InvalidRequestError,
        "got generator; .*list\\(\\.\\.\\.\\)",
    ),
    ("document: None", {"documents": [None]}, InvalidRequestError, "document 0 has type NoneType"),
    ("document: whitespace only", {"documents": ["ok", " \n"]}, InvalidRequestError, "document 1 is empty"),
    ("document: bytes not UTF-8", {"documents": [b"caf\xe9"]}, InvalidRequestError, "document 0 is not valid UTF-8"),
    (
        "document: lone surrogate",
        {"documents": [SURROGATE]},
        InvalidRequestError,
        "document 0's text is not valid Unicode",
    ),
    (
        "document: mapping text None",
        {"documents": [{"text": None}]},
        InvalidRequestError,
        "document 0's text must be a str",
    ),
    ("document: mapping without text", {"documents": [{"title": "t"}]}, InvalidRequestError, "without a 'text' key"),
    (
        "document: mapping unknown key",
        {"documents": [{"text": "x", "score": 1}]},
        InvalidRequestError,
        "unknown keys \\['score'\\]",
    ),
    (
        "document: Document text bytes",
        {"documents": [Document(b"x")]},
        InvalidRequestError,
        "document 0's text must be a str",
    ),
    (
        "document: title int",
        {"documents": [Document("x", title=5)]},
        InvalidRequestError,
        "document 0's title must be a str",
    ),
    (
        "document: title whitespace",
        {"documents": [Document("x", title=" ")]},
        InvalidRequestError,
        "document 0's title is empty",
    ),
    (
        "document: title lone surrogate",
        {"documents": [Document("x", title=SURROGATE)]},
        InvalidRequestError,
        "document 0's title is not valid Unicode",
    ),
    ("document: id int", {"documents": [{"text": "x", "id": 7}]}, InvalidRequestError, "document 0's id must be a str"),
    ("instructions: int", {"instructions": 3}, InvalidRequestError, "instructions must be a str"),
    ("instructions: whitespace only", {"instructions": "  "}, InvalidRequestError, "instructions is empty .* or None"),
    (
        "instructions: lone surrogate",
        {"instructions": SURROGATE},
        InvalidRequestError,
        "instructions is not valid Unicode",
    ),
    ("keep_rate: NaN", {"keep_rate": float("nan")}, InvalidRequestError, "keep_rate must be finite, got nan"),
    ("keep_rate: +inf", {"keep_rate": float("inf")}, InvalidRequestError, "keep_rate must be finite, got inf"),
    ("keep_rate: -inf", {"keep_rate": float("-inf")}, InvalidRequestError, "keep_rate must be finite, got -inf"),
    (
        "keep_rate: str",
        {"keep_rate": "0.5"},
        InvalidRequestError,
        "keep_rate must be a number or 'auto', got str '0.5'",
    ),
    (
        "keep_rate: str other than 'auto'",
        {"keep_rate": "AUTO"},
        InvalidRequestError,
        "keep_rate must be a number or 'auto', got str 'AUTO'; pass .* 'auto'",
    ),
    ("keep_rate: bool", {"keep_rate": True}, InvalidRequestError, "keep_rate must be a number, got bool"),
    (
        "draft_document_cache: str",
        {"draft_document_cache": "yes"},
        InvalidRequestError,
        "draft_document_cache must be True or False, got str 'yes'; pass a bool",
    ),
    ("keep_rate: 0", {"keep_rate": 0}, InvalidRequestError, "keep_rate must be in \\(0, 1\\], got 0"),
    ("keep_rate: 1.5", {"keep_rate": 1.5}, InvalidRequestError, "keep_rate must be in \\(0, 1\\], got 1.5"),
    (
        "max_new_tokens: str",
        {"max_new_tokens": "5"},
        InvalidRequestError,
        "max_new_tokens: .*valid integer \\(got '5'\\)",
    ),
    ("max_new_tokens: NaN", {"max_new_tokens": float("nan")}, InvalidRequestError, "max_new_tokens: .*\\(got nan\\)"),
    ("max_new_tokens: 0", {"max_new_tokens": 0}, InvalidRequestError, "max_new_tokens: .*greater than or equal to 1"),
    ("max_new_tokens: float", {"max_new_tokens": 2.5}, InvalidRequestError, "max_new_tokens: .*\\(got 2.5\\)"),
    ("temperature: NaN", {"temperature": float("nan")}, InvalidRequestError, "temperature: .*finite number"),
    ("temperature: +inf", {"temperature": float("inf")}, InvalidRequestError, "temperature: .*finite number"),
    ("temperature: negative", {"temperature": -1.0}, InvalidRequestError, "temperature: .*greater than or equal to 0"),
    ("temperature: str", {"temperature": "hot"}, InvalidRequestError, "temperature: .*valid number \\(got 'hot'\\)"),
    ("top_p: 0", {"top_p": 0.0}, InvalidRequestError, "top_p: .*greater than 0"),
    ("top_p: NaN", {"top_p": float("nan")}, InvalidRequestError, "top_p: .*finite number"),
    ("seed: str", {"seed": "1"}, InvalidRequestError, "seed: .*valid integer"),
    ("seed: negative", {"seed": -1}, InvalidRequestError, "seed: .*greater than or equal to 0"),
    ("seed: beyond int64", {"seed": 2**70}, InvalidRequestError, "seed: .*less than 9223372036854775808"),
    ("stop: int", {"stop": 5}, InvalidRequestError, "stop: stop must be a string or a list of strings, got int"),
    ("stop: empty string", {"stop": [""]}, InvalidRequestError, "stop: stop must be non-empty strings"),
    ("stop: lone surrogate", {"stop": [SURROGATE]}, InvalidRequestError, "stop: stop string .* not valid Unicode"),
    ("logprobs: str", {"logprobs": "yes"}, InvalidRequestError, "logprobs: .*valid boolean .*pass True or False"),
    (
        "top_logprobs: 21",
        {"logprobs": True, "top_logprobs": 21},
        InvalidRequestError,
        "top_logprobs: .*less than or equal to 20 .*pass an int in \\[0, 20\\]",
    ),
    (
        "top_logprobs: -1",
        {"logprobs": True, "top_logprobs": -1},
        InvalidRequestError,
        "top_logprobs: .*greater than or equal to 0",
    ),
    ("top_logprobs: bool", {"logprobs": True, "top_logprobs": True}, InvalidRequestError, "top_logprobs: .*integer"),
    ("top_logprobs: str", {"logprobs": True, "top_logprobs": "3"}, InvalidRequestError, "top_logprobs: .*integer"),
    (
        "top_logprobs without logprobs",
        {"top_logprobs": 3},
        InvalidRequestError,
        "top_logprobs=3 needs logprobs=True; set logprobs=True too",
    ),
    (
        "unknown option",
        {"max_tokens": 5},
        InvalidRequestError,
        "unknown option 'max_tokens'; use one of the generation options",
    ),
    (
        "huge: prompt over the context",
        lambda s: {"documents": _long_documents(s, 1100)},
        ContextLengthError,
        "the prompt has \\d{4} tokens but the main model's context is 1024 tokens",
    ),
    (
        "huge: max_new_tokens over the context",
        {"max_new_tokens": 10**9},
        ContextLengthError,
        "max_new_tokens=1000000000 = \\d+ exceeds the main model's context of 1024",
    ),
    (
        "huge: prompt over max_draft_tokens",
        lambda s: {"documents": _long_documents(s, 700), "max_new_tokens": 2},
        DraftLimitError,
        "the prompt has \\d{3} tokens but the draft may score at most 600",
    ),
]


def _engine_call(style: str, arguments: Callable[[Any], dict] | dict) -> Callable[[Any], Any]:
    def call(s):
        given = arguments(s) if callable(arguments) else arguments
        kwargs = {"question": QUESTION, "documents": DOCUMENTS, "max_new_tokens": 2, **given}
        return s.run(style, kwargs)

    return call


LAYOUT_CASES: list[tuple[str, Callable[[Any], dict], type, str]] = [
    ("layout: None", lambda s: {"layout": None}, InvalidRequestError, "layout must be a PromptLayout, got NoneType"),
    ("layout: str", lambda s: {"layout": "When?"}, InvalidRequestError, "layout must be a PromptLayout, got str"),
    ("layout: empty", lambda s: {"layout": s.empty_layout()}, InvalidRequestError, "layout is empty"),
    (
        "layout: ids outside the vocabulary",
        lambda s: {"layout": s.foreign_layout()},
        InvalidRequestError,
        "token ids outside this tokenizer's vocabulary",
    ),
    (
        "params: dict",
        lambda s: {"params": {"max_new_tokens": 2}},
        InvalidRequestError,
        "params must be a GenerationParams or None, got dict",
    ),
    ("keep_rate: NaN", lambda s: {"keep_rate": float("nan")}, InvalidRequestError, "keep_rate must be finite"),
    (
        "draft_document_cache: int",
        lambda s: {"draft_document_cache": 1},
        InvalidRequestError,
        "draft_document_cache must be True or False, got int",
    ),
]


def _layout_call(style: str, arguments: Callable[[Any], dict]) -> Callable[[Any], Any]:
    def call(s):
        kwargs = {
            "layout": s.engine.layout(QUESTION, DOCUMENTS),
            "params": GenerationParams(max_new_tokens=2),
            **arguments(s),
        }
        return s.run(f"{style}_layout", kwargs)

    return call


CHAT_CASES: list[tuple[str, dict, type, str]] = [
    (
        "messages: OpenAI-style dicts",
        {"messages": [{"role": "user", "content": QUESTION}]},
        InvalidRequestError,
        "messages\\[0\\] is a dict, not a ChatMessage; build it as ChatMessage",
    ),
    (
        "messages: one str",
        {"messages": QUESTION},
        InvalidRequestError,
        "messages is a str; pass a list of ChatMessage",
    ),
    (
        "insert_missing: str",
        {"insert_missing": "no"},
        InvalidRequestError,
        "insert_missing must be True or False, got str 'no'; pass a bool",
    ),
]


def _chat_call(style: str, arguments: dict) -> Callable[[Any], Any]:
    def call(s):
        kwargs = {"messages": [ChatMessage("user", [QUESTION])], "documents": DOCUMENTS, "max_new_tokens": 2}
        return s.run(style, {**kwargs, **arguments})

    return call


STYLES = ("generate", "stream", "agenerate", "astream")
CHAT_STYLES = ("chat", "stream_chat", "achat", "astream_chat")
ROWS: list[Row] = [
    Row(f"engine.{style}", case, _engine_call(style, arguments), error, message)
    for case, arguments, error, message in ENGINE_CASES
    for style in STYLES
] + [
    Row(f"engine.{style}_layout", case, _layout_call(style, arguments), error, message)
    for case, arguments, error, message in LAYOUT_CASES
    for style in STYLES
]
ROWS += [
    Row(f"engine.{style}", case, _chat_call(style, arguments), error, message)
    for case, arguments, error, message in CHAT_CASES
    for style in CHAT_STYLES
]

ROWS += [
    Row(
        "engine.generate_text",
        "prompt: int",
        lambda s: s.engine.generate_text(5),
        InvalidRequestError,
        "prompt must be a str",
    ),
    Row(
        "engine.generate_text",
        "prompt: whitespace only",
        lambda s: s.engine.generate_text("\n "),
        InvalidRequestError,
        "prompt is empty",
    ),
    Row(
        "engine.generate_text",
        "prompt: lone surrogate",
        lambda s: s.engine.generate_text(SURROGATE),
        InvalidRequestError,
        "prompt is not valid Unicode",
    ),
    Row(
        "engine.generate_text",
        "parse_special_tokens: str",
        lambda s: s.engine.generate_text("Q?", parse_special_tokens="no"),
        InvalidRequestError,
        "parse_special_tokens must be True or False, got str",
    ),
    Row(
        "engine.generate_text",
        "keep_rate: str",
        lambda s: s.engine.generate_text("Q?", keep_rate="all"),
        InvalidRequestError,
        "keep_rate must be a number or 'auto'",
    ),
    Row(
        "engine.generate_text",
        "unknown option",
        lambda s: s.engine.generate_text("Q?", n=2),
        InvalidRequestError,
        "unknown option 'n'",
    ),
    Row(
        "engine.generate",
        "draft_document_cache: True without a cache",
        lambda s: s.configure(document_cache_mb=0).generate(QUESTION, DOCUMENTS, draft_document_cache=True),
        InvalidRequestError,
        "draft_document_cache=True, but .*document_cache_mb=0.*leave draft_document_cache off",
    ),
    Row(
        "engine.warm_documents",
        "documents: one str",
        lambda s: s.engine.warm_documents("one text"),
        InvalidRequestError,
        "documents must be a list .* got str; wrap",
    ),
    Row(
        "engine.warm_documents",
        "document: whitespace only",
        lambda s: s.engine.warm_documents(["ok", " "]),
        InvalidRequestError,
        "document 1 is empty",
    ),
    Row(
        "engine.warm_documents",
        "instructions: int",
        lambda s: s.engine.warm_documents(["ok"], 5),
        InvalidRequestError,
        "instructions must be a str",
    ),
    Row(
        "engine.layout",
        "use_chat_template: str",
        lambda s: s.engine.layout(QUESTION, DOCUMENTS, None, "no"),
        InvalidRequestError,
        "use_chat_template must be True or False",
    ),
    Row(
        "engine.text_layout",
        "parse_special_tokens: int",
        lambda s: s.engine.text_layout("Q?", 1),
        InvalidRequestError,
        "parse_special_tokens must be True or False, got int",
    ),
    # configuration: pydantic's ValidationError naming the field
    Row(
        "SpecPrefillEngine(...)",
        "keep_rate: NaN",
        lambda s: s.configure(keep_rate=float("nan")),
        ValidationError,
        "keep_rate\n.*finite number",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "keep_rate: str",
        lambda s: s.configure(keep_rate="most"),
        ValidationError,
        "keep_rate\n.*a number or 'auto'",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "auto_keep_floor above ceiling",
        lambda s: s.configure(auto_keep_floor=0.6, auto_keep_ceiling=0.5),
        ValidationError,
        "auto_keep_floor \\(0.6\\) is above auto_keep_ceiling",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "max_draft_tokens: 0",
        lambda s: s.configure(max_draft_tokens=0),
        ValidationError,
        "max_draft_tokens\n.*greater than or equal to 1",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "look_ahead: +inf",
        lambda s: s.configure(look_ahead=float("inf")),
        ValidationError,
        "look_ahead\n",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "device: not a device",
        lambda s: s.configure(device="gpu0"),
        ValidationError,
        "device 'gpu0' is not a torch device; use e.g. 'cpu'",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "positions: unknown",
        lambda s: s.configure(positions="middle"),
        ValidationError,
        "positions\n.*'original' or 'contiguous'",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "chunk_size: str",
        lambda s: s.configure(chunk_size="32"),
        ValidationError,
        "chunk_size\n.*valid integer.*input_value='32'",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "chunking: unknown",
        lambda s: s.configure(chunking="words"),
        ValidationError,
        "chunking\n.*'tokens' or 'sentences'",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "max_draft_tokens: bool",
        lambda s: s.configure(max_draft_tokens=True),
        ValidationError,
        "max_draft_tokens\n.*valid integer.*input_value=True",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "auto_keep_share: str",
        lambda s: s.configure(auto_keep_share="0.5"),
        ValidationError,
        "auto_keep_share\n.*valid number.*input_value='0.5'",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "document_repair: unknown",
        lambda s: s.configure(document_repair="cacheblend"),
        ValidationError,
        "document_repair\n.*'naive', 'epic', 'blend' or 'query'",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "document_repair_share: above 1",
        lambda s: s.configure(document_repair_share=1.5),
        ValidationError,
        "document_repair_share\n.*less than or equal to 1",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "document_repair_share without blend",
        lambda s: s.configure(document_repair="naive", document_repair_share=0.05),
        ValidationError,
        "document_repair_share applies to document_repair='blend' or 'query' only, not 'naive'",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "draft_layers with a 'self' draft",
        lambda s: s.configure(draft="self:2", draft_layers=2),
        ValidationError,
        "draft_layers applies to a separate draft model, not to 'self:2'; name the main model's layers as 'self:<n>'",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "draft_layers with a look-ahead",
        lambda s: s.configure(draft="smollm2-135m", draft_layers=2, look_ahead=4),
        ValidationError,
        "no output to decode look-ahead tokens from",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "draft_layers: zero",
        lambda s: s.configure(draft="smollm2-135m", draft_layers=0),
        ValidationError,
        "draft_layers\n.*greater than or equal to 1",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "draft_document_cache without a cache",
        lambda s: s.configure(draft_document_cache=True, document_cache_mb=0),
        ValidationError,
        "draft_document_cache is on but document_cache_mb is 0",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "unknown setting",
        lambda s: s.configure(keeprate=0.2),
        ValidationError,
        "keeprate\n.*Extra inputs are not permitted",
    ),
    Row(
        "SpecPrefillEngine(...)",
        "config and settings both",
        lambda s: s.configure(config=SpecPrefillConfig(), keep_rate=0.2),
        InvalidRequestError,
        "pass either a SpecPrefillConfig or its fields",
    ),
]


def _gateway_chat(spec_prefill):
    """A chat request body parsed as the gateway parses it (a 400 GatewayError naming the field)."""
    from specprefill_rag.serve.app import _parse
    from specprefill_rag.serve.schema import ChatCompletionRequest

    body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "spec_prefill": spec_prefill}
    return _parse(ChatCompletionRequest, body)


def _gateway_warm(body, document_cache_mb=None):
    """A warm-up request as the gateway serves it (a 400 GatewayError naming the field or the flag)."""
    from specprefill_rag.serve.app import _parse
    from specprefill_rag.serve.gateway import Gateway
    from specprefill_rag.serve.schema import WarmDocumentsRequest

    def call(s):
        settings = {} if document_cache_mb is None else {"document_cache_mb": document_cache_mb}
        gateway = Gateway(_gateway_settings(**settings), s.configure(**settings) if settings else s.engine)
        return asyncio.run(gateway.warm(_parse(WarmDocumentsRequest, body)))

    return call


def _gateway_body(path, **fields):
    """A request body for ``path`` with ``fields``, parsed as the gateway parses it (a 400 naming the field)."""
    from specprefill_rag.serve.app import _parse
    from specprefill_rag.serve.schema import ChatCompletionRequest, CompletionRequest

    if path == "/v1/completions":
        return _parse(CompletionRequest, {"model": "tiny", "prompt": QUESTION, **fields})
    return _parse(
        ChatCompletionRequest, {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], **fields}
    )


def _gateway_answer(call):
    """An engine error as the gateway answers it (a 400 GatewayError in the wire's words)."""
    from specprefill_rag.serve.errors import as_gateway_error

    def answer(s):
        try:
            call(s)
        except SpecPrefillError as error:
            raise as_gateway_error(error, False) from None

    return answer


def _gateway_settings(**settings):
    from specprefill_rag.serve import GatewaySettings

    return GatewaySettings(**settings)


ROWS += [
    Row(
        "gateway request",
        "spec_prefill.system_context: unknown",
        lambda s: _gateway_chat({"system_context": "on"}),
        GatewayError,
        "invalid 'spec_prefill.system_context': .*'off', 'after_instructions' or 'delimited'",
    ),
    Row(
        "gateway request",
        "spec_prefill.system_context: int",
        lambda s: _gateway_chat({"system_context": 1}),
        GatewayError,
        "invalid 'spec_prefill.system_context': .*'off', 'after_instructions' or 'delimited'",
    ),
    Row(
        "gateway request",
        "spec_prefill.draft_document_cache: str",
        lambda s: _gateway_chat({"draft_document_cache": "yes"}),
        GatewayError,
        "invalid 'spec_prefill.draft_document_cache': Input should be a valid boolean",
    ),
    Row(
        "gateway warm-up",
        "documents: str",
        _gateway_warm({"documents": "one text"}),
        GatewayError,
        "invalid 'documents': Input should be a valid list",
    ),
    Row(
        "gateway warm-up",
        "documents: too many",
        _gateway_warm({"documents": ["a"] * 65}),
        GatewayError,
        "65 documents in one call; send at most 64 per call",
    ),
    Row(
        "gateway warm-up",
        "document: whitespace only",
        _gateway_warm({"documents": ["ok", "  "]}),
        GatewayError,
        "document 1 is empty",
    ),
    Row(
        "gateway warm-up",
        "the gateway runs without the cache",
        _gateway_warm({"documents": ["ok"]}, document_cache_mb=0),
        GatewayError,
        "without the per-document draft cache \\(--document-cache-mb 0\\)",
        "documents",
    ),
    Row(
        "gateway /v1/chat/completions",
        "tools: huge list (129 tools)",
        lambda s: _gateway_body("chat", tools=[{"type": "function", "function": {"name": "t"}}] * 129),
        GatewayError,
        "offers 129 tools; at most 128 per request .* offer only the tools this step may call",
        "tools",
    ),
    Row(
        "gateway /v1/chat/completions",
        "tool_calls arguments: huge nesting (100,000 deep)",
        lambda s: _gateway_body(
            "chat",
            messages=[
                {"role": "user", "content": QUESTION},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"a": ' * 100_000 + "1" + "}" * 100_000},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "r"},
            ],
        ),
        GatewayError,
        "nested at most 64 deep",
        "messages.1.tool_calls.0.function.arguments",
    ),
    Row(
        "gateway request",
        "huge: prompt over --max-draft-tokens",
        _gateway_answer(lambda s: s.engine.generate(QUESTION, _long_documents(s, 700), max_new_tokens=2)),
        GatewayError,
        'at most 600 per request \\(--max-draft-tokens.*send "spec_prefill": \\{"keep_rate": 1.0\\}',
        "messages",
    ),
    Row(
        "GatewaySettings(...)",
        "draft_document_cache without a cache",
        lambda s: _gateway_settings(draft_document_cache=True, document_cache_mb=0),
        ValidationError,
        "draft_document_cache is on but document_cache_mb is 0",
    ),
    Row(
        "gateway /v1/chat/completions",
        "top_logprobs: 21",
        lambda s: _gateway_body("chat", logprobs=True, top_logprobs=21),
        GatewayError,
        "invalid 'top_logprobs': .*less than or equal to 20",
    ),
    Row(
        "gateway /v1/chat/completions",
        "top_logprobs: -1",
        lambda s: _gateway_body("chat", logprobs=True, top_logprobs=-1),
        GatewayError,
        "invalid 'top_logprobs': .*greater than or equal to 0",
    ),
    Row(
        "gateway /v1/chat/completions",
        "top_logprobs: true",
        lambda s: _gateway_body("chat", logprobs=True, top_logprobs=True),
        GatewayError,
        "invalid 'top_logprobs': .*valid integer",
    ),
    Row(
        "gateway /v1/chat/completions",
        'top_logprobs: "3"',
        lambda s: _gateway_body("chat", logprobs=True, top_logprobs="3"),
        GatewayError,
        "invalid 'top_logprobs': .*valid integer",
    ),
    Row(
        "gateway /v1/chat/completions",
        "top_logprobs without logprobs",
        lambda s: _gateway_body("chat", top_logprobs=3),
        GatewayError,
        "invalid 'top_logprobs': top_logprobs=3 needs logprobs: true; send both",
    ),
    Row(
        "gateway /v1/completions",
        "logprobs: 6",
        lambda s: _gateway_body("/v1/completions", logprobs=6),
        GatewayError,
        "invalid 'logprobs': .*less than or equal to 5",
    ),
    Row(
        "gateway /v1/completions",
        "logprobs: true",
        lambda s: _gateway_body("/v1/completions", logprobs=True),
        GatewayError,
        "invalid 'logprobs': .*valid integer",
    ),
    Row(
        "GatewaySettings(...)",
        "system_context: unknown",
        lambda s: _gateway_settings(system_context="on"),
        ValidationError,
        "system_context\n.*'off', 'after_instructions' or 'delimited'",
    ),
]

# -- the CLI: exit status 2 and one error line naming the argument --------------------------------

CLI_CASES = [
    (
        "--keep-rate: not a number",
        ["--keep-rate", "abc"],
        "argument --keep-rate: 'abc' is neither a number nor 'auto'",
    ),
    ("--keep-rate: NaN", ["--keep-rate", "nan"], "keep_rate\n.*finite number"),
    ("--keep-rate: inf", ["--keep-rate", "inf"], "keep_rate\n.*finite number"),
    ("--max-new-tokens: 0", ["--max-new-tokens", "0"], "max_new_tokens: .*greater than or equal to 1"),
    ("--max-new-tokens: not an int", ["--max-new-tokens", "2.5"], "argument --max-new-tokens: invalid int value"),
    ("--temperature: NaN", ["--temperature", "nan"], "temperature: .*finite number"),
    ("--min-prompt-tokens: negative", ["--min-prompt-tokens", "-5"], "min_prompt_tokens\n.*greater than or equal to 0"),
    ("--question: empty", ["--question", ""], "question is empty"),
    ("--question: undecodable bytes", ["--question", "caf\udce9?"], "question is not valid Unicode"),
    ("--instructions: whitespace only", ["--instructions", "   "], "instructions is empty"),
    ("--docs: not UTF-8", lambda s: ["--docs", s.file("latin1.txt", b"caf\xe9")], "latin1.txt is not UTF-8"),
    ("--docs: a directory", lambda s: ["--docs", str(s.folder)], "is not a file"),
    ("--docs: empty file", lambda s: ["--docs", s.file("empty.txt", b" \n")], "empty.txt is empty"),
    ("--docs: missing file", lambda s: ["--docs", str(s.folder / "missing.txt")], "missing.txt does not exist"),
    (
        "--docs: prompt over the context",
        lambda s: ["--docs", s.file("long.txt", " ".join(random_documents(1, 1400)).encode())],
        "the prompt has \\d{4} tokens but the main model's context is 1024 tokens",
    ),
    ("--device: not a device", ["--device", "gpu0"], "device 'gpu0' is not a torch device"),
    ("--device: not on this machine", ["--device", "cuda:99"], "device 'cuda:99' is not available on this machine"),
    ("--main: no such model", ["--main", "./no/such/model"], "model path './no/such/model' does not exist"),
    ("unknown option", ["--top-k", "5"], "unrecognized arguments: --top-k 5"),
]


def _cli_call(arguments):
    def call(s):
        return s.cli(arguments(s) if callable(arguments) else arguments)

    return call


ROWS += [Row("CLI ask", case, _cli_call(arguments), "exit 2", message) for case, arguments, message in CLI_CASES]

# -- the vLLM client (stand-in server) and the plugin's checks that need no vLLM -------------------

ROWS += [
    Row(
        "for_vllm",
        "server: int",
        lambda s: s.connect(5),
        InvalidRequestError,
        "server must be the http\\(s\\) URL .* got int",
    ),
    Row(
        "for_vllm",
        "server: no scheme",
        lambda s: s.connect("127.0.0.1:8000"),
        InvalidRequestError,
        "server '127.0.0.1:8000' is not an http\\(s\\) URL; pass e.g.",
    ),
    Row(
        "for_vllm",
        "server: port not a number",
        lambda s: s.connect("http://127.0.0.1:port"),
        InvalidRequestError,
        "is not an http\\(s\\) URL",
    ),
    Row("for_vllm", "server: whitespace only", lambda s: s.connect(" "), InvalidRequestError, "server is empty"),
    Row(
        "for_vllm",
        "timeout: NaN",
        lambda s: s.connect(s.url, timeout=float("nan")),
        InvalidRequestError,
        "timeout must be finite",
    ),
    Row(
        "for_vllm",
        "timeout: negative",
        lambda s: s.connect(s.url, timeout=-1),
        InvalidRequestError,
        "timeout must be > 0",
    ),
    Row(
        "for_vllm",
        "timeout: str",
        lambda s: s.connect(s.url, timeout="60"),
        InvalidRequestError,
        "timeout must be a number, got str",
    ),
    Row(
        "for_vllm",
        "on_missing_plugin: unknown",
        lambda s: s.connect(s.url, on_missing_plugin="ignore"),
        InvalidRequestError,
        "on_missing_plugin must be 'error' or 'full_prompt'",
    ),
    Row(
        "for_vllm", "keep_rate: NaN", lambda s: s.connect(s.url, keep_rate=float("nan")), ValidationError, "keep_rate\n"
    ),
    Row(
        "for_vllm",
        "draft: self",
        lambda s: s.connect(s.url, draft="self:4", look_ahead=1),
        InvalidRequestError,
        "needs the main model in-process",
    ),
    Row(
        "vLLM engine.generate",
        "question: lone surrogate",
        lambda s: s.remote.generate(SURROGATE, DOCUMENTS),
        InvalidRequestError,
        "question is not valid Unicode",
    ),
    Row(
        "vLLM engine.generate",
        "max_new_tokens over the server's context",
        lambda s: s.remote.generate(QUESTION, DOCUMENTS, max_new_tokens=1024),
        ContextLengthError,
        "exceeds the main model's context of 1024",
    ),
    Row(
        "vLLM engine.generate",
        "refused by the server (400)",
        lambda s: s.remote.generate(QUESTION, DOCUMENTS, max_new_tokens=MAX_TOKENS_ALLOWED + 1),
        InvalidRequestError,
        "refused the request \\(400\\)",
    ),
    Row(
        "vLLM server backend",
        "forced tool call before adopt_tokenizer",
        lambda s: VLLMServerBackend(s.url, frozenset()).check_output_format(FORCED_CALL),
        InvalidRequestError,
        "needs the served model's tokenizer, to write its tool-call markers as their tokens; build the engine with",
    ),
    Row(
        "vLLM engine.astream",
        "unknown option",
        lambda s: s.remote.astream(QUESTION, DOCUMENTS, best_of=2),
        InvalidRequestError,
        "unknown option 'best_of'",
    ),
    Row(
        "plugin positions",
        "runs: None",
        lambda s: check_runs(None),
        InvalidRequestError,
        "specprefill_runs must be a flat list of integer \\(start, length\\) pairs; send e.g.",
    ),
    Row("plugin positions", "runs: odd length", lambda s: decode_runs([0, 4, 9]), InvalidRequestError, "pairs"),
    Row("plugin positions", "runs: float", lambda s: decode_runs([0, 2.5]), InvalidRequestError, "integer"),
    Row("plugin positions", "runs: bool", lambda s: decode_runs([True, 1]), InvalidRequestError, "integer"),
    Row(
        "plugin positions",
        "runs: overlapping",
        lambda s: decode_runs([0, 4, 2, 2]),
        InvalidRequestError,
        "strictly increasing",
    ),
    Row("plugin positions", "runs: huge", lambda s: decode_runs([0, 2**62]), InvalidRequestError, "below 2\\*\\*62"),
    Row(
        "plugin admission",
        "2**40 positions for 3 tokens",
        lambda s: check_kept_count({"specprefill_prompt_length": 2**40, "specprefill_runs": [0, 2**40]}, 3),
        ValueError,
        "specprefill_runs cover 1099511627776 positions but the prompt has 3 tokens; send exactly",
    ),
    Row(
        "plugin admission",
        "L + max_tokens over max_model_len",
        lambda s: check_length({"specprefill_prompt_length": 1000, "specprefill_runs": [0, 1000]}, 100, 1024),
        ValueError,
        "L=1000 \\+ max_tokens=100 = 1100 exceeds max_model_len=1024 .* lower max_tokens to at most 24",
    ),
]


class Surfaces:
    """What the rows call: the engine, the CLI, the vLLM client; and a good request for each surface."""

    def __init__(self, engine, model_folder, folder, capsys):
        self.engine, self.model_folder, self.folder, self.capsys = engine, model_folder, folder, capsys
        self._documents: dict[int, list[str]] = {}
        self._remote = None

    # -- the engine
    def run(self, style, kwargs):
        method = getattr(self.engine, style)
        if style.startswith("agenerate") or style == "achat":
            return asyncio.run(method(**kwargs))
        if style.startswith("astream"):
            return asyncio.run(_collect(method(**kwargs)))
        return list(method(**kwargs)) if style.startswith("stream") else method(**kwargs)

    def documents_of(self, tokens):
        if tokens not in self._documents:
            documents = random_documents(1, 40, seed=tokens)
            while len(self.engine.layout(QUESTION, documents)) < tokens:
                documents += random_documents(1, 40, seed=tokens + len(documents))
            self._documents[tokens] = documents
        return self._documents[tokens]

    def empty_layout(self):
        nothing = torch.zeros(0, dtype=torch.long)
        return PromptLayout(nothing, nothing, nothing, "")

    def foreign_layout(self):
        layout = self.engine.layout(QUESTION, DOCUMENTS)
        return PromptLayout(layout.input_ids + 10**6, layout.roles, layout.document_index, layout.text)

    def configure(self, **settings):
        return SpecPrefillEngine.from_models(self.engine.main.model, self.engine.tokenizer, **settings)

    # -- the CLI
    def file(self, name, data):
        path = self.folder / name
        path.write_bytes(data)
        return str(path)

    def cli(self, arguments):
        self.capsys.readouterr()
        code = cli_main(self._cli_argv(arguments))
        return code, self.capsys.readouterr().err

    def _cli_argv(self, arguments):
        good = {
            "--question": QUESTION,
            "--docs": self.file("good.txt", DOCUMENTS[0].encode()),
            "--main": str(self.model_folder),
            "--draft": str(self.model_folder),
            "--min-prompt-tokens": "0",
            "--max-new-tokens": "2",
        }
        argv = ["ask"]
        overridden = dict(zip(arguments[::2], arguments[1::2]))
        for flag, value in {**good, **overridden}.items():
            argv += [flag, value]
        return argv

    # -- the vLLM client
    @property
    def url(self):
        if not hasattr(self, "_server"):
            self._server, self._url = serve(handler_class(plugin=True))
        return self._url

    def connect(self, server, **settings):
        settings = {"draft": str(self.model_folder), "min_prompt_tokens": 0, "look_ahead": 2, **settings}
        return SpecPrefillEngine.for_vllm(server, **settings)

    @property
    def remote(self):
        if self._remote is None:
            self._remote = self.connect(self.url, timeout=10.0)
        return self._remote

    def close(self):
        if hasattr(self, "_server"):
            self._server.shutdown()

    # -- the good request after each bad one
    def serve_good_request(self, row):
        if row.surface == "CLI ask":
            code, err = self.cli([])
            assert code == 0, err
        elif row.surface.startswith("plugin"):
            assert decode_runs([0, 2, 5, 1]).tolist() == [0, 1, 5]
            check_kept_count({"specprefill_prompt_length": 6, "specprefill_runs": [0, 2, 5, 1]}, 3)
        elif "vllm" in row.surface.lower():
            assert self.remote.generate(QUESTION, DOCUMENTS).token_ids == [5, 6, 7]
        else:
            result = self.engine.generate(QUESTION, DOCUMENTS, max_new_tokens=2)
            assert result.stats.prompt_tokens > 0 and result.finish_reason in ("stop", "length")


async def _collect(chunks):
    return [chunk async for chunk in chunks]


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer, tiny_draft):
    return SpecPrefillEngine.from_models(
        tiny_model, tokenizer, tiny_draft, min_prompt_tokens=0, look_ahead=2, max_draft_tokens=600
    )


@pytest.fixture(scope="module")
def module_surfaces(engine, tiny_model_dir, tmp_path_factory):
    surfaces = Surfaces(engine, tiny_model_dir, tmp_path_factory.mktemp("cli"), None)
    yield surfaces
    surfaces.close()


@pytest.fixture
def surfaces(module_surfaces, capsys):
    module_surfaces.capsys = capsys
    return module_surfaces


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_bad_input_gets_a_typed_error_and_the_engine_keeps_serving(row, surfaces):
    if row.error == "exit 2":
        code, err = row.call(surfaces)
        assert code == 2 and "Traceback" not in err
        assert re.search(row.message, err, re.S), err
    else:
        with pytest.raises(row.error) as raised:
            row.call(surfaces)
        message = str(raised.value)
        assert re.search(row.message, message, re.S), message
        if row.param is not None:
            assert raised.value.param == row.param, raised.value
        if isinstance(raised.value, SpecPrefillError) or row.surface.startswith("plugin"):
            assert FIX.search(message), f"the message names no fix: {message}"
    surfaces.serve_good_request(row)


def test_the_matrix_covers_every_kind_of_bad_input():
    cases = " ".join(row.case for row in ROWS).lower()
    for kind in (
        "int",
        "none",
        "bytes",
        "surrogate",
        "utf-8",
        "empty",
        "whitespace",
        "nan",
        "inf",
        "str",
        "huge",
        "unknown",
    ):
        assert kind in cases, kind
    assert len(ROWS) >= 60
