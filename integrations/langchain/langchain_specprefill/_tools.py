"""Tool calling and structured output between LangChain's shapes and the core's.

In: LangChain tools -> OpenAI tool schemas (:func:`tool_schemas`), LangChain's ``tool_choice`` forms -> the
core's (:func:`core_tool_choice`), the call's tool options checked (:func:`tool_options`). Out: the core's
:class:`~specprefill_rag.results.ToolCall` / :class:`~specprefill_rag.results.InvalidToolCall` -> LangChain's
``tool_calls``, ``tool_call_chunks`` and ``invalid_tool_calls``. Torch-free (the gateway path uses it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.messages.tool import (
    InvalidToolCall as LCInvalidToolCall,
)
from langchain_core.messages.tool import (
    ToolCall as LCToolCall,
)
from langchain_core.messages.tool import (
    ToolCallChunk,
    invalid_tool_call,
    tool_call,
    tool_call_chunk,
)
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool

from specprefill_rag.config import OutputFormat
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.results import InvalidToolCall, ToolCall

# The call options of tool calling and structured output (bound by bind_tools / with_structured_output).
TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls", "keep_tools_whole", "compress_tool_results")
ToolLike = Mapping[str, Any] | type | Callable[..., Any] | BaseTool
_REQUIRED = ("any", "required")
_CHOICES = "'auto', 'none', 'any'/'required'/True, a tool's name or {'type': 'function', 'function': {'name': ...}}"


def tool_schemas(tools: Sequence[ToolLike], strict: bool | None = None) -> list[dict[str, Any]]:
    """Each tool as an OpenAI tool schema (:func:`convert_to_openai_tool`), in order."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidRequestError(f"bind_tools takes a list of tools, got {type(tools).__name__}; pass a list")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"strict must be True, False or None, got {_short(strict)}; pass one of them")
    schemas = []
    for index, tool in enumerate(tools):
        try:
            schemas.append(convert_to_openai_tool(tool, strict=strict))
        except (TypeError, ValueError) as error:
            raise InvalidRequestError(
                f"tools[{index}] is not a tool LangChain can describe ({error}); pass a BaseTool, a function with a "
                "docstring, a pydantic model, a TypedDict or an OpenAI tool schema"
            ) from None
    return schemas


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """The function names of OpenAI tool schemas (those without one are left to the core to refuse)."""
    names = []
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


def core_tool_choice(choice: Any, names: Sequence[str]) -> str | None:
    """LangChain's ``tool_choice`` as the core's: ``auto``, ``none``, ``required`` or a tool's name (None: not
    given). ``any``, ``required`` and ``True`` ask for a call to any tool; a name or OpenAI's
    ``{"type": "function", "function": {"name": ...}}`` for a call to that tool.
    """
    if choice is None:
        return None
    if choice is True or choice in _REQUIRED:
        if not names:
            raise InvalidRequestError(
                f"tool_choice={choice!r} asks for a tool call but no tools are bound; pass the tools to bind_tools"
            )
        return "required"
    if isinstance(choice, Mapping):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or set(choice) != {"type", "function"}:
            raise InvalidRequestError(f"tool_choice {_short(choice)} is not understood; use {_CHOICES}")
        choice = name
    if not isinstance(choice, str) or isinstance(choice, bool):
        raise InvalidRequestError(f"tool_choice {_short(choice)} is not understood; use {_CHOICES}")
    if choice in ("auto", "none"):
        return choice
    if choice not in names:
        raise InvalidRequestError(
            f"tool_choice names {choice!r}, which is not one of the tools {list(names)}; use a bound tool's name"
        )
    return choice


def openai_tool_choice(choice: str) -> str | dict[str, Any]:
    """The core's ``tool_choice`` as an OpenAI request field (for a gateway)."""
    if choice in ("auto", "none", "required"):
        return choice
    return {"type": "function", "function": {"name": choice}}


def tool_options(options: Mapping[str, Any], keep_whole: Sequence[str], compress: bool) -> dict[str, Any]:
    """The call's tool options checked: ``tools`` (OpenAI schemas), ``tool_choice`` (the core's form),
    ``parallel_tool_calls`` (bool or None), ``keep_tools_whole`` and ``compress_tool_results`` (the call's,
    else the model's).
    """
    tools = options.get("tools")
    if tools is not None and (isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence)):
        raise InvalidRequestError(
            f"tools must be a list of OpenAI tool schemas, got {type(tools).__name__}; pass the tools to bind_tools"
        )
    parallel = options.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError(f"parallel_tool_calls must be True, False or None, got {_short(parallel)}; pass one")
    compress = options.get("compress_tool_results", compress)
    if not isinstance(compress, bool):
        raise InvalidRequestError(f"compress_tool_results must be True or False, got {_short(compress)}; pass one")
    return {
        "tools": list(tools) if tools is not None else None,
        "tool_choice": core_tool_choice(options.get("tool_choice"), tool_names(tools)),
        "parallel_tool_calls": parallel,
        "keep_tools_whole": check_tool_name_list(options.get("keep_tools_whole", keep_whole), "keep_tools_whole"),
        "compress_tool_results": compress,
    }


def check_tool_name_list(value: Any, field: str) -> list[str]:
    """A list of tool names (strings), or an error naming ``field``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"{field} must be a list of tool names, got {type(value).__name__}; pass a list")
    for name in value:
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(
                f"{field} must hold tool names (non-empty strings), got {_short(name)}; pass names"
            )
    return list(value)


def called_tools(messages: Iterable[BaseMessage]) -> dict[str, str]:
    """Each call id of the history's AI messages -> the tool it called."""
    calls = (call for message in messages if isinstance(message, AIMessage) for call in message.tool_calls)
    return {call["id"]: call["name"] for call in calls if call["id"]}


def keep_whole_names(
    keep_whole: Sequence[str], tools: Sequence[Mapping[str, Any]] | None, called: Iterable[str]
) -> list[str]:
    """``keep_tools_whole`` for one request: every name must be a tool offered or called, once the request has
    either (a misspelt name would otherwise keep nothing whole without a word); [] when it has neither (no
    tool result to keep whole).
    """
    known = set(tool_names(tools)) | set(called)
    if not known:
        return []
    unknown = [name for name in keep_whole if name not in known]
    if unknown:
        raise InvalidRequestError(
            f"keep_tools_whole names {unknown}, which are neither bound tools nor called in the messages "
            f"({sorted(known)}); use the names of the tools whose results should stay whole"
        )
    return list(keep_whole)


def check_output_format(value: Any) -> OutputFormat | None:
    """The ``output_format`` call option: an :class:`OutputFormat` or None."""
    if value is not None and not isinstance(value, OutputFormat):
        raise InvalidRequestError(
            f"output_format must be a specprefill_rag.config.OutputFormat, got {type(value).__name__}; build it as "
            "OutputFormat('json_schema', schema={...}) or OutputFormat('json_object')"
        )
    return value


def check_one_constraint(output: OutputFormat | None, tool_choice: str | None) -> None:
    """Refuse an ``output_format`` with a forced tool call: both would constrain the answer."""
    if output is not None and tool_choice not in (None, "auto", "none"):
        raise InvalidRequestError(
            f"output_format and tool_choice={tool_choice!r} both constrain the answer; use one of them"
        )


# -- out: the core's calls -> LangChain's ------------------------------------------------------------


def lc_tool_calls(calls: Iterable[ToolCall]) -> list[LCToolCall]:
    """The model's calls as ``AIMessage.tool_calls``."""
    return [tool_call(name=c.name, args=dict(c.arguments), id=c.id) for c in calls]


def lc_invalid_tool_calls(calls: Iterable[InvalidToolCall]) -> list[LCInvalidToolCall]:
    """The calls that did not decode as ``AIMessage.invalid_tool_calls`` (raw text and why)."""
    return [invalid_tool_call(name=c.name, args=c.arguments, id=c.id, error=c.error) for c in calls]


def lc_tool_call_chunks(calls: Sequence[ToolCall], first_index: int) -> list[ToolCallChunk]:
    """Calls completed in one streamed chunk as ``tool_call_chunks``; ``first_index``: calls streamed before.
    Each call comes whole (its arguments as a JSON string), so LangChain's merge gives back the same calls.
    """
    return [
        tool_call_chunk(name=c.name, args=json.dumps(dict(c.arguments), ensure_ascii=False), id=c.id, index=i)
        for i, c in enumerate(calls, first_index)
    ]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
