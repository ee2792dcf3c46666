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
from specprefill_rag.config import GenerationParams
from specprefill_rag.gateway_client import GatewayClient
from specprefill_rag.results import StreamChunk

Reply = tuple[StreamChunk, dict[str, Any]]


class LocalSession:
    """The engine of ``settings`` (loaded on first use), with documents found by :func:`chat_layout`."""

    runs_here = True

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def _layout(self, messages: list[BaseMessage], options: dict[str, Any]) -> Any:
        from specprefill_rag.prompt.chat import chat_layout

        return chat_layout(
            self.settings.engine.tokenizer,
            [to_chat_message(m) for m in messages],
            documents_argument(options.get("documents")),
            self.settings.protect_tail_tokens,
            question=options.get("question"),
        )

    def _keep_rate(self, options: dict[str, Any]) -> Any:
        """The call's keep rate, else the constructor's (also for an engine given with ``from_engine``)."""
        return options.get("keep_rate", self.settings.keep_rate)

    def stream(self, messages: list[BaseMessage], params: GenerationParams, options: dict[str, Any]) -> Iterator[Reply]:
        layout = self._layout(messages, options)
        for chunk in self.settings.engine.stream_layout(layout.layout, params, self._keep_rate(options)):
            yield chunk, {"document_source": layout.document_source}

    async def astream(
        self, messages: list[BaseMessage], params: GenerationParams, options: dict[str, Any]
    ) -> AsyncGenerator[Reply, None]:
        layout = self._layout(messages, options)
        chunks = self.settings.engine.astream_layout(layout.layout, params, self._keep_rate(options))
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk, {"document_source": layout.document_source}

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

    def _body(self, messages: list[BaseMessage], params: GenerationParams, options: dict[str, Any]) -> dict[str, Any]:
        keep_rate = options.get("keep_rate", self.settings.keep_rate)
        spec_prefill = {
            "keep_rate": keep_rate,
            "max_document_tokens": self.settings.max_document_tokens,
            "documents": documents_json(options.get("documents")),
            "question": options.get("question"),
        }
        return self.client.body([to_openai_message(m) for m in messages], spec_prefill, params)

    def stream(self, messages: list[BaseMessage], params: GenerationParams, options: dict[str, Any]) -> Iterator[Reply]:
        for reply in self.client.stream(self._body(messages, params, options)):
            yield reply.chunk, reply.extras

    async def astream(
        self, messages: list[BaseMessage], params: GenerationParams, options: dict[str, Any]
    ) -> AsyncGenerator[Reply, None]:
        async with aclosing(self.client.astream(self._body(messages, params, options))) as replies:
            async for reply in replies:
                yield reply.chunk, reply.extras

    def token_ids(self, text: str) -> list[int]:
        return self.client.token_ids(text)
