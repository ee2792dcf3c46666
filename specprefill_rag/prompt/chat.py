"""Chat messages -> prompt layout, finding the retrieved documents the way frameworks deliver them.

Framework adapters (LangChain, LlamaIndex) convert their messages to :class:`ChatMessage` and call
:func:`chat_layout`. Documents are found, in this order of preference:

1. ``documents=`` given with the call: located verbatim in the messages (a prompt template already
   stuffed them in), else inserted into the last user message before its text;
2. document blocks inside messages (:class:`~specprefill_rag.prompt.Document` parts);
3. text wrapped by :func:`mark_document` (what ``format_docs`` helpers emit); the markers are removed;
4. none of these (the fallback): every message but the system text is a candidate, except the last
   ``protect_tail_tokens`` tokens (the question); the stats say ``"fallback"``, or ``"none"`` when nothing
   is left to drop.

Tool results (``tool`` messages) are documents too, whatever else is found, unless the message says
``compress=False``. Text outside documents is kept whole: system and developer messages as instructions,
the last user message as the question, earlier turns as context that is never dropped. Tools offered
(``tools=``) and the tool calls of assistant messages are written by the chat template as its own
scaffolding, so they are always kept.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ..arguments import check_documents, check_optional_text, check_unicode
from ..config import SystemContext
from ..errors import InvalidRequestError
from .context import split_system_context
from .documents import as_document, document_segments
from .layout import Document, DocumentLike, PromptLayout, Role, Segment, ToolCall, Turn
from .render import build_turns_layout, protect_tail
from .tools import (
    check_no_control_text,
    check_tool_call,
    check_tools,
    hermes_in_messages,
    model_tool_format,
    template_tool_format,
)

# A secret of this process in every marker: retrieved text cannot forge one, so a document cannot end
# its own span early and pass the rest of its text off as the (never dropped) question.
_MARKER_NONCE = secrets.token_hex(8)
DOCUMENT_START = f"\x02{_MARKER_NONCE}\x02"
DOCUMENT_END = f"\x03{_MARKER_NONCE}\x03"
_MARKED = re.compile(f"{re.escape(DOCUMENT_START)}(.*?){re.escape(DOCUMENT_END)}", re.S)

ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
_ROLES = ("system", "developer", "user", "assistant", "tool")
# Where a request's documents were found. "system-context": retrieved context in a system message
# (``system_context``); the LangChain adapter adds "retriever-located" (a retriever's documents, located).
# "tool-results": only tool results are documents. "fallback": none were marked, so earlier text became
# pseudo-documents (rule 4 below); "none": nothing in the prompt may be dropped.
DocumentSource = Literal[
    "argument-located",
    "argument-inserted",
    "blocks",
    "markers",
    "fallback",
    "none",
    "retriever-located",
    "system-context",
    "tool-results",
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
    """A framework-neutral chat message: text parts (str) and document parts (Document).

    Attributes:
        tool_calls: an assistant message's calls (its text may be empty).
        tool_call_id: a ``tool`` message's call, one made by an earlier assistant message.
        name: a ``tool`` message's tool (taken from its call when None).
        compress: a ``tool`` message's result may be compressed (it is a document); False keeps it whole.
    """

    role: ChatRole
    parts: list[str | Document] = field(default_factory=list)
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    compress: bool = True

    @property
    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p.text for p in self.parts)


@dataclass(frozen=True)
class ChatLayout:
    """A prompt layout and where its documents came from."""

    layout: PromptLayout
    document_source: DocumentSource
    n_documents: int
    tools: tuple[dict[str, Any], ...] = ()
    """The checked tool schemas offered to the model."""


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


def _outside_role(message: ChatMessage, is_question: bool) -> Role:
    """The role of a message's text outside its documents."""
    if message.role == "tool":
        return Role.DOCUMENT if message.compress else Role.INSTRUCTION
    return Role.QUESTION if is_question and message.role == "user" else Role.INSTRUCTION


def _question_index(messages: Sequence[ChatMessage]) -> int:
    """The last user message: the question (kept whole). Tool results may follow it."""
    return max(i for i, m in enumerate(messages) if m.role == "user")


def _turn(message: ChatMessage, segments: Sequence[Segment]) -> Turn:
    """A message as the chat template reads it; a developer message is a system turn (the templates of open
    models know no developer role).
    """
    role = "system" if message.role == "developer" else message.role
    return Turn(role, tuple(segments), message.tool_calls, message.tool_call_id, message.name)


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


def _numbered(turns: list[Turn]) -> list[Turn]:
    """Document segments without an index (tool results) get their own, after every other document's."""
    next_index = 1 + max((s.document for t in turns for s in t.segments), default=-1)
    numbered = []
    for turn in turns:
        segments = []
        for segment in turn.segments:
            if segment.role == Role.DOCUMENT and segment.document < 0:
                segment = Segment(segment.text, Role.DOCUMENT, next_index, segment.scaffold)
                next_index += 1
            segments.append(segment)
        numbered.append(replace(turn, segments=tuple(segments)))
    return numbered


def _validate(messages: Sequence[ChatMessage]) -> None:
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequestError(
            f"messages is a {type(messages).__name__}; pass a list of ChatMessage, e.g. [ChatMessage('user', ['...'])]"
        )
    if not messages:
        raise InvalidRequestError("no messages given; pass at least one user message")
    calls: dict[str, ToolCall] = {}
    for index, message in enumerate(messages):
        _validate_message(message, index, calls)
    last = next((m for m in reversed(messages) if m.role not in ("system", "developer")), messages[-1])
    if last.role not in ("user", "tool"):
        raise InvalidRequestError(
            f"the last message is from '{last.role}'; SpecPrefill answers a user message or a tool result (system "
            "messages may follow them), so end with one"
        )
    if not any(m.role == "user" for m in messages):
        raise InvalidRequestError("no user message given; pass the user's question as a user message")
    question = messages[_question_index(messages)]
    if last.role == "user" and not question.text.strip():
        raise InvalidRequestError("the last user message is empty; pass the question in it")


def _validate_message(message: ChatMessage, index: int, calls: dict[str, ToolCall]) -> None:
    """One message's role, text and tool fields; ``calls``: the calls made so far and not yet answered."""
    field_name = f"messages[{index}]"
    if not isinstance(message, ChatMessage):
        raise InvalidRequestError(
            f"{field_name} is a {type(message).__name__}, not a ChatMessage; build it as ChatMessage(role, [text]) "
            "(OpenAI-style dicts are read by the gateway and the framework adapters, not by the engine)"
        )
    if message.role not in _ROLES:
        raise InvalidRequestError(f"{field_name} has role {message.role!r}; use one of {list(_ROLES)}")
    for part in message.parts:
        if isinstance(part, str):
            check_unicode(part, f"message {index}")
    if message.tool_calls and message.role != "assistant":
        raise InvalidRequestError(
            f"{field_name} is a {message.role} message with tool_calls; only assistants call: move the calls to an "
            "assistant message"
        )
    for number, call in enumerate(message.tool_calls):
        checked = check_tool_call(call, f"{field_name}.tool_calls[{number}]")
        if checked.id in calls:
            raise InvalidRequestError(
                f"{field_name}.tool_calls[{number}] reuses the call id {checked.id!r}; give each call its own id"
            )
        calls[checked.id] = checked
    if message.role != "tool":
        if message.tool_call_id is not None:
            raise InvalidRequestError(
                f"{field_name} has a tool_call_id but is not a tool message; send tool results with role 'tool'"
            )
        return
    answered = calls.pop(message.tool_call_id, None) if message.tool_call_id is not None else None
    if answered is None:
        raise InvalidRequestError(
            f"{field_name} is a tool result for call id {message.tool_call_id!r}, which no earlier assistant "
            "message made (or another result already answered); send each result with its call's id"
        )
    if message.name is not None and message.name != answered.name:
        raise InvalidRequestError(
            f"{field_name} names the tool {message.name!r}, but its call was to {answered.name!r}; pass the called "
            "tool's name or leave the name out"
        )


def _with_tool_names(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """Tool messages with their tool's name (from the call) and calls with their checked arguments."""
    calls = {call.id: call for m in messages for call in m.tool_calls}
    return [
        replace(
            m,
            tool_calls=tuple(ToolCall(c.name, dict(c.arguments), c.id) for c in m.tool_calls),
            name=m.name or (calls[m.tool_call_id].name if m.role == "tool" and m.tool_call_id else None),
        )
        for m in messages
    ]


def _has_explicit_documents(messages: Sequence[ChatMessage]) -> DocumentSource:
    if any(isinstance(p, Document) for m in messages for p in m.parts):
        return "blocks"
    if any(DOCUMENT_START in m.text for m in messages):
        return "markers"
    if any(m.role == "tool" and m.compress for m in messages):
        return "tool-results"
    return "none"


def _with_documents(
    messages: Sequence[ChatMessage], documents: list[Document], insert_missing: bool
) -> tuple[list[Turn], DocumentSource] | None:
    found: dict[int, int] = {}
    question = _question_index(messages)
    located = [_locate(m.text, documents, _outside_role(m, i == question), found) for i, m in enumerate(messages)]
    if len(found) == len(documents):
        return [_turn(m, s) for m, s in zip(messages, located)], "argument-located"
    if not insert_missing:
        return None
    turns = [_turn(m, (Segment(m.text, _outside_role(m, False)),)) for m in messages]
    inserted = (
        *document_segments(documents),
        Segment("Question: ", Role.TEMPLATE),
        Segment(messages[question].text, Role.QUESTION),
    )
    turns[question] = _turn(messages[question], inserted)
    return turns, "argument-inserted"


def _fallback(messages: Sequence[ChatMessage], question: str | None) -> list[Turn]:
    """Every message but system text and kept tool results is a candidate pseudo-document. With a ``question``
    found in the last user message, it and what follows are kept; otherwise the caller protects the tail.
    """
    kept = [m.role in ("system", "developer") or (m.role == "tool" and not m.compress) for m in messages]
    turns = [
        _turn(m, (Segment(m.text, Role.INSTRUCTION if keep else Role.DOCUMENT, i),))
        for i, (m, keep) in enumerate(zip(messages, kept))
    ]
    index = _question_index(messages)
    text = messages[index].text
    start = text.rfind(question) if question else -1
    if start >= 0:
        last = (Segment(text[:start], Role.DOCUMENT, index), Segment(text[start:], Role.QUESTION))
        turns[index] = _turn(messages[index], [s for s in last if s.text])
    return turns


def _whole(messages: Sequence[ChatMessage]) -> list[Turn]:
    """Every message whole: an agent's first step holds no retrieved text yet (it comes as tool results)."""
    question = _question_index(messages)
    return [_turn(m, (Segment(m.text, _outside_role(m, i == question)),)) for i, m in enumerate(messages)]


def _append_question(turns: list[Turn], index: int, question: str) -> list[Turn]:
    extra = (Segment("\n\nQuestion: ", Role.TEMPLATE), Segment(question, Role.QUESTION))
    turns = list(turns)
    turns[index] = replace(turns[index], segments=(*turns[index].segments, *extra))
    return turns


def chat_layout(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    documents: Sequence[DocumentLike] | None = None,
    protect_tail_tokens: int = 64,
    use_chat_template: bool = True,
    question: str | None = None,
    insert_missing: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    system_context: SystemContext = "off",
    tool_choice: Any = None,
) -> ChatLayout:
    """Lay out a chat for SpecPrefill; see the module docstring for how documents are found.

    ``question``: the user's question when it is not simply the last user message; kept whole, and
    appended to the last user message if it does not occur there. ``insert_missing=False``: documents
    that are not all found verbatim in the messages are not inserted (they came from the messages,
    e.g. a template variable); the fallback applies instead. ``tools``: OpenAI tool schemas, rendered by
    the chat template (:mod:`specprefill_rag.prompt.tools`). ``system_context``: when no documents are given or
    marked, the retrieved context a system message holds as plain text (:mod:`specprefill_rag.prompt.context`)
    is documents (``"system-context"``). ``tool_choice``: ``None`` or ``"auto"`` with tools and no tool result
    yet is an agent's first step (:attr:`PromptLayout.awaits_tool_results`); a forced call is not.
    """
    _validate(messages)
    checked_tools = check_tools(tools)
    messages, from_system = _with_system_context(messages, system_context if documents is None else "off")
    messages = _with_tool_names(messages)
    check_no_control_text(tokenizer, checked_tools, [c for m in messages for c in m.tool_calls])
    question = check_optional_text(question, "question", "user's question")
    turns, source = _turns(messages, documents, question, insert_missing)
    has_results = any(m.role == "tool" for m in messages)
    awaits_tool_results = bool(checked_tools) and tool_choice in (None, "auto") and not has_results
    if source == "none" and awaits_tool_results:
        turns = _whole(messages)  # no fallback pseudo-documents: the question stays whole, however long
    source = "system-context" if from_system else source
    question_index = _question_index(messages)
    if question is not None and question not in messages[question_index].text:
        turns = _append_question(turns, question_index, question)
    query = _draft_query(messages, question)
    turns, offered = _numbered(turns), checked_tools
    uses_tools = bool(checked_tools) or any(m.tool_calls or m.role == "tool" for m in messages)
    if uses_tools and use_chat_template and model_tool_format(tokenizer) and not template_tool_format(tokenizer):
        turns, offered = hermes_in_messages(turns, checked_tools), ()
    layout = build_turns_layout(tokenizer, turns, use_chat_template, offered, query)
    if awaits_tool_results:
        layout = replace(layout, awaits_tool_results=True)
    if source == "none":
        return fallback_layout(layout if question else protect_tail(layout, protect_tail_tokens), checked_tools)
    n_documents = len({int(i) for i in layout.document_index.unique() if int(i) >= 0})
    return ChatLayout(layout, source, n_documents, checked_tools)


def _system_context_message(message: ChatMessage, mode: SystemContext) -> ChatMessage:
    """A system message with the retrieved context it holds as Document parts (the core renders each document
    followed by a blank line, so a blank line that follows one in the text is that line, not another).
    """
    if message.role != "system" or mode == "off":
        return message
    parts: list[str | Document] = []
    after_document = False
    for text, is_document in split_system_context(message.text, mode):
        if is_document:
            parts.append(Document(text))
        else:
            text = text.removeprefix("\n\n") if after_document else text
            if text:
                parts.append(text)
        after_document = is_document
    return replace(message, parts=parts)


def _with_system_context(messages: Sequence[ChatMessage], mode: SystemContext) -> tuple[Sequence[ChatMessage], bool]:
    """The messages with the context of their system messages as documents, and whether any was found; unchanged
    when they name their documents (document blocks, markers): those win.
    """
    if mode == "off" or _has_explicit_documents(messages) in ("blocks", "markers"):
        return messages, False
    split = [_system_context_message(m, mode) for m in messages]
    return split, any(isinstance(part, Document) for m in split for part in m.parts)


def fallback_layout(layout: PromptLayout, tools: tuple[dict[str, Any], ...] = ()) -> ChatLayout:
    """A layout whose pseudo-documents (runs of candidate text, no marked documents) the fallback found:
    ``"fallback"`` with their count, or ``"none"`` when none are left.
    """
    n_documents = len({int(i) for i in layout.document_index.unique() if int(i) >= 0})
    return ChatLayout(layout, "fallback" if n_documents else "none", n_documents, tools)


def _draft_query(messages: Sequence[ChatMessage], question: str | None) -> str | None:
    """After tool results, what the draft scores the documents against: the arguments of the calls the results
    answer (the agent's own query), the question, then ``Answer:`` so that the draft's look-ahead starts the
    answer (ending on the arguments, it continued the JSON and kept 10 of 39 answers at keep 0.3 on HotpotQA
    against 27: ``benchmarks/tool_query.py``); None when the chat ends with the user's message.
    """
    answered = {m.tool_call_id for m in _trailing_results(messages)}
    if not answered:
        return None
    pending = [c for m in messages for c in m.tool_calls if c.id in answered]
    asked = question or messages[_question_index(messages)].text
    arguments = "\n".join(json.dumps(dict(c.arguments), ensure_ascii=False) for c in pending)
    return f"\n\n{arguments}\nQuestion: {asked.strip()}\nAnswer:"


def _trailing_results(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """The tool results that end the chat (the answers to the last assistant message's calls)."""
    results: list[ChatMessage] = []
    for message in reversed(messages):
        if message.role in ("system", "developer") and not results:
            continue  # instructions appended after the results (LlamaIndex's ReAct early stopping)
        if message.role != "tool":
            break
        results.append(message)
    return results


def _turns(
    messages: Sequence[ChatMessage],
    documents: Sequence[DocumentLike] | None,
    question: str | None,
    insert_missing: bool,
) -> tuple[list[Turn], DocumentSource]:
    """The turns with their documents marked, and where the documents came from."""
    source = _has_explicit_documents(messages)
    if documents is not None:
        if source not in ("none", "tool-results"):
            raise InvalidRequestError(
                f"documents were given twice: as an argument and as {source} in the messages; pass them one way"
            )
        if isinstance(documents, (list, tuple)) and not documents:
            raise InvalidRequestError("documents=[] is empty; pass the retrieved documents or leave it out")
        normalised = [as_document(d, i) for i, d in enumerate(check_documents(documents))]
        placed = _with_documents(messages, normalised, insert_missing)
        if placed is not None:
            return placed
    if source == "none":
        return _fallback(messages, question), "none"
    turns, count = [], 0
    question_index = _question_index(messages)
    for i, message in enumerate(messages):
        segments = _message_segments(message, _outside_role(message, i == question_index), count)
        count += sum(s.role == Role.DOCUMENT for s in segments)
        turns.append(_turn(message, segments))
    return turns, source
