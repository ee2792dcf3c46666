"""Where a call's answer comes from: the engine in this process, or a SpecPrefill gateway.

Both sessions take ``(role, text)`` messages and a :class:`Request` and yield ``(StreamChunk, extras)``,
``extras`` being the stats that go next to the engine's (``document_source``, ``n_documents``...).
The gateway session imports no torch: an application that talks to a gateway loads no model.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from specprefill_rag.config import GenerationParams
from specprefill_rag.gateway_client import GatewayClient
from specprefill_rag.results import StreamChunk

Reply = tuple[StreamChunk, dict[str, Any]]


@dataclass(frozen=True)
class Request:
    """One call: messages as ``(role, text)``, where the documents are and how to decode."""

    messages: list[tuple[str, str]]
    documents: list[Any] | None
    question: str | None
    insert_missing: bool
    keep_rate: Any  # a fraction or "auto": the call's, else the LLM's (the engine checks it)
    params: GenerationParams


class LocalSession:
    """The engine of ``llm`` (loaded on first use), with documents found by :func:`chat_layout`."""

    runs_here = True

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def _layout(self, request: Request) -> Any:
        from specprefill_rag.prompt.chat import ChatMessage, chat_layout

        messages = [ChatMessage(role, [text]) for role, text in request.messages]
        return chat_layout(
            self.llm.engine.tokenizer,
            messages,
            request.documents,
            self.llm.protect_tail_tokens,
            question=request.question,
            insert_missing=request.insert_missing,
        )

    @staticmethod
    def _extras(layout: Any) -> dict[str, Any]:
        return {"document_source": layout.document_source, "n_documents": layout.n_documents}

    def stream(self, request: Request) -> Iterator[Reply]:
        layout = self._layout(request)
        for chunk in self.llm.engine.stream_layout(layout.layout, request.params, request.keep_rate):
            yield chunk, self._extras(layout)

    async def astream(self, request: Request) -> AsyncGenerator[Reply, None]:
        layout = self._layout(request)
        async with aclosing(self.llm.engine.astream_layout(layout.layout, request.params, request.keep_rate)) as chunks:
            async for chunk in chunks:
                yield chunk, self._extras(layout)

    @property
    def context_length(self) -> int:
        return self.llm.engine.backend.context_length

    @property
    def is_chat_model(self) -> bool:
        return bool(getattr(self.llm.engine.tokenizer, "chat_template", None))


class GatewaySession:
    """A gateway: the messages go out as OpenAI messages, the documents in ``spec_prefill.documents``."""

    runs_here = False
    is_chat_model = True

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
        }
        messages = [{"role": role, "content": text} for role, text in request.messages]
        return self.client.body(messages, options, request.params)

    def stream(self, request: Request) -> Iterator[Reply]:
        for reply in self.client.stream(self._body(request)):
            yield reply.chunk, reply.extras

    async def astream(self, request: Request) -> AsyncGenerator[Reply, None]:
        async with aclosing(self.client.astream(self._body(request))) as replies:
            async for reply in replies:
                yield reply.chunk, reply.extras

    @property
    def context_length(self) -> int:
        return self.client.context_length


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
