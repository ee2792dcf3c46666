"""A request's tools and ``tool_choice`` -> what decoding parses and what it constrains.

``auto``: the answer's tool calls are parsed in the model family's markup, and only calls naming one of the
tools count (a call of any other stays content); with ``lazy`` (the ``lazy_tool_grammar`` setting) a lazy
grammar constrains a call once the answer starts one: free text until a trigger (the family's marker, or
``{"name": "<tool>"`` naming an offered tool), then a call of an offered tool with arguments valid for its
schema, then free text again. ``none``: nothing is parsed (the tools are still shown); ``required`` or a tool's
name: the answer is constrained to calls (to that tool), so the model cannot answer otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..config import OutputFormat
from ..errors import InvalidRequestError
from ..prompt.tools import ToolChoice, check_tool_choice, model_tool_format


def tool_decoding(
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]],
    choice: ToolChoice | None,
    parallel: bool = True,
    lazy: bool = False,
) -> dict[str, Any]:
    """The :class:`~specprefill_rag.config.GenerationParams` fields for ``tools`` (checked) and ``choice``;
    ``lazy``: ``auto`` gets a lazy ``tool_call`` output format (a backend that cannot build its grammar decodes
    without it, and the calls are parsed from the text as written).
    """
    chosen = check_tool_choice(choice, tools)
    if not tools or chosen == "none":
        return {}
    markup = model_tool_format(tokenizer)
    if markup is None:
        raise InvalidRequestError(
            "this tokenizer has no chat template, and tool calls are written in chat turns; use a model with a chat "
            "template or leave tools out"
        )
    names = tuple(tool["function"]["name"] for tool in tools)
    fields: dict[str, Any] = {"tool_format": markup, "tool_names": names, "parallel_tool_calls": parallel}
    if chosen == "auto":
        if lazy:
            fields["output_format"] = OutputFormat(
                "tool_call", tools=tuple(tools), tool_format=markup, parallel=parallel, lazy=True
            )
        return fields
    offered = tuple(tools) if chosen == "required" else tuple(t for t in tools if t["function"]["name"] == chosen)
    parallel_calls = parallel and chosen == "required"
    fields["output_format"] = OutputFormat("tool_call", tools=offered, tool_format=markup, parallel=parallel_calls)
    return fields
