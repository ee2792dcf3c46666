"""Request bodies -> prompt layouts, finding documents as the framework adapters do.

Over HTTP, documents come from ``spec_prefill.documents``, ``document`` content parts, or the
fallback rule (:mod:`specprefill_rag.chat`). A ``/v1/completions`` prompt is used exactly as sent:
``spec_prefill.documents`` are located in it verbatim (every one must be found), otherwise every
token but special tokens and the protected tail is a candidate.

Special tokens: in chat requests only the chat template writes control tokens. A completion prompt is
the client's own rendering, so its special-token strings are control tokens, as vLLM reads them, except
inside the ``spec_prefill.documents`` located in it, which are tokenized as text. Clients that stuff
untrusted text into a completion prompt should name it in ``spec_prefill.documents`` (or use chat).
"""

from __future__ import annotations

from typing import Any

from ..chat import ChatLayout, ChatMessage, chat_layout
from ..errors import InvalidRequestError
from ..prompt import Document, Role, Segment, as_document, layout_from_segments
from .errors import bad_request
from .schema import ChatCompletionRequest, CompletionRequest, DocumentOption, Message, SpecPrefillOptions

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _core_message(message: Message) -> ChatMessage:
    if isinstance(message.content, str):
        return ChatMessage(_ROLES[message.role], [message.content])  # type: ignore[arg-type]
    parts: list[str | Document] = [
        Document(p.text, p.title, p.id) if p.type == "document" else p.text for p in message.content
    ]
    return ChatMessage(_ROLES[message.role], parts)  # type: ignore[arg-type]


def _documents(options: SpecPrefillOptions) -> list[Any] | None:
    if options.documents is None:
        return None
    return [Document(d.text, d.title, d.id) if isinstance(d, DocumentOption) else d for d in options.documents]


def chat_request_layout(tokenizer: Any, body: ChatCompletionRequest, protect_tail_tokens: int) -> ChatLayout:
    """The layout of a chat request (raises :class:`InvalidRequestError` naming the problem)."""
    options = body.spec_prefill
    return chat_layout(
        tokenizer, [_core_message(m) for m in body.messages], _documents(options), protect_tail_tokens,
        question=options.question, insert_missing=options.insert_documents,
    )


def _located_segments(prompt: str, documents: list[Document]) -> list[Segment]:
    spans = []
    for index, document in enumerate(documents):
        start = prompt.find(document.text)
        if start < 0:
            raise bad_request(f"spec_prefill.documents[{index}] does not occur verbatim in the prompt; send the "
                              "documents exactly as they appear in it, or leave them out", "spec_prefill.documents")
        spans.append((start, start + len(document.text), index))
    segments, cursor = [], 0
    for start, end, index in sorted(spans):
        if start < cursor:
            raise bad_request(f"spec_prefill.documents[{index}] overlaps another document in the prompt",
                              "spec_prefill.documents")
        client_text = Segment(prompt[cursor:start], Role.QUESTION, scaffold=True)
        segments += [client_text, Segment(prompt[start:end], Role.DOCUMENT, index)]
        cursor = end
    segments.append(Segment(prompt[cursor:], Role.QUESTION, scaffold=True))
    return [s for s in segments if s.text]


def completion_request_layout(engine: Any, body: CompletionRequest) -> ChatLayout:
    """The layout of a text-completion request; the prompt is tokenized exactly as sent."""
    prompt = body.text
    if not prompt.strip():
        raise InvalidRequestError("prompt is empty; send the prompt text")
    documents = _documents(body.spec_prefill)
    if documents is None:
        return ChatLayout(engine.text_layout(prompt, parse_special_tokens=True), "none", 0)
    if not documents:
        raise bad_request("spec_prefill.documents is empty; send the documents or leave the field out",
                          "spec_prefill.documents")
    normalised = [as_document(d, i) for i, d in enumerate(documents)]
    layout = layout_from_segments(engine.tokenizer, _located_segments(prompt, normalised), add_special_tokens=False)
    return ChatLayout(layout, "argument-located", len(normalised))
