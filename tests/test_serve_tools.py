"""Tool calling through the gateway (issue #30): OpenAI's tool fields are accepted and checked (400s naming
the field), a tool result in the history is a document the draft compresses (unless the request keeps it
whole), the model's calls come back in OpenAI's shapes, whole and streamed, and the torch-free client reads
them back into :class:`StreamChunk` / :class:`GenerationResult`.

The gateway serves a tiny random model whose tokenizer has the Qwen2.5 chat template (tool calling, hermes
markup). A random model does not write tool calls, so the reply tests script the main model's tokens: the
backend answers a given text (what a tool-calling model writes), which the engine decodes and parses as usual.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.config import GenerationParams, OutputFormat
from specprefill_rag.decode import constraints
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.gateway_client import GatewayClient, _StreamReader, completion_reply, gateway_card, tool_calls_json
from specprefill_rag.prompt.chat import ChatMessage
from specprefill_rag.results import InvalidToolCall, SpecPrefillStats, ToolCall
from specprefill_rag.serve.responses import CHAT, ResponseWriter, sse
from specprefill_rag.serve.schema import ResponseFormat
from specprefill_rag.testing import build_tokenizer, random_documents
from tests.serve_helpers import MODEL, QUESTION, SYSTEM, running_gateway

TEMPLATE = Path(__file__).parent / "fixtures" / "chat_templates" / "qwen2_5.jinja"
RESULT = random_documents(1, 60, seed=3)[0]  # a tool result long enough to compress
OTHER_RESULT = random_documents(1, 60, seed=4)[0]
# An output to enforce (tool_choice required or named, response_format JSON) is compiled by the backend.
needs_xgrammar = pytest.mark.skipif(constraints.xgr is None, reason="xgrammar is not installed")


def tool(name: str) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {"q": {"type": "string"}}}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [tool("search"), tool("lookup")]
DEEP = '{"a": ' * 100_000 + "1" + "}" * 100_000  # history arguments nested past Python's recursion limit
NESTED_65 = '{"a": ' * 65 + "1" + "}" * 65


def call(call_id: str, name: str = "search", arguments: str = '{"q": "bridge"}') -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def history(*results: tuple[str, str, str]) -> list[dict[str, Any]]:
    """System, question, one assistant message calling each (id, tool, result), then the results."""
    calls = [call(call_id, name) for call_id, name, _ in results]
    answers = [{"role": "tool", "tool_call_id": call_id, "content": text} for call_id, _, text in results]
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": calls},
        *answers,
    ]


def hermes(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class Script:
    """The main backend's answers: the model's own, or a scripted text; records every request's params."""

    def __init__(self, engine: SpecPrefillEngine) -> None:
        self.tokenizer = engine.tokenizer
        self.real = engine.backend.agenerate
        self.text: str | None = None
        self.params: list[GenerationParams] = []

    def agenerate(self, prompt: Any, params: GenerationParams, report: Any = None) -> AsyncGenerator[int, None]:
        self.params.append(params)
        return self.real(prompt, params) if self.text is None else self._scripted(self.text)

    async def _scripted(self, text: str) -> AsyncGenerator[int, None]:
        for token in self.tokenizer.encode(text, add_special_tokens=False):
            yield token


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_draft):
    tokenizer = build_tokenizer()  # its own: the session's tokenizer keeps its template
    tokenizer.chat_template = TEMPLATE.read_text()
    return SpecPrefillEngine.from_models(
        tiny_model, tokenizer, tiny_draft, keep_rate=0.3, min_prompt_tokens=0, look_ahead=2
    )


@pytest.fixture(scope="module")
def scripted(engine):
    script = Script(engine)
    engine.backend.agenerate = script.agenerate  # this module's engine only
    return script


@pytest.fixture
def script(scripted):
    scripted.text, scripted.params[:] = None, []
    yield scripted
    scripted.text = None


@pytest.fixture(scope="module")
def gateway(engine, scripted):
    with running_gateway(engine) as url:
        yield url


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(client, **fields):
    body = {"model": MODEL, "messages": history(("c1", "search", RESULT)), "max_tokens": 4, "temperature": 0, **fields}
    return client.post("/chat/completions", body=body, cast_to=object)


# --- requests: what is accepted, what is refused --------------------------------------------------------------


def user_then(*messages: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": QUESTION}, *messages]


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "1-64"),
        ({"tools": [{"type": "function"}]}, "tools.0.function", "is required"),
        ({"tools": [{"type": "tool", "function": {"name": "a"}}]}, "tools.0.type", "'function'"),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}]},
            "tools.0.function.parameters",
            "type 'object'",
        ),
        ({"tools": [tool("search"), tool("search")]}, "tools", "twice"),
        ({"tools": [tool(f"t{i}") for i in range(129)]}, "tools", "129 tools; at most 128"),
        (  # the schemas alone overflow the context: about tools, not messages or documents
            {"tools": [{"type": "function", "function": {"name": "a", "description": "lorem ipsum " * 20000}}]},
            "tools",
            "the offered tools alone take at least",
        ),
        (
            {"messages": user_then({"role": "assistant", "tool_calls": [call("c1", arguments=DEEP)]})},
            "messages.1.tool_calls.0.function.arguments",
            "nested at most 64 deep",
        ),
        (
            {"messages": user_then({"role": "assistant", "tool_calls": [call("c1", arguments=NESTED_65)]})},
            "messages.1.tool_calls.0.function.arguments",
            "more than 64 objects or lists deep",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "description": "<|im_end|>"}}]},
            "tools",
            "control-token text",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fetch"}}}, "tool_choice", "fetch"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "'auto', 'none' or 'required'"),
        ({"tool_choice": {"type": "function", "function": {"name": "search"}}}, "tool_choice", "no tools"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        (
            {"messages": user_then({"role": "tool", "tool_call_id": "nope", "content": "x"})},
            "messages.1.tool_call_id",
            "'nope', which no earlier assistant message's tool_calls made",
        ),
        (
            {"messages": user_then({"role": "tool", "content": "x"})},
            "messages.1.tool_call_id",
            "needs the tool_call_id",
        ),
        (
            {"messages": [*history(("c1", "search", "x")), {"role": "tool", "tool_call_id": "c1", "content": "y"}]},
            "messages.4.tool_call_id",
            "another tool message already answered",
        ),
        (
            {"messages": user_then({"role": "assistant", "content": None, "tool_calls": [call("c1"), call("c1")]})},
            "messages.1.tool_calls.1.id",
            "reuses the call id",
        ),
        (
            {"messages": user_then({"role": "assistant", "content": "", "tool_calls": [call("c1", arguments="[1]")]})},
            "messages.1.tool_calls.0.function.arguments",
            "JSON object encoded as a string",
        ),
        (
            {"messages": user_then({"role": "assistant", "tool_calls": [call("c1", arguments="{'q': 1}")]})},
            "messages.1.tool_calls.0.function.arguments",
            "JSON object encoded as a string",
        ),
        (
            {"messages": user_then({"role": "assistant", "tool_calls": [call("c1", arguments='{"q": NaN}')]})},
            "messages.1.tool_calls.0.function.arguments",
            "NaN is not JSON",
        ),
        ({"messages": user_then({"role": "assistant", "content": None})}, "messages.1.content", "content is required"),
        (
            {"messages": [{"role": "user", "content": QUESTION, "tool_calls": [call("c1")]}]},
            "messages.0.tool_calls",
            "only assistant messages make calls",
        ),
        (
            {
                "messages": history(("c1", "search", "x"))[:3]
                + [{"role": "tool", "tool_call_id": "c1", "content": [{"type": "document", "text": "x"}]}]
            },
            "messages.3.content",
            "a tool result is text",
        ),
        (
            {
                "messages": history(("c1", "search", "x"))[:3]
                + [{"role": "tool", "tool_call_id": "c1", "name": "lookup", "content": "x"}]
            },
            "messages",
            "its call was to 'search'",
        ),
        ({"spec_prefill": {"keep_tools_whole": ["fetch"]}}, "spec_prefill.keep_tools_whole", "'fetch'"),
        ({"spec_prefill": {"compress_tool_results": "no"}}, "spec_prefill.compress_tool_results", "boolean"),
        ({"functions": [{"name": "search"}]}, "functions", "tools and tool_choice"),
        ({"function_call": "auto"}, "function_call", "tools and tool_choice"),
        (
            {"messages": user_then({"role": "function", "name": "search", "content": "x"})},
            "messages.1",
            "role 'tool' with tool_call_id",
        ),
        ({"response_format": {"type": "json_object"}, "tools": TOOLS}, "response_format", "tool_choice 'none'"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
            "response_format.json_schema.schema",
            "is required",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'json_object'"),
        pytest.param(  # the backend cannot enforce it: refused before any draft work
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strnig"}}}},
            "response_format",
            "cannot be compiled",
            marks=needs_xgrammar,
        ),
    ],
)
def test_bad_tool_fields_get_a_400_naming_the_field_and_the_next_request_is_served(client, fields, param, says):
    with pytest.raises(openai.BadRequestError) as refused:
        post(client, **fields)
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == param, error
    assert says in error["message"]
    assert post(client, tools=TOOLS)["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False},
        {"tools": TOOLS, "tool_choice": "none"},
        {"tools": [], "tool_choice": "none"},
        {"tools": [{"type": "function", "function": {"name": "now"}}]},  # no parameters, no description
        {"tools": [{"type": "function", "function": {"name": "now", "strict": True, "parameters": {}}}]},
        pytest.param(
            {"tools": TOOLS, "tool_choice": "none", "response_format": {"type": "json_object"}}, marks=needs_xgrammar
        ),
        {"messages": [*history(("c1", "search", [{"type": "text", "text": RESULT}]))]},
        {
            "messages": [
                *history(("c1", "search", RESULT))[:3],
                {"role": "tool", "tool_call_id": "c1", "content": RESULT},
            ]
        },
        {
            "messages": [
                *history(("c1", "search", RESULT)),
                {"role": "assistant", "content": "It opened in 1883."},
                {"role": "user", "content": "And who built it?"},
            ]
        },
    ],
)
def test_tool_requests_are_accepted(client, fields):
    answer = post(client, **fields)
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")


# --- tool results are documents --------------------------------------------------------------------------------


def test_a_tool_result_in_the_history_is_a_compressed_document(client, engine):
    answer = post(client, tools=TOOLS)
    stats = answer["spec_prefill"]
    assert stats["document_source"] == "tool-results" and stats["n_documents"] == 1
    assert stats["compressed"] and stats["kept_document_tokens"] < stats["document_tokens"]
    core = [
        ChatMessage("system", [SYSTEM]),
        ChatMessage("user", [QUESTION]),
        ChatMessage("assistant", [], (ToolCall("search", {"q": "bridge"}, "c1"),)),
        ChatMessage("tool", [RESULT], tool_call_id="c1"),
    ]
    layout = engine.chat_layout(core, None, TOOLS).layout  # the same prompt as in-process
    assert stats["prompt_tokens"] == len(layout) and stats["document_tokens"] == layout.n_document_tokens


def test_compress_tool_results_false_keeps_every_result_whole(client):
    stats = post(client, tools=TOOLS, spec_prefill={"compress_tool_results": False})["spec_prefill"]
    assert not stats["compressed"] and stats["document_tokens"] == 0
    assert stats["uncompressed_reason"] == "no_documents"


def test_keep_tools_whole_keeps_only_that_tools_results(client):
    messages = history(("c1", "search", RESULT), ("c2", "lookup", OTHER_RESULT))
    both = post(client, tools=TOOLS, messages=messages)["spec_prefill"]
    one = post(client, tools=TOOLS, messages=messages, spec_prefill={"keep_tools_whole": ["lookup"]})["spec_prefill"]
    assert both["n_documents"] == 2 and one["n_documents"] == 1 and one["compressed"]
    assert 0 < one["document_tokens"] < both["document_tokens"]
    assert one["prompt_tokens"] == both["prompt_tokens"]  # the same prompt, fewer candidates


def test_keep_tools_whole_may_name_a_tool_only_called_in_the_history(client):
    stats = post(client, spec_prefill={"keep_tools_whole": ["search"]})["spec_prefill"]
    assert not stats["compressed"] and stats["document_tokens"] == 0


def test_a_template_without_tool_calling_still_takes_tools_and_a_tool_history(tokenizer, tiny_model, tiny_draft):
    """The session tokenizer's ChatML template knows no tools: the core writes them into the messages (hermes)."""
    plain = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, keep_rate=0.3, min_prompt_tokens=0)
    with running_gateway(plain) as url:
        plain_client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stats = post(plain_client, tools=TOOLS)["spec_prefill"]
        assert stats["document_source"] == "tool-results" and stats["compressed"]
        assert stats["invalid_tool_calls"] == []  # its answer's calls are parsed
        assert post(plain_client)["spec_prefill"]["document_source"] == "tool-results"


# --- decoding parameters ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {"tool_format": None, "output_format": None}),
        pytest.param(
            {"tools": TOOLS},
            {
                "tool_format": "hermes",
                "parallel_tool_calls": True,
                "output_format": OutputFormat("tool_call", tools=tuple(TOOLS), tool_format="hermes", lazy=True),
            },
            marks=needs_xgrammar,
        ),
        ({"tools": TOOLS, "parallel_tool_calls": False}, {"tool_format": "hermes", "parallel_tool_calls": False}),
        ({"tools": TOOLS, "tool_choice": "none"}, {"tool_format": None, "output_format": None}),
        pytest.param(
            {"tools": TOOLS, "tool_choice": "required"},
            {"output_format": OutputFormat("tool_call", tools=tuple(TOOLS), tool_format="hermes", parallel=True)},
            marks=needs_xgrammar,
        ),
        pytest.param(
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
            {"output_format": OutputFormat("tool_call", tools=(TOOLS[1],), tool_format="hermes", parallel=False)},
            marks=needs_xgrammar,
        ),
        ({"response_format": {"type": "text"}}, {"output_format": None}),
        pytest.param(
            {"response_format": {"type": "json_object"}},
            {"output_format": OutputFormat("json_object")},
            marks=needs_xgrammar,
        ),
        pytest.param(
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}},
            {"output_format": OutputFormat("json_schema", schema={"type": "object"})},
            marks=needs_xgrammar,
        ),
        pytest.param(
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "object"}, "strict": False},
                }
            },
            {"output_format": OutputFormat("json_schema", schema={"type": "object"}, strict=False)},
            marks=needs_xgrammar,
        ),
    ],
)
def test_tools_tool_choice_and_response_format_reach_the_decoding_params(client, script, fields, expected):
    script.text = '{"q": "bridge"}' if "response_format" in fields else hermes("lookup", {"q": "bridge"})
    post(client, **fields)
    params = script.params[-1]
    assert {name: getattr(params, name) for name in expected} == expected


# --- replies: the model's calls in OpenAI's shapes -------------------------------------------------------------


@needs_xgrammar
def test_auto_returns_a_call_written_without_markup_even_over_the_grammar_limits(client, script):
    # a pattern past max_pattern_repeat (1,000): a forced call of it is a 400, auto decodes without its lazy grammar
    many = {
        "type": "function",
        "function": {
            "name": "pick",
            "parameters": {"type": "object", "properties": {"n": {"type": "string", "pattern": "^[a-z]{5000}$"}}},
        },
    }
    script.text = 'Sure.\n```json\n{"name": "pick", "arguments": {"n": "abc"}}\n```'
    messages = [{"role": "user", "content": QUESTION}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[many], max_tokens=100)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("pick", {"n": "abc"})
    ]
    with pytest.raises(openai.BadRequestError, match="max_pattern_repeat"):
        client.chat.completions.create(
            model=MODEL, messages=messages, tools=[many], tool_choice="required", max_tokens=100
        )


def test_a_whole_answer_carries_the_calls_and_null_content(client, script):
    script.text = hermes("search", {"q": "bridge opening"}) + "\n" + hermes("lookup", {"q": "1883"})
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS, max_tokens=100
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "search", {"q": "bridge opening"}),
        ("function", "lookup", {"q": "1883"}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id for c in calls)
    assert answer.model_extra["spec_prefill"]["invalid_tool_calls"] == []


def test_text_around_a_call_is_the_content(client, script):
    script.text = "Let me look that up.\n" + hermes("search", {"q": "bridge"})
    body = post(client, tools=TOOLS, max_tokens=100)
    message = body["choices"][0]["message"]
    assert message["content"] == "Let me look that up." and message["tool_calls"][0]["function"]["name"] == "search"


def test_a_streamed_answer_sends_one_delta_per_call(client, script):
    script.text = "Looking.\n" + hermes("search", {"q": "bridge"}) + "\n" + hermes("lookup", {"q": "1883"})
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS, max_tokens=100, stream=True
    )
    chunks = list(stream)
    deltas = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
    assert [d.index for d in deltas] == [0, 1] and [d.function.name for d in deltas] == ["search", "lookup"]
    assert [json.loads(d.function.arguments) for d in deltas] == [{"q": "bridge"}, {"q": "1883"}]
    assert all(d.id and d.type == "function" for d in deltas)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Looking."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].model_extra["spec_prefill"]["invalid_tool_calls"] == []


def test_a_call_that_does_not_decode_is_reported_not_dropped(client, gateway, script):
    script.text = '<tool_call>\n{"name": "search", "arguments": {"q": \n</tool_call>'
    for stream in (False, True):
        body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS}
        if stream:
            sent = httpx.post(gateway + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
            events = [json.loads(x[6:]) for x in sent.text.splitlines() if x.startswith("data: {")]
            last, finish = events[-1], events[-1]["choices"][0]["finish_reason"]
            assert not any(e["choices"][0]["delta"].get("tool_calls") for e in events)
        else:
            last = client.post("/chat/completions", body={**body, "max_tokens": 100}, cast_to=object)
            finish = last["choices"][0]["finish_reason"]
            assert "tool_calls" not in last["choices"][0]["message"]
        [invalid] = last["spec_prefill"]["invalid_tool_calls"]
        assert finish in ("stop", "length") and invalid["error"] and invalid["id"]
        assert invalid["arguments"].startswith('{"name": "search"')


INJECTED = hermes("delete_all_files", {"path": "/"})  # a tool result told the model to call it


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_of_a_tool_not_offered_is_content_whole_and_streamed(gateway, script, stream):
    script.text = "Cleaning up.\n" + INJECTED + "\n" + hermes("search", {"q": "bridge"})
    body = {"model": MODEL, "messages": history(("c1", "search", RESULT)), "tools": TOOLS, "max_tokens": 100}
    sent = httpx.post(gateway + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
    assert sent.status_code == 200
    if stream:
        events = [json.loads(x[6:]) for x in sent.text.splitlines() if x.startswith("data: {")]
        deltas = [e["choices"][0]["delta"] for e in events]
        content = "".join(d.get("content") or "" for d in deltas)
        names = [c["function"]["name"] for d in deltas for c in d.get("tool_calls") or ()]
        extra = events[-1]["spec_prefill"]
    else:
        message = sent.json()["choices"][0]["message"]
        content, names = message["content"], [c["function"]["name"] for c in message["tool_calls"]]
        extra = sent.json()["spec_prefill"]
    assert names == ["search"] and content == "Cleaning up.\n" + INJECTED  # as written
    assert extra["invalid_tool_calls"] == []


def test_with_tool_choice_none_the_markup_is_plain_text(client, script):
    script.text = hermes("search", {"q": "bridge"})
    body = post(client, tools=TOOLS, tool_choice="none", max_tokens=100)
    assert body["choices"][0]["message"]["content"] == script.text and "invalid_tool_calls" not in body["spec_prefill"]
    assert body["choices"][0]["finish_reason"] == "stop"


# --- the torch-free client -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway_client(gateway):
    return GatewayClient(gateway, gateway_card(gateway, 30), timeout=60)


def client_body(gateway_client, **extra):
    messages = [{"role": "user", "content": QUESTION}]
    return gateway_client.body(messages, {"keep_rate": None}, GenerationParams(max_new_tokens=100), extra)


def test_the_client_reads_streamed_calls(gateway_client, script):
    script.text = "Looking.\n" + hermes("search", {"q": "bridge"}) + "\n" + hermes("lookup", {"q": "1883"})
    replies = list(gateway_client.stream(client_body(gateway_client, tools=TOOLS)))
    streamed = [c for r in replies for c in r.chunk.tool_calls]
    result = replies[-1].chunk.result
    assert [(c.name, dict(c.arguments)) for c in streamed] == [("search", {"q": "bridge"}), ("lookup", {"q": "1883"})]
    assert result.tool_calls == tuple(streamed) and result.finish_reason == "tool_calls"
    assert result.text == "Looking." and result.invalid_tool_calls == ()
    assert "invalid_tool_calls" not in replies[-1].extras and replies[-1].extras["document_source"] == "none"


def test_the_client_reads_a_whole_answer_and_invalid_calls(gateway_client, script):
    script.text = hermes("search", {"q": "bridge"})
    whole = gateway_client.complete(client_body(gateway_client, tools=TOOLS)).chunk.result
    assert whole.finish_reason == "tool_calls" and whole.text == ""
    assert [(c.name, dict(c.arguments)) for c in whole.tool_calls] == [("search", {"q": "bridge"})]
    script.text = '<tool_call>\n{"name": "search"\n</tool_call>'
    broken = list(gateway_client.stream(client_body(gateway_client, tools=TOOLS)))[-1].chunk.result
    assert broken.tool_calls == () and broken.finish_reason == "stop"
    assert [c.arguments for c in broken.invalid_tool_calls] == ['{"name": "search"']


def test_the_client_sends_a_tool_history(gateway_client):
    messages = history(("c1", "search", RESULT))
    messages[2]["tool_calls"] = tool_calls_json([ToolCall("search", {"q": "bridge"}, "c1")])
    body = gateway_client.body(messages, {}, GenerationParams(max_new_tokens=4), {"tools": TOOLS})
    stats = list(gateway_client.stream(body))[-1].extras
    assert stats["document_source"] == "tool-results" and stats["n_documents"] == 1


def test_client_body_merges_extra_fields_and_params():
    gateway_client = GatewayClient("http://gateway", {"id": MODEL})
    messages = [{"role": "user", "content": QUESTION}]
    plain = gateway_client.body(messages, {"keep_rate": 0.5}, GenerationParams(max_new_tokens=8))
    assert plain == gateway_client.body(messages, {"keep_rate": 0.5}, GenerationParams(max_new_tokens=8), None)
    assert "tools" not in plain and "response_format" not in plain
    extra = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    body = gateway_client.body(messages, {}, GenerationParams(parallel_tool_calls=False), extra)
    assert body["tools"] == TOOLS and body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    schema = {"type": "object", "properties": {"year": {"type": "integer"}}}
    structured = gateway_client.body(messages, {}, GenerationParams(output_format=OutputFormat("json_schema", schema)))
    assert structured["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": schema, "strict": True},
    }
    loose = OutputFormat("json_schema", schema, strict=False)
    sent = gateway_client.body(messages, {}, GenerationParams(output_format=loose))["response_format"]
    assert ResponseFormat.model_validate(sent).output_format == loose  # what the gateway reads back
    with pytest.raises(InvalidRequestError, match="set each field once"):
        gateway_client.body(messages, {}, GenerationParams(max_new_tokens=8), {"max_tokens": 9})
    with pytest.raises(InvalidRequestError, match="no tools are sent"):
        gateway_client.body(messages, {}, GenerationParams(tool_format="hermes", tool_names=("search",)))


def stats(**fields: Any) -> SpecPrefillStats:
    numbers = dict.fromkeys(["prompt_tokens", "document_tokens", "kept_tokens", "kept_document_tokens"], 10)
    return SpecPrefillStats(
        **numbers,
        keep_rate=1.0,
        compressed=False,
        draft_ms=0.0,
        main_prefill_ms=1.0,
        ttft_ms=1.0,
        completion_tokens=5,
        decode_tokens_per_s=0.0,
        **fields,
    )


def test_the_writers_shapes_round_trip_through_the_client_reader():
    """The gateway's formatting and the client's parsing, without a model: what one writes the other reads."""
    writer = ResponseWriter(CHAT, MODEL)
    first, second = ToolCall("search", {"q": "bridge"}, "call_1"), ToolCall("lookup", {"q": "1883"}, "call_2")
    bad = InvalidToolCall(None, '{"name": ', "call_3", "malformed JSON")
    extra = {"document_source": "tool-results", "invalid_tool_calls": [vars(bad)]}
    events = [
        writer.chunk("Looking.", True),
        writer.chunk("", False, None, None, (first,), 0),
        writer.chunk("", False, "tool_calls", {**stats().as_dict(), **extra}, (second,), 1),
    ]
    assert events[1]["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "id": "call_1", "type": "function", **tool_calls_json([first])[0]}]
    }
    reader = _StreamReader()
    replies = [r for event in events for r in reader.feed(sse(event).decode().strip())]
    result = replies[-1].chunk.result
    assert [r.chunk.tool_calls for r in replies] == [(), (first,), (second,)]
    assert result.tool_calls == (first, second) and result.invalid_tool_calls == (bad,)
    assert result.finish_reason == "tool_calls" and result.text == "Looking."
    assert replies[-1].extras == {"document_source": "tool-results"}

    whole = writer.whole("", "tool_calls", stats(), {**stats().as_dict()}, (first, second))
    assert whole["choices"][0]["message"]["content"] is None
    assert whole["choices"][0]["message"]["tool_calls"] == tool_calls_json([first, second])
    parsed = completion_reply(whole).chunk.result
    assert parsed.tool_calls == (first, second) and parsed.finish_reason == "tool_calls" and parsed.text == ""


def test_the_client_joins_a_call_streamed_in_pieces_and_reports_one_left_unfinished():
    """OpenAI servers stream a call's arguments in pieces (same index); a call that never completes is invalid."""
    pieces = [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": '}},
        {"index": 0, "function": {"arguments": '"bridge"}'}},
        {"index": 1, "id": "call_2", "type": "function", "function": {"name": "lookup", "arguments": '{"q": '}},
    ]
    reader = _StreamReader()
    lines = [{"choices": [{"index": 0, "delta": {"tool_calls": [piece]}, "finish_reason": None}]} for piece in pieces]
    lines.append(
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}], "spec_prefill": stats().as_dict()}
    )
    replies = [r for line in lines for r in reader.feed(sse(line).decode().strip())]
    result = replies[-1].chunk.result
    assert result.tool_calls == (ToolCall("search", {"q": "bridge"}, "call_1"),)
    assert result.invalid_tool_calls == (
        InvalidToolCall("lookup", '{"q": ', "call_2", "the arguments are not a JSON object"),
    )
    assert [r.chunk.tool_calls for r in replies] == [result.tool_calls, ()]  # the call completes with its 2nd piece


# --- framework clients -----------------------------------------------------------------------------------------


def test_the_openai_sdk_sends_tools_and_a_tool_history(client):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=history(("c1", "search", RESULT)),
        tools=TOOLS,
        tool_choice="auto",
        parallel_tool_calls=True,
        max_tokens=4,
        temperature=0,
        extra_body={"spec_prefill": {"keep_tools_whole": []}},
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.model_extra["spec_prefill"]["document_source"] == "tool-results"


def test_langchain_chat_openai_binds_tools_and_sends_a_tool_history(gateway, script):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool as langchain_tool
    from langchain_openai import ChatOpenAI

    @langchain_tool
    def search(q: str) -> str:
        """Search the archive."""
        return RESULT

    llm = ChatOpenAI(base_url=gateway + "/v1", api_key="unused", model=MODEL, max_tokens=100, max_retries=0)
    bound = llm.bind_tools([search])
    script.text = hermes("search", {"q": "bridge"})
    asked = bound.invoke([HumanMessage(QUESTION)])
    assert [(c["name"], c["args"]) for c in asked.tool_calls] == [("search", {"q": "bridge"})]
    script.text = "It opened in 1883."
    messages = [
        SystemMessage(SYSTEM),
        HumanMessage(QUESTION),
        asked,
        ToolMessage(RESULT, tool_call_id=asked.tool_calls[0]["id"]),
    ]
    answer = bound.invoke(messages)
    assert isinstance(answer, AIMessage) and answer.content == "It opened in 1883."
    assert answer.response_metadata["finish_reason"] == "stop"


@needs_xgrammar
@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_makes_the_model_call_that_tool(client, script, stream):
    """Constrained decoding (the model's own tokens, no script): even a random model answers with a call."""
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        max_tokens=200,
        temperature=0,
        stream=stream,
    )
    if stream:
        chunks = list(answer)
        calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
        finish = chunks[-1].choices[0].finish_reason
    else:
        calls, finish = answer.choices[0].message.tool_calls, answer.choices[0].finish_reason
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["lookup"]
    assert isinstance(json.loads(calls[0].function.arguments), dict)
