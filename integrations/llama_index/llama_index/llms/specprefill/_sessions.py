"""Where a call's answer comes from: the engine in this process, or a SpecPrefill gateway.

Both sessions take a :class:`Request` (its messages as :class:`Message`) and yield ``(StreamChunk, extras)``,
``extras`` being the stats that go next to the engine's (``document_source``, ``n_documents``...).
The gateway session imports no torch: an application that talks to a gateway loads no model.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specprefill_rag.config import GenerationParams
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.gateway_client import GatewayClient, tool_calls_json
from specprefill_rag.results import StreamChunk, ToolCall

if TYPE_CHECKING:  # the engine needs torch; a gateway session never imports it
    from specprefill_rag.engine import ChatRequest

Reply = tuple[StreamChunk, dict[str, Any]]


@dataclass(frozen=True)
class Message:
    """One chat message, framework-neutral and torch-free (the core's ``ChatMessage`` fields).

    Attributes:
        role: ``system``, ``developer``, ``user``, ``assistant`` or ``tool``.
        text: the message's text.
        tool_calls: an assistant message's calls.
        tool_call_id: a tool message's call.
        name: a tool message's tool: the name it gives, else its call's (None when no earlier call has its id).
        compress: a tool message's result may be compressed (False: kept whole).
    """

    role: str
    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    compress: bool = True


@dataclass(frozen=True)
class Request:
    """One call: its messages, where the documents are, the tools offered and how to decode.

    ``tools`` are OpenAI tool schemas (None: no tools); ``tool_choice`` is the core's (``auto``, ``none``,
    ``required`` or a tool's name; None: ``auto``).
    """

    messages: list[Message]
    documents: list[Any] | None
    question: str | None
    insert_missing: bool
    keep_rate: Any  # a fraction or "auto": the call's, else the LLM's (the engine checks it)
    params: GenerationParams
    reselect: Any = None  # the call's, else the LLM's when given; None: the engine's (or gateway's) own
    draft_document_cache: Any = None  # likewise
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool = True


class LocalSession:
    """The engine of ``llm`` (loaded on first use), through its chat path."""

    runs_here = True

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def _request(self, request: Request) -> ChatRequest:
        """The engine's request (:meth:`~specprefill_rag.SpecPrefillEngine.chat_request`): the layout, with
        documents found in the messages or given, and the decoding its tools and ``tool_choice`` add.
        """
        from specprefill_rag.prompt.chat import ChatMessage

        messages = [
            ChatMessage(m.role, [m.text], m.tool_calls, m.tool_call_id, m.name, m.compress) for m in request.messages
        ]
        return self.llm.engine.chat_request(
            messages,
            request.documents,
            request.tools,
            request.tool_choice,
            request.parallel_tool_calls,
            params=request.params,
            question=request.question,
            insert_missing=request.insert_missing,
        )

    @staticmethod
    def _extras(prepared: ChatRequest) -> dict[str, Any]:
        return {"document_source": prepared.chat.document_source, "n_documents": prepared.chat.n_documents}

    def stream(self, request: Request) -> Iterator[Reply]:
        prepared = self._request(request)
        chunks = self.llm.engine.stream_layout(
            prepared.chat.layout, prepared.params, request.keep_rate, request.reselect, request.draft_document_cache
        )
        for chunk in chunks:
            yield chunk, self._extras(prepared)

    async def astream(self, request: Request) -> AsyncGenerator[Reply, None]:
        prepared = self._request(request)
        chunks = self.llm.engine.astream_layout(
            prepared.chat.layout, prepared.params, request.keep_rate, request.reselect, request.draft_document_cache
        )
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk, self._extras(prepared)

    def warm(self, documents: Sequence[Any], instructions: str | None) -> int:
        """Draft ``documents`` into the engine's per-document cache (:meth:`SpecPrefillEngine.warm_documents`)."""
        return self.llm.engine.warm_documents(documents, instructions)

    async def awarm(self, documents: Sequence[Any], instructions: str | None) -> int:
        return await asyncio.to_thread(self.warm, documents, instructions)

    @property
    def context_length(self) -> int:
        return self.llm.engine.backend.context_length

    @property
    def is_chat_model(self) -> bool:
        return bool(getattr(self.llm.engine.tokenizer, "chat_template", None))

    @property
    def is_function_calling_model(self) -> bool:
        """Whether the main model can call tools: it has a chat template (one without tool calling gets the Hermes
        format written into the messages, :func:`~specprefill_rag.prompt.tools.model_tool_format`).
        """
        from specprefill_rag.prompt.tools import model_tool_format

        return model_tool_format(self.llm.engine.tokenizer) is not None


class GatewaySession:
    """A gateway: the messages go out as OpenAI messages, the documents in ``spec_prefill.documents``."""

    runs_here = False
    is_chat_model = True
    is_function_calling_model = True  # the gateway's model decides; it refuses tools its template cannot call

    def __init__(self, client: GatewayClient, llm: Any) -> None:
        self.client = client
        self.llm = llm

    def _body(self, request: Request) -> dict[str, Any]:
        options = {
            "keep_rate": request.keep_rate,
            "max_document_tokens": self.llm.max_document_tokens,
            "documents": _json_documents(request.documents),
            "question": request.question,
            "insert_documents": request.insert_missing,
            "keep_tools_whole": _tools_kept_whole(request.messages) or None,
            "reselect": request.reselect,
            "draft_document_cache": request.draft_document_cache,
        }
        messages = [_json_message(m) for m in request.messages]
        return self.client.body(messages, options, request.params, _tool_fields(request))

    def stream(self, request: Request) -> Iterator[Reply]:
        for reply in self.client.stream(self._body(request)):
            yield reply.chunk, reply.extras

    async def astream(self, request: Request) -> AsyncGenerator[Reply, None]:
        async with aclosing(self.client.astream(self._body(request))) as replies:
            async for reply in replies:
                yield reply.chunk, reply.extras

    def warm(self, documents: Sequence[Any], instructions: str | None) -> int:
        """Draft ``documents`` into the gateway's per-document cache (:meth:`GatewayClient.warm_documents`)."""
        return self.client.warm_documents(_json_documents(list(documents)) or [], instructions)["warmed"]

    async def awarm(self, documents: Sequence[Any], instructions: str | None) -> int:
        return (await self.client.awarm_documents(_json_documents(list(documents)) or [], instructions))["warmed"]

    @property
    def context_length(self) -> int:
        return self.client.context_length


def _json_message(message: Message) -> dict[str, Any]:
    """A message as OpenAI's: an assistant's ``tool_calls``, a tool result's ``tool_call_id`` and ``name``."""
    body: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.tool_calls:
        body["tool_calls"] = tool_calls_json(message.tool_calls)
    if message.role == "tool":
        body["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            body["name"] = message.name
    return body


def _tool_fields(request: Request) -> dict[str, Any]:
    """The request's OpenAI tool fields: ``tools``, ``tool_choice`` (a tool's name in OpenAI's dict form) and
    ``parallel_tool_calls``, when given.
    """
    fields: dict[str, Any] = {}
    if request.tools is not None:
        fields["tools"] = request.tools
        fields["parallel_tool_calls"] = request.parallel_tool_calls
    choice = request.tool_choice
    if choice is not None:
        named = choice not in ("auto", "none", "required")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice}} if named else choice
    return fields


def _tools_kept_whole(messages: list[Message]) -> list[str]:
    """The tools whose results stay whole, as the gateway's ``spec_prefill.keep_tools_whole`` (per tool).

    A result kept whole on its own (``spec_prefill_compress=False``) goes as its tool's name, which is exact when
    every result of that tool in the request is kept whole; otherwise it cannot be expressed, and is refused.
    """
    results = [m for m in messages if m.role == "tool"]
    whole = sorted({m.name for m in results if not m.compress and m.name is not None})
    mixed = sorted({m.name for m in results if m.compress and m.name in whole})
    if mixed:
        raise InvalidRequestError(
            f"the gateway keeps tool results whole per tool, but some results of {mixed} are kept whole and others "
            "not; give them all spec_prefill_compress=False, or name the tool in keep_tools_whole"
        )
    return whole


def _json_documents(documents: list[Any] | None) -> list[Any] | None:
    """Documents as JSON: text, or ``{"text", "title", "id"}`` (a core ``Document`` or a mapping)."""
    if documents is None:
        return None
    return [_json_document(d) for d in documents]


def _json_document(document: Any) -> Any:
    if isinstance(document, str):
        return document
    if isinstance(document, bytes):
        return document.decode("utf-8")
    if isinstance(document, dict):
        return dict(document)
    return {"text": document.text, "title": getattr(document, "title", None), "id": getattr(document, "id", None)}
