"""Chat messages -> prompt layout, finding the retrieved documents the way frameworks deliver them.

Framework adapters (LangChain, LlamaIndex) convert their messages to :class:`ChatMessage` and call
:func:`chat_layout`. Documents are found, in this order of preference:

1. ``documents=`` given with the call: located verbatim in the messages (a prompt template already
   stuffed them in), else inserted into the last user message before its text;
2. document blocks inside messages (:class:`~specprefill_rag.prompt.Document` parts);
3. text wrapped by :func:`mark_document` (what ``format_docs`` helpers emit); the markers are removed;
4. none of these: every message but the system text is a candidate, except the last
   ``protect_tail_tokens`` tokens (the question).

Text outside documents is kept whole: the system message as instructions, the last user message as
the question, earlier turns as context that is never dropped.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..arguments import check_documents, check_optional_text, check_unicode
from ..errors import InvalidRequestError
from .documents import as_document, document_segments
from .layout import Document, DocumentLike, PromptLayout, Role, Segment, Turn
from .render import build_turns_layout, protect_tail

# A secret of this process in every marker: retrieved text cannot forge one, so a document cannot end
# its own span early and pass the rest of its text off as the (never dropped) question.
_MARKER_NONCE = secrets.token_hex(8)
DOCUMENT_START = f"\x02{_MARKER_NONCE}\x02"
DOCUMENT_END = f"\x03{_MARKER_NONCE}\x03"
_MARKED = re.compile(f"{re.escape(DOCUMENT_START)}(.*?){re.escape(DOCUMENT_END)}", re.S)

ChatRole = Literal["system", "user", "assistant"]
# Where a request's documents were found. The adapters and the gateway add their own: "retriever-located"
# (a LangChain retriever's documents, located in the prompt), "system-context" (the gateway's system_context).
DocumentSource = Literal[
    "argument-located", "argument-inserted", "blocks", "markers", "none", "retriever-located", "system-context"
]


def mark_document(text: str) -> str:
    """Wrap a document's text so :func:`chat_layout` finds its span (markers are removed before use).

    The markers hold a secret of this process, so they only work within it (not across a network)
    and a document cannot contain them.
    """
    if not isinstance(text, str):
        raise InvalidRequestError(f"mark_document takes the document's text as str, got {type(text).__name__}")
    if DOCUMENT_START in text or DOCUMENT_END in text:
        raise InvalidRequestError("this text is already marked as a document; mark each document once")
    return f"{DOCUMENT_START}{text}{DOCUMENT_END}"


@dataclass
class ChatMessage:
    """A framework-neutral chat message: text parts (str) and document parts (Document)."""

    role: ChatRole
    parts: list[str | Document] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p.text for p in self.parts)


@dataclass(frozen=True)
class ChatLayout:
    """A prompt layout and where its documents came from."""

    layout: PromptLayout
    document_source: DocumentSource
    n_documents: int


def _split_markers(text: str, outside: Role, next_index: int) -> list[Segment]:
    segments, cursor = [], 0
    for match in _MARKED.finditer(text):
        segments.append(Segment(text[cursor : match.start()], outside))
        segments.append(Segment(match.group(1), Role.DOCUMENT, next_index + len(segments) // 2))
        cursor = match.end()
    rest = text[cursor:]
    if DOCUMENT_START in rest or DOCUMENT_END in rest:
        raise InvalidRequestError("unbalanced document markers in a message; build the text with mark_document()")
    return [s for s in [*segments, Segment(rest, outside)] if s.text]


def _locate(text: str, documents: list[Document], outside: Role, found: dict[int, int]) -> list[Segment]:
    """Segments of ``text`` with every not-yet-found document that occurs in it verbatim marked."""
    spans = []
    for index, document in enumerate(documents):
        start = text.find(document.text) if index not in found else -1
        if start >= 0:
            spans.append((start, start + len(document.text), index))
    spans.sort()
    segments, cursor = [], 0
    for start, end, index in spans:
        if start < cursor:
            continue  # overlaps an earlier document: leave it to be found elsewhere or inserted
        found[index] = 1
        segments += [Segment(text[cursor:start], outside), Segment(text[start:end], Role.DOCUMENT, index)]
        cursor = end
    return [s for s in [*segments, Segment(text[cursor:], outside)] if s.text]


def _outside_role(message: ChatMessage, is_last: bool) -> Role:
    if message.role == "system":
        return Role.INSTRUCTION
    return Role.QUESTION if is_last else Role.INSTRUCTION


def _message_segments(message: ChatMessage, outside: Role, next_index: int) -> list[Segment]:
    segments: list[Segment] = []
    for part in message.parts:
        index = next_index + sum(s.role == Role.DOCUMENT for s in segments)
        if isinstance(part, Document):
            part = as_document(part, index)
            label = [Segment(f"{part.title}\n", Role.TEMPLATE)] if part.title else []
            segments += [*label, Segment(part.text, Role.DOCUMENT, index), Segment("\n\n", Role.TEMPLATE)]
        else:
            segments += _split_markers(part, outside, index)
    return segments


def _validate(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise InvalidRequestError("no messages given; pass at least one user message")
    for index, message in enumerate(messages):
        for part in message.parts:
            if isinstance(part, str):
                check_unicode(part, f"message {index}")
    if messages[-1].role != "user":
        raise InvalidRequestError(
            f"the last message is from '{messages[-1].role}'; SpecPrefill answers a user message, so end with one"
        )
    if not messages[-1].text.strip():
        raise InvalidRequestError("the last user message is empty; pass the question in it")


def _has_explicit_documents(messages: Sequence[ChatMessage]) -> DocumentSource:
    if any(isinstance(p, Document) for m in messages for p in m.parts):
        return "blocks"
    if any(DOCUMENT_START in m.text for m in messages):
        return "markers"
    return "none"


def _with_documents(
    messages: Sequence[ChatMessage], documents: list[Document], insert_missing: bool
) -> tuple[list[Turn], DocumentSource] | None:
    found: dict[int, int] = {}
    located = [
        _locate(m.text, documents, _outside_role(m, i == len(messages) - 1), found) for i, m in enumerate(messages)
    ]
    if len(found) == len(documents):
        return [Turn(m.role, tuple(s)) for m, s in zip(messages, located)], "argument-located"
    if not insert_missing:
        return None
    turns = [Turn(m.role, (Segment(m.text, _outside_role(m, False)),)) for m in messages[:-1]]
    last = messages[-1]
    question = Segment(last.text, Role.QUESTION)
    turns.append(Turn(last.role, (*document_segments(documents), Segment("Question: ", Role.TEMPLATE), question)))
    return turns, "argument-inserted"


def _fallback(messages: Sequence[ChatMessage], question: str | None) -> list[Turn]:
    """Every non-system message is a candidate pseudo-document. With a ``question`` found in the last
    message, it and what follows are kept; otherwise the caller protects the tail.
    """
    turns = [
        Turn(m.role, (Segment(m.text, Role.INSTRUCTION if m.role == "system" else Role.DOCUMENT, i),))
        for i, m in enumerate(messages)
    ]
    text = messages[-1].text
    start = text.rfind(question) if question else -1
    if start >= 0:
        last = (Segment(text[:start], Role.DOCUMENT, len(messages) - 1), Segment(text[start:], Role.QUESTION))
        turns[-1] = Turn(messages[-1].role, tuple(s for s in last if s.text))
    return turns


def _append_question(turns: list[Turn], question: str) -> list[Turn]:
    last = turns[-1]
    extra = (Segment("\n\nQuestion: ", Role.TEMPLATE), Segment(question, Role.QUESTION))
    return [*turns[:-1], Turn(last.role, (*last.segments, *extra))]


def chat_layout(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    documents: Sequence[DocumentLike] | None = None,
    protect_tail_tokens: int = 64,
    use_chat_template: bool = True,
    question: str | None = None,
    insert_missing: bool = True,
) -> ChatLayout:
    """Lay out a chat for SpecPrefill; see the module docstring for how documents are found.

    ``question``: the user's question when it is not simply the last user message; kept whole, and
    appended to the last message if it does not occur there. ``insert_missing=False``: documents
    that are not all found verbatim in the messages are not inserted (they came from the messages,
    e.g. a template variable); the fallback applies instead.
    """
    _validate(messages)
    question = check_optional_text(question, "question", "user's question")
    source = _has_explicit_documents(messages)
    if documents is not None:
        if source != "none":
            raise InvalidRequestError(
                f"documents were given twice: as an argument and as {source} in the messages; pass them one way"
            )
        if isinstance(documents, (list, tuple)) and not documents:
            raise InvalidRequestError("documents=[] is empty; pass the retrieved documents or leave it out")
        normalised = [as_document(d, i) for i, d in enumerate(check_documents(documents))]
        placed = _with_documents(messages, normalised, insert_missing)
        if placed is None:
            return chat_layout(tokenizer, messages, None, protect_tail_tokens, use_chat_template, question)
        turns, source = placed
    elif source != "none":
        turns, count = [], 0
        for i, message in enumerate(messages):
            segments = _message_segments(message, _outside_role(message, i == len(messages) - 1), count)
            count += sum(s.role == Role.DOCUMENT for s in segments)
            turns.append(Turn(message.role, tuple(segments)))
    else:
        turns = _fallback(messages, question)
        if question is not None and question not in messages[-1].text:
            turns = _append_question(turns, question)
        layout = build_turns_layout(tokenizer, turns, use_chat_template)
        return ChatLayout(layout if question else protect_tail(layout, protect_tail_tokens), "none", 0)
    if question is not None and question not in messages[-1].text:
        turns = _append_question(turns, question)
    layout = build_turns_layout(tokenizer, turns, use_chat_template)
    n_documents = len({int(i) for i in layout.document_index.unique() if int(i) >= 0})
    return ChatLayout(layout, source, n_documents)
