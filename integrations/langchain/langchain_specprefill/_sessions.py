"""Where a call's answer comes from: the engine in this process, or a SpecPrefill gateway.

Both sessions take LangChain messages and the call's options and yield ``(StreamChunk, extras)``,
``extras`` being the stats that go next to the engine's (``document_source``...). The gateway session
imports no torch: an application that sends its requests to a gateway loads no model.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from typing import Any

from langchain_core.messages import BaseMessage

from langchain_specprefill.documents import documents_argument, documents_json, to_chat_message, to_openai_message
from langchain_specprefill.retrievers import located_documents
from specprefill_rag.config import GenerationParams
from specprefill_rag.gateway_client import GatewayClient
from specprefill_rag.results import StreamChunk

Reply = tuple[StreamChunk, dict[str, Any]]

RETRIEVER_LOCATED = "retriever-located"  # the adapter's document_source for documents found by the recorder


def _retrieved_in(options: dict[str, Any], texts: list[str], explicit: bool) -> list[str]:
    """The run's retrieved documents found verbatim in ``texts``; none when documents were given
    explicitly (``documents=``, content blocks or markers win).
    """
    if explicit or options.get("documents") is not None:
        return []
    return located_documents(options.get("retrieved") or (), texts)


class LocalSession:
    """The engine of ``settings`` (loaded on first use), with documents found by :func:`chat_layout`."""

    runs_here = True

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def _layout(self, messages: list[BaseMessage], options: dict[str, Any]) -> tuple[Any, str]:
        """The layout and its ``document_source`` (``"retriever-located"`` for the run's retrieved documents)."""
        from specprefill_rag.prompt.chat import DOCUMENT_START, chat_layout
        from specprefill_rag.prompt.layout import Document

        chat = [to_chat_message(m) for m in messages]
        texts = [m.text for m in chat]
        blocks = any(isinstance(p, Document) for m in chat for p in m.parts)
        explicit = blocks or any(DOCUMENT_START in t for t in texts)
        retrieved = _retrieved_in(options, texts, explicit)
        tokenizer, tail = self.settings.engine.tokenizer, self.settings.protect_tail_tokens
        if retrieved:
            # found verbatim, so nothing is inserted; if they cannot all be placed, the fallback applies
            layout = chat_layout(
                tokenizer, chat, retrieved, tail, question=options.get("question"), insert_missing=False
            )
            located = layout.document_source == "argument-located"
            return layout, RETRIEVER_LOCATED if located else layout.document_source
        layout = chat_layout(
            tokenizer, chat, documents_argument(options.get("documents")), tail, question=options.get("question")
        )
        return layout, layout.document_source

    def _keep_rate(self, options: dict[str, Any]) -> Any:
        """The call's keep rate, else the constructor's (also for an engine given with ``from_engine``)."""
        return options.get("keep_rate", self.settings.keep_rate)

    def stream(self, messages: list[BaseMessage], params: GenerationParams, options: dict[str, Any]) -> Iterator[Reply]:
        layout, source = self._layout(messages, options)
        for chunk in self.settings.engine.stream_layout(layout.layout, params, self._keep_rate(options)):
            yield chunk, {"document_source": source}

    async def astream(
        self, messages: list[BaseMessage], params: GenerationParams, options: dict[str, Any]
    ) -> AsyncGenerator[Reply, None]:
        layout, source = self._layout(messages, options)
        chunks = self.settings.engine.astream_layout(layout.layout, params, self._keep_rate(options))
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk, {"document_source": source}

    def token_ids(self, text: str) -> list[int]:
        return self.settings.engine.tokenizer.encode(text, add_special_tokens=False)


class GatewaySession:
    """A gateway: messages go out as OpenAI messages (documents as ``document`` parts or in
    ``spec_prefill.documents``), the gateway's draft scores them and its main model answers.
    """

    runs_here = False

    def __init__(self, client: GatewayClient, settings: Any) -> None:
        self.client = client
        self.settings = settings

    def _body(
        self, messages: list[BaseMessage], params: GenerationParams, options: dict[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """The request, and whether it carries the run's retrieved documents (located, never inserted)."""
        keep_rate = options.get("keep_rate", self.settings.keep_rate)
        openai = [to_openai_message(m) for m in messages]
        texts = [m["content"] for m in openai if isinstance(m["content"], str)]
        retrieved = _retrieved_in(options, texts, explicit=len(texts) < len(openai))
        spec_prefill = {
            "keep_rate": keep_rate,
            "max_document_tokens": self.settings.max_document_tokens,
            "documents": retrieved or documents_json(options.get("documents")),
            "question": options.get("question"),
            "insert_documents": False if retrieved else None,
        }
        return self.client.body(openai, spec_prefill, params), bool(retrieved)

    @staticmethod
    def _extras(reply: Any, retrieved: bool) -> dict[str, Any]:
        if retrieved and reply.extras.get("document_source") == "argument-located":
            return {**reply.extras, "document_source": RETRIEVER_LOCATED}
        return reply.extras

    def stream(self, messages: list[BaseMessage], params: GenerationParams, options: dict[str, Any]) -> Iterator[Reply]:
        body, retrieved = self._body(messages, params, options)
        for reply in self.client.stream(body):
            yield reply.chunk, self._extras(reply, retrieved)

    async def astream(
        self, messages: list[BaseMessage], params: GenerationParams, options: dict[str, Any]
    ) -> AsyncGenerator[Reply, None]:
        body, retrieved = self._body(messages, params, options)
        async with aclosing(self.client.astream(body)) as replies:
            async for reply in replies:
                yield reply.chunk, self._extras(reply, retrieved)

    def token_ids(self, text: str) -> list[int]:
        return self.client.token_ids(text)
