"""SpecPrefillLLM: the text-completion (string in, string out) variant."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.llms import LLM
from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict

from langchain_specprefill._settings import CALL_OPTIONS, SpecPrefillSettings, logprob_fields
from specprefill_rag.arguments import check_unicode
from specprefill_rag.config import LogprobSettings
from specprefill_rag.results import StreamChunk, legacy_logprobs


class SpecPrefillLLM(SpecPrefillSettings, LogprobSettings, LLM):
    """Text LLM with SpecPrefill. The prompt is sent as one user turn through the main model's chat
    template; documents are found as for :class:`~langchain_specprefill.ChatSpecPrefill`
    (``documents=``, marked text from ``format_docs``, else everything but the protected tail).
    The output never includes the prompt.

    Log-probabilities: ``logprobs=True`` and ``top_logprobs=k`` (constructor or call option) put a text
    completion's ``logprobs`` in OpenAI's legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``, as the gateway's ``/v1/completions`` and LangChain's ``OpenAI`` give them) in
    ``generation_info["logprobs"]``; streamed, each chunk carries its own tokens' (merged chunks hold them all).
    """

    model_config = ConfigDict(extra="forbid")  # an unknown setting is refused, not ignored
    _call_option_names = (*CALL_OPTIONS, *LogprobSettings.model_fields)

    @property
    def _llm_type(self) -> str:
        return "specprefill"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._specprefill_params()

    def get_token_ids(self, text: str) -> list[int]:
        return self.session.token_ids(text)

    def _decoding_fields(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return logprob_fields(self, kwargs)

    def _chunks(
        self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any], run_manager: Any = None
    ) -> Iterator[GenerationChunk]:
        messages: list[BaseMessage] = [HumanMessage(check_unicode(prompt, "prompt"))]
        offset = 0  # the answer's text so far, as its tokens' texts count it (text_offset)
        for chunk, extras in self._replies(messages, stop, kwargs, run_manager):
            yield self._chunk(chunk, extras, offset)
            offset += _tokens_text_length(chunk)

    async def _achunks(
        self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any], run_manager: Any = None
    ) -> AsyncGenerator[GenerationChunk, None]:
        """:meth:`_chunks` on the event loop (the engine's native async path, or the gateway's)."""
        messages: list[BaseMessage] = [HumanMessage(check_unicode(prompt, "prompt"))]
        offset = 0
        async with aclosing(self._areplies(messages, stop, kwargs, run_manager)) as replies:
            async for chunk, extras in replies:
                yield self._chunk(chunk, extras, offset)
                offset += _tokens_text_length(chunk)

    def _chunk(self, chunk: StreamChunk, extras: dict[str, Any], offset: int) -> GenerationChunk:
        """The chunk's text; its tokens' logprobs when asked; the result's metadata on the last chunk."""
        info = self._response_metadata(chunk.result, extras) if chunk.result is not None else {}
        logprobs = legacy_logprobs(chunk.logprobs, offset)
        if logprobs is not None:
            info["logprobs"] = logprobs
        return GenerationChunk(text=chunk.text, generation_info=info or None)

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        return "".join(chunk.text for chunk in self._chunks(prompt, stop, kwargs, run_manager))

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """One generation per prompt, with the SpecPrefill stats in ``generation_info``."""
        chunks = (list(self._chunks(prompt, stop, kwargs, run_manager)) for prompt in prompts)
        return LLMResult(generations=[_generation(c) for c in chunks])

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """:meth:`_generate` on the event loop; the prompts run concurrently."""

        async def one(prompt: str) -> list[Generation]:
            return _generation([chunk async for chunk in self._achunks(prompt, stop, kwargs, run_manager)])

        return LLMResult(generations=list(await asyncio.gather(*(one(prompt) for prompt in prompts))))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        for chunk in self._chunks(prompt, stop, kwargs, run_manager):
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncGenerator[GenerationChunk, None]:
        async with aclosing(self._achunks(prompt, stop, kwargs, run_manager)) as chunks:
            async for chunk in chunks:
                if run_manager:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk


def _generation(chunks: list[GenerationChunk]) -> list[Generation]:
    """One generation from a whole stream: the SpecPrefill stats of its last chunk, the logprobs of all."""
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    return [Generation(text=whole.text, generation_info=whole.generation_info)]


def _tokens_text_length(chunk: StreamChunk) -> int:
    """Characters of the chunk's tokens' texts (each decoded alone), which ``text_offset`` counts."""
    return sum(len(entry.token) for entry in chunk.logprobs or ())
