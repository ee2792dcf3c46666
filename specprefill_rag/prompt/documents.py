"""Retrieved documents as callers give them (text, bytes, mappings, :class:`Document`) -> checked
documents, their labelled prompt segments and the turns of a RAG question.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..arguments import check_documents, check_optional_text, check_text
from ..errors import InvalidRequestError
from .layout import Document, DocumentLike, Role, Segment, Turn

_DOCUMENT_KEYS = ("text", "title", "id")


def as_document(value: DocumentLike, index: int) -> Document:
    """Validate a document given as text, UTF-8 bytes, a mapping with text/title/id, or a Document.

    Text must be valid Unicode and not blank, the title a non-blank str or None, the id a str or None;
    nothing is coerced (``{"text": None}`` is refused, not sent as the word ``None``).
    """
    name = f"document {index}"
    if isinstance(value, bytes):
        value = _decode_utf8(value, name)
    if isinstance(value, str):
        value = Document(value)
    elif isinstance(value, Mapping):
        value = _mapping_document(value, name)
    if not isinstance(value, Document):
        raise InvalidRequestError(
            f"{name} has type {type(value).__name__}; pass str, bytes, Document or a mapping with 'text'"
        )
    if isinstance(value.text, str) and not value.text.strip():
        raise InvalidRequestError(f"{name} is empty; drop it before calling")
    text = check_text(value.text, f"{name}'s text", "document text")
    title = check_optional_text(value.title, f"{name}'s title", "title")
    if value.id is not None and not isinstance(value.id, str):
        raise InvalidRequestError(f"{name}'s id must be a str or None, got {type(value.id).__name__}; pass str(id)")
    return Document(text, title, value.id)


def _decode_utf8(value: bytes, name: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequestError(
            f"{name} is not valid UTF-8 (byte {error.start}: {value[error.start : error.start + 4]!r}); "
            "decode it with its real encoding before passing it"
        ) from None


def _mapping_document(value: Mapping[str, Any], name: str) -> Document:
    if "text" not in value:
        raise InvalidRequestError(f"{name} is a mapping without a 'text' key; give text, title and id")
    unknown = sorted(str(key) for key in value if key not in _DOCUMENT_KEYS)
    if unknown:
        raise InvalidRequestError(
            f"{name} has unknown keys {unknown}; a document mapping takes 'text' and optionally 'title' and 'id': "
            "drop the others"
        )
    return Document(value["text"], value.get("title"), value.get("id"))


def document_segments(documents: Sequence[DocumentLike], first_index: int = 0) -> list[Segment]:
    """Validated documents as labelled segments: ``Document [i] title`` (template), then the text."""
    segments: list[Segment] = []
    for offset, raw in enumerate(check_documents(documents)):
        index = first_index + offset
        document = as_document(raw, index)
        label = f"Document [{index + 1}]" + (f" {document.title}" if document.title else "")
        segments += [Segment(f"{label}\n", Role.TEMPLATE), Segment(document.text.strip(), Role.DOCUMENT, index)]
        segments.append(Segment("\n\n", Role.TEMPLATE))
    return segments


def rag_turns(question: str, documents: Sequence[DocumentLike], instructions: str | None) -> list[Turn]:
    """Validate a RAG request and lay it out as ``[system?, user]`` turns; the question comes last."""
    question = check_text(question, "question", "user's question")
    instructions = check_optional_text(instructions, "instructions", "system instructions")
    user = document_segments(documents) + [
        Segment("Question: ", Role.TEMPLATE),
        Segment(question.strip(), Role.QUESTION),
    ]
    system = [Turn("system", (Segment(instructions, Role.INSTRUCTION),))] if instructions else []
    return system + [Turn("user", tuple(user))]
