"""Tool calls parsed from generated text: hermes, llama3 and mistral markup, blocking and streamed."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from specprefill_rag.decode.tool_calls import (
    InvalidToolCall,
    ParsedOutput,
    StreamedPart,
    ToolCallStream,
    new_call_id,
    parse_tool_calls,
    tool_call_format,
)
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.prompt.layout import ToolCall


def counter():
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def parse(text, fmt, offered=None):
    return parse_tool_calls(text, fmt, counter(), offered)


def hermes_block(name, arguments, key="arguments"):
    return f"<tool_call>\n{json.dumps({'name': name, key: arguments}, ensure_ascii=False)}\n</tool_call>"


WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"zone": "Europe/Paris"}

# --- hermes ---------------------------------------------------------------------------------------------------


def test_hermes_single_call():
    out = parse(hermes_block("get_weather", WEATHER), "hermes")
    assert out == ParsedOutput("", (ToolCall("get_weather", WEATHER, "call_0"),), ())


def test_hermes_parallel_calls_in_order():
    text = hermes_block("get_weather", WEATHER) + "\n" + hermes_block("get_time", TIME)
    out = parse(text, "hermes")
    assert out.content == ""
    assert out.tool_calls == (ToolCall("get_weather", WEATHER, "call_0"), ToolCall("get_time", TIME, "call_1"))
    assert out.invalid_tool_calls == ()


def test_hermes_text_before_between_and_after_calls():
    text = (
        "  Let me check.\n\n"
        + hermes_block("get_weather", WEATHER)
        + "\nand\n"
        + hermes_block("get_time", TIME)
        + "\n Done. "
    )
    out = parse(text, "hermes")
    # whitespace next to removed blocks is trimmed; the rest of the text is kept as written
    assert out.content == "  Let me check.\n\nand\n\nDone. "
    assert [call.name for call in out.tool_calls] == ["get_weather", "get_time"]


def test_hermes_whitespace_inside_the_block_and_missing_arguments():
    out = parse('<tool_call>  \n\t{"name": "ping"}  \n\n</tool_call>', "hermes")
    assert out.tool_calls == (ToolCall("ping", {}, "call_0"),)


def test_hermes_no_calls_keeps_the_text_unchanged():
    for text in ["", "Paris is the capital of France.", "  spaced out \n", "a </tool_call> stray close", "<tool"]:
        assert parse(text, "hermes") == ParsedOutput(text, (), ())


def test_hermes_malformed_json_is_invalid():
    out = parse('Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', "hermes")
    assert out.content == "Hi"
    assert out.tool_calls == ()
    (bad,) = out.invalid_tool_calls
    assert bad.name == "get_weather" and bad.id == "call_0"  # the name it gave, for the agent's error message
    assert bad.arguments == '{"name": "get_weather", "arguments": {"city": }'
    assert bad.error.startswith("malformed JSON: Expecting value")


@pytest.mark.parametrize(
    ("arguments", "raw", "error"),
    [
        ([1, 2], "[1, 2]", "arguments must be a JSON object, got a list"),
        (3, "3", "arguments must be a JSON object, got a number"),
        (None, "null", "arguments must be a JSON object, got null"),
        ("[1]", "[1]", "arguments are a string holding a list, not a JSON object"),
        ("{oops", "{oops", "arguments are a string that is not JSON"),
    ],
)
def test_hermes_non_object_arguments_are_invalid(arguments, raw, error):
    out = parse(hermes_block("f", arguments), "hermes")
    assert out.tool_calls == ()
    (bad,) = out.invalid_tool_calls
    assert (bad.name, bad.arguments, bad.id) == ("f", raw, "call_0")
    assert bad.error.startswith(error)


@pytest.mark.parametrize(
    ("block", "raw", "error"),
    [
        ('{"arguments": {"a": 1}}', '{"a": 1}', 'the call has no "name"'),
        ('{"name": "", "arguments": {"a": 1}}', '{"a": 1}', 'the call has no "name"'),
        ('{"name": 7, "arguments": {}}', "{}", '"name" must be a string, got a number'),
        ('{"answer": 42}', '{"answer": 42}', 'the call has no "name"'),  # nothing to split: the whole object
        ('["get_weather", {"a": 1}]', '["get_weather", {"a": 1}]', "must be a JSON object, got a list"),
    ],
)
def test_hermes_missing_or_bad_name_is_invalid(block, raw, error):
    out = parse(f"<tool_call>{block}</tool_call>", "hermes")
    assert out.tool_calls == ()
    (bad,) = out.invalid_tool_calls
    assert bad.name is None and bad.arguments == raw and error in bad.error


def test_hermes_double_encoded_arguments_are_decoded():
    out = parse(hermes_block("get_weather", json.dumps(WEATHER)), "hermes")
    assert out.tool_calls == (ToolCall("get_weather", WEATHER, "call_0"),)


def test_hermes_unicode_arguments():
    arguments = {"city": "São Paulo", "note": "天気 ☀️", "escaped": "\u00e9"}
    out = parse(hermes_block("get_weather", arguments), "hermes")
    assert out.tool_calls == (ToolCall("get_weather", arguments, "call_0"),)
    escaped = '<tool_call>{"name": "get_weather", "arguments": {"city": "S\\u00e3o Paulo"}}</tool_call>'
    assert parse(escaped, "hermes").tool_calls[0].arguments == {"city": "São Paulo"}


def test_hermes_unterminated_block_at_the_end():
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    out = parse(text, "hermes")
    assert out == ParsedOutput("Checking.", (ToolCall("get_weather", {"city": "Paris"}, "call_0"),), ())
    out = parse('<tool_call>\n{"name": "get_weather", "argu', "hermes")
    assert out.tool_calls == ()
    (cut,) = out.invalid_tool_calls
    assert cut == InvalidToolCall("get_weather", '{"name": "get_weather", "argu', "call_0", "unterminated")


def test_hermes_block_left_open_before_the_next_one():
    text = '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert parse(text, "hermes").tool_calls == (ToolCall("a", {}, "call_0"), ToolCall("b", {}, "call_1"))
    out = parse('<tool_call>{"name": "a", <tool_call>{"name": "b", "arguments": {}}</tool_call>', "hermes")
    assert out.tool_calls == (ToolCall("b", {}, "call_1"),)
    assert out.invalid_tool_calls == (InvalidToolCall("a", '{"name": "a",', "call_0", "unterminated"),)


def test_valid_and_invalid_calls_take_ids_in_writing_order():
    text = hermes_block("a", {}) + "<tool_call>{broken}</tool_call>" + hermes_block("c", {"x": 1})
    out = parse(text, "hermes")
    assert [c.id for c in out.tool_calls] == ["call_0", "call_2"]
    assert [c.id for c in out.invalid_tool_calls] == ["call_1"]


# --- llama3 ---------------------------------------------------------------------------------------------------


def test_llama3_single_call_with_and_without_python_tag():
    for prefix in ["", "  \n", "<|python_tag|>", " <|python_tag|> "]:
        text = prefix + '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
        assert parse(text, "llama3") == ParsedOutput("", (ToolCall("get_weather", WEATHER, "call_0"),), ())


def test_llama3_accepts_the_arguments_key():
    out = parse('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}', "llama3")
    assert out.tool_calls == (ToolCall("get_weather", WEATHER, "call_0"),)


def test_llama3_parallel_calls_separated_by_semicolons():
    text = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; {"name": "get_time", '
    text += '"parameters": {"zone": "Europe/Paris"}};'
    out = parse(text, "llama3")
    assert out.tool_calls == (ToolCall("get_weather", WEATHER, "call_0"), ToolCall("get_time", TIME, "call_1"))
    assert out.content == "" and out.invalid_tool_calls == ()


def test_llama3_plain_text_is_content():
    for text in ["The weather in Paris is mild.", '  Sure: {"name": "x", "parameters": {}}', "", "  \n", "<b>bold</b>"]:
        assert parse(text, "llama3") == ParsedOutput(text, (), ())


def test_llama3_text_after_the_calls_is_content():
    out = parse('{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}\n\nI asked for the time. ', "llama3")
    assert out == ParsedOutput("I asked for the time. ", (ToolCall("get_time", TIME, "call_0"),), ())


def test_llama3_malformed_and_non_object_calls_are_invalid():
    out = parse('{"name": "get_weather", "parameters": {"city": "Paris"', "llama3")
    (bad,) = out.invalid_tool_calls
    assert bad.name is None and bad.arguments == '{"name": "get_weather", "parameters": {"city": "Paris"'
    assert bad.error.startswith("malformed JSON")
    out = parse('{"name": "f", "parameters": [1]}', "llama3")
    assert out.invalid_tool_calls == (
        InvalidToolCall("f", "[1]", "call_0", "arguments must be a JSON object, got a list"),
    )
    out = parse('{"parameters": {"a": 1}}', "llama3")
    assert out.invalid_tool_calls == (InvalidToolCall(None, '{"a": 1}', "call_0", 'the call has no "name"'),)
    out = parse('<|python_tag|>brave_search.call(query="paris")', "llama3")
    (bad,) = out.invalid_tool_calls
    assert bad.arguments == 'brave_search.call(query="paris")' and "expected a JSON object" in bad.error
    out = parse('{"name": "a", "parameters": {}}; not json', "llama3")
    assert out.tool_calls == (ToolCall("a", {}, "call_0"),)
    assert out.invalid_tool_calls[0].arguments == "not json"


def test_llama3_double_encoded_and_unicode_arguments():
    out = parse(json.dumps({"name": "get_weather", "parameters": json.dumps(WEATHER)}), "llama3")
    assert out.tool_calls == (ToolCall("get_weather", WEATHER, "call_0"),)
    arguments = {"city": "Zürich", "emoji": "🌧"}
    text = json.dumps({"name": "get_weather", "parameters": arguments}, ensure_ascii=False)
    assert parse(text, "llama3").tool_calls == (ToolCall("get_weather", arguments, "call_0"),)


# --- mistral --------------------------------------------------------------------------------------------------


def test_mistral_json_list_single_and_parallel():
    one = f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}]'
    assert parse(one, "mistral") == ParsedOutput("", (ToolCall("get_weather", WEATHER, "call_0"),), ())
    two = json.dumps([{"name": "get_weather", "arguments": WEATHER}, {"name": "get_time", "arguments": TIME}])
    out = parse("[TOOL_CALLS] " + two, "mistral")
    assert out.tool_calls == (ToolCall("get_weather", WEATHER, "call_0"), ToolCall("get_time", TIME, "call_1"))


def test_mistral_name_args_form_single_and_repeated():
    one = f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(WEATHER)}"
    assert parse(one, "mistral") == ParsedOutput("", (ToolCall("get_weather", WEATHER, "call_0"),), ())
    two = one + f"[TOOL_CALLS]get_time[ARGS]{json.dumps(TIME)}"
    out = parse(two, "mistral")
    assert out.tool_calls == (ToolCall("get_weather", WEATHER, "call_0"), ToolCall("get_time", TIME, "call_1"))
    assert out.content == "" and out.invalid_tool_calls == ()


def test_mistral_text_before_the_calls_and_after():
    out = parse(f"Let me look.\n[TOOL_CALLS]get_time[ARGS]{json.dumps(TIME)}\n Then I answer.", "mistral")
    assert out == ParsedOutput("Let me look.\n\nThen I answer.", (ToolCall("get_time", TIME, "call_0"),), ())


def test_mistral_no_calls():
    for text in ["", "Paris is mild today.", " [TOOL_ not quite ", "[ARGS] alone"]:
        assert parse(text, "mistral") == ParsedOutput(text, (), ())


def test_mistral_malformed_and_non_object_are_invalid():
    out = parse('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}', "mistral")
    (bad,) = out.invalid_tool_calls
    assert bad.name is None and bad.error.startswith("malformed JSON")
    assert bad.arguments == '[{"name": "get_weather", "arguments": {"city": "Paris"}'
    out = parse('[TOOL_CALLS]get_weather[ARGS]{"city": Paris}[TOOL_CALLS]get_time[ARGS]{}', "mistral")
    assert out.tool_calls == (ToolCall("get_time", {}, "call_1"),)
    (bad,) = out.invalid_tool_calls
    assert (bad.name, bad.arguments, bad.id) == ("get_weather", '{"city": Paris}', "call_0")
    out = parse("[TOOL_CALLS]get_weather[ARGS][1, 2]", "mistral")
    assert out.invalid_tool_calls == (
        InvalidToolCall("get_weather", "[1, 2]", "call_0", "arguments must be a JSON object, got a list"),
    )
    out = parse('[TOOL_CALLS][{"arguments": {}}, "get_time"]', "mistral")
    assert [bad.error for bad in out.invalid_tool_calls] == [
        'the call has no "name"',
        "a tool call must be a JSON object, got a string",
    ]
    out = parse("[TOOL_CALLS][ARGS]{}", "mistral")
    assert out.invalid_tool_calls == (InvalidToolCall(None, "{}", "call_0", 'the call has no "name"'),)
    out = parse("[TOOL_CALLS]get_weather", "mistral")
    (bad,) = out.invalid_tool_calls
    assert bad.arguments == "get_weather" and "expected a JSON list" in bad.error
    out = parse("[TOOL_CALLS]get_weather[ARGS]", "mistral")
    assert out.invalid_tool_calls == (InvalidToolCall("get_weather", "", "call_0", "no arguments after [ARGS]"),)


def test_mistral_double_encoded_and_unicode_arguments():
    out = parse(f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(json.dumps(WEATHER))}", "mistral")
    assert out.tool_calls == (ToolCall("get_weather", WEATHER, "call_0"),)
    arguments = {"city": "Kraków", "note": "日本語"}
    text = "[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": arguments}], ensure_ascii=False)
    assert parse(text, "mistral").tool_calls == (ToolCall("get_weather", arguments, "call_0"),)


# --- streaming ------------------------------------------------------------------------------------------------

SAMPLES = {
    "hermes": [
        "",
        "Plain answer with no calls.",
        "  leading and trailing  \n",
        hermes_block("get_weather", WEATHER),
        "Let me check.\n" + hermes_block("get_weather", WEATHER) + "\n" + hermes_block("get_time", TIME),
        "A\n" + hermes_block("a", {}) + "\n B \n" + hermes_block("b", {"é": "ü"}) + "\nC  ",
        "<tool_call>{broken}</tool_call> after",
        hermes_block("f", json.dumps({"k": [1, 2]})),
        'x <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
        '<tool_call>{"name": "a", <tool_call>{"name": "b", "arguments": {}}</tool_call>',
        "<tool_call>{}",
        "almost <tool_ca but not",
        "ends with <tool_",
        "\n\n<tool_call></tool_call>\n\n",
        'Searching. {"name": "get_weather", "arguments": {"city": "Par',
        '{{"name": "a", "arguments": {"x": 1}',
        '```json\n{\n  "name": "x", "arguments": {}\n',
        'Use {"name": "get_weather", like this.',
    ],
    "llama3": [
        "",
        "  \n ",
        "The answer is 4.",
        "  <b>not a tag</b>",
        "<|python",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        ' <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": "ß"}}',
        '{"name": "a", "parameters": {}}\n\nTrailing words. ',
        '{"name": "a", "parameters": {"x": ',
        "<|python_tag|>code.call()",
    ],
    "mistral": [
        "",
        "No calls here.",
        "trailing partial [TOOL_",
        "[TOOL_CALLS]" + json.dumps([{"name": "a", "arguments": WEATHER}, {"name": "b", "arguments": TIME}]),
        f"Looking.\n[TOOL_CALLS]get_weather[ARGS]{json.dumps(WEATHER)}[TOOL_CALLS]get_time[ARGS]{json.dumps(TIME)}",
        '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}[TOOL_CALLS]b[ARGS]{}\n then text ',
        "[TOOL_CALLS]f[ARGS]" + json.dumps(json.dumps({"q": "ñ"})),
        "[TOOL_CALLS]f[ARGS]12",
        "[TOOL_CALLS]orphan [TOOL_CALLS][ARGS]{}",
        '[TOOL_CALLS][{"name": "a", "arguments": {}',
        "[TOOL_CALLS]a[ARGS]{}b[ARGS]{}",
    ],
}

CASES = [(fmt, text) for fmt, texts in SAMPLES.items() for text in texts]


def streamed(fmt, deltas, offered=None):
    stream = ToolCallStream(fmt, counter(), offered)
    parts = [stream.push(delta) for delta in deltas] + [stream.finish()]
    return ParsedOutput(
        "".join(part.content for part in parts),
        tuple(call for part in parts for call in part.tool_calls),
        tuple(call for part in parts for call in part.invalid_tool_calls),
    )


@pytest.mark.parametrize(("fmt", "text"), CASES)
def test_streaming_equals_blocking_at_every_split(fmt, text):
    whole = parse(text, fmt)
    for cut in range(len(text) + 1):
        assert streamed(fmt, [text[:cut], text[cut:]]) == whole, cut
    assert streamed(fmt, list(text)) == whole


@pytest.mark.parametrize(("fmt", "text"), CASES)
def test_streaming_equals_blocking_at_random_splits(fmt, text):
    whole = parse(text, fmt)
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 8))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed(fmt, deltas) == whole, deltas


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[TOOL_", "[ARGS]", "<|python_tag|>", "<|py",
    '{"name": "a", "arguments": {"x": 1}}', '{"name": "b", "parameters": {}}', '[{"name": "c", "arguments": {}}]',
    "{", "}", "[", "]", '"', ";", " ", "\n", "word", "é", "get_weather", '"{\\"a\\": 1}"', "12",
]  # fmt: skip


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_streaming_equals_blocking_on_random_markup_soup(fmt):
    rng = random.Random(fmt)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 10)))
        whole = parse(text, fmt)
        cuts = sorted(rng.sample(range(len(text) + 1), k=rng.randint(0, min(6, len(text)))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed(fmt, deltas) == whole, deltas
        assert streamed(fmt, list(text)) == whole, text


OFFERED = frozenset({"get_weather", "a", "x"})


@pytest.mark.parametrize(("fmt", "text"), CASES)
def test_streaming_equals_blocking_with_offered_tools_at_every_split(fmt, text):
    whole = parse(text, fmt, OFFERED)
    assert all(call.name in OFFERED for call in whole.tool_calls)
    assert all(call.name is None or call.name in OFFERED for call in whole.invalid_tool_calls)
    for cut in range(len(text) + 1):
        assert streamed(fmt, [text[:cut], text[cut:]], OFFERED) == whole, cut
    assert streamed(fmt, list(text), OFFERED) == whole


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_streaming_equals_blocking_with_offered_tools_on_random_markup_soup(fmt):
    rng = random.Random(fmt + "offered")
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 10)))
        whole = parse(text, fmt, {"a"})
        assert all(call.name == "a" for call in whole.tool_calls), text
        cuts = sorted(rng.sample(range(len(text) + 1), k=rng.randint(0, min(6, len(text)))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed(fmt, deltas, {"a"}) == whole, deltas


def test_hermes_stream_releases_content_early_and_calls_when_closed():
    stream = ToolCallStream("hermes", counter())
    assert stream.push("Let me") == StreamedPart("Let me", ())
    assert stream.push(" check <tool_") == StreamedPart(" check", ())  # '<tool_' and the space before it held
    assert stream.push('call>\n{"name": "get_weather", ') == StreamedPart("", ())
    assert stream.push('"arguments": {"city": "Paris"}}\n</tool_call>\n') == StreamedPart(
        "", (ToolCall("get_weather", {"city": "Paris"}, "call_0"),)
    )
    assert stream.push('<tool_call>{"name": "x"') == StreamedPart("", ())
    assert stream.finish() == StreamedPart("", (), (InvalidToolCall("x", '{"name": "x"', "call_1", "unterminated"),))


def test_hermes_stream_releases_a_false_alarm():
    stream = ToolCallStream("hermes", counter())
    assert stream.push("a <tool") == StreamedPart("a", ())
    assert stream.push("box> b") == StreamedPart(" <toolbox> b", ())
    assert stream.finish() == StreamedPart("", ())


def test_llama3_stream_passes_text_through_and_holds_calls():
    stream = ToolCallStream("llama3", counter())
    assert stream.push("  ") == StreamedPart("", ())
    assert stream.push("The ") == StreamedPart("  The ", ())
    assert stream.push('{"name": "x", "parameters": {}}') == StreamedPart('{"name": "x", "parameters": {}}', ())
    assert stream.finish() == StreamedPart("", ())
    stream = ToolCallStream("llama3", counter())
    assert stream.push("<|python_") == StreamedPart("", ())
    assert stream.push('tag|>{"name": "x", "parameters": {}}') == StreamedPart("", ())
    assert stream.finish() == StreamedPart("", (ToolCall("x", {}, "call_0"),))


def test_mistral_stream_passes_text_and_emits_calls_when_complete():
    stream = ToolCallStream("mistral", counter())
    assert stream.push("Looking it up [TOOL_") == StreamedPart("Looking it up", ())
    assert stream.push('CALLS][{"name": "a", "arguments": {}}') == StreamedPart("", ())
    assert stream.push("]") == StreamedPart("", (ToolCall("a", {}, "call_0"),))
    assert stream.push('[TOOL_CALLS]b[ARGS]{"x": 1}') == StreamedPart("", (ToolCall("b", {"x": 1}, "call_1"),))
    assert stream.finish() == StreamedPart("", ())


# --- formats, ids and caller errors ---------------------------------------------------------------------------

QWEN = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}# Tools\\n<tools>{%- for tool in tools %}{{ tool | tojson }}"
    '{%- endfor %}</tools>\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n'
    "</tool_call><|im_end|>{%- endif %}"
)
SMOLLM3 = '{%- if xml_tools %}<tool_call>{"name": "tool_name", "arguments": {}}</tool_call>{%- endif %}'
LLAMA31 = (
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- if builtin_tools is defined %}"
    "{{- '<|python_tag|>' + tool_call.name }}{%- else %}{{- '{\"name\": \"' + tool_call.name + '\", ' }}"
    "{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}{%- endif %}{{- '<|eot_id|>' }}"
)
LLAMA32_NO_PYTHON_TAG = (
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}Respond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.{{- "<|eot_id|>" }}'
)
LLAMA3_NO_TOOLS = (
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
)
MISTRAL = "{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- for tool_call in message.tool_calls %}{%- endfor %}"
CHATML = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']}}{% endfor %}"


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        (QWEN, "hermes"),
        (SMOLLM3, "hermes"),
        (LLAMA31, "llama3"),
        (LLAMA32_NO_PYTHON_TAG, "llama3"),
        (MISTRAL, "mistral"),
        (LLAMA3_NO_TOOLS, None),
        (CHATML, None),
        ('{"parameters": 1}', None),  # "parameters" alone is not a Llama template
        ("", None),
        (None, None),
    ],
)
def test_tool_call_format_of_templates(template, fmt):
    assert tool_call_format(template) == fmt


def test_tool_call_format_refuses_a_mapping_of_templates():
    with pytest.raises(InvalidRequestError, match="default one"):
        tool_call_format({"default": QWEN, "tool_use": QWEN})  # type: ignore[arg-type]


def test_default_ids_are_unique_and_prefixed():
    ids = {new_call_id() for _ in range(2000)}
    assert len(ids) == 2000
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call_id) for call_id in ids)
    out = parse_tool_calls(hermes_block("a", {}) * 3 + "<tool_call>{bad}</tool_call>", "hermes")
    found = [call.id for call in out.tool_calls] + [call.id for call in out.invalid_tool_calls]
    assert len(set(found)) == 4 and all(call_id.startswith("call_") for call_id in found)


def test_caller_errors_are_invalid_request_errors():
    with pytest.raises(InvalidRequestError, match="unknown tool-call format 'qwen'"):
        parse_tool_calls("x", "qwen")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="unknown tool-call format"):
        ToolCallStream(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="text must be a string"):
        parse_tool_calls(b"x", "hermes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="new_id"):
        ToolCallStream("hermes", "call_1")  # type: ignore[arg-type]
    stream = ToolCallStream("mistral")
    with pytest.raises(InvalidRequestError, match="delta must be a string"):
        stream.push(None)  # type: ignore[arg-type]
    stream.finish()
    with pytest.raises(InvalidRequestError, match="after finish"):
        stream.push("more")
    with pytest.raises(InvalidRequestError, match="after finish"):
        stream.finish()


# --- offered tools: a call must name one ---------------------------------------------------------------------

INJECTED = {"path": "/"}  # what a tool result told the model to call


def test_hermes_call_of_a_tool_not_offered_stays_content_as_written():
    block = hermes_block("delete_all_files", INJECTED)
    out = parse("Sure.\n" + block + "\n" + hermes_block("get_weather", WEATHER), "hermes", {"get_weather"})
    assert out.content == "Sure.\n" + block  # as written; the newline before the real call goes with it
    alone = "See " + block + " then more."
    assert parse(alone, "hermes", {"get_weather"}) == ParsedOutput(alone, (), ())
    assert out.tool_calls == (ToolCall("get_weather", WEATHER, "call_0"),) and out.invalid_tool_calls == ()


def test_hermes_broken_or_unterminated_call_of_a_tool_not_offered_stays_content():
    for text in ['<tool_call>{"name": "delete_all_files", "arguments": {"path": }</tool_call>',
                 '<tool_call>{"name": "delete_all_files", "arguments": "not json"}</tool_call>',
                 '<tool_call>{"name": "delete_all_files", "arguments": {}']:  # fmt: skip
        assert parse(text, "hermes", {"get_weather"}) == ParsedOutput(text, (), ()), text


def test_llama3_call_of_a_tool_not_offered_and_a_json_answer_stay_content():
    call = json.dumps({"name": "delete_all_files", "parameters": INJECTED})
    assert parse(call, "llama3", {"get_weather"}) == ParsedOutput(call, (), ())
    assert parse("<|python_tag|>" + call, "llama3", {"get_weather"}) == ParsedOutput(call, (), ())
    answer = '{"city": "Paris", "temperature": 21}'
    assert parse(answer, "llama3", {"get_weather"}) == ParsedOutput(answer, (), ())
    both = json.dumps({"name": "get_weather", "parameters": WEATHER}) + "; " + call
    out = parse(both, "llama3", {"get_weather"})
    assert out.content == call and out.tool_calls == (ToolCall("get_weather", WEATHER, "call_0"),)


def test_mistral_call_of_a_tool_not_offered_stays_content():
    listed = [{"name": "delete_all_files", "arguments": INJECTED}, {"name": "get_weather", "arguments": WEATHER}]
    out = parse("[TOOL_CALLS]" + json.dumps(listed), "mistral", {"get_weather"})
    assert out.content == json.dumps(listed[0]) and [c.name for c in out.tool_calls] == ["get_weather"]
    named = "delete_all_files[ARGS]" + json.dumps(INJECTED)
    assert parse("[TOOL_CALLS]" + named, "mistral", {"get_weather"}) == ParsedOutput(named, (), ())
    broken = '[TOOL_CALLS]delete_all_files[ARGS]{"path": }'
    assert parse(broken, "mistral", {"get_weather"}).content == 'delete_all_files[ARGS]{"path": }'


@pytest.mark.parametrize(
    "text",
    [
        'The answer as JSON: {"city": "Paris", "unit": "celsius"}',
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        "```python\nget_weather(city='Paris')\n```",
        "I would call get_weather or delete_all_files, but the answer is already in the documents.",
    ],
)
@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_prose_json_and_code_blocks_are_content_not_calls(fmt, text):
    if fmt == "hermes" and text.startswith("```json"):
        # a json fence holding exactly {"name": <offered tool>, "arguments": {...}} is how small models write a
        # call (#45): hermes takes it as the call, fence and all; any other JSON stays content (cases above)
        parsed = parse(text, fmt, {"get_weather"})
        assert parsed.content == "" and [(c.name, dict(c.arguments)) for c in parsed.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        return
    assert parse(text, fmt, {"get_weather"}) == ParsedOutput(text, (), ())


def test_offered_must_be_names():
    for offered in ["get_weather", [1, 2]]:
        with pytest.raises(InvalidRequestError, match="offered"):
            ToolCallStream("hermes", counter(), offered)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "written", ['{"name": "delete_all_files", "arguments": {}}', '{{"name": "delete_all_files", "arguments": {}}}']
)
def test_a_call_written_without_markup_of_a_tool_not_offered_stays_content(written):
    """The hermes parser takes calls written as bare JSON (lazy grammar, #45); one naming a tool not offered is
    the model's text, kept in the content, not dropped and not a call (#43 item 4)."""
    parsed = parse_tool_calls(f"Sure. {written} done", "hermes", offered=("search",))
    assert parsed.tool_calls == () and parsed.invalid_tool_calls == ()
    assert parsed.content == f"Sure. {written} done"  # as written, not split off by blank lines


@pytest.mark.parametrize(
    ("written", "raw"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Par', '{"name": "get_weather", "arguments": {"city": "Par'),
        ('{{"name": "get_weather", "arguments": {"city": "Paris"}', '{"name": "get_weather", "arguments": {"city": '
         '"Paris"}'),
        ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n', '{\n  "name": "get_weather",\n  "arguments": {'),
    ],
)  # fmt: skip
def test_a_call_written_without_markup_that_the_text_ends_inside_is_an_unterminated_call(written, raw):
    """A call the lazy grammar of tool_choice="auto" started and max_tokens cut off is a call, not the answer's
    text (#45: the agentic study's call-text answers): an invalid call naming the tool, as OpenAI returns a cut
    call, in place of content."""
    parsed = parse_tool_calls("Let me search.\n" + written, "hermes", counter(), offered=("get_weather",))
    assert parsed == ParsedOutput(
        "Let me search.", (), (InvalidToolCall("get_weather", raw, "call_0", "unterminated"),)
    )
    assert streamed("hermes", list("Let me search.\n" + written), {"get_weather"}) == parsed


def test_a_cut_off_or_malformed_text_call_that_is_no_call_of_an_offered_tool_stays_content():
    for text in ['Sure: {"name": "delete_all_files", "arguments": {"path": "/',  # a tool not offered
                 'A record: {"name": "Ali',  # no name given whole
                 'Use {"name": "get_weather", like this.',  # malformed before the end: prose
                 'Then {"name": "get_weather", "arguments": {"city": Paris}} and so on']:  # fmt: skip
        assert parse(text, "hermes", {"get_weather"}) == ParsedOutput(text, (), ()), text


def test_a_malformed_call_is_named_by_its_own_name_not_an_arguments():
    text = '<tool_call>\n{"arguments": {"name": "Kendrick \\"K\\" Lamar", "x": }, "name": "search"}\n</tool_call>'
    (bad,) = parse(text, "hermes").invalid_tool_calls
    assert bad.name == "search"
    doubled = '{{"arguments": {{"name": "inner"}}, "name": "search", "arguments": }}'
    (bad,) = parse(f"<tool_call>\n{doubled}\n</tool_call>", "hermes").invalid_tool_calls
    assert bad.name == "search"
