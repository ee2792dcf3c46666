"""ChatSpecPrefill: a LangChain chat model whose main model prefills only the document tokens that matter."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from contextlib import aclosing
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field

from langchain_specprefill._sessions import Reply
from langchain_specprefill._settings import CALL_OPTIONS, SpecPrefillSettings, logprob_fields
from langchain_specprefill._tools import (
    TOOL_OPTIONS,
    ToolLike,
    check_one_constraint,
    check_output_format,
    lc_invalid_tool_calls,
    lc_tool_call_chunks,
    lc_tool_calls,
    tool_options,
    tool_schemas,
)
from specprefill_rag.config import LogprobSettings, OutputFormat
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.results import GenerationResult, StreamChunk, TokenLogprob, chat_logprobs

StructuredMethod = Literal["function_calling", "json_schema", "json_mode"]
_METHODS = ("function_calling", "json_schema", "json_mode")


def _usage(stats: Any) -> dict[str, int]:
    return {
        "input_tokens": stats.prompt_tokens,
        "output_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


class ChatSpecPrefill(SpecPrefillSettings, LogprobSettings, BaseChatModel):
    """Chat model with SpecPrefill: a draft scores the retrieved documents, the main model prefills the
    best ``keep_rate`` of them at their original positions; instructions and the question stay whole.

    Documents are found from, in order: ``documents=`` on the call (LangChain Documents, dicts or
    strings), ``text-plain`` content blocks, text marked by :func:`langchain_specprefill.format_docs`,
    the documents a retriever returned earlier in the same run where found verbatim in the messages;
    otherwise everything but the system message and the last ``protect_tail_tokens`` is a candidate.

    Tools: :meth:`bind_tools` offers tools through the main model's chat template (it must have tool calling:
    Qwen2.5/Hermes, Llama 3.x or Mistral markup); the answer's calls come back as ``AIMessage.tool_calls``
    (``tool_call_chunks`` when streamed). Tool results (``ToolMessage``) are documents the draft compresses,
    except the results of the tools named in ``keep_tools_whole`` (or all, ``compress_tool_results=False``).
    :meth:`with_structured_output` forces a tool call or constrains the answer to a JSON schema.

    Log-probabilities (as ChatOpenAI): ``logprobs=True`` and ``top_logprobs=k`` (constructor or call option) put
    OpenAI's ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}`` in the message's
    ``response_metadata["logprobs"]``; streamed, each chunk carries its own tokens' (merged chunks hold them all).
    They are the main model's raw distribution, before temperature, top-p, penalties and constraints.

    Example:
        .. code-block:: python

            llm = ChatSpecPrefill(model="smollm2-135m", keep_rate=0.2)
            chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
            message = chain.invoke("When did the bridge open?")
            message.response_metadata["spec_prefill"]["keep_rate"]
    """

    model_config = ConfigDict(extra="forbid")  # an unknown setting is refused, not ignored

    keep_tools_whole: list[str] = Field(
        default_factory=list,
        description="Tools whose results (ToolMessages) stay whole; every other tool result is a document the draft "
        "may compress. Also a call option (bind(keep_tools_whole=[...])); each name must be a bound or called tool.",
    )
    compress_tool_results: bool = Field(
        True, description="False: every tool result stays whole (also a call option); by default each is a document."
    )

    _call_option_names = (*CALL_OPTIONS, *TOOL_OPTIONS, "output_format", *LogprobSettings.model_fields)

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

    def bind_tools(
        self,
        tools: Sequence[ToolLike],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer ``tools`` to the model (each converted with :func:`convert_to_openai_tool`) in every call.

        Args:
            tools: BaseTools, functions, pydantic models, TypedDicts or OpenAI tool schemas.
            tool_choice: ``"auto"`` (the model decides; the default), ``"none"`` (no call; the tools are still
                shown), ``"any"``/``"required"``/``True`` (a call to some tool) or a tool's name (or
                ``{"type": "function", "function": {"name": ...}}``: a call to that tool). A forced call is
                constrained token by token, so the answer is a well-formed call (unless ``max_tokens`` cuts it:
                then it is an invalid call).
            parallel_tool_calls: False: at most one call (a further one is reported as an invalid call).
            strict: passed to :func:`convert_to_openai_tool` (the schemas' ``strict`` flag).
            kwargs: more call options to bind (``keep_tools_whole``, ``keep_rate``...).
        """
        schemas = tool_schemas(tools, strict)
        given = {**kwargs, "tools": schemas, "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls}
        checked = tool_options(given, self.keep_tools_whole, self.compress_tool_results)  # bad values fail here
        bound: dict[str, Any] = {**kwargs, "tools": schemas}
        for name in ("tool_choice", "parallel_tool_calls"):
            if checked[name] is not None:
                bound[name] = checked[name]
        return self.bind(**bound)

    def with_structured_output(
        self,
        schema: Mapping[str, Any] | type | None = None,
        *,
        method: StructuredMethod = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """A runnable whose answers are ``schema`` objects (a pydantic model's instance, else a dict).

        Args:
            schema: a pydantic model, a TypedDict, a JSON schema or an OpenAI tool schema (optional with
                ``json_mode``: the answer is then any JSON object).
            method: ``"function_calling"``: the schema is the one tool and the call to it is forced;
                ``"json_schema"``: the answer is JSON valid for the schema; ``"json_mode"``: the answer is a
                JSON object (describe the keys in the prompt). Each is enforced token by token.
            include_raw: return ``{"raw": AIMessage, "parsed": ..., "parsing_error": ...}``; a parsing error is
                then returned, not raised.
            strict: the tool schema's ``strict`` flag (function_calling) or the JSON schema's (json_schema); the
                answer is constrained to the schema either way. Not for json_mode.
        """
        if kwargs:
            raise InvalidRequestError(
                f"with_structured_output got unknown arguments {sorted(kwargs)}; it takes schema, method, include_raw "
                "and strict: pass only those"
            )
        if method not in _METHODS:
            raise InvalidRequestError(f"method must be one of {list(_METHODS)}, got {method!r}; use one of them")
        if not isinstance(include_raw, bool):
            raise InvalidRequestError(
                f"include_raw must be True or False, got {type(include_raw).__name__}; pass a bool"
            )
        if schema is None and method != "json_mode":
            raise InvalidRequestError(f"method={method!r} needs a schema; pass one, or use method='json_mode'")
        if method == "json_mode" and strict is not None:
            raise InvalidRequestError("strict applies to function_calling and json_schema; leave it out with json_mode")
        if method == "function_calling":
            llm, parser = self._forced_tool(schema, strict)
        else:
            llm, parser = self._json_output(schema, method, strict)
        return _with_parser(llm, parser, include_raw)

    def _forced_tool(self, schema: Any, strict: bool | None) -> tuple[Runnable[LanguageModelInput, Any], Any]:
        """``schema`` as the one tool, its call forced; the parser of that call's arguments."""
        tool = tool_schemas([schema], strict)[0]
        name = tool["function"]["name"]
        traced = {"kwargs": {"method": "function_calling", "strict": strict}, "schema": tool}
        llm = self.bind_tools([tool], tool_choice=name, parallel_tool_calls=False, ls_structured_output_format=traced)
        if _is_pydantic(schema):
            return llm, PydanticToolsParser(tools=[schema], first_tool_only=True)
        return llm, JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)

    def _json_output(
        self, schema: Any, method: str, strict: bool | None
    ) -> tuple[Runnable[LanguageModelInput, Any], Any]:
        """The answer constrained to JSON (for ``schema`` with json_schema); the parser of the answer's text."""
        if method == "json_schema":
            # strict unless False, as the gateway reads response_format: unset, it is what vLLM's xgrammar does
            output = OutputFormat("json_schema", schema=_json_schema(schema, strict), strict=strict is not False)
        else:
            output = OutputFormat("json_object")
        traced = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        llm = self.bind(output_format=output, **({"ls_structured_output_format": traced} if schema else {}))
        return llm, PydanticOutputParser(pydantic_object=schema) if _is_pydantic(schema) else JsonOutputParser()

    def _call_options(
        self, stop: list[str] | None, kwargs: dict[str, Any], run_manager: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        """The base options plus the checked tool options (the model's ``keep_tools_whole`` and
        ``compress_tool_results`` unless the call sets them).
        """
        params, options = super()._call_options(stop, kwargs, run_manager)
        tools = tool_options(kwargs, self.keep_tools_whole, self.compress_tool_results)
        check_one_constraint(params.output_format, tools["tool_choice"])
        return params, {**options, **tools}

    def _decoding_fields(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``output_format`` (a JSON object or schema; with_structured_output binds it), checked; ``logprobs`` and
        ``top_logprobs``: the call's, else the model's.
        """
        output = check_output_format(kwargs.get("output_format"))
        logprobs = logprob_fields(self, kwargs)
        return {**logprobs, "output_format": output} if output is not None else logprobs

    def _chunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], run_manager: Any = None
    ) -> Iterator[ChatGenerationChunk]:
        streamed = 0  # tool calls streamed so far: the next one's index
        for chunk, extras in self._replies(messages, stop, kwargs, run_manager):
            yield self._chunk(chunk, extras, streamed)
            streamed += len(chunk.tool_calls)

    async def _achunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], run_manager: Any = None
    ) -> AsyncGenerator[ChatGenerationChunk, None]:
        """:meth:`_chunks` on the event loop (the engine's native async path, or the gateway's)."""
        streamed = 0
        async with aclosing(self._areplies(messages, stop, kwargs, run_manager)) as replies:
            async for chunk, extras in replies:
                yield self._chunk(chunk, extras, streamed)
                streamed += len(chunk.tool_calls)

    def _chunk(self, chunk: StreamChunk, extras: dict[str, Any], streamed: int) -> ChatGenerationChunk:
        metadata = self._metadata(chunk.result, extras) if chunk.result is not None else None
        message = ai_message_chunk(chunk, streamed, metadata)
        info = {"finish_reason": chunk.result.finish_reason} if chunk.result is not None else None
        return ChatGenerationChunk(message=message, generation_info=info)

    def _metadata(self, result: GenerationResult, extras: dict[str, Any]) -> dict[str, Any]:
        """``response_metadata``: the SpecPrefill stats, the calls that did not decode (when any) and the answer's
        log-probabilities (when asked).
        """
        metadata = self._response_metadata(result, extras)
        if result.invalid_tool_calls:
            metadata["invalid_tool_calls"] = lc_invalid_tool_calls(result.invalid_tool_calls)
        return {**metadata, **logprobs_metadata(result.logprobs)}

    def _chat_result(self, replies: list[Reply]) -> ChatResult:
        """One message from a whole stream; calls, usage and metadata from its last chunk's result."""
        last, extras = replies[-1]
        assert last.result is not None  # the last chunk always carries the result
        content = "".join(chunk.text for chunk, _ in replies)
        message = ai_message(content, last.result, self._metadata(last.result, extras))
        info = {"finish_reason": last.result.finish_reason}
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._chat_result(list(self._replies(messages, stop, kwargs, run_manager)))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        async with aclosing(self._areplies(messages, stop, kwargs, run_manager)) as replies:
            return self._chat_result([reply async for reply in replies])

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


def _is_pydantic(schema: Any) -> bool:
    return isinstance(schema, type) and is_basemodel_subclass(schema)


def _json_schema(schema: Any, strict: bool | None) -> dict[str, Any]:
    """``schema`` as a JSON schema (:func:`convert_to_json_schema`), or an error naming the fix."""
    try:
        return convert_to_json_schema(schema, strict=strict)
    except (TypeError, ValueError) as error:
        raise InvalidRequestError(
            f"the schema is not one LangChain can describe ({error}); pass a pydantic model, a TypedDict or a JSON "
            "schema"
        ) from None


def _with_parser(llm: Runnable[LanguageModelInput, Any], parser: Any, include_raw: bool) -> Runnable[Any, Any]:
    """``llm | parser``; with ``include_raw``, ``{"raw", "parsed", "parsing_error"}`` (errors returned, not raised)."""
    if not include_raw:
        return llm | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")


def ai_message(content: str, result: GenerationResult, metadata: dict[str, Any]) -> AIMessage:
    """A finished answer as an AIMessage: its text, ``tool_calls``, ``invalid_tool_calls`` (raw text and why),
    usage and ``response_metadata`` (``finish_reason`` is ``"tool_calls"`` when the model called).
    """
    return AIMessage(
        content=content,
        tool_calls=lc_tool_calls(result.tool_calls),
        invalid_tool_calls=lc_invalid_tool_calls(result.invalid_tool_calls),
        usage_metadata=_usage(result.stats),
        response_metadata=metadata,
    )


def ai_message_chunk(chunk: StreamChunk, streamed: int, metadata: dict[str, Any] | None) -> AIMessageChunk:
    """A streamed piece as an AIMessageChunk: its text and the tool calls completed in it (``tool_call_chunks``,
    indexed from ``streamed``, the calls streamed before); the last one (``metadata`` given) also usage and
    ``response_metadata``.

    The calls that did not decode are in the last chunk's ``response_metadata["invalid_tool_calls"]``, not in
    ``tool_call_chunks``: LangChain rebuilds a merged stream's calls from the chunks' raw arguments, and would
    turn a refused call with JSON arguments (a second call under ``parallel_tool_calls=False``) into one to run.
    """
    calls = lc_tool_call_chunks(chunk.tool_calls, streamed)
    own = logprobs_metadata(chunk.logprobs)  # this chunk's tokens only: merging the chunks joins the lists
    if chunk.result is None or metadata is None:
        return AIMessageChunk(content=chunk.text, tool_call_chunks=calls, response_metadata=own)
    return AIMessageChunk(
        content=chunk.text,
        tool_call_chunks=calls,
        usage_metadata=_usage(chunk.result.stats),
        response_metadata={**metadata, **own},
        chunk_position="last",
    )


def logprobs_metadata(logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
    """``{"logprobs": {"content": [...]}}`` in OpenAI's shape (ChatOpenAI's ``response_metadata`` key); empty when
    the request did not ask for them.
    """
    return {} if logprobs is None else {"logprobs": chat_logprobs(logprobs)}
