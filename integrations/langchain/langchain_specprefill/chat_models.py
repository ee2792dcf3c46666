"""ChatSpecPrefill: a LangChain chat model whose main model prefills only the document tokens that matter."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from specprefill_rag.aio import iterate_in_thread
from specprefill_rag.chat import chat_layout

from langchain_specprefill._settings import SpecPrefillSettings
from langchain_specprefill.documents import documents_argument, to_chat_message


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
    strings), ``text-plain`` content blocks, text marked by :func:`langchain_specprefill.format_docs`;
    otherwise everything but the system message and the last ``protect_tail_tokens`` is a candidate.

    Example:
        .. code-block:: python

            llm = ChatSpecPrefill(model="smollm2-135m", keep_rate=0.2)
            chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
            message = chain.invoke("When did the bridge open?")
            message.response_metadata["spec_prefill"]["keep_rate"]
    """

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
        """Token ids from the main model's own tokenizer."""
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def _chunks(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> Iterator[ChatGenerationChunk]:
        params, options = self._call_options(stop, kwargs)
        engine = self.engine
        layout = chat_layout(
            engine.tokenizer,
            [to_chat_message(m) for m in messages],
            documents_argument(options.get("documents")),
            self.protect_tail_tokens,
            question=options.get("question"),
        )
        for chunk in engine.stream_layout(layout.layout, params, options.get("keep_rate")):
            if chunk.result is None:
                yield ChatGenerationChunk(message=AIMessageChunk(content=chunk.text))
                continue
            metadata = self._response_metadata(chunk.result, layout.document_source)
            last = AIMessageChunk(content=chunk.text, usage_metadata=_usage(chunk.result.stats),  # type: ignore[arg-type]
                                  response_metadata=metadata, chunk_position="last")
            yield ChatGenerationChunk(message=last, generation_info={"finish_reason": chunk.result.finish_reason})

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chunks = list(self._chunks(messages, stop, kwargs))
        final = chunks[-1].message
        message = AIMessage(
            content="".join(str(c.message.content) for c in chunks),
            usage_metadata=final.usage_metadata,
            response_metadata=final.response_metadata,
        )
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=chunks[-1].generation_info)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for chunk in self._chunks(messages, stop, kwargs):
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in iterate_in_thread(lambda: self._chunks(messages, stop, kwargs)):
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
