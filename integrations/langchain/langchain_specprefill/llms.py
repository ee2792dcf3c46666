"""SpecPrefillLLM: the text-completion (string in, string out) variant."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.llms import LLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from specprefill_rag.aio import iterate_in_thread
from specprefill_rag.chat import ChatMessage, chat_layout

from langchain_specprefill._settings import SpecPrefillSettings
from langchain_specprefill.documents import documents_argument


class SpecPrefillLLM(SpecPrefillSettings, LLM):
    """Text LLM with SpecPrefill. The prompt is sent as one user turn through the main model's chat
    template; documents are found as for :class:`~langchain_specprefill.ChatSpecPrefill`
    (``documents=``, marked text from ``format_docs``, else everything but the protected tail).
    The output never includes the prompt."""

    @property
    def _llm_type(self) -> str:
        return "specprefill"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._specprefill_params()

    def get_token_ids(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def _chunks(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> Iterator[GenerationChunk]:
        params, options = self._call_options(stop, kwargs)
        engine = self.engine
        layout = chat_layout(
            engine.tokenizer,
            [ChatMessage("user", [prompt])],
            documents_argument(options.get("documents")),
            self.protect_tail_tokens,
            question=options.get("question"),
        )
        for chunk in engine.stream_layout(layout.layout, params, options.get("keep_rate")):
            info = None
            if chunk.result is not None:
                info = {**self._response_metadata(chunk.result, layout.document_source)}
            yield GenerationChunk(text=chunk.text, generation_info=info)

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        return "".join(chunk.text for chunk in self._chunks(prompt, stop, kwargs))

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """One generation per prompt, with the SpecPrefill stats in ``generation_info``."""
        generations = []
        for prompt in prompts:
            chunks = list(self._chunks(prompt, stop, kwargs))
            text = "".join(chunk.text for chunk in chunks)
            generations.append([Generation(text=text, generation_info=chunks[-1].generation_info)])
        return LLMResult(generations=generations)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        for chunk in self._chunks(prompt, stop, kwargs):
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        async for chunk in iterate_in_thread(lambda: self._chunks(prompt, stop, kwargs)):
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
