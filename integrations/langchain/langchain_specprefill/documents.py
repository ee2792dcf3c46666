"""LangChain documents and messages -> the core's framework-neutral forms, or OpenAI messages for a gateway.

The core's chat and prompt modules (torch) are imported where they are used, so that an application
that talks to a gateway imports no torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from langchain_core.documents import Document as LCDocument
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage

from langchain_specprefill._tools import called_tools
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.results import ToolCall

_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "ai": "assistant",
    "assistant": "assistant",
    "tool": "tool",
}
_CALL_BLOCKS = ("tool_use", "tool_call")  # content blocks that repeat one of an AIMessage's tool_calls


def format_docs(docs: Iterable[LCDocument | str], separator: str = "\n\n") -> str:
    """Join retrieved documents for a prompt template, marking each so ChatSpecPrefill finds its span.

    Use it where RAG chains use their own ``format_docs``: ``retriever | format_docs``. The markers
    are two invisible control characters that ChatSpecPrefill removes before tokenizing; other
    models would see them, so use this helper only in front of SpecPrefill models.
    """
    from specprefill_rag.prompt.chat import mark_document

    return separator.join(mark_document(d.page_content if isinstance(d, LCDocument) else str(d)) for d in docs)


def document_prompt() -> Any:
    """A ``document_prompt`` for ``create_stuff_documents_chain`` that marks each document's span."""
    from langchain_core.prompts import PromptTemplate

    from specprefill_rag.prompt.chat import mark_document

    return PromptTemplate.from_template(mark_document("{page_content}"))


def to_core_document(value: Any, index: int) -> Any:
    """LangChain ``Document`` -> core ``Document`` (title/id from metadata); other forms pass through."""
    from specprefill_rag.prompt.layout import Document

    if isinstance(value, LCDocument):
        metadata = value.metadata or {}
        title = metadata.get("title") or metadata.get("source")
        return Document(value.page_content, title=str(title) if title else None, id=value.id or metadata.get("id"))
    return value


def documents_argument(value: Any) -> list[Any] | None:
    """Validate the ``documents=`` call argument: a list of Documents, dicts or strings."""
    if value is None:
        return None
    _check_documents(value)
    return [to_core_document(v, i) for i, v in enumerate(value)]


def _block_part(block: Any) -> str | dict[str, Any]:
    """A content block as text, or as a document: ``{"type": "document", "text", "title", "id"}``."""
    if isinstance(block, str):
        return block
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in ("text", "text-plain") and not isinstance(block.get("text"), str):
        raise InvalidRequestError(
            f"a {kind!r} content block needs its 'text' as a str, got {type(block.get('text')).__name__}; pass the text"
        )
    if kind == "text":
        return block["text"]
    if kind == "text-plain":  # checked like every document (title, id, Unicode) when the prompt is laid out
        return {"type": "document", "text": block["text"], "title": block.get("title"), "id": block.get("id")}
    raise InvalidRequestError(
        f"content block of type {kind!r} is not supported; pass text and 'text-plain' document blocks"
    )


def _role_and_parts(message: BaseMessage) -> tuple[str, list[str | dict[str, Any]]]:
    role = _ROLES.get(getattr(message, "role", None) or message.type)
    supported = isinstance(message, (SystemMessage, HumanMessage, AIMessage, ToolMessage)) or message.type == "chat"
    if role is None or not supported:
        raise InvalidRequestError(
            f"{type(message).__name__} is not supported; pass system, human, AI and tool messages "
            "(give retrieved documents as documents= or as text-plain blocks)"
        )
    content = message.content
    if isinstance(content, str):
        return role, [content]
    if isinstance(message, AIMessage):
        content = _without_call_blocks(message)
    parts = [_block_part(block) for block in content]
    if isinstance(message, ToolMessage) and not all(isinstance(part, str) for part in parts):
        raise InvalidRequestError(
            "a ToolMessage's content is text (a str or text blocks): a tool result is a document already; pass its text"
        )
    return role, parts


def _without_call_blocks(message: AIMessage) -> list[Any]:
    """An AI message's content blocks less those that repeat one of its ``tool_calls`` (Anthropic's ``tool_use``,
    LangChain's ``tool_call`` blocks): the call itself goes to the template from ``tool_calls``.
    """
    ids = {call["id"] for call in message.tool_calls}
    blocks = []
    for block in message.content:
        if isinstance(block, dict) and block.get("type") in _CALL_BLOCKS:
            if block.get("id") not in ids:
                raise InvalidRequestError(
                    f"an AIMessage has a {block.get('type')!r} content block (id {block.get('id')!r}) that none of its "
                    "tool_calls has; pass every call in tool_calls"
                )
            continue
        blocks.append(block)
    return blocks


def _check_ai_calls(message: BaseMessage) -> None:
    if isinstance(message, AIMessage) and message.invalid_tool_calls:
        raise InvalidRequestError(
            f"an AIMessage has {len(message.invalid_tool_calls)} invalid_tool_calls (calls that did not decode); "
            "SpecPrefill cannot show a malformed call to the model: drop them from the message, or replace them "
            "by valid tool_calls answered by ToolMessages"
        )


def tool_name(message: BaseMessage, called: dict[str, str]) -> str | None:
    """A ToolMessage's tool: its ``name``, else the tool of the call it answers (None for other messages)."""
    if not isinstance(message, ToolMessage):
        return None
    return message.name or called.get(message.tool_call_id)


def to_chat_message(message: BaseMessage, compress: bool = True) -> Any:
    """A LangChain message as a core ChatMessage: text parts and ``text-plain`` document blocks; an AIMessage's
    ``tool_calls``; a ToolMessage's result (``tool_call_id``, ``name``; ``artifact`` is not for the model and
    ``status="error"`` is still a result). ``compress``: a tool result may be compressed (False: kept whole).
    """
    from specprefill_rag.prompt.chat import ChatMessage
    from specprefill_rag.prompt.layout import Document

    _check_ai_calls(message)
    role, parts = _role_and_parts(message)
    core = [p if isinstance(p, str) else Document(p["text"], title=p["title"], id=p["id"]) for p in parts]
    if isinstance(message, AIMessage):
        calls = tuple(ToolCall(c["name"], c["args"], c["id"]) for c in message.tool_calls)  # type: ignore[arg-type]
        return ChatMessage("assistant", core, tool_calls=calls)
    if isinstance(message, ToolMessage):
        return ChatMessage("tool", core, tool_call_id=message.tool_call_id, name=message.name, compress=compress)
    return ChatMessage(role, core)  # type: ignore[arg-type]


def to_chat_messages(messages: Sequence[BaseMessage], keep_whole: Sequence[str] = (), compress: bool = True) -> Any:
    """The messages as core ChatMessages; a tool result is a document unless ``compress`` is False or its tool
    is in ``keep_whole``.
    """
    kept = kept_whole(messages, keep_whole, compress)
    return [to_chat_message(m, not whole) for m, whole in zip(messages, kept)]


def kept_whole(messages: Sequence[BaseMessage], keep_whole: Sequence[str], compress: bool) -> list[bool]:
    """For each message, whether it is a tool result to keep whole (``compress`` False, or its tool named in
    ``keep_whole``); retrieved documents are not looked for in those either.
    """
    called = called_tools(messages)
    return [isinstance(m, ToolMessage) and (not compress or tool_name(m, called) in keep_whole) for m in messages]


def _unmarked(text: str) -> list[str | dict[str, Any]]:
    """Text with :func:`format_docs` markers -> text and document parts. The markers hold a secret of this
    process, so they are read here, never sent (importing the core's chat module, which needs torch).
    """
    if "\x02" not in text:
        return [text]
    from specprefill_rag.prompt.chat import DOCUMENT_END, DOCUMENT_START

    pieces = re.split(f"{re.escape(DOCUMENT_START)}(.*?){re.escape(DOCUMENT_END)}", text, flags=re.S)
    parts: list[str | dict[str, Any]] = []
    for index, piece in enumerate(pieces):
        if index % 2:
            parts.append({"type": "document", "text": piece})
        elif piece:
            parts.append(piece)
    return parts


def to_openai_message(message: BaseMessage) -> dict[str, Any]:
    """A LangChain message as an OpenAI chat message for a gateway: plain text content, or text and
    ``document`` parts (from ``text-plain`` blocks and :func:`format_docs` markers); an AIMessage's
    ``tool_calls`` (arguments as JSON text), a ToolMessage's ``tool_call_id`` and ``name``.
    """
    _check_ai_calls(message)
    role, parts = _role_and_parts(message)
    if isinstance(message, ToolMessage):  # text only (checked): one string, as the core joins its parts
        result = {"role": "tool", "content": "".join(parts), "tool_call_id": message.tool_call_id}  # type: ignore[arg-type]
        return {**result, "name": message.name} if message.name else result
    expanded = [piece for part in parts for piece in (_unmarked(part) if isinstance(part, str) else [part])]
    if all(isinstance(part, str) for part in expanded):
        openai: dict[str, Any] = {"role": role, "content": "".join(expanded)}  # type: ignore[arg-type]
    else:
        content = [
            {"type": "text", "text": p} if isinstance(p, str) else {k: v for k, v in p.items() if v is not None}
            for p in expanded
        ]
        openai = {"role": role, "content": content}
    if isinstance(message, AIMessage) and message.tool_calls:
        openai["tool_calls"] = _openai_calls(message)
    return openai


def _openai_calls(message: AIMessage) -> list[dict[str, Any]]:
    """An AIMessage's calls in OpenAI's shape; arguments that are not plain JSON are refused here, by name."""
    from specprefill_rag.gateway_client import tool_calls_json

    for number, call in enumerate(message.tool_calls):
        try:
            json.dumps(call["args"], allow_nan=False)
        except (TypeError, ValueError) as error:
            raise InvalidRequestError(
                f"tool_calls[{number}] ({call['name']!r}) has arguments that are not plain JSON ({error}); "
                "use dicts, lists, strings and numbers"
            ) from None
    return tool_calls_json([ToolCall(c["name"], c["args"], c["id"]) for c in message.tool_calls])  # type: ignore[arg-type]


def documents_json(value: Any) -> list[Any] | None:
    """The ``documents=`` call argument as ``spec_prefill.documents``: strings and ``{"text", "title", "id"}``."""
    if value is None:
        return None
    _check_documents(value)
    return [_document_json(v) for v in value]


def _document_json(value: Any) -> Any:
    if not isinstance(value, LCDocument):
        return value
    metadata = value.metadata or {}
    title = metadata.get("title") or metadata.get("source")
    return {"text": value.page_content, "title": str(title) if title else None, "id": value.id or metadata.get("id")}


def _check_documents(value: Any) -> None:
    if isinstance(value, (str, bytes, dict, LCDocument)) or not isinstance(value, Sequence):
        raise InvalidRequestError(
            "documents= must be a list of LangChain Documents, dicts with 'text', or strings; "
            f"got {type(value).__name__}; pass a list"
        )
