"""The tool-call structural tag as data (specprefill_rag.decode.formats): one builder for the in-process compiler
and a vLLM main. Walks over the compiled grammar are in tests/test_constraints.py; vLLM enforcing it is in
tests/vllm/test_tool_choice.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizers import AddedToken

from specprefill_rag.config import OutputFormat
from specprefill_rag.decode import constraints
from specprefill_rag.decode.formats import TOOL_MARKERS, marker_tokens, tool_call_structural_tag
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.testing import build_family_tokenizer, build_tokenizer
from tests.test_constraints import CLOCK, TOOLS, WEATHER

needs_xgrammar = pytest.mark.skipif(constraints.xgr is None, reason="xgrammar is not installed")
QWEN_MARKERS = {"<tool_call>": 402, "</tool_call>": 403}


def pieces(tag: Any, kind: str) -> list[dict[str, Any]]:
    """Every piece of ``kind`` in the tag, depth first."""
    found = []
    if isinstance(tag, dict):
        if tag.get("type") == kind:
            found.append(tag)
        for value in tag.values():
            found += pieces(value, kind)
    elif isinstance(tag, list):
        for value in tag:
            found += pieces(value, kind)
    return found


def test_the_tag_is_plain_json_and_names_each_tool_with_its_schema():
    fmt = OutputFormat("tool_call", tools=TOOLS, tool_format="hermes")
    tag = tool_call_structural_tag(fmt, QWEN_MARKERS)
    assert json.loads(json.dumps(tag)) == tag
    assert tag["type"] == "structural_tag"
    heads = {piece["value"] for piece in pieces(tag, "const_string")}
    assert '\n{"name": "get_weather", "arguments": ' in heads and '\n{"name": "get_time", "arguments": ' in heads
    schemas = [piece["json_schema"] for piece in pieces(tag, "json_schema")]
    assert WEATHER["function"]["parameters"] in schemas and CLOCK["function"]["parameters"] in schemas
    assert all(piece["max_whitespace_cnt"] == 1 for piece in pieces(tag, "json_schema"))


def test_single_token_markers_go_as_their_ids_and_the_others_as_text():
    fmt = OutputFormat("tool_call", tools=(CLOCK,), tool_format="hermes", parallel=False)
    with_tokens = tool_call_structural_tag(fmt, QWEN_MARKERS)
    assert [piece["token"] for piece in pieces(with_tokens, "token")] == [402, 403]
    assert not any("tool_call>" in piece["value"] for piece in pieces(with_tokens, "const_string"))
    as_text = tool_call_structural_tag(fmt, {})
    assert pieces(as_text, "token") == []
    texts = [piece["value"] for piece in pieces(as_text, "const_string")]
    assert texts[0] == "<tool_call>" and texts[-1] == "</tool_call>"


def test_one_call_or_many():
    one_tool = OutputFormat("tool_call", tools=(CLOCK,), tool_format="llama3", parallel=False)
    assert pieces(tool_call_structural_tag(one_tool, {}), "or") == []
    assert pieces(tool_call_structural_tag(one_tool, {}), "star") == []
    many = OutputFormat("tool_call", tools=TOOLS, tool_format="llama3", parallel=True)
    tag = tool_call_structural_tag(many, {})
    [star] = pieces(tag, "star")
    assert star["content"]["elements"][0] == {"type": "const_string", "value": "; "}
    assert len(pieces(tag, "or")) == 2  # the first call and each further one: either tool


def test_mistral_wraps_the_list_after_its_marker():
    fmt = OutputFormat("tool_call", tools=(WEATHER,), tool_format="mistral", parallel=False)
    elements = tool_call_structural_tag(fmt, {"[TOOL_CALLS]": 7})["format"]["elements"]
    assert elements[0] == {"type": "token", "token": 7}
    assert elements[1] == {"type": "const_string", "value": "["} and elements[-1] == {
        "type": "const_string",
        "value": "]",
    }
    spelled = tool_call_structural_tag(fmt, {})["format"]["elements"]
    assert spelled[0] == {"type": "const_string", "value": "[TOOL_CALLS]"}


@pytest.mark.parametrize(
    "fmt, problem",
    [
        (OutputFormat("json_object"), "kind='tool_call'"),
        (OutputFormat("tool_call", tools=(WEATHER, WEATHER), tool_format="hermes"), "'get_weather' repeat"),
        (OutputFormat("tool_call", tools=TOOLS), "tool_format"),
    ],
)
def test_a_format_that_is_no_valid_tool_call_is_refused(fmt, problem):
    with pytest.raises(InvalidRequestError, match=problem):
        tool_call_structural_tag(fmt, {})


def test_marker_tokens_finds_the_single_token_markers_of_a_vocabulary():
    qwen = build_family_tokenizer("qwen3")
    assert marker_tokens(qwen, len(qwen)) == {
        "<tool_call>": qwen.convert_tokens_to_ids("<tool_call>"),
        "</tool_call>": qwen.convert_tokens_to_ids("</tool_call>"),
    }
    mistral = build_family_tokenizer("mistral")
    mistral.add_tokens([AddedToken("[TOOL_CALLS]", special=True)])
    assert marker_tokens(mistral, len(mistral)) == {"[TOOL_CALLS]": mistral.convert_tokens_to_ids("[TOOL_CALLS]")}
    chatml = build_tokenizer()
    assert marker_tokens(chatml, len(chatml)) == {}  # spelled in several tokens
    assert marker_tokens(qwen, qwen.convert_tokens_to_ids("<tool_call>")) == {}  # ids at or past the logits' width
    assert set(TOOL_MARKERS) == {"<tool_call>", "</tool_call>", "[TOOL_CALLS]"}


@needs_xgrammar
@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral"])
def test_the_tag_passes_xgrammars_check_without_a_tokenizer(family):
    """What vLLM runs on a request's structural tag before it reaches the engine (validate_xgrammar_grammar)."""
    xgr = constraints.xgr
    fmt = OutputFormat("tool_call", tools=TOOLS, tool_format=family)
    markers = {"<tool_call>": 402, "</tool_call>": 403, "[TOOL_CALLS]": 400}
    tag = tool_call_structural_tag(fmt, markers)
    xgr.Grammar.from_structural_tag(json.dumps(tag))
    named = {id(piece): piece for piece in pieces(tag, "token")}.values()  # calls repeat: each piece once
    assert bool(named) == (family != "llama3")
    if named:
        texts = {index: text for text, index in markers.items()}
        for piece in named:
            piece["token"] = texts[piece["token"]]
        with pytest.raises(Exception, match="tokenizer"):  # a token named by its text needs one; vLLM's has none
            xgr.Grammar.from_structural_tag(json.dumps(tag))
