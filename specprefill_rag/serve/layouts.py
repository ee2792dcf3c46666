"""Request bodies -> prompt layouts, finding documents as the framework adapters do.

Over HTTP, documents come from ``spec_prefill.documents``, ``document`` content parts, retrieved
context inside a system message when ``system_context`` asks for it (:mod:`specprefill_rag.prompt.context`;
explicit documents win), or the fallback rule (:mod:`specprefill_rag.prompt.chat`). A ``/v1/completions``
prompt is used exactly as sent: ``spec_prefill.documents`` are located in it verbatim (every one must be
found), otherwise every token but special tokens and the protected tail is a candidate.

Special tokens: in chat requests only the chat template writes control tokens. A completion prompt is
the client's own rendering, so its special-token strings are control tokens, as vLLM reads them, except
inside the ``spec_prefill.documents`` located in it, which are tokenized as text. Clients that stuff
untrusted text into a completion prompt should name it in ``spec_prefill.documents`` (or use chat).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ContextLengthError, InvalidRequestError
from ..prompt.chat import ChatLayout, ChatMessage, DocumentSource, chat_layout
from ..prompt.context import SystemContext, split_system_context
from ..prompt.documents import as_document
from ..prompt.layout import Document, Role, Segment
from ..prompt.render import layout_from_segments
from ..prompt.tokens import count_tokens_at_least
from .errors import bad_request
from .schema import ChatCompletionRequest, CompletionRequest, Message, SpecPrefillOptions, TokenizeRequest

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
DOCUMENTS_FIELD = "spec_prefill.documents"
SYSTEM_CONTEXT_SOURCE: DocumentSource = "system-context"  # the stats' document_source of such documents


def _core_message(message: Message) -> ChatMessage:
    if isinstance(message.content, str):
        return ChatMessage(_ROLES[message.role], [message.content])  # type: ignore[arg-type]
    parts: list[str | Document] = [
        Document(p.text, p.title, p.id) if p.type == "document" else p.text for p in message.content
    ]
    return ChatMessage(_ROLES[message.role], parts)  # type: ignore[arg-type]


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
    return ChatMessage(message.role, parts)


def _with_system_context(
    messages: list[ChatMessage], options: SpecPrefillOptions, mode: SystemContext
) -> tuple[list[ChatMessage], bool]:
    """The messages with the context of their system messages as documents, and whether any was found; unchanged
    when the request names its documents (``spec_prefill.documents``, document parts): those win.
    """
    chosen = options.system_context if options.system_context is not None else mode
    if chosen == "off" or options.documents is not None:
        return messages, False
    if any(isinstance(part, Document) for m in messages for part in m.parts):
        return messages, False
    split = [_system_context_message(m, chosen) for m in messages]
    return split, any(isinstance(part, Document) for m in split for part in m.parts)


def _documents(options: SpecPrefillOptions) -> list[Document] | None:
    """``spec_prefill.documents`` checked (a 400 naming that field), or None."""
    if options.documents is None:
        return None
    try:
        return [
            as_document(d if isinstance(d, str) else Document(d.text, d.title, d.id), i)
            for i, d in enumerate(options.documents)
        ]
    except InvalidRequestError as error:
        raise bad_request(str(error), DOCUMENTS_FIELD) from None


def check_fits(tokenizer: Any, texts: Sequence[str], context_length: int, as_text: bool = True) -> None:
    """Refuse texts that cannot fit the context before they are rendered and tokenized whole: an oversized
    request then costs one piece of tokenization, not memory in proportion to its size. Texts of fewer
    characters than the context are never counted (they are small).
    """
    if sum(len(text) for text in texts) <= context_length:
        return
    tokens = count_tokens_at_least(tokenizer, texts, context_length, as_text)
    if tokens > context_length:
        raise ContextLengthError(tokens, 0, context_length, at_least=True)


def chat_request_layout(
    tokenizer: Any,
    body: ChatCompletionRequest,
    protect_tail_tokens: int,
    context_length: int,
    system_context: SystemContext = "off",
) -> ChatLayout:
    """The layout of a chat request; a problem is a 400 naming ``messages`` or ``spec_prefill.documents``.

    ``system_context``: the gateway's default for ``spec_prefill.system_context`` (retrieved context sent as
    plain text in a system message, :mod:`specprefill_rag.prompt.context`).
    """
    options = body.spec_prefill
    messages = [_core_message(m) for m in body.messages]
    documents = _documents(options)
    check_fits(tokenizer, [m.text for m in messages], context_length)
    check_fits(tokenizer, [d.text for d in documents or ()], context_length)  # located or inserted: both count
    messages, from_system = _with_system_context(messages, options, system_context)
    try:
        if from_system:
            layout = chat_layout(tokenizer, messages, None, protect_tail_tokens, question=options.question)
            return ChatLayout(layout.layout, SYSTEM_CONTEXT_SOURCE, layout.n_documents)
        return chat_layout(
            tokenizer,
            messages,
            documents,
            protect_tail_tokens,
            question=options.question,
            insert_missing=options.insert_documents,
        )
    except ContextLengthError:
        raise
    except InvalidRequestError as error:
        raise bad_request(str(error), "messages") from None


def _located_segments(prompt: str, documents: list[Document]) -> list[Segment]:
    spans = []
    for index, document in enumerate(documents):
        start = prompt.find(document.text)
        if start < 0:
            raise bad_request(
                f"spec_prefill.documents[{index}] does not occur verbatim in the prompt; send the "
                "documents exactly as they appear in it, or leave them out",
                DOCUMENTS_FIELD,
            )
        spans.append((start, start + len(document.text), index))
    segments, cursor = [], 0
    for start, end, index in sorted(spans):
        if start < cursor:
            raise bad_request(
                f"spec_prefill.documents[{index}] overlaps another document in the prompt", DOCUMENTS_FIELD
            )
        client_text = Segment(prompt[cursor:start], Role.QUESTION, scaffold=True)
        segments += [client_text, Segment(prompt[start:end], Role.DOCUMENT, index)]
        cursor = end
    segments.append(Segment(prompt[cursor:], Role.QUESTION, scaffold=True))
    return [s for s in segments if s.text]


def completion_request_layout(engine: Any, body: CompletionRequest, context_length: int) -> ChatLayout:
    """The layout of a text-completion request; the prompt is tokenized exactly as sent."""
    prompt = body.text
    if not prompt.strip():
        raise bad_request("prompt is empty; send the prompt text", "prompt")
    documents = _documents(body.spec_prefill)
    check_fits(engine.tokenizer, [prompt], context_length, as_text=False)  # a lower bound either way
    if documents is None:
        return ChatLayout(engine.text_layout(prompt, parse_special_tokens=True), "none", 0)
    layout = layout_from_segments(engine.tokenizer, _located_segments(prompt, documents), add_special_tokens=False)
    return ChatLayout(layout, "argument-located", len(documents))


def tokenize_request(tokenizer: Any, body: TokenizeRequest, context_length: int) -> list[int]:
    """``POST /tokenize``: the prompt's token ids as the main model reads them (special-token strings are control
    tokens, as in a completion prompt); a prompt longer than the context is refused, not tokenized whole.
    """
    check_fits(tokenizer, [body.prompt], context_length, as_text=False)
    ids = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
    if len(ids) > context_length:
        raise ContextLengthError(len(ids), 0, context_length)
    return list(ids)
