"""ChatSpecPrefill: a LangChain chat model whose main model prefills only the document tokens that matter."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from typing import Any, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict

from langchain_specprefill._settings import SpecPrefillSettings
from specprefill_rag.results import StreamChunk


def _usage(stats: Any) -> dict[str, int]:
    return {
        "input_tokens": stats.prompt_tokens,
        "output_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


class ChatSpecPrefill(SpecPrefillSettings, BaseChatModel):
    """Chat model with SpecPrefill: a draft scores the retrieved documents, the main model prefills the
    best ``keep_rate`` of them at their original positions; instructions and the question stay whole.

    Documents are found from, in order: ``documents=`` on the call (LangChain Documents, dicts or
    strings), ``text-plain`` content blocks, text marked by :func:`langchain_specprefill.format_docs`,
    the documents a retriever returned earlier in the same run where found verbatim in the messages;
    otherwise everything but the system message and the last ``protect_tail_tokens`` is a candidate.

    Example:
        .. code-block:: python

            llm = ChatSpecPrefill(model="smollm2-135m", keep_rate=0.2)
            chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
            message = chain.invoke("When did the bridge open?")
            message.response_metadata["spec_prefill"]["keep_rate"]
    """

    model_config = ConfigDict(extra="forbid")  # an unknown setting is refused, not ignored

    @property
    def _llm_type(self) -> str:
        return "specprefill-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._specprefill_params()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="specprefill",
            ls_model_name=kwargs.get("model", self.model),
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        stops = stop or self.stop
        if stops:
            params["ls_stop"] = stops
        return params

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids from the main model's own tokenizer (the gateway's, through a gateway)."""
        return self.session.token_ids(text)

    def _chunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], run_manager: Any = None
    ) -> Iterator[ChatGenerationChunk]:
        for chunk, extras in self._replies(messages, stop, kwargs, run_manager):
            yield self._chunk(chunk, extras)

    async def _achunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], run_manager: Any = None
    ) -> AsyncGenerator[ChatGenerationChunk, None]:
        """:meth:`_chunks` on the event loop (the engine's native async path, or the gateway's)."""
        async with aclosing(self._areplies(messages, stop, kwargs, run_manager)) as replies:
            async for chunk, extras in replies:
                yield self._chunk(chunk, extras)

    def _chunk(self, chunk: StreamChunk, extras: dict[str, Any]) -> ChatGenerationChunk:
        if chunk.result is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=chunk.text))
        metadata = self._response_metadata(chunk.result, extras)
        last = AIMessageChunk(
            content=chunk.text,
            usage_metadata=_usage(chunk.result.stats),
            response_metadata=metadata,
            chunk_position="last",
        )
        return ChatGenerationChunk(message=last, generation_info={"finish_reason": chunk.result.finish_reason})

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return _chat_result(list(self._chunks(messages, stop, kwargs, run_manager)))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return _chat_result([chunk async for chunk in self._achunks(messages, stop, kwargs, run_manager)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for chunk in self._chunks(messages, stop, kwargs, run_manager):
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncGenerator[ChatGenerationChunk, None]:
        async with aclosing(self._achunks(messages, stop, kwargs, run_manager)) as chunks:
            async for chunk in chunks:
                if run_manager:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk


def _chat_result(chunks: list[ChatGenerationChunk]) -> ChatResult:
    """One message from a whole stream; usage and metadata from its last chunk."""
    final = cast(AIMessageChunk, chunks[-1].message)  # the adapter's own chunks
    message = AIMessage(
        content="".join(str(c.message.content) for c in chunks),
        usage_metadata=final.usage_metadata,
        response_metadata=final.response_metadata,
    )
    return ChatResult(generations=[ChatGeneration(message=message, generation_info=chunks[-1].generation_info)])
