"""Tool calling between LlamaIndex and SpecPrefill: tool schemas, ``tool_choice``, the calls of a history
and of an answer.

LlamaIndex hands tools over as ``BaseTool`` objects and describes calls the way llama-index-llms-openai
does: ``ToolCallBlock`` blocks on the assistant message and OpenAI-shaped ``additional_kwargs["tool_calls"]``
(dicts, or the ``openai`` package's objects). This module turns those into the core's
:class:`~specprefill_rag.results.ToolCall` and back. It imports no torch (a gateway client loads no model).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, ToolCallBlock
from llama_index.core.llms.llm import ToolSelection

from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.results import InvalidToolCall, ToolCall

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

CHOICES = ("auto", "none", "required")


class NoToolCallError(ValueError):
    """The model's answer holds no tool call where one was expected (``error_on_no_tool_call=True``).

    A ``ValueError``, as llama-index-llms-openai raises: the model's output is at fault, not the request, and
    LlamaIndex's structured-output and agent code handles this case as a ``ValueError``.
    """


def tool_schemas(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI tool schemas: a ``BaseTool`` through ``metadata.to_openai_tool()``, a schema dict as given."""
    from llama_index.core.tools.types import BaseTool

    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidRequestError(
            f"tools must be a list, got {type(tools).__name__}; pass a list of LlamaIndex tools or OpenAI tool schemas"
        )
    schemas = []
    for index, tool in enumerate(tools):
        if isinstance(tool, BaseTool):
            schemas.append(tool.metadata.to_openai_tool(skip_length_check=True))
        elif isinstance(tool, Mapping):
            schemas.append(dict(tool))
        else:
            raise InvalidRequestError(
                f"tools[{index}] is a {type(tool).__name__}; pass a LlamaIndex BaseTool (e.g. FunctionTool) or an "
                'OpenAI tool schema {"type": "function", "function": {...}}'
            )
    return schemas


def prepared_tools(tools: Sequence[BaseTool]) -> list[dict[str, Any]] | None:
    """What ``_prepare_chat_with_tools`` passes on as ``tools``: the schemas, None for no tools."""
    return tool_schemas(tools) or None


def resolve_tool_choice(choice: Any, tool_required: bool) -> str:
    """LlamaIndex's ``tool_choice`` (None, ``auto``/``none``/``required``, a tool's name, or OpenAI's
    ``{"type": "function", "function": {"name": ...}}``) with ``tool_required`` -> the core's choice.

    ``tool_required=True`` makes ``None`` and ``auto`` mean ``required``; with ``none`` it is a contradiction.
    """
    name = tool_choice_name(choice)
    if not tool_required:
        return name or "auto"
    if name == "none":
        raise InvalidRequestError(
            "tool_required=True with tool_choice='none' asks for a call and forbids one; drop one of them"
        )
    return "required" if name in (None, "auto") else name


def tool_choice_name(choice: Any) -> str | None:
    """A ``tool_choice`` as the core's string (None stays None): OpenAI's dict form gives its function name."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, Mapping):
        function = choice.get("function")
        if choice.get("type") == "function" and isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return str(function["name"])
    raise InvalidRequestError(
        f"tool_choice must be a str or OpenAI's dict form, got {_short(choice)}; pass one of {list(CHOICES)}, a "
        'tool\'s name or {"type": "function", "function": {"name": ...}}'
    )


# -- calls in a history: LlamaIndex -> core ----------------------------------------------------------


def message_tool_calls(message: ChatMessage, field: str) -> tuple[ToolCall, ...]:
    """An assistant message's calls: its ``ToolCallBlock`` blocks, else ``additional_kwargs["tool_calls"]``.

    A message with both (as llama-index-llms-openai writes them) must name the same call ids in both.
    """
    from_blocks = tuple(
        _block_call(block, f"{field}.blocks[{index}]")
        for index, block in enumerate(message.blocks)
        if isinstance(block, ToolCallBlock)
    )
    listed = message.additional_kwargs.get("tool_calls")
    if listed is None:
        return from_blocks
    if isinstance(listed, (str, bytes, Mapping)) or not isinstance(listed, Sequence):
        raise InvalidRequestError(
            f"{field}.additional_kwargs['tool_calls'] must be a list, got {type(listed).__name__}; pass a list of "
            "OpenAI tool calls"
        )
    from_kwargs = tuple(_listed_call(c, f"{field}.additional_kwargs['tool_calls'][{i}]") for i, c in enumerate(listed))
    if not from_blocks:
        return from_kwargs
    if [c.id for c in from_blocks] != [c.id for c in from_kwargs]:
        raise InvalidRequestError(
            f"{field} has ToolCallBlocks for the calls {[c.id for c in from_blocks]} but additional_kwargs"
            f"['tool_calls'] lists {[c.id for c in from_kwargs]}; give the calls one way, or the same calls both ways"
        )
    return from_blocks


def _block_call(block: ToolCallBlock, field: str) -> ToolCall:
    if not block.tool_call_id:
        raise InvalidRequestError(f"{field} is a ToolCallBlock without tool_call_id; give each call its id")
    return ToolCall(block.tool_name, _arguments(block.tool_kwargs, f"{field}.tool_kwargs"), block.tool_call_id)


def _listed_call(call: Any, field: str) -> ToolCall:
    """An OpenAI tool call: a dict or an object with ``id`` and ``function.name``/``function.arguments``."""
    kind = _get(call, "type")
    function = _get(call, "function")
    if kind not in (None, "function") or function is None:
        raise InvalidRequestError(
            f'{field} is not an OpenAI function call; pass {{"id": ..., "type": "function", "function": '
            '{"name": ..., "arguments": ...}}'
        )
    call_id, name = _get(call, "id"), _get(function, "name")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError(f"{field} has no id; give each call its id (it pairs the call with its result)")
    if not isinstance(name, str):
        raise InvalidRequestError(f"{field}.function.name must be a str, got {_short(name)}; pass the tool's name")
    return ToolCall(name, _arguments(_get(function, "arguments"), f"{field}.function.arguments"), call_id)


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, Mapping) else getattr(value, key, None)


def _arguments(value: Any, field: str) -> dict[str, Any]:
    """A call's arguments as a dict: a dict, or its JSON text (blank text: no arguments)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise InvalidRequestError(
                f"{field} is not valid JSON ({error}); pass the call's arguments as a JSON object"
            ) from None
    if not isinstance(value, Mapping):
        raise InvalidRequestError(
            f"{field} must be a JSON object, got {type(value).__name__}; pass the call's arguments as a dict"
        )
    return dict(value)


# -- calls in an answer: core -> LlamaIndex ----------------------------------------------------------


def openai_tool_call(call: ToolCall) -> dict[str, Any]:
    """A call as llama-index-llms-openai lists it in ``additional_kwargs["tool_calls"]`` (arguments as JSON)."""
    arguments = json.dumps(dict(call.arguments), ensure_ascii=False)
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def invalid_tool_call(call: InvalidToolCall) -> dict[str, Any]:
    """A call the model wrote that could not be decoded: its name, raw arguments, id and why."""
    return {"id": call.id, "name": call.name, "arguments": call.arguments, "error": call.error}


def call_blocks(calls: Sequence[ToolCall]) -> list[ToolCallBlock]:
    """The calls as ``ToolCallBlock`` blocks (arguments as a dict)."""
    return [ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=dict(c.arguments)) for c in calls]


def call_kwargs(calls: Sequence[ToolCall], invalid: Sequence[InvalidToolCall]) -> dict[str, Any]:
    """The assistant message's ``additional_kwargs``: ``tool_calls`` and ``invalid_tool_calls`` when there are any."""
    kwargs: dict[str, Any] = {}
    if calls:
        kwargs["tool_calls"] = [openai_tool_call(c) for c in calls]
    if invalid:
        kwargs["invalid_tool_calls"] = [invalid_tool_call(c) for c in invalid]
    return kwargs


def tool_selections(response: ChatResponse, error_on_no_tool_call: bool) -> list[ToolSelection]:
    """The calls of an answer as LlamaIndex ``ToolSelection``s (``FunctionCallingLLM.get_tool_calls_from_response``)."""
    calls = message_tool_calls(response.message, "response.message")
    if not calls and error_on_no_tool_call:
        invalid = response.message.additional_kwargs.get("invalid_tool_calls") or []
        wrote = f"; it wrote {len(invalid)} call(s) that could not be decoded: {_short(invalid)}" if invalid else ""
        cut = isinstance(response.raw, Mapping) and response.raw.get("finish_reason") == "length"
        ran_out = " (the answer stopped at max_new_tokens: raise it)" if cut else ""
        raise NoToolCallError(
            f"expected at least one tool call, but the model made none{wrote}{ran_out}; pass tool_required=True "
            "(or tool_choice='required' or a tool's name) to constrain decoding to a call, or "
            "error_on_no_tool_call=False to accept an answer without one"
        )
    return [ToolSelection(tool_id=c.id, tool_name=c.name, tool_kwargs=dict(c.arguments)) for c in calls]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
