r"""Retrieved context inside a system message -> ordered (text, is_document) parts. Pure string code.

RAG tutorials put the retrieved documents into the system message as plain text (LangChain's
``create_stuff_documents_chain`` QA prompts, LlamaIndex's ``context`` and ``condense_plus_context`` chat
engines). :func:`split_system_context` finds that context and splits it into documents where the
frameworks join them (``"\n\n"``: LangChain's ``format_docs`` and ``DEFAULT_DOCUMENT_SEPARATOR``,
LlamaIndex's node texts); everything else is instructions, kept whole. The parts always concatenate
to the message exactly, and a message where no context is found comes back as one text part.

Modes (:data:`SystemContext`):

* ``"off"``: nothing is split.
* ``"delimited"``: only the context spans of known templates (:data:`DELIMITED_TEMPLATES`):

  - ``<context>`` ... ``</context>`` (LangChain hub ``langchain-ai/retrieval-qa-chat``) and
    ``<documents>`` ... ``</documents>``: from the first opening tag to the last closing tag, so a
    document that quotes a tag stays inside;
  - a line of 10 or more dashes ... the same line of dashes (LlamaIndex ``context`` chat engine, and its
    ``Context information is below.`` QA prompts): to the next identical line, so a document holding
    one ends the span early (the rest is kept whole, never dropped);
  - ``Here are the relevant documents for the context:`` ... ``Instruction:`` (LlamaIndex
    ``condense_plus_context``): to the last ``Instruction:`` line; in its refine prompt to the first
    ``Existing Answer:`` line (the answer being refined is kept whole);
  - ``Use the following pieces of retrieved context to answer the question.`` ... paragraph, then the
    context to the end of the message (LangChain RAG tutorial QA prompt);
  - ``Use the following context in your response:`` then the context to the end of the message (LangChain's
    RAG agent tutorial, its ``@dynamic_prompt`` middleware);
  - ``Context:`` at a line start or after a sentence (not at the message's start), then the context to
    the end of the message (``create_retrieval_chain`` docs' QA prompt:
    ``"... keep the answer concise. Context: {context}"``).

* ``"after_instructions"``: any prompt whose documents come last: after the first ``Context:`` or
  ``Documents:`` label (at a line start or after a sentence, not at the message's start), else after
  the first paragraph (the first blank line), everything is documents.

Within the context, documents are the pieces between blank lines (``"\n\n"`` or more newlines):
a retrieved document with paragraphs of its own becomes several documents, which changes no text.
"""

from __future__ import annotations

import re
from typing import get_args

from ..config import SystemContext

SYSTEM_CONTEXT_MODES: tuple[str, ...] = get_args(SystemContext)
Part = tuple[str, bool]  # (text, is_document)

_BLANK_LINES = re.compile(r"\n{2,}")
_TAGS = ("context", "documents")
_DASH_LINE = re.compile(r"^[ \t]*(-{10,})[ \t]*$", re.M)  # LlamaIndex: 20 or 21; a markdown rule is shorter
_LLAMA_CONDENSE = re.compile(r"Here are the relevant documents for the context:[ \t]*\n")
_LLAMA_INSTRUCTION = re.compile(r"\n[ \t]*\n[ \t]*Instruction:")
_LLAMA_EXISTING_ANSWER = re.compile(r"\n[ \t]*\n[ \t]*Existing Answer:")
_LANGCHAIN_TUTORIAL = re.compile(r"Use the following pieces of retrieved context to answer[ \t\n]+the question\.")
_LANGCHAIN_AGENT_TUTORIAL = re.compile(r"Use the following context in your response:")
_LABEL_AT = r"(?:(?<=\n)|(?<=[.!?] ))[ \t]*"  # a label at the very start leaves no instructions: not one
_CONTEXT_LABEL = re.compile(_LABEL_AT + r"Context:[ \t]*\n?")
_ANY_LABEL = re.compile(_LABEL_AT + r"(?:Context|Documents):[ \t]*\n?")

DELIMITED_TEMPLATES = (
    "<context>\\n{context}\\n</context> (LangChain hub retrieval-qa-chat), <documents>...</documents>",
    "a dash line ... the same dash line (LlamaIndex context chat engine, 'Context information is below.')",
    "'Here are the relevant documents for the context:' ... 'Instruction:' (LlamaIndex condense_plus_context)",
    "'Use the following pieces of retrieved context to answer the question. ...\\n\\n{context}' (LangChain tutorial)",
    "'Use the following context in your response:\\n\\n{context}' (LangChain RAG agent tutorial)",
    "'Context: {context}' at the end (create_retrieval_chain QA prompt)",
)


def _tag_span(text: str) -> tuple[int, int] | None:
    for tag in _TAGS:
        opening = text.find(f"<{tag}>")
        closing = text.rfind(f"</{tag}>")
        if opening >= 0 and closing > opening:
            return opening + len(tag) + 2, closing
    return None


def _dash_span(text: str) -> tuple[int, int] | None:
    """From the first dash line that recurs to its next occurrence (one pass: a client's many dash lines
    cost linear time).
    """
    first: dict[str, re.Match[str]] = {}
    best: tuple[int, int] | None = None
    for line in _DASH_LINE.finditer(text):
        opening = first.setdefault(line.group(1), line)
        if opening is not line and (best is None or opening.end() < best[0]):
            best = (opening.end(), line.start())
    return best


def _llama_condense_span(text: str) -> tuple[int, int] | None:
    opening = _LLAMA_CONDENSE.search(text)
    if opening is None:
        return None
    refine = _LLAMA_EXISTING_ANSWER.search(text, opening.end())  # the refine prompt: the answer is not context
    if refine is not None:
        return opening.end(), refine.start()
    ends = list(_LLAMA_INSTRUCTION.finditer(text, opening.end()))
    return (opening.end(), ends[-1].start()) if ends else None


def _to_end_after(pattern: re.Pattern[str], text: str, paragraph: bool) -> tuple[int, int] | None:
    match = pattern.search(text)
    if match is None:
        return None
    start = match.end()
    if paragraph:  # the context starts after the paragraph holding the match
        blank = _BLANK_LINES.search(text, start)
        if blank is None:
            return None
        start = blank.start()
    return start, len(text)


def _delimited_span(text: str) -> tuple[int, int] | None:
    return (
        _tag_span(text)
        or _dash_span(text)
        or _llama_condense_span(text)
        or _to_end_after(_LANGCHAIN_TUTORIAL, text, paragraph=True)
        or _to_end_after(_LANGCHAIN_AGENT_TUTORIAL, text, paragraph=False)
        or _to_end_after(_CONTEXT_LABEL, text, paragraph=False)
    )


def _after_instructions_span(text: str) -> tuple[int, int] | None:
    label = _ANY_LABEL.search(text)
    if label is not None and label.end() < len(text):
        return label.end(), len(text)
    blank = _BLANK_LINES.search(text)
    return (blank.start(), len(text)) if blank is not None else None


def _documents(context: str) -> list[Part]:
    """``context`` as text and document parts: documents between blank lines, their edge whitespace text."""
    parts: list[Part] = []
    cursor = 0
    for piece in [*_BLANK_LINES.finditer(context), None]:
        end = piece.start() if piece is not None else len(context)
        chunk = context[cursor:end]
        stripped = chunk.strip()
        if stripped:
            lead = len(chunk) - len(chunk.lstrip())
            parts += [(chunk[:lead], False), (stripped, True), (chunk[lead + len(stripped) :], False)]
        else:
            parts.append((chunk, False))
        if piece is not None:
            parts.append((piece.group(0), False))
            cursor = piece.end()
    return parts


def _merged(parts: list[Part]) -> list[Part]:
    merged: list[Part] = []
    for text, is_document in parts:
        if not text:
            continue
        if merged and not is_document and not merged[-1][1]:
            merged[-1] = (merged[-1][0] + text, False)
        else:
            merged.append((text, is_document))
    return merged


def split_system_context(text: str, mode: SystemContext) -> list[Part]:
    """``text`` as ordered (text, is_document) parts whose texts concatenate to ``text``; see the module doc.

    No context found, an empty context, or ``mode="off"``: ``[(text, False)]``.
    """
    if mode not in SYSTEM_CONTEXT_MODES:
        raise ValueError(f"system_context={mode!r}; use one of {', '.join(SYSTEM_CONTEXT_MODES)}")
    span = None
    if mode == "delimited":
        span = _delimited_span(text)
    elif mode == "after_instructions":
        span = _after_instructions_span(text)
    if span is None:
        return [(text, False)] if text else []
    start, end = span
    parts = _merged([(text[:start], False), *_documents(text[start:end]), (text[end:], False)])
    return parts if any(is_document for _, is_document in parts) else [(text, False)]
