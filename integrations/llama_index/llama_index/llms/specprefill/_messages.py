"""LlamaIndex chat messages in, assistant messages out.

In: each ``ChatMessage`` becomes a session :class:`~llama_index.llms.specprefill._sessions.Message`: its text
blocks joined, an assistant's calls (:func:`~llama_index.llms.specprefill._tools.message_tool_calls`), a tool
result's ``additional_kwargs["tool_call_id"]`` and tool (``additional_kwargs["name"]``, else its call's) and whether
that result may be compressed.
Out: :class:`ChatAnswer` gathers a stream's chunks into ``ChatResponse`` objects whose message carries the text,
the calls made so far (``ToolCallBlock`` blocks and ``additional_kwargs["tool_calls"]``) and, at the end, any
call the model wrote that could not be decoded (``additional_kwargs["invalid_tool_calls"]``); when asked, the
log-probabilities of the tokens so far (``logprobs``: per token its own ``LogProb``, then the most likely ones).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    LogProb,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.llms.specprefill._sessions import Message
from llama_index.llms.specprefill._tools import call_blocks, call_kwargs, message_tool_calls

from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.results import StreamChunk, TokenLogprob, ToolCall

ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "developer",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.TOOL: "tool",
}
COMPRESS_KEY = "spec_prefill_compress"
"""``additional_kwargs`` key of a tool message: False keeps that result whole."""


def session_messages(messages: Sequence[ChatMessage], keep_tools_whole: Collection[str]) -> list[Message]:
    """The messages for a session; tool results of the tools in ``keep_tools_whole`` are kept whole."""
    called: dict[str, str] = {}  # call id -> tool name, from the assistant messages so far
    converted = []
    for index, message in enumerate(messages):
        converted.append(_message(message, f"messages[{index}]", called, keep_tools_whole))
        called.update({call.id: call.name for call in converted[-1].tool_calls})
    return converted


def _message(message: ChatMessage, field: str, called: dict[str, str], keep_whole: Collection[str]) -> Message:
    role = ROLES.get(message.role)
    if role is None:
        raise InvalidRequestError(
            f"chat role {message.role.value!r} is not supported; use system, developer, user, assistant or tool"
        )
    text = _text(message, field, role)
    if role == "assistant":
        return Message(role, text, tool_calls=message_tool_calls(message, field))
    if role != "tool":
        return Message(role, text)
    call_id = message.additional_kwargs.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError(
            f"{field} is a tool message without additional_kwargs['tool_call_id']; pass the id of the call it "
            "answers there"
        )
    name = message.additional_kwargs.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequestError(
            f"{field}.additional_kwargs['name'] must be a str, got {type(name).__name__}; pass the tool's name"
        )
    compress = _compress(message, field)
    tool = name or called.get(call_id)  # None for an unknown call id: the core or the gateway refuses it
    return Message(role, text, tool_call_id=call_id, name=tool, compress=compress and tool not in keep_whole)


def _text(message: ChatMessage, field: str, role: str) -> str:
    parts = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif not (isinstance(block, ToolCallBlock) and role == "assistant"):
            what = "ToolCallBlock outside an assistant message" if isinstance(block, ToolCallBlock) else None
            raise InvalidRequestError(
                f"{field}: {what or type(block).__name__} is not supported; pass text blocks only "
                "(and ToolCallBlocks in assistant messages)"
            )
    return "".join(parts)


def _compress(message: ChatMessage, field: str) -> bool:
    value = message.additional_kwargs.get(COMPRESS_KEY, True)
    if not isinstance(value, bool):
        raise InvalidRequestError(
            f"{field}.additional_kwargs[{COMPRESS_KEY!r}] must be True or False, got {type(value).__name__}; "
            "pass a bool"
        )
    return value


def log_probs(entry: TokenLogprob) -> list[LogProb]:
    """One generated token's ``LogProb`` list: its own first, then the most likely tokens at its step."""
    return [LogProb(token=e.token, logprob=e.logprob, bytes=list(e.bytes)) for e in (entry, *entry.top_logprobs)]


class LogprobAnswer:
    """A stream's text and log-probabilities so far (``logprobs`` None while the request did not ask)."""

    def __init__(self) -> None:
        self.text = ""
        self.logprobs: list[list[LogProb]] | None = None

    def add(self, chunk: StreamChunk) -> None:
        self.text += chunk.text
        if chunk.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *(log_probs(entry) for entry in chunk.logprobs)]


class ChatAnswer:
    """A stream's chunks -> cumulative ``ChatResponse`` objects (text, calls and log-probabilities so far)."""

    def __init__(self) -> None:
        self.so_far = LogprobAnswer()
        self.calls: list[ToolCall] = []

    def add(self, chunk: StreamChunk, raw: dict[str, Any]) -> ChatResponse:
        """The response after ``chunk``; ``raw`` is its ``raw`` (usage and stats on the last chunk)."""
        self.so_far.add(chunk)
        self.calls += chunk.tool_calls
        invalid = chunk.result.invalid_tool_calls if chunk.result is not None else ()
        message = ChatMessage(
            role=MessageRole.ASSISTANT,
            blocks=[TextBlock(text=self.so_far.text), *call_blocks(self.calls)],
            additional_kwargs=call_kwargs(self.calls, invalid),
        )
        extras = {"spec_prefill": raw["spec_prefill"]} if raw else {}
        logprobs = self.so_far.logprobs
        return ChatResponse(message=message, delta=chunk.text, raw=raw, additional_kwargs=extras, logprobs=logprobs)
