"""Where a call's answer comes from: the engine in this process, or a SpecPrefill gateway.

Both sessions take LangChain messages and the call's options and yield ``(StreamChunk, extras)``,
``extras`` being the stats that go next to the engine's (``document_source``...). The gateway session
imports no torch: an application that sends its requests to a gateway loads no model.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from langchain_core.messages import BaseMessage

from langchain_specprefill._tools import called_tools, keep_whole_names, openai_tool_choice
from langchain_specprefill.documents import (
    documents_argument,
    documents_json,
    kept_whole,
    to_chat_messages,
    to_openai_message,
)
from langchain_specprefill.retrievers import located_documents
from specprefill_rag.config import GenerationParams
from specprefill_rag.gateway_client import GatewayClient
from specprefill_rag.results import StreamChunk

if TYPE_CHECKING:  # the engine needs torch; a gateway session never imports it
    from specprefill_rag.engine import ChatRequest

Reply = tuple[StreamChunk, dict[str, Any]]

RETRIEVER_LOCATED = "retriever-located"  # the adapter's document_source for documents found by the recorder


def _retrieved_in(options: dict[str, Any], texts: list[str], explicit: bool) -> list[str]:
    """The run's retrieved documents found verbatim in ``texts``; none when documents were given
    explicitly (``documents=``, content blocks or markers win).
    """
    if explicit or options.get("documents") is not None:
        return []
    return located_documents(options.get("retrieved") or (), texts)


def _keep_whole(messages: list[BaseMessage], options: dict[str, Any]) -> list[str]:
    """The call's ``keep_tools_whole`` where it applies (checked against the tools offered and called)."""
    called = called_tools(messages).values()
    return keep_whole_names(options.get("keep_tools_whole") or [], options.get("tools"), called)


class LocalSession:
    """The engine of ``settings`` (loaded on first use): the engine's chat path, with documents found in the
    messages (the run's retrieved ones located, never inserted).
    """

    runs_here = True

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def _request(
        self, messages: list[BaseMessage], params: GenerationParams, options: dict[str, Any]
    ) -> tuple[ChatRequest, str]:
        """The engine's request (:meth:`~specprefill_rag.SpecPrefillEngine.chat_request`) and its
        ``document_source`` (``"retriever-located"`` for the run's retrieved documents).
        """
        from specprefill_rag.prompt.chat import DOCUMENT_START
        from specprefill_rag.prompt.layout import Document

        chat = to_chat_messages(messages, _keep_whole(messages, options), options.get("compress_tool_results", True))
        texts = [m.text for m in chat]
        blocks = any(isinstance(p, Document) for m in chat for p in m.parts)
        explicit = blocks or any(DOCUMENT_START in t for t in texts)
        searched = [m.text for m in chat if m.role != "tool" or m.compress]  # not in results kept whole
        retrieved = _retrieved_in(options, searched, explicit)
        request = self.settings.engine.chat_request(
            chat,
            retrieved if retrieved else documents_argument(options.get("documents")),
            options.get("tools"),
            options.get("tool_choice"),
            options.get("parallel_tool_calls") is not False,
            params=params,
            question=options.get("question"),
            insert_missing=not retrieved,  # found verbatim: nothing to insert; if not all placed, the fallback
        )
        source = request.chat.document_source
        return request, RETRIEVER_LOCATED if retrieved and source == "argument-located" else source

    def _keep_rate(self, options: dict[str, Any]) -> Any:
        """The call's keep rate, else the constructor's (also for an engine given with ``from_engine``)."""
        return options.get("keep_rate", self.settings.keep_rate)

    def _reselect(self, options: dict[str, Any]) -> Any:
        """The call's ``reselect``, else the constructor's."""
        return options.get("reselect", self.settings.reselect)

    def _document_cache(self, options: dict[str, Any]) -> Any:
        """The call's ``draft_document_cache``, else the constructor's when given; None: the engine's."""
        return options.get("draft_document_cache", _given(self.settings, "draft_document_cache"))

    def stream(self, messages: list[BaseMessage], params: GenerationParams, options: dict[str, Any]) -> Iterator[Reply]:
        request, source = self._request(messages, params, options)
        keep_rate, reselect = self._keep_rate(options), self._reselect(options)
        cache = self._document_cache(options)
        chunks = self.settings.engine.stream_layout(request.chat.layout, request.params, keep_rate, reselect, cache)
        for chunk in chunks:
            yield chunk, {"document_source": source}

    async def astream(
        self, messages: list[BaseMessage], params: GenerationParams, options: dict[str, Any]
    ) -> AsyncGenerator[Reply, None]:
        request, source = self._request(messages, params, options)
        keep_rate, reselect = self._keep_rate(options), self._reselect(options)
        cache = self._document_cache(options)
        chunks = self.settings.engine.astream_layout(request.chat.layout, request.params, keep_rate, reselect, cache)
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk, {"document_source": source}

    def token_ids(self, text: str) -> list[int]:
        return self.settings.engine.tokenizer.encode(text, add_special_tokens=False)

    def warm(self, documents: Sequence[Any], instructions: str | None) -> int:
        """Draft ``documents`` into the engine's per-document cache (:meth:`SpecPrefillEngine.warm_documents`)."""
        return self.settings.engine.warm_documents(documents_argument(documents), instructions)

    async def awarm(self, documents: Sequence[Any], instructions: str | None) -> int:
        return await asyncio.to_thread(self.warm, documents, instructions)


def _tool_fields(options: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI request fields of the call's tools: ``tools``, ``tool_choice``, ``parallel_tool_calls``."""
    fields: dict[str, Any] = {}
    if options.get("tools") is not None:
        fields["tools"] = options["tools"]
    if options.get("tool_choice") is not None:
        fields["tool_choice"] = openai_tool_choice(options["tool_choice"])
    if options.get("parallel_tool_calls") is not None:
        fields["parallel_tool_calls"] = options["parallel_tool_calls"]
    return fields


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
        keep = _keep_whole(messages, options)
        whole = kept_whole(messages, keep, options.get("compress_tool_results", True))
        texts = [m["content"] for m, kept in zip(openai, whole) if isinstance(m["content"], str) and not kept]
        explicit = any(not isinstance(m["content"], str) for m in openai)
        retrieved = _retrieved_in(options, texts, explicit)
        spec_prefill = {
            "keep_rate": keep_rate,
            "max_document_tokens": self.settings.max_document_tokens,
            "documents": retrieved or documents_json(options.get("documents")),
            "question": options.get("question"),
            "insert_documents": False if retrieved else None,
            "compress_tool_results": False if options.get("compress_tool_results") is False else None,
            "keep_tools_whole": keep or None,
            "reselect": options.get("reselect", _given(self.settings, "reselect")),
            "draft_document_cache": options.get("draft_document_cache", _given(self.settings, "draft_document_cache")),
        }
        return self.client.body(openai, spec_prefill, params, _tool_fields(options)), bool(retrieved)

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

    def warm(self, documents: Sequence[Any], instructions: str | None) -> int:
        """Draft ``documents`` into the gateway's per-document cache (:meth:`GatewayClient.warm_documents`)."""
        return self.client.warm_documents(documents_json(documents) or [], instructions)["warmed"]

    async def awarm(self, documents: Sequence[Any], instructions: str | None) -> int:
        return (await self.client.awarm_documents(documents_json(documents) or [], instructions))["warmed"]


def _given(settings: Any, name: str) -> Any:
    """A setting the user gave the constructor, else None (the gateway's own default applies)."""
    return getattr(settings, name) if name in settings.model_fields_set else None
