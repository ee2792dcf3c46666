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

Tools: the offered tools reach the chat template; a ``tool`` message's result is a document (compressible)
unless ``spec_prefill.compress_tool_results`` is false or its tool is in ``spec_prefill.keep_tools_whole``.
:func:`chat_request_decoding` turns ``tools``, ``tool_choice`` and ``response_format`` into the decoding
fields (the tool-call markup to parse, the output to enforce).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..config import OutputFormat, SystemContext
from ..decode.tool_choice import tool_decoding
from ..errors import ContextLengthError, InvalidRequestError, OutputFormatError
from ..prompt.chat import ChatLayout, ChatMessage, chat_layout, fallback_layout
from ..prompt.documents import as_document
from ..prompt.layout import Document, Role, Segment
from ..prompt.render import layout_from_segments
from ..prompt.tokens import count_tokens_at_least
from ..prompt.tools import check_no_control_text
from .errors import bad_request
from .schema import ChatCompletionRequest, CompletionRequest, Message, SpecPrefillOptions, TokenizeRequest

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
DOCUMENTS_FIELD = "spec_prefill.documents"
KEEP_TOOLS_FIELD = "spec_prefill.keep_tools_whole"


def _parts(message: Message) -> list[str | Document]:
    """A message's content as core parts (none for an assistant message that only makes calls)."""
    if message.content is None:
        return []
    if isinstance(message.content, str):
        return [message.content]
    return [Document(p.text, p.title, p.id) if p.type == "document" else p.text for p in message.content]


def _core_message(message: Message, compress: bool) -> ChatMessage:
    """The core message; ``compress``: a tool result may be compressed (it is a document)."""
    calls = tuple(call.core for call in message.tool_calls or ())
    role = _ROLES[message.role]
    return ChatMessage(role, _parts(message), calls, message.tool_call_id, message.name, compress)  # type: ignore[arg-type]


def _called_tools(messages: Sequence[Message]) -> dict[str, str]:
    """Each call id of the history -> the tool it called (a 400 naming a call id used twice, or a tool result
    that answers no earlier call).
    """
    called: dict[str, str] = {}
    answered: set[str] = set()
    for index, message in enumerate(messages):
        for number, call in enumerate(message.tool_calls or ()):
            if call.id in called:
                field = f"messages.{index}.tool_calls.{number}.id"
                raise bad_request(f"{field} reuses the call id {call.id!r}; give each call its own id", field)
            called[call.id] = call.function.name
        call_id = message.tool_call_id
        if call_id is not None and (call_id not in called or call_id in answered):
            field = f"messages.{index}.tool_call_id"
            raise bad_request(
                f"{field} is {call_id!r}, which no earlier assistant message's tool_calls made (or another tool "
                "message already answered); send each result with its call's id, after that call",
                field,
            )
        if call_id is not None:
            answered.add(call_id)
    return called


def _kept_whole(body: ChatCompletionRequest, called: dict[str, str]) -> set[str]:
    """``spec_prefill.keep_tools_whole``, checked: each a tool offered in ``tools`` or called in the messages."""
    known = {tool["function"]["name"] for tool in body.tool_schemas} | set(called.values())
    for name in body.spec_prefill.keep_tools_whole:
        if name not in known:
            raise bad_request(
                f"{KEEP_TOOLS_FIELD} names the tool {name!r}, which is neither offered in tools nor called in the "
                f"messages (known: {sorted(known)})",
                KEEP_TOOLS_FIELD,
            )
    return set(body.spec_prefill.keep_tools_whole)


def _core_messages(body: ChatCompletionRequest) -> list[ChatMessage]:
    """The request's messages for the core, each tool result compressible unless the options keep it whole."""
    called = _called_tools(body.messages)
    whole = _kept_whole(body, called)
    compress = body.spec_prefill.compress_tool_results
    return [
        _core_message(m, compress and (m.name or called.get(m.tool_call_id or "")) not in whole) for m in body.messages
    ]


def _tool_texts(body: ChatCompletionRequest) -> list[str]:
    """The offered tools and the history's call arguments as text: the template writes them into the prompt."""
    arguments = [call.function.arguments for m in body.messages for call in m.tool_calls or ()]
    return [json.dumps(body.tool_schemas, ensure_ascii=False), *arguments] if body.tools else arguments


def _system_context(options: SpecPrefillOptions, default: SystemContext) -> SystemContext:
    """The request's ``spec_prefill.system_context``, else the gateway's; off when it names its documents."""
    if options.documents is not None:
        return "off"
    return options.system_context if options.system_context is not None else default


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
    """The layout of a chat request (with its checked tools); a problem is a 400 naming ``messages``, the
    field of a message, ``tools``, ``spec_prefill.documents`` or ``spec_prefill.keep_tools_whole``.

    ``system_context``: the gateway's default for ``spec_prefill.system_context`` (retrieved context sent as
    plain text in a system message, :mod:`specprefill_rag.prompt.context`).
    """
    options = body.spec_prefill
    messages = _core_messages(body)
    documents = _documents(options)
    _check_tools_fit(tokenizer, body, context_length)
    check_fits(tokenizer, [m.text for m in messages] + _tool_texts(body), context_length)
    check_fits(tokenizer, [d.text for d in documents or ()], context_length)  # located or inserted: both count
    _check_tool_text(tokenizer, body)
    try:
        return chat_layout(
            tokenizer,
            messages,
            documents,
            protect_tail_tokens,
            question=options.question,
            insert_missing=options.insert_documents,
            tools=body.tool_schemas,
            system_context=_system_context(options, system_context),
            tool_choice=body.tool_choice,
        )
    except ContextLengthError:
        raise
    except InvalidRequestError as error:
        raise bad_request(str(error), "messages") from None


def _check_tools_fit(tokenizer: Any, body: ChatCompletionRequest, context_length: int) -> None:
    """Tools whose schemas alone overflow the context are a 400 naming ``tools`` (not ``messages``)."""
    if not body.tools:
        return
    try:
        check_fits(tokenizer, [json.dumps(body.tool_schemas, ensure_ascii=False)], context_length)
    except ContextLengthError as error:
        raise bad_request(
            f"the offered tools alone take at least {error.prompt_tokens} tokens, more than the main model's context "
            f"of {context_length} tokens (the template writes every tool's schema into the prompt); offer fewer "
            "tools, or shorter descriptions and parameters",
            "tools",
        ) from None


def _check_tool_text(tokenizer: Any, body: ChatCompletionRequest) -> None:
    """No control-token text in the tools (a 400 naming ``tools``); the calls' are checked with the messages."""
    try:
        check_no_control_text(tokenizer, body.tool_schemas, [])
    except InvalidRequestError as error:
        raise bad_request(str(error), "tools") from None


def chat_request_decoding(engine: Any, body: ChatCompletionRequest, layout: ChatLayout) -> dict[str, Any]:
    """The :class:`~specprefill_rag.config.GenerationParams` fields of a chat request's ``tools``, ``tool_choice``,
    ``parallel_tool_calls`` and ``response_format`` (an output to enforce is compiled afterwards, by
    :func:`check_output_format`); a tokenizer without a chat template is a 400 naming ``tools``.
    """
    parallel, lazy = body.parallel_tool_calls is not False, engine.config.lazy_tool_grammar
    try:
        fields = tool_decoding(engine.tokenizer, layout.tools, body.chosen_tool, parallel, lazy)
    except InvalidRequestError as error:
        raise bad_request(str(error), "tools") from None
    if body.output_format is not None:
        fields = {**fields, "output_format": body.output_format}
    return fields


def check_output_format(engine: Any, body: ChatCompletionRequest, output: OutputFormat) -> None:
    """Blocking: the main backend checks ``output`` against the schema limits and compiles it (cached), so one it
    cannot enforce is a 400 before any draft work, naming ``response_format``, the forced call's tool
    (``tools[i].function.parameters``) or ``tool_choice``.
    """
    try:
        engine.backend.check_output_format(output)
    except InvalidRequestError as error:
        raise bad_request(str(error), _output_param(body, error)) from None


def _output_param(body: ChatCompletionRequest, error: InvalidRequestError) -> str:
    if body.output_format is not None:
        return "response_format"
    tool = error.tool if isinstance(error, OutputFormatError) else None
    for index, schema in enumerate(body.tool_schemas if tool is not None else ()):
        if schema.get("function", {}).get("name") == tool:
            return f"tools[{index}].function.parameters"
    return "tool_choice"


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
        return fallback_layout(engine.text_layout(prompt, parse_special_tokens=True))
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
