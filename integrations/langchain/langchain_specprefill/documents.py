"""LangChain documents and messages -> the core's framework-neutral forms."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from langchain_core.documents import Document as LCDocument
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from specprefill_rag.chat import ChatMessage, mark_document
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.prompt import Document

_ROLES = {"system": "system", "human": "user", "user": "user", "ai": "assistant", "assistant": "assistant"}


def format_docs(docs: Iterable[LCDocument | str], separator: str = "\n\n") -> str:
    """Join retrieved documents for a prompt template, marking each so ChatSpecPrefill finds its span.

    Use it where RAG chains use their own ``format_docs``: ``retriever | format_docs``. The markers
    are two invisible control characters that ChatSpecPrefill removes before tokenizing; other
    models would see them, so use this helper only in front of SpecPrefill models.
    """
    return separator.join(mark_document(d.page_content if isinstance(d, LCDocument) else str(d)) for d in docs)


def document_prompt() -> Any:
    """A ``document_prompt`` for ``create_stuff_documents_chain`` that marks each document's span."""
    from langchain_core.prompts import PromptTemplate

    return PromptTemplate.from_template(mark_document("{page_content}"))


def to_core_document(value: Any, index: int) -> Any:
    """LangChain ``Document`` -> core ``Document`` (title/id from metadata); other forms pass through."""
    if isinstance(value, LCDocument):
        metadata = value.metadata or {}
        title = metadata.get("title") or metadata.get("source")
        return Document(value.page_content, title=str(title) if title else None, id=value.id or metadata.get("id"))
    return value


def documents_argument(value: Any) -> list[Any] | None:
    """Validate the ``documents=`` call argument: a list of Documents, dicts or strings."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, dict, LCDocument)) or not isinstance(value, Sequence):
        raise InvalidRequestError(
            "documents= must be a list of LangChain Documents, dicts with 'text', or strings; "
            f"got {type(value).__name__}; pass a list"
        )
    return [to_core_document(v, i) for i, v in enumerate(value)]


def _block_part(block: Any) -> str | Document:
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
        return Document(block["text"], title=block.get("title"), id=block.get("id"))
    raise InvalidRequestError(
        f"content block of type {kind!r} is not supported; pass text and 'text-plain' document blocks"
    )


def to_chat_message(message: BaseMessage) -> ChatMessage:
    """A LangChain message as a core ChatMessage: text parts and ``text-plain`` document blocks."""
    role = _ROLES.get(getattr(message, "role", None) or message.type)
    if role is None or not isinstance(message, (SystemMessage, HumanMessage, AIMessage)) and message.type != "chat":
        raise InvalidRequestError(
            f"{type(message).__name__} is not supported; pass system, human and AI messages "
            "(give retrieved documents as documents= or as text-plain blocks)"
        )
    content = message.content
    parts = [content] if isinstance(content, str) else [_block_part(block) for block in content]
    return ChatMessage(role, parts)  # type: ignore[arg-type]
