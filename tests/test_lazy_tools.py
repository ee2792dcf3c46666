"""tool_choice="auto" with a lazy tool-call grammar (issue #45): free text until a trigger, then a call of an
offered tool with arguments valid for its schema, then free text again.

Tiny random models cannot want to call a tool, so the mechanism is tested: the grammar's mask token by token
(free before a trigger, only a valid call after it), a model scripted to write a trigger and left to random
logits after it (the grammar alone completes the call), and the parser of the text forms, whole and streamed.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from tokenizers import AddedToken

from specprefill_rag.backends.vllm import request_outputs, structured_outputs
from specprefill_rag.config import GenerationParams, GrammarLimits, OutputFormat
from specprefill_rag.decode import constraints
from specprefill_rag.decode.constraints import ConstraintCompiler, TokenConstraint
from specprefill_rag.decode.formats import lazy_tool_call_tag
from specprefill_rag.decode.tool_calls import InvalidToolCall, ToolCallStream, parse_tool_calls
from specprefill_rag.decode.tool_choice import tool_decoding
from specprefill_rag.engine import SpecPrefillEngine
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.prompt.chat import ChatMessage
from specprefill_rag.testing import build_family_tokenizer, build_model
from tests.test_chat_tools import TOPIC

needs_xgrammar = pytest.mark.skipif(constraints.xgr is None, reason="xgrammar is not installed")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
BROWSE = TOPIC  # the same enum-constrained tool the forced-call tests use
TOOLS = (WEATHER, BROWSE)
LAZY = OutputFormat("tool_call", tools=TOOLS, tool_format="hermes", lazy=True)
# Ordinary answers: JSON that names no offered tool, code, fences, a tool's name in prose, Qwen's markers' text
# outside a call; none may be constrained.
PLAIN = [
    "The weather in Paris is mild; I could call get_weather or browse, but I know the answer.",
    'As JSON: {"name": "Alice", "age": 3} and {"city": "Paris", "days": 2}.',
    '```json\n{"answer": "yes", "items": [1, 2, {"name": "x"}]}\n```',
    "```python\ndef browse(topic):\n    return {'name': topic}\n```",
    '{"name": "get_weather_forecast", "arguments": {}} is another tool, {"name" : "browse"} is spaced otherwise.',
    'Jinja writes {{ user.name }} and {{"title": "x"}}; {{"name" is not the opening without its quote.',
]


@pytest.fixture(scope="module")
def qwen() -> Any:
    """ChatML plus Qwen's non-special added ``<tool_call>`` / ``</tool_call>`` tokens, Qwen2.5's tool template."""
    return build_family_tokenizer("qwen3")


@pytest.fixture(scope="module")
def compiler(qwen: Any) -> ConstraintCompiler:
    return ConstraintCompiler(qwen, len(qwen))


def write(constraint: TokenConstraint, tokens: list[int]) -> int:
    """Accept ``tokens`` while the mask allows each; how many were allowed."""
    for done, token in enumerate(tokens):
        if not constraint.allowed()[token]:
            return done
        constraint.accept(token)
    return len(tokens)


def ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@needs_xgrammar
@pytest.mark.parametrize("text", PLAIN)
def test_before_a_trigger_every_text_token_is_allowed(qwen, compiler, text):
    constraint = compiler.constraint(LAZY)
    free = constraint.allowed()
    assert int(free.sum()) == len(qwen) - 2  # all but the hidden control tokens: <|im_start|>, <|endoftext|>
    for token in ids(qwen, text):
        assert torch.equal(constraint.allowed(), free), qwen.decode([token])
        constraint.accept(token)
    assert torch.equal(constraint.allowed(), free) and not constraint.finished


@needs_xgrammar
@pytest.mark.parametrize(
    ("start", "call"),
    [
        ('Let me check. {"name": "get_weather"', ', "arguments": {"city": "Paris", "days": 2}}'),
        ('{{"name": "browse"', ', "arguments": {"topic": "rivers"}}}'),  # the template's form: closed doubled
        ('{"name":"browse"', ', "arguments": {"topic": "rivers"}}'),
        ("```json\n" + '{"name": "browse"', ', "arguments": {"topic": "bridges"}}'),
        ("```json\n" + '{\n  "name": "browse"', ', "arguments": {"topic": "bridges"}}'),  # pretty-printed
        ("<tool_call>", '\n{"name": "browse", "arguments": {"topic": "rivers"}}\n</tool_call>'),
    ],
)
def test_after_a_trigger_only_a_valid_call_of_an_offered_tool_and_then_free_text(qwen, compiler, start, call):
    constraint = compiler.constraint(LAZY)
    free = constraint.allowed()
    tokens = ids(qwen, start + call)
    assert write(constraint, tokens) == len(tokens)
    assert torch.equal(constraint.allowed(), free)  # free again after the call
    for wrong in [', "parameters": {}}', ', "arguments": {"topic": "lakes"}}', ', "arguments": {"city": 1}}']:
        constraint = compiler.constraint(LAZY)
        tokens = ids(qwen, start + wrong)
        assert write(constraint, tokens) < len(tokens), wrong


@needs_xgrammar
def test_a_marker_cannot_open_a_call_of_a_tool_not_offered(qwen, compiler):
    constraint = compiler.constraint(LAZY)
    prefix = ids(qwen, '<tool_call>\n{"name": "')
    assert write(constraint, prefix) == len(prefix)
    allowed = constraint.allowed()
    firsts = {qwen.decode([token]) for token in allowed.nonzero().flatten().tolist()}
    assert firsts and all("get_weather".startswith(t) or "browse".startswith(t) for t in firsts), firsts
    tokens = ids(qwen, 'delete_all_files", "arguments": {}}')
    assert write(compiler.constraint(LAZY), prefix + tokens) < len(prefix + tokens)


@needs_xgrammar
@pytest.mark.parametrize("opening", ['{{"name": "', '{{"name":"', 'I will look it up.\n{{ "name": "'])
def test_the_templates_doubled_opening_makes_the_name_an_offered_tools(qwen, compiler, opening):
    # the real pair's first steps wrote {{"name": "Elizabeth Stanley", "arguments": {"query": ...}}} (issue #45)
    prefix = ids(qwen, opening)
    constraint = compiler.constraint(LAZY)
    assert write(constraint, prefix) == len(prefix)
    firsts = {qwen.decode([token]) for token in constraint.allowed().nonzero().flatten().tolist()}
    assert firsts and all("get_weather".startswith(t) or "browse".startswith(t) for t in firsts), firsts
    entity = ids(qwen, opening + 'Elizabeth Stanley", "arguments": {"query": "her father"}}}')
    assert write(compiler.constraint(LAZY), entity) < len(entity)
    call = ids(qwen, opening + 'browse", "arguments": {"topic": "rivers"}}} Done.')
    assert write(compiler.constraint(LAZY), call) == len(call)


@needs_xgrammar
def test_one_call_only_without_parallel_calls(qwen, compiler):
    single = OutputFormat("tool_call", tools=TOOLS, tool_format="hermes", parallel=False, lazy=True)
    constraint = compiler.constraint(single)
    tokens = ids(qwen, 'Ok. {"name": "browse", "arguments": {"topic": "rivers"}}')
    assert write(constraint, tokens) == len(tokens)
    assert constraint.finished  # nothing but the end may follow


@needs_xgrammar
@pytest.mark.parametrize(
    ("family", "call", "wrong"),
    [
        ("llama3", '{"name": "browse", "parameters": {"topic": "rivers"}}', '{"name": "browse", "arguments": {}}'),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "browse", "arguments": {"topic": "rivers"}}]',
            '[TOOL_CALLS][{"name": "delete_all_files", "arguments": {}}]',
        ),
    ],
)
def test_the_other_families_calls_are_lazy_too(family, call, wrong):
    tokenizer = build_family_tokenizer(family)
    if family == "mistral":  # a special (control) token, as in Mistral v0.3: kept visible as a marker
        tokenizer.add_tokens([AddedToken("[TOOL_CALLS]", special=True)])
    family_compiler = ConstraintCompiler(tokenizer, len(tokenizer))
    lazy = OutputFormat("tool_call", tools=TOOLS, tool_format=family, lazy=True)
    for text, whole in [(PLAIN[1] + " " + call + " Done.", True), (PLAIN[1] + " " + wrong, False)]:
        tokens = ids(tokenizer, text)
        assert (write(family_compiler.constraint(lazy), tokens) == len(tokens)) is whole, text


def test_the_lazy_tag_triggers_on_the_marker_and_each_offered_tool_by_name():
    tag = lazy_tool_call_tag(LAZY)["format"]
    assert tag["type"] == "triggered_tags"
    openings = ['{{"name": "{}"', '{{"name":"{}"', '{{ "name": "{}"', '{{\n  "name": "{}"', '{{\n    "name": "{}"']
    names = ["get_weather", "browse"]
    template = ['{{"name": "', '{{"name":"', '{{ "name": "']
    bare = [opening.format(name) for name in names for opening in openings]
    assert tag["triggers"] == ["<tool_call>", *template, *bare]
    assert all(any(t["begin"].startswith(trigger) for trigger in tag["triggers"]) for t in tag["tags"])


# The engine: a model scripted to write a trigger, random after it.


@contextmanager
def scripted(model: Any, tokens: list[int]) -> Iterator[None]:
    """``model`` writes ``tokens`` first (their logits raised far above the rest), then its own random logits."""
    calls = itertools.count()

    def raise_script(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        step = next(calls)
        if step < len(tokens):
            output.logits[0, -1, tokens[step]] += 1e4
        return output

    handle = model.register_forward_hook(raise_script, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def model(qwen):
    return build_model(qwen, layers=2)


def engine(model, qwen, **settings):
    return SpecPrefillEngine.from_models(model, qwen, keep_rate=1.0, min_prompt_tokens=0, **settings)


QUESTION = [ChatMessage("user", ["Which topic should I browse?"])]
# The marker alone may open either tool's call; the random model is given the name (a string of get_weather's
# could run past max_new_tokens).
TRIGGERS = ['{"name": "browse"', '{{"name": "browse"', '```json\n{"name": "browse"', '<tool_call>\n{"name": "browse"']


@needs_xgrammar
@pytest.mark.parametrize("trigger", TRIGGERS)
def test_auto_completes_a_call_a_model_starts_whole_and_streamed(qwen, model, trigger):
    lazy = engine(model, qwen)
    script = ids(qwen, "Let me look. " + trigger)
    with scripted(model, script):
        result = lazy.chat(QUESTION, tools=[WEATHER, BROWSE], max_new_tokens=120, seed=0)
    [call] = result.tool_calls[:1]
    assert call.name == "browse" and dict(call.arguments)["topic"] in ("bridges", "rivers")
    assert result.text.startswith("Let me look.") and "browse" not in result.text
    with scripted(model, script):
        chunks = list(lazy.stream_chat(QUESTION, tools=[WEATHER, BROWSE], max_new_tokens=120, seed=0))
    streamed = [c for chunk in chunks for c in chunk.tool_calls]
    assert [(c.name, dict(c.arguments)) for c in streamed] == [(c.name, dict(c.arguments)) for c in result.tool_calls]


@needs_xgrammar
def test_a_call_in_the_templates_form_naming_an_entity_becomes_a_call_of_the_offered_tool(qwen, model):
    written = 'Let me look. {{"name": "Elizabeth Stanley", "arguments": {"query": "her father"}}}'
    with scripted(model, ids(qwen, written)):
        lazy = engine(model, qwen).chat(QUESTION, tools=[BROWSE], max_new_tokens=60, seed=0)
    [call] = lazy.tool_calls
    assert call.name == "browse" and dict(call.arguments)["topic"] in ("bridges", "rivers")
    assert lazy.text == "Let me look."
    with scripted(model, ids(qwen, written)):
        chunks = list(engine(model, qwen).stream_chat(QUESTION, tools=[BROWSE], max_new_tokens=60, seed=0))
    assert [(c.name, dict(c.arguments)) for chunk in chunks for c in chunk.tool_calls] == [(call.name, call.arguments)]
    script = ids(qwen, written)
    with scripted(model, script):
        free = engine(model, qwen, lazy_tool_grammar=False).chat(QUESTION, tools=[BROWSE], max_new_tokens=len(script))
    assert free.tool_calls == () and written.removeprefix("Let me look. ") in free.text  # stays the answer's text


@needs_xgrammar
def test_with_the_setting_off_the_random_continuation_is_no_call(qwen, model):
    free = engine(model, qwen, lazy_tool_grammar=False)
    with scripted(model, ids(qwen, '{"name": "browse"')):
        result = free.chat(QUESTION, tools=[WEATHER, BROWSE], max_new_tokens=120, seed=0)
    assert result.tool_calls == () and result.text.startswith('{"name": "browse"')


@needs_xgrammar
def test_an_ordinary_answer_is_unchanged_by_the_lazy_grammar(qwen, model):
    answers = []
    for lazy in (True, False):
        with scripted(model, ids(qwen, PLAIN[1])):
            answers.append(
                engine(model, qwen, lazy_tool_grammar=lazy).chat(QUESTION, tools=list(TOOLS), max_new_tokens=30, seed=0)
            )
    assert answers[0].text == answers[1].text and answers[0].tool_calls == ()


@needs_xgrammar
def test_tools_over_the_limits_fall_back_to_parsing_under_auto_but_not_when_forced(qwen, model, caplog):
    limited = engine(model, qwen, max_enum_values=2)
    huge = {
        "type": "function",
        "function": {"name": "pick", "parameters": {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}}},
    }
    with (
        caplog.at_level(logging.WARNING),
        scripted(model, ids(qwen, '<tool_call>\n{"name": "pick", "arguments": {}}\n</tool_call>')),
    ):
        result = limited.chat(QUESTION, tools=[huge], max_new_tokens=30, seed=0)
    assert [c.name for c in result.tool_calls] == ["pick"]  # parsed as written
    assert "without its lazy tool-call grammar" in caplog.text and "enum" in caplog.text
    with pytest.raises(InvalidRequestError, match="enum"):
        limited.chat(QUESTION, tools=[huge], tool_choice="pick", max_new_tokens=4)


def test_tool_choice_auto_is_lazy_only_when_asked_and_the_others_are_unchanged(qwen):
    tools = (WEATHER, BROWSE)
    auto = tool_decoding(qwen, tools, "auto", lazy=True)["output_format"]
    assert auto == OutputFormat("tool_call", tools=tools, tool_format="hermes", parallel=True, lazy=True)
    assert "output_format" not in tool_decoding(qwen, tools, "auto", lazy=False)
    assert tool_decoding(qwen, tools, "none", lazy=True) == {}
    for choice, offered in [("required", tools), ("browse", (BROWSE,))]:
        forced = tool_decoding(qwen, tools, choice, lazy=True)["output_format"]
        assert forced.tools == offered and not forced.lazy
    assert GenerationParams(**tool_decoding(qwen, tools, None, lazy=True)).output_format.lazy


def test_a_vllm_main_gets_the_lazy_tag_and_falls_back_over_the_limits():
    outputs = structured_outputs(LAZY, None)
    assert '"triggered_tags"' in outputs["structural_tag"] and '{\\"name\\": \\"browse\\"' in outputs["structural_tag"]
    tight = GrammarLimits(max_enum_values=1)
    assert request_outputs(LAZY, None, tight) is None
    with pytest.raises(InvalidRequestError, match="enum"):
        request_outputs(OutputFormat("tool_call", tools=TOOLS, tool_format="hermes"), {}, tight)


# The hermes parser: calls written without markup.

TEXT_FORMS = [
    ('I will search.\n{{"name": "browse", "arguments": {"topic": "rivers"}}}', "I will search."),
    ('```json\n{"name": "browse", "arguments": {"topic": "rivers"}}\n```\nDone.', "Done."),
    ('{{"name": "browse", "arguments": {"topic": "rivers"}}}}', ""),  # the rest of doubled arguments' braces
    ('```json\n{{"name": "browse", "arguments": {"topic": "rivers"}}}\n```', ""),
    ('{"name": "browse", "arguments": {"topic": "rivers"}}', ""),
    ('Ok {"name": "browse", "parameters": {"topic": "rivers"}} then', "Ok\n\nthen"),
    ('{"name":"browse","arguments":{"topic":"rivers"}}', ""),
    # pretty-printed inside a fence, as the real pair wrote 24 of its calls in the agentic study (#45)
    ('```json\n{\n  "name": "browse",\n  "arguments": {\n    "topic": "rivers"\n  }\n}\n```', ""),
    ('Searching.\n{ "name" : "browse", "arguments": {"topic": "rivers"} }', "Searching."),
]


def parse_both(text: str) -> tuple[Any, Any]:
    """The blocking parse and the parse streamed one character at a time, as (content, calls, invalid)."""
    whole = parse_tool_calls(text, "hermes", lambda: "id")
    stream = ToolCallStream("hermes", lambda: "id")
    parts = [stream.push(ch) for ch in text] + [stream.finish()]
    streamed = (
        "".join(p.content for p in parts),
        sum((p.tool_calls for p in parts), ()),
        sum((p.invalid_tool_calls for p in parts), ()),
    )
    return (whole.content, whole.tool_calls, whole.invalid_tool_calls), streamed


@pytest.mark.parametrize(("text", "content"), TEXT_FORMS)
def test_hermes_parses_a_call_written_without_markup_whole_and_streamed(text, content):
    whole, streamed = parse_both(text)
    assert whole == streamed
    assert whole[0] == content and [(c.name, dict(c.arguments)) for c in whole[1]] == [("browse", {"topic": "rivers"})]


# PLAIN[4] writes a call of a tool not offered: the parser alone takes it as a call (the offered names decide).
@pytest.mark.parametrize(
    "text", [*PLAIN[:4], 'bad {"name": "x", "arguments": {]} end', '{"name": "x", "arguments": {}, "id": 1}']
)
def test_hermes_leaves_json_that_is_no_call_as_content(text):
    whole, streamed = parse_both(text)
    assert whole == streamed == (text, (), ())


def test_hermes_takes_a_call_the_text_ends_inside_as_an_unterminated_call():
    """max_tokens cut the call off: an invalid call (any name counts when none were offered), not content."""
    whole, streamed = parse_both('bad {"name": "x", "arguments": {')
    assert (
        whole == streamed == ("bad", (), (InvalidToolCall("x", '{"name": "x", "arguments": {', "id", "unterminated"),))
    )


def test_without_xgrammar_auto_still_parses_the_calls(qwen, model, monkeypatch, caplog):
    monkeypatch.setattr(constraints, "xgr", None)
    script = ids(qwen, '<tool_call>\n{"name": "browse", "arguments": {"topic": "rivers"}}\n</tool_call>')
    with caplog.at_level(logging.WARNING), scripted(model, script):
        result = engine(model, qwen).chat(QUESTION, tools=list(TOOLS), max_new_tokens=len(script), seed=0)
    assert [(c.name, dict(c.arguments)) for c in result.tool_calls] == [("browse", {"topic": "rivers"})]
    assert "specprefill-rag[constrained]" in caplog.text  # the warning says how to get the grammar
