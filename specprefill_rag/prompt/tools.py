"""Tools offered to the model and the tool calls of a chat history, checked before rendering.

Tool schemas use OpenAI's shape (``{"type": "function", "function": {"name", "description", "parameters"}}``)
and reach the chat template as its ``tools=``. The template writes them, and the calls of earlier assistant
turns, as its own scaffolding, where special-token strings would become control tokens; so none of them may
hold the text of one of the tokenizer's added tokens (a description saying ``<|im_end|>`` is refused, not
passed on as a turn boundary).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

from ..arguments import check_unicode
from ..config import ToolCallFormat
from ..errors import InvalidRequestError
from .layout import Role, Segment, ToolCall, Turn

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names (plus dots)
MAX_TOOLS = 128  # OpenAI's bound on the tools of one request; every tool's schema is part of the prompt
MAX_ARGUMENTS_DEPTH = 64  # nesting of a call's arguments: deeper JSON is refused, not recursed into
ToolChoice = Literal["auto", "none", "required"] | str
"""``auto`` (the model decides), ``none`` (no call), ``required`` (at least one call) or a tool's name."""


def tool_call_format(chat_template: str | None) -> ToolCallFormat | None:
    """The family of a chat template's tool-call markup, or None when it has none this module knows.

    ``chat_template`` is the template's source; for a tokenizer with several named templates pass the default one.
    """
    if chat_template is None:
        return None
    if not isinstance(chat_template, str):
        raise InvalidRequestError(
            f"chat_template must be a string or None, got {type(chat_template).__name__}; "
            "for a tokenizer with several named templates pass the default one"
        )
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    llama_turns = "<|eot_id|>" in chat_template or "<|start_header_id|>" in chat_template
    if "<|python_tag|>" in chat_template or (llama_turns and re.search(r"""\\?["']parameters\\?["']""", chat_template)):
        return "llama3"
    return None


def template_tool_format(tokenizer: Any) -> ToolCallFormat | None:
    """The tool-call markup the tokenizer's chat template itself writes (None: it has no tool calling)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # several named templates: the default one renders chats
        template = template.get("default")
    return tool_call_format(template if isinstance(template, str) else None)


def model_tool_format(tokenizer: Any) -> ToolCallFormat | None:
    """The markup the model's tool calls are parsed in: its template's, or ``hermes`` written into the messages
    for a chat template without tool calling (:func:`hermes_in_messages`); None without a chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    return template_tool_format(tokenizer) or "hermes"


def check_tools(tools: Sequence[Mapping[str, Any]] | None, field: str = "tools") -> tuple[dict[str, Any], ...]:
    """The tool schemas, checked: at most :data:`MAX_TOOLS`, each ``{"type": "function", "function": {...}}``
    with a unique valid name, an optional str description and an optional JSON-object ``parameters`` schema.
    Returned as plain dicts (what chat templates read); nothing is added or dropped. Linear in the tools' size.
    """
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidRequestError(f"{field} must be a list of tool schemas, got {type(tools).__name__}")
    check_tool_count(len(tools), field)
    checked = tuple(_check_tool(tool, f"{field}[{i}]") for i, tool in enumerate(tools))
    seen: set[str] = set()
    for tool in checked:
        name = tool["function"]["name"]
        if name in seen:
            raise InvalidRequestError(f"{field} names the tool {name!r} twice; give each tool once")
        seen.add(name)
    return checked


def check_tool_count(count: int, field: str = "tools") -> None:
    """At most :data:`MAX_TOOLS` tools (checked before any of them is looked at)."""
    if count > MAX_TOOLS:
        raise InvalidRequestError(
            f"{field} offers {count} tools; at most {MAX_TOOLS} per request (OpenAI's limit): offer only the tools "
            "this step may call"
        )


def check_depth(value: Any, field: str, limit: int = MAX_ARGUMENTS_DEPTH) -> None:
    """Refuse JSON (decoded) nested more than ``limit`` objects or lists deep; counted without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        if depth > limit:
            raise InvalidRequestError(
                f"{field}: JSON nested more than {limit} objects or lists deep; send it nested at most {limit} deep"
            )
        stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))


def _check_tool(tool: Any, field: str) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
        raise InvalidRequestError(
            f'{field} must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}'
        )
    unknown = sorted(set(tool) - {"type", "function"})
    if unknown:
        raise InvalidRequestError(f"{field} has unknown keys {unknown}; a tool takes 'type' and 'function'")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise InvalidRequestError(
            f"{field}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {_short(name)}; use such a name"
        )
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise InvalidRequestError(f"{field}.function.description must be a string")
        check_unicode(description, f"{field}.function.description")
    parameters = function.get("parameters")
    if parameters is not None and (not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object"):
        raise InvalidRequestError(f"{field}.function.parameters must be a JSON schema of type 'object'")
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise InvalidRequestError(
            f"{field}.function has unknown keys {unknown}; it takes name, description, parameters and strict"
        )
    return _plain(tool, field)


def _plain(value: Any, field: str) -> Any:
    """A JSON-serialisable copy (plain dicts and lists), or an error naming the field."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as error:
        raise InvalidRequestError(f"{field} is not plain JSON ({error}); use dicts, lists, strings, numbers") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_tool_choice(choice: ToolChoice | None, tools: Sequence[Mapping[str, Any]]) -> ToolChoice:
    """``auto`` (default), ``none``, ``required`` or the name of one of ``tools``."""
    if choice is None:
        return "auto"
    if not isinstance(choice, str):
        raise InvalidRequestError(
            f"tool_choice must be 'auto', 'none', 'required' or a tool's name, got {type(choice).__name__}"
        )
    names = [tool["function"]["name"] for tool in tools]
    if choice in ("auto", "none"):
        return choice
    if not tools:
        raise InvalidRequestError(f"tool_choice={choice!r} but no tools are given; pass tools or leave it out")
    if choice != "required" and choice not in names:
        raise InvalidRequestError(
            f"tool_choice names {_short(choice)}, which is not one of the tools {names}; pass one of them, or "
            "'auto', 'none' or 'required'"
        )
    return choice


def check_tool_call(call: Any, field: str) -> ToolCall:
    """A history's tool call: a :class:`ToolCall` with a str id, a valid name and an object of arguments."""
    if not isinstance(call, ToolCall):
        raise InvalidRequestError(
            f"{field} must be a ToolCall(name, arguments, id), got {type(call).__name__}; build it with ToolCall"
        )
    if not isinstance(call.name, str) or not TOOL_NAME.fullmatch(call.name):
        raise InvalidRequestError(
            f"{field}.name must be 1-64 letters, digits, '_', '-' or '.', got {_short(call.name)}; use such a name"
        )
    if not isinstance(call.id, str) or not call.id.strip():
        raise InvalidRequestError(
            f"{field}.id must be a non-empty string (it pairs the call with its result); pass the id the call was made "
            "with"
        )
    if not isinstance(call.arguments, Mapping):
        raise InvalidRequestError(
            f"{field}.arguments must be a JSON object (dict), got {type(call.arguments).__name__}; pass the "
            "arguments as a dict"
        )
    check_depth(dict(call.arguments), f"{field}.arguments")
    return ToolCall(call.name, _plain(call.arguments, f"{field}.arguments"), call.id)


def template_tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """Calls in the shape chat templates read (OpenAI's, arguments as an object)."""
    return [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": dict(call.arguments)}}
        for call in calls
    ]


def check_no_control_text(tokenizer: Any, tools: Sequence[Mapping[str, Any]], calls: Sequence[ToolCall]) -> None:
    """Refuse tool schemas or calls holding the text of an added token: the template writes them as scaffolding."""
    controls = [str(token) for token in getattr(tokenizer, "added_tokens_decoder", {}).values()]
    for what, value in [("a tool schema", tools), ("a tool call", template_tool_calls(calls))]:
        if not value:
            continue
        text = json.dumps(value, ensure_ascii=False)
        found = next((c for c in controls if c and c in text), None)
        if found is not None:
            raise InvalidRequestError(
                f"{what} contains the control-token text {found!r}; the chat template writes tools and calls as "
                "its own markup, so remove that text from names, descriptions and arguments"
            )


_TOOLS_PREAMBLE = (
    "# Tools\n\nYou can call functions to help answer. Their signatures are listed in <tools></tools>:\n<tools>\n"
)
_CALL_INSTRUCTIONS = (
    "\n</tools>\n\nTo call a function, write one JSON object per call inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
)


def hermes_in_messages(turns: Sequence[Turn], tools: Sequence[Mapping[str, Any]]) -> list[Turn]:
    """Tool calling for a chat template that has none (SmolLM2's ignores ``tools`` and drops tool calls): the
    Hermes format written into the messages. The tools are described at the end of the system turn (one is
    added first if there is none), each call as ``<tool_call>`` JSON in its assistant turn, and each run of
    tool results as one user turn of ``<tool_response>`` blocks. Everything written here is kept; the results
    stay documents. Written as message text (not scaffolding), so nothing in it becomes a control token.
    """
    written = [_with_calls(turn) for turn in _grouped_results(turns)]
    if not tools:
        return written
    schemas = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    description = Segment(_TOOLS_PREAMBLE + schemas + _CALL_INSTRUCTIONS, Role.INSTRUCTION)
    if written and written[0].role == "system":
        first = written[0]
        gap = (Segment("\n\n", Role.INSTRUCTION),) if first.segments else ()
        return [replace(first, segments=(*first.segments, *gap, description)), *written[1:]]
    return [Turn("system", (description,)), *written]


def _with_calls(turn: Turn) -> Turn:
    if not turn.tool_calls:
        return turn
    calls = [
        Segment(
            f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': dict(c.arguments)}, ensure_ascii=False)}"
            "\n</tool_call>",
            Role.INSTRUCTION,
        )
        for c in turn.tool_calls
    ]
    gap = (Segment("\n", Role.INSTRUCTION),) if turn.segments else ()
    return Turn(turn.role, (*turn.segments, *gap, *_joined(calls)))


def _joined(segments: list[Segment]) -> list[Segment]:
    joined: list[Segment] = []
    for segment in segments:
        joined += [Segment("\n", Role.INSTRUCTION), segment] if joined else [segment]
    return joined


def _grouped_results(turns: Sequence[Turn]) -> list[Turn]:
    """Each run of tool turns as one user turn of ``<tool_response>`` blocks."""
    grouped: list[Turn] = []
    previous_was_result = False
    for turn in turns:
        if turn.role != "tool":
            grouped.append(turn)
            previous_was_result = False
            continue
        opening, closing = Segment("<tool_response>\n", Role.TEMPLATE), Segment("\n</tool_response>", Role.TEMPLATE)
        block = (opening, *turn.segments, closing)
        if previous_was_result:
            last = grouped[-1]
            grouped[-1] = replace(last, segments=(*last.segments, Segment("\n", Role.TEMPLATE), *block))
        else:
            grouped.append(Turn("user", block))
        previous_was_result = True
    return grouped
