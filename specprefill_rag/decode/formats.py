"""Output formats as data: checking an :class:`OutputFormat`, and the xgrammar structural tag of a tool_call format.

The one place the tool-call grammar is written. :func:`tool_call_structural_tag` returns plain JSON data (a dict in
xgrammar's structural-tag schema), which the in-process compiler (:mod:`~specprefill_rag.decode.constraints`)
compiles itself and a vLLM main compiles from ``structured_outputs.structural_tag`` with its own xgrammar. No
xgrammar, vLLM or torch is needed here, so the gateway builds the tag whatever is installed.

A tool-call marker that the main model's tokenizer writes as one token (Qwen's ``<tool_call>``, Mistral's
``[TOOL_CALLS]``) is a ``{"type": "token", "token": <id>}`` piece: the model must write that token, the way it
was trained to, not the marker's text spelled in pieces. The id, not the token's text, goes into the tag: vLLM
checks a structural tag without its tokenizer (``xgr.Grammar.from_structural_tag`` in
``vllm/v1/structured_output/backend_xgrammar.py``, ``validate_xgrammar_grammar``), and a token named by its
text cannot be resolved there, so only an id passes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from ..config import OutputFormat
from ..errors import InvalidRequestError

# In tool-call arguments: one whitespace character in a row (the families' own format is json.dumps's,
# `{"a": 1, "b": 2}`), so the call stays short and a small model spends its tokens on the arguments, not on layout.
CALL_WHITESPACE = 1
TOOL_FORMATS = ("hermes", "llama3", "mistral")
# Markup of each tool-call family: text before and after one call, the separator between calls, and the
# text around the whole list. A marker that is one token of the vocabulary is forced as that token.
_CALL_OPEN = {"hermes": "<tool_call>", "llama3": "", "mistral": ""}
_CALL_CLOSE = {"hermes": "</tool_call>", "llama3": "", "mistral": ""}
_ARGUMENTS_KEY = {"hermes": "arguments", "llama3": "parameters", "mistral": "arguments"}
_SEPARATOR = {"hermes": "\n", "llama3": "; ", "mistral": ", "}
_LIST_OPEN = {"hermes": "", "llama3": "", "mistral": "[TOOL_CALLS]"}
TOOL_MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def validate_format(fmt: OutputFormat) -> None:
    """Raise :class:`~specprefill_rag.errors.InvalidRequestError` for a malformed format, before compiling.

    Checks the fields each kind needs and forbids the ones it does not use; a schema must be a JSON object
    (a dict) that serialises to JSON; tools need ``function.name`` (unique) and an object ``parameters``.
    """
    if fmt.kind not in ("json_object", "json_schema", "tool_call"):
        raise InvalidRequestError(
            f"unknown output format kind {fmt.kind!r}; use 'json_object', 'json_schema' or 'tool_call'"
        )
    if fmt.kind != "json_schema" and fmt.schema is not None:
        raise InvalidRequestError(f"`schema` is for kind='json_schema', not kind={fmt.kind!r}")
    if fmt.kind != "tool_call" and (fmt.tools or fmt.tool_format is not None or fmt.lazy):
        raise InvalidRequestError(f"`tools`, `tool_format` and `lazy` are for kind='tool_call', not kind={fmt.kind!r}")
    if fmt.kind == "json_schema":
        if not isinstance(fmt.schema, Mapping):
            raise InvalidRequestError(
                f"kind='json_schema' needs `schema`, a JSON Schema object (a dict); got {type(fmt.schema).__name__}"
            )
        as_json(fmt.schema, "the JSON schema")
    elif fmt.kind == "tool_call":
        if fmt.tool_format not in TOOL_FORMATS:
            raise InvalidRequestError(
                f"kind='tool_call' needs `tool_format`, one of {', '.join(TOOL_FORMATS)}; got {fmt.tool_format!r}"
            )
        if not fmt.tools:
            raise InvalidRequestError("kind='tool_call' needs at least one tool in `tools`")
        names = [name for name, _ in _tools(fmt)]
        duplicated = sorted({name for name in names if names.count(name) > 1})
        if duplicated:
            raise InvalidRequestError(f"tool names must be unique; {', '.join(map(repr, duplicated))} repeat")


def as_json(value: Any, what: str) -> Any:
    """``value`` as plain JSON data (dicts, lists, ...), or InvalidRequestError when it is not JSON."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise InvalidRequestError(f"{what} is not JSON-serialisable: {error}") from error


def _tools(fmt: OutputFormat) -> list[tuple[str, dict[str, Any]]]:
    """``(name, parameters schema)`` of each tool of a tool_call format, checked."""
    return [_tool(index, tool) for index, tool in enumerate(fmt.tools)]


def _tool(index: int, tool: Any) -> tuple[str, dict[str, Any]]:
    """One OpenAI tool schema's name and parameters (the empty object when it takes none)."""
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise InvalidRequestError(
            f'tool {index} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}'
        )
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequestError(f"tool {index} has no `function.name` (a non-empty string)")
    name: str = function["name"]
    parameters = function.get("parameters")
    if parameters is None or (isinstance(parameters, Mapping) and not parameters):
        return name, dict(_NO_PARAMETERS)
    if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        got = parameters.get("type") if isinstance(parameters, Mapping) else type(parameters).__name__
        raise InvalidRequestError(
            f'the parameters of tool {name!r} must be an object schema ({{"type": "object", "properties": '
            f"...}}); got {got!r}"
        )
    return name, as_json(parameters, f"the parameters of tool {name!r}")


def marker_tokens(tokenizer: Any, vocab_size: int, markers: Iterable[str] = TOOL_MARKERS) -> dict[str, int]:
    """Each of ``markers`` that ``tokenizer`` writes as exactly one token (an id below ``vocab_size``), with its id."""
    found = {}
    for text in markers:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and 0 <= ids[0] < vocab_size:
            found[text] = int(ids[0])
    return found


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _sequence(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}


def _marker(text: str, markers: Mapping[str, int]) -> dict[str, Any]:
    """Fixed markup text: the single token when ``text`` is one of ``markers``."""
    return {"type": "token", "token": markers[text]} if text in markers else _const(text)


def _call(family: str, name: str, parameters: dict[str, Any], markers: Mapping[str, int]) -> dict[str, Any]:
    """One tool call of ``family`` naming ``name``, its arguments valid for ``parameters``."""
    newline = "\n" if family == "hermes" else ""
    head = f'{newline}{{"name": {json.dumps(name, ensure_ascii=False)}, "{_ARGUMENTS_KEY[family]}": '
    arguments = {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": CALL_WHITESPACE}
    pieces = [_const(head), arguments, _const("}" + newline)]
    if _CALL_OPEN[family]:
        pieces.insert(0, _marker(_CALL_OPEN[family], markers))
    if _CALL_CLOSE[family]:
        pieces.append(_marker(_CALL_CLOSE[family], markers))
    return _sequence(*pieces)


def tool_call_structural_tag(fmt: OutputFormat, markers: Mapping[str, int]) -> dict[str, Any]:
    """The xgrammar structural tag of a tool_call format, as JSON data: one call (``fmt.parallel`` False) or
    calls joined by the family's separator, each naming one of ``fmt.tools`` with arguments valid for its
    parameters. ``markers`` are the marker texts the main tokenizer writes as one token, with their ids
    (:func:`marker_tokens`); the others are spelled as text. A ``lazy`` format's tag is
    :func:`lazy_tool_call_tag`'s. InvalidRequestError for a malformed format.
    """
    validate_format(fmt)
    if fmt.kind != "tool_call" or fmt.tool_format is None:
        raise InvalidRequestError(f"a structural tag is built for kind='tool_call', not kind={fmt.kind!r}")
    if fmt.lazy:
        return lazy_tool_call_tag(fmt)
    family = fmt.tool_format
    calls = [_call(family, name, parameters, markers) for name, parameters in _tools(fmt)]
    body = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    if fmt.parallel:
        more = _sequence(_const(_SEPARATOR[family]), body)
        body = _sequence(body, {"type": "star", "content": more})
    if family == "mistral":
        body = _sequence(_marker(_LIST_OPEN[family], markers), _const("["), body, _const("]"))
    return {"type": "structural_tag", "format": body}


# How JSON written without markup opens a call: as json.dumps writes it, compact, with a space, and pretty-printed
# with 2 or 4 spaces (small models write that inside a json fence: 24 of 60 HotpotQA agent runs, issue #45).
_TEXT_CALL_OPENINGS = ('{{"name": {}', '{{"name":{}', '{{ "name": {}', '{{\n  "name": {}', '{{\n    "name": {}')


# How Qwen2.5's chat template shows a call: ``{{"name": <function-name>, "arguments": <args-json-object>}}``, doubled
# braces included. Small models copy it and fill the name with an entity of the question rather than the tool (9 of
# 60 HotpotQA agent runs' first steps, issue #45). No JSON value opens with two braces, so the template's opening is
# taken as the family's marker: once written, the name must be an offered tool's.
TEMPLATE_CALL_OPENINGS = ('{{"name": "', '{{"name":"', '{{ "name": "')


def text_call_triggers(name: str) -> tuple[str, ...]:
    """The texts that start a call of tool ``name`` written without markup: ``{"name": "<name>"`` as JSON
    writes it (compact, spaced or pretty-printed).
    """
    quoted = json.dumps(name, ensure_ascii=False)
    return tuple(opening.format(quoted) for opening in _TEXT_CALL_OPENINGS)


def _tag(begin: str, parameters: dict[str, Any], end: str) -> dict[str, Any]:
    arguments = {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": CALL_WHITESPACE}
    return {"type": "tag", "begin": begin, "content": arguments, "end": end}


def lazy_tool_call_tag(fmt: OutputFormat) -> dict[str, Any]:
    """The structural tag of a ``lazy`` tool_call format (``tool_choice="auto"``), as JSON data: free text, in
    which a trigger starts a call that must name one of ``fmt.tools`` with arguments valid for its parameters;
    after the call the text is free again (one call only when ``fmt.parallel`` is False: then the output ends).

    Triggers: the family's call marker (``<tool_call>``, ``[TOOL_CALLS]``; llama3 has none), and for each tool
    ``{"name": "<tool>"`` (:func:`text_call_triggers`), the bare JSON that small models write instead (also
    inside a json fence; compact, spaced or pretty-printed). A bare trigger names the tool, closing quote included,
    so JSON that names no offered tool (``{"name": "Alice"}``) never triggers. For hermes, also the template's own
    opening with its doubled braces (:data:`TEMPLATE_CALL_OPENINGS`), before any name: the name written after it
    must be an offered tool's (so an answer's code that spells ``{{"name": "`` literally, as a Python f-string
    building JSON does, is read as a call when tools are offered). Markers are matched as text (xgrammar's
    triggered tags take text), which a marker's single token also spells.
    """
    assert fmt.tool_format is not None
    family = fmt.tool_format
    key = _ARGUMENTS_KEY[family]
    tools = _tools(fmt)
    marker = _LIST_OPEN[family] or _CALL_OPEN[family]
    tags, triggers = [], [marker] if marker else []
    if family == "hermes":
        triggers += TEMPLATE_CALL_OPENINGS
    for name, parameters in tools:
        openings = text_call_triggers(name)
        bare = openings[0]
        tags += [_tag(f'{opening}, "{key}": ', parameters, "}") for opening in openings]
        triggers += openings
        if family == "hermes":
            tags.append(_tag(f'{marker}\n{bare}, "{key}": ', parameters, "}\n" + _CALL_CLOSE[family]))
            quoted = json.dumps(name, ensure_ascii=False)[1:]  # the name and its closing quote
            tags += [_tag(f'{opening}{quoted}, "{key}": ', parameters, "}}") for opening in TEMPLATE_CALL_OPENINGS]
        elif family == "mistral":
            tags.append(_tag(f'{marker}[{bare}, "{key}": ', parameters, "}]"))
    body = {"type": "triggered_tags", "triggers": triggers, "tags": tags, "stop_after_first": not fmt.parallel}
    return {"type": "structural_tag", "format": body}
