"""Output formats over a GrammarLimits bound are refused before compiling; dead ends and deep calls are not 500s."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from specprefill_rag.backends.vllm import structured_outputs
from specprefill_rag.config import GrammarLimits, OutputFormat, SpecPrefillConfig
from specprefill_rag.decode.constraints import ConstraintCompiler, json_grammar
from specprefill_rag.decode.schema_limits import check_format_limits, pattern_repetition
from specprefill_rag.decode.tool_calls import MAX_CALL_DEPTH, parse_tool_calls
from specprefill_rag.errors import OutputFormatError
from specprefill_rag.serve import GatewaySettings
from specprefill_rag.testing import build_tokenizer

LIMITS = GrammarLimits()


def _schema(**schema):
    return OutputFormat("json_schema", schema=schema)


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize(
    ("pattern", "repeat", "nested"),
    [
        ("^[a-z]{40000}$", 40000, 1),
        ("^(([a-z]{1,50}){1,50})$", 2500, 2500),
        (r"^((25[0-5]|2[0-4]\d|1?\d{1,2})\.){3}(25[0-5]|2[0-4]\d|1?\d{1,2})$", 6, 6),
        (r"^([0-9a-f]{2}:){5}[0-9a-f]{2}$", 10, 10),
        (r"^\d+-[a-z]*$", 1, 1),
        (r"\p{L}{3}", 3, 1),  # the braces of \p{L} are not a count
        (r"[{]{5}x\{9}", 5, 1),  # nor a brace in a class, or an escaped one
        ("(a{2,}){3}", 6, 6),
    ],
)
def test_pattern_repetition_multiplies_nested_counts(pattern, repeat, nested):
    assert pattern_repetition(pattern) == (repeat, nested)


@pytest.mark.parametrize(
    ("fmt", "says"),
    [
        (_schema(type="string", pattern="^[a-z]{40000}$"), "max_pattern_repeat"),
        (_schema(type="string", pattern="^(([a-z]{1,10}){1,10})$"), "max_pattern_nested_repeat"),
        (_schema(type="string", pattern="a" * 2000), "max_pattern_chars"),
        (_schema(anyOf=[{"const": i} for i in range(600)]), "max_schema_branches"),
        (_schema(enum=list(range(2000))), "max_enum_values"),
        (_schema(**_nested(40)), "max_schema_depth"),
        (_schema(type="object", properties={f"k{i}": {"type": "string"} for i in range(8000)}), "max_schema_bytes"),
        (_schema(type="object", patternProperties={"^[a-z]{5000}$": {}}), "max_pattern_repeat"),
    ],
)
def test_a_format_over_a_limit_is_refused_naming_the_limit(fmt, says):
    with pytest.raises(OutputFormatError, match=says) as caught:
        check_format_limits(fmt, LIMITS)
    assert caught.value.tool is None


def test_a_pattern_inside_data_is_not_a_regular_expression():
    fmt = _schema(type="object", default={"pattern": "a{9999}"}, enum=[{"pattern": "b{9999}"}])
    check_format_limits(fmt, LIMITS)


def test_a_forced_calls_limit_names_the_tool():
    tools = (
        _tool("ok", {"type": "object"}),
        _tool("wide", {"type": "object", "properties": {"x": {"enum": list(range(5000))}}}),
    )
    with pytest.raises(OutputFormatError, match="tool 'wide'") as caught:
        check_format_limits(OutputFormat("tool_call", tools=tools, tool_format="hermes"), LIMITS)
    assert caught.value.tool == "wide"


def test_the_tools_sizes_add_up():
    parameters = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(40)}}
    size = len(json.dumps(parameters, separators=(",", ":")))
    limits = GrammarLimits(max_schema_bytes=max(1024, size * 2 + 1))
    tools = tuple(_tool(f"t{i}", parameters) for i in range(3))
    check_format_limits(OutputFormat("tool_call", tools=tools[:2], tool_format="hermes"), limits)
    with pytest.raises(OutputFormatError, match="together"):
        check_format_limits(OutputFormat("tool_call", tools=tools, tool_format="hermes"), limits)


def test_limits_are_settings_with_bounds():
    assert SpecPrefillConfig(max_pattern_repeat=5000).max_pattern_repeat == 5000
    with pytest.raises(ValidationError, match="max_schema_depth"):
        GrammarLimits(max_schema_depth=0)
    with pytest.raises(ValidationError, match="grammar_cache_mb"):
        SpecPrefillConfig(grammar_cache_mb="64")
    check_format_limits(_schema(type="string", pattern="^[a-z]{4000}$"), GrammarLimits(max_pattern_repeat=4000))


def test_a_schema_nested_past_the_recursion_limit_is_refused_before_it_is_serialised():
    tokenizer = build_tokenizer()
    compiler = ConstraintCompiler(tokenizer, len(tokenizer))
    deep = _schema(**_nested(5000))  # json.dumps of it raises RecursionError
    with pytest.raises(OutputFormatError, match="max_schema_depth"):
        compiler.compiled(deep)
    with pytest.raises(OutputFormatError, match="max_schema_depth"):
        json_grammar(deep)
    assert compiler.compiles == 0


def test_an_over_limit_pattern_is_never_compiled():
    tokenizer = build_tokenizer()
    compiler = ConstraintCompiler(tokenizer, len(tokenizer))
    with pytest.raises(OutputFormatError, match="repeats 40000 times"):
        compiler.compiled(_schema(type="string", pattern="^[a-z]{40000}$"))
    assert compiler.compiles == 0 and compiler.cached == 0


def test_a_grammar_dead_end_is_an_output_format_error_not_a_crash():
    tokenizer = build_tokenizer()
    compiler = ConstraintCompiler(tokenizer, len(tokenizer))
    constraint = compiler.constraint(_schema(type="string", pattern=r"[^\s\S]"))  # no string matches
    opening = int(constraint.allowed().nonzero()[0][0])  # the opening quote
    constraint.accept(opening)
    with pytest.raises(OutputFormatError, match="cannot be completed") as caught:
        constraint.allowed()
    assert caught.value.kind == "json_schema"


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral"])
def test_a_call_nested_past_the_recursion_limit_is_an_invalid_call_not_a_crash(family):
    deep = "[" * 5000 + "]" * 5000
    arguments = f'{{"x": {deep}}}'
    text = {
        "hermes": f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>',
        "llama3": f'{{"name": "f", "parameters": {arguments}}}',
        "mistral": f'[TOOL_CALLS][{{"name": "f", "arguments": {arguments}}}]',
    }[family]
    parsed = parse_tool_calls(text, family)
    assert parsed.tool_calls == ()
    assert len(parsed.invalid_tool_calls) == 1
    assert f"nested deeper than {MAX_CALL_DEPTH} levels" in parsed.invalid_tool_calls[0].error


def test_a_call_within_the_depth_bound_still_parses():
    arguments = "[" * 100 + "]" * 100
    parsed = parse_tool_calls(
        f'<tool_call>\n{{"name": "f", "arguments": {{"x": {arguments}}}}}\n</tool_call>', "hermes"
    )
    assert len(parsed.tool_calls) == 1


def test_the_gateways_limits_reach_its_engine_and_a_vllm_main_checks_them_too():
    settings = GatewaySettings(max_schema_bytes=2048, max_enum_values=4)
    config = settings.engine_config()
    assert (config.max_schema_bytes, config.max_enum_values) == (2048, 4)
    wide = _schema(enum=list(range(5)))
    structured_outputs(wide)  # within the defaults
    with pytest.raises(OutputFormatError, match="max_enum_values"):
        structured_outputs(wide, limits=config)
