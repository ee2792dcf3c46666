"""LangChain documents and messages -> the core's framework-neutral forms, or OpenAI messages for a gateway.

The core's chat and prompt modules (torch) are imported where they are used, so that an application
that talks to a gateway imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from langchain_core.documents import Document as LCDocument
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage

from specprefill_rag.errors import InvalidRequestError

_ROLES = {"system": "system", "human": "user", "user": "user", "ai": "assistant", "assistant": "assistant"}


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
    if role is None or not isinstance(message, (SystemMessage, HumanMessage, AIMessage)) and message.type != "chat":
        raise InvalidRequestError(
            f"{type(message).__name__} is not supported; pass system, human and AI messages "
            "(give retrieved documents as documents= or as text-plain blocks)"
        )
    content = message.content
    return role, [content] if isinstance(content, str) else [_block_part(block) for block in content]


def to_chat_message(message: BaseMessage) -> Any:
    """A LangChain message as a core ChatMessage: text parts and ``text-plain`` document blocks."""
    from specprefill_rag.prompt.chat import ChatMessage
    from specprefill_rag.prompt.layout import Document

    role, parts = _role_and_parts(message)
    core = [p if isinstance(p, str) else Document(p["text"], title=p["title"], id=p["id"]) for p in parts]
    return ChatMessage(role, core)  # type: ignore[arg-type]


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
    ``document`` parts (from ``text-plain`` blocks and :func:`format_docs` markers).
    """
    role, parts = _role_and_parts(message)
    expanded = [piece for part in parts for piece in (_unmarked(part) if isinstance(part, str) else [part])]
    if all(isinstance(part, str) for part in expanded):
        return {"role": role, "content": "".join(expanded)}  # type: ignore[arg-type]
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {k: v for k, v in p.items() if v is not None}
        for p in expanded
    ]
    return {"role": role, "content": content}


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
