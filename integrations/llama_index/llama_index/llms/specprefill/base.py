"""SpecPrefillLLM for LlamaIndex query and chat engines.

Query engines and ``ContextChatEngine`` call ``llm.predict(template, context_str=..., query_str=...)``
(or ``context_msg`` when refining). This class reads those variables where the template is turned
into messages or a prompt, and attaches them to what it returns (the last message's
``additional_kwargs``, or the prompt string), so every call carries its own context: no global state,
safe under concurrency. The retrieved context is then located in the rendered prompt, one document
span per retrieved node: a small instrumentation handler (attached when the first SpecPrefillLLM is
built, removable with :func:`remove_node_recorder`) remembers each retrieval's nodes in a context
variable. Without it, the context is split at blank lines, which is how LlamaIndex joins nodes.

Tool calling follows llama-index-llms-openai: ``SpecPrefillLLM`` is a ``FunctionCallingLLM``, so agents
(``FunctionAgent``) and ``structured_predict`` use the model's own tool calling; tool results are documents
the draft may compress (see :class:`SpecPrefillLLM` for keeping some whole).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator, Sequence
from contextlib import aclosing
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr, model_validator
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.schema import MetadataMode
from llama_index.llms.specprefill._messages import COMPRESS_KEY, ChatAnswer, LogprobAnswer, session_messages
from llama_index.llms.specprefill._sessions import GatewaySession, LocalSession, Message, Request
from llama_index.llms.specprefill._tools import prepared_tools, resolve_tool_choice, tool_choice_name, tool_schemas
from llama_index.llms.specprefill._tools import tool_selections as _tool_selections

from specprefill_rag.adapters.settings import AdapterSettings
from specprefill_rag.arguments import check_flag, check_text, generation_params
from specprefill_rag.config import GenerationParams, LogprobSettings, declared_field
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.gateway_client import engine_here, find_gateway
from specprefill_rag.results import StreamChunk

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

    from specprefill_rag import SpecPrefillEngine

_CAPTURE_KEY = "specprefill_template_args"
CALL_OPTIONS = ("documents", "query", "keep_rate", "reselect", "draft_document_cache", "formatted")
TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls")
"""Chat-only call options (``_prepare_chat_with_tools`` fills them)."""


Answer = TypeVar("Answer", CompletionResponse, ChatResponse)


class _TemplatedPrompt(str):
    """A rendered prompt that remembers the template variables it was rendered from."""

    template_args: dict[str, Any]


def _template_args(prompt: BasePromptTemplate, prompt_args: dict[str, Any]) -> dict[str, Any]:
    """``context_str``/``context_msg`` and ``query_str``, from the call and the template's partials."""
    merged = {**getattr(prompt, "kwargs", {}), **prompt_args}
    context = merged.get("context_str") or merged.get("context_msg")
    return {"context": context, "query": merged.get("query_str")}


_retrieved_nodes: ContextVar[tuple[str, ...]] = ContextVar("specprefill_retrieved_nodes", default=())


class RetrievedNodeRecorder(BaseEventHandler):
    """Remembers, per execution context, the LLM-visible text of the nodes the last retrieval returned,
    so the synthesizer's ``context_str`` can be split into one document span per node.
    """

    @classmethod
    def class_name(cls) -> str:
        return "SpecPrefillRetrievedNodeRecorder"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            texts = (n.node.get_content(metadata_mode=MetadataMode.LLM).strip() for n in event.nodes)
            _retrieved_nodes.set(tuple(t for t in texts if t))


def install_node_recorder() -> RetrievedNodeRecorder:
    """Attach the recorder to LlamaIndex's root instrumentation dispatcher (once; idempotent)."""
    root = get_dispatcher()
    for handler in root.event_handlers:
        if isinstance(handler, RetrievedNodeRecorder):
            return handler
    recorder = RetrievedNodeRecorder()
    root.add_event_handler(recorder)
    return recorder


def remove_node_recorder() -> None:
    """Detach the recorder; query engines then fall back to splitting context at blank lines."""
    root = get_dispatcher()
    root.event_handlers = [h for h in root.event_handlers if not isinstance(h, RetrievedNodeRecorder)]


def context_documents(context: str | None) -> list[str] | None:
    """The retrieved nodes inside ``context``, one document each; without recorded nodes, the blocks
    LlamaIndex joined with blank lines.
    """
    if not context:
        return None
    nodes = [text for text in dict.fromkeys(_retrieved_nodes.get()) if text in context]
    if nodes:
        return nodes
    blocks = [block.strip() for block in context.split("\n\n")]
    return [block for block in blocks if block] or None


class SpecPrefillLLM(FunctionCallingLLM, AdapterSettings, LogprobSettings):
    """SpecPrefill in front of a main model: a draft scores the retrieved context, the main model
    prefills the best ``keep_rate`` of it at original positions; instructions and the query stay whole.

    Tool calling: a ``FunctionCallingLLM``, so ``FunctionAgent``, ``predict_and_call`` and ``structured_predict``
    use the model's own calls. ``metadata.is_function_calling_model`` is true when the main model has a chat
    template (its own tool calling, else the Hermes format written into the messages); through a gateway, the
    gateway's model decides. The answer's message carries the calls as ``ToolCallBlock`` blocks and OpenAI-shaped
    ``additional_kwargs["tool_calls"]``; calls the model wrote that could not be decoded are in
    ``additional_kwargs["invalid_tool_calls"]`` (never dropped). ``tool_required=True``, ``tool_choice="required"``
    or a tool's name constrains decoding to a call (xgrammar in-process; the server's structured outputs on vLLM).

    Tool results (``role="tool"`` messages with ``additional_kwargs["tool_call_id"]``) are documents: the draft
    may compress them like retrieved nodes. To keep a result whole, name its tool in ``keep_tools_whole`` (every
    result of that tool), or set ``additional_kwargs["spec_prefill_compress"] = False`` on the tool message
    (that result only).

    Log-probabilities: ``logprobs=True`` (and ``top_logprobs=k``) fill ``ChatResponse.logprobs`` and
    ``CompletionResponse.logprobs``: one list per generated token, the token's own ``LogProb`` first, then the
    ``k`` most likely tokens at its step (most likely first). Unlike llama-index-llms-openai, which lists only
    the alternatives and skips tokens without them, every token is there with its own log-probability. They are
    the main model's raw distribution, before temperature, top-p, penalties and constraints; streamed responses
    carry those of the tokens so far.

    Example:
        .. code-block:: python

            llm = SpecPrefillLLM(model="smollm2-135m", keep_rate=0.3)
            response = index.as_query_engine(llm=llm).query("When did the bridge open?")
            response.source_nodes, ...

            llm = SpecPrefillLLM(model="Qwen/Qwen2.5-1.5B-Instruct", keep_tools_whole=["calculator"])
            agent = FunctionAgent(llm=llm, tools=[search_tool, calculator_tool])  # search results: compressed
    """

    max_new_tokens: int = declared_field(GenerationParams, "max_new_tokens", "adapters")
    keep_tools_whole: list[str] = Field(
        default_factory=list,
        description="Tools whose results are never compressed (kept whole); other tool results are documents. "
        f"One result: additional_kwargs[{COMPRESS_KEY!r}]=False on its tool message.",
    )

    model_config = ConfigDict(extra="forbid")  # an unknown setting is refused, not ignored

    _engine: SpecPrefillEngine | None = PrivateAttr(default=None)
    _session: LocalSession | GatewaySession | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _validate_specprefill(self) -> SpecPrefillLLM:
        GenerationParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(self.stop or ()),
        )
        install_node_recorder()
        return self

    @classmethod
    def from_engine(cls, engine: SpecPrefillEngine, **fields: Any) -> SpecPrefillLLM:
        """Wrap an existing engine (models already in memory)."""
        llm = cls(**fields)
        llm._engine = engine
        return llm

    @classmethod
    def class_name(cls) -> str:
        return "SpecPrefillLLM"

    @property
    def engine(self) -> SpecPrefillEngine:
        """Loaded on first use, shared by every instance with the same settings."""
        if self._engine is None:
            self._engine = engine_here(self._config, self.backend, self.timeout, not self.session.runs_here)
        return self._engine

    @property
    def session(self) -> LocalSession | GatewaySession:
        """Where answers come from, decided on first use: a gateway when ``backend`` is a gateway's URL
        (it says so in /v1/models), else the engine in this process.
        """
        if self._session is None:
            gateway = None if self._engine is not None else find_gateway(self.backend, self.timeout, self.api_key)
            self._session = GatewaySession(gateway, self) if gateway else LocalSession(self)
        return self._session

    @property
    def metadata(self) -> LLMMetadata:
        session = self.session
        return LLMMetadata(
            context_window=session.context_length,
            num_output=self.max_new_tokens,
            is_chat_model=session.is_chat_model,
            is_function_calling_model=session.is_function_calling_model,
            model_name=self.model,
        )

    # -- where templates become messages or prompts: remember the template variables ------------

    def _get_messages(self, prompt: BasePromptTemplate, **prompt_args: Any) -> list[ChatMessage]:
        messages = super()._get_messages(prompt, **prompt_args)
        last = messages[-1]
        messages[-1] = last.model_copy(
            update={"additional_kwargs": {**last.additional_kwargs, _CAPTURE_KEY: _template_args(prompt, prompt_args)}}
        )
        return messages

    def _get_prompt(self, prompt: BasePromptTemplate, **prompt_args: Any) -> str:
        rendered = _TemplatedPrompt(super()._get_prompt(prompt, **prompt_args))
        rendered.template_args = _template_args(prompt, prompt_args)
        return rendered

    # -- one engine call -------------------------------------------------------------------------

    def _request(
        self, messages: list[Message], captured: dict[str, Any], kwargs: dict[str, Any], options: tuple[str, ...]
    ) -> Request:
        unknown = sorted(set(kwargs) - set(options))
        if unknown:
            raise InvalidRequestError(f"unknown call options {unknown}; use the supported ones: {list(options)}")
        explicit = kwargs.get("documents")
        documents = explicit if explicit is not None else context_documents(captured.get("context"))
        question = kwargs["query"] if "query" in kwargs else captured.get("query")
        keep_rate = kwargs.get("keep_rate")  # the call's, else this LLM's (also over an engine from from_engine)
        keep_rate = self.keep_rate if keep_rate is None else keep_rate
        tools = kwargs.get("tools")
        return Request(
            messages,
            documents,
            question,
            explicit is not None,
            keep_rate,
            self._params(),
            tools=None if tools is None else tool_schemas(tools),
            tool_choice=tool_choice_name(kwargs.get("tool_choice")),
            parallel_tool_calls=check_flag(kwargs.get("parallel_tool_calls", True), "parallel_tool_calls"),
            reselect=kwargs.get("reselect", self.reselect if "reselect" in self.model_fields_set else None),
            draft_document_cache=kwargs.get("draft_document_cache", self._given("draft_document_cache")),
        )

    def _given(self, name: str) -> Any:
        """A setting given to the constructor, else None (the engine's or the gateway's own applies)."""
        return getattr(self, name) if name in self.model_fields_set else None

    def _params(self) -> GenerationParams:
        return generation_params(
            {
                "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "seed": self.seed,
                "stop": list(self.stop or ()),
                "logprobs": self.logprobs,
                "top_logprobs": self.top_logprobs,
            }
        )

    @staticmethod
    def _raw(chunk: StreamChunk, extras: dict[str, Any]) -> dict[str, Any]:
        if chunk.stats is None:
            return {}
        stats = {**chunk.stats.as_dict(), **extras}
        usage = {
            "prompt_tokens": chunk.stats.prompt_tokens,
            "completion_tokens": chunk.stats.completion_tokens,
            "total_tokens": chunk.stats.prompt_tokens + chunk.stats.completion_tokens,
        }
        return {"usage": usage, "spec_prefill": stats, "finish_reason": chunk.finish_reason}

    def _response(self, chunk: StreamChunk, answer: LogprobAnswer, extras: dict[str, Any]) -> CompletionResponse:
        """The response for one engine chunk; ``answer`` holds everything generated so far."""
        raw = self._raw(chunk, extras)
        return CompletionResponse(
            text=answer.text,
            delta=chunk.text,
            raw=raw,
            additional_kwargs={"spec_prefill": raw["spec_prefill"]} if raw else {},
            logprobs=answer.logprobs,
        )

    def _completions(self, request: Request) -> CompletionResponseGen:
        answer = LogprobAnswer()
        for chunk, extras in self.session.stream(request):
            answer.add(chunk)
            yield self._response(chunk, answer, extras)

    async def _acompletions(self, request: Request) -> CompletionResponseAsyncGen:
        """:meth:`_completions` on the event loop (the engine's native async path, or the gateway's)."""
        answer = LogprobAnswer()
        async with aclosing(self.session.astream(request)) as replies:
            async for chunk, extras in replies:
                answer.add(chunk)
                yield self._response(chunk, answer, extras)

    def _chats(self, request: Request) -> ChatResponseGen:
        answer = ChatAnswer()
        for chunk, extras in self.session.stream(request):
            yield answer.add(chunk, self._raw(chunk, extras))

    async def _achats(self, request: Request) -> ChatResponseAsyncGen:
        """:meth:`_chats` on the event loop."""
        answer = ChatAnswer()
        async with aclosing(self.session.astream(request)) as replies:
            async for chunk, extras in replies:
                yield answer.add(chunk, self._raw(chunk, extras))

    def _prompt_request(self, prompt: str, kwargs: dict[str, Any]) -> Request:
        check_text(prompt, "prompt", "prompt text")
        captured = getattr(prompt, "template_args", {})
        return self._request([Message("user", str(prompt))], captured, kwargs, CALL_OPTIONS)

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> Request:
        if isinstance(messages, (str, bytes)) or not all(isinstance(m, ChatMessage) for m in messages):
            raise InvalidRequestError(
                "messages must be a list of llama_index ChatMessage; wrap text as ChatMessage(role='user', content=...)"
            )
        captured = messages[-1].additional_kwargs.get(_CAPTURE_KEY, {}) if messages else {}
        converted = session_messages(messages, self.keep_tools_whole)
        return self._request(converted, captured, kwargs, CALL_OPTIONS + TOOL_OPTIONS)

    # -- tool calling (FunctionCallingLLM) -------------------------------------------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The ``chat`` arguments of ``chat_with_tools``: the history plus ``user_msg``, the tools' OpenAI
        schemas, ``tool_choice`` (``tool_required=True``: ``required``) and ``parallel_tool_calls``. Other
        ``kwargs`` go on to ``chat`` (which refuses unknown ones). ``chat_history`` is not modified.
        """
        messages = list(chat_history or [])
        if user_msg is not None:
            if isinstance(user_msg, str):
                user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
            messages.append(user_msg)
        schemas = prepared_tools(tools)
        prepared: dict[str, Any] = {"messages": messages, "tools": schemas, **kwargs}
        if schemas:
            prepared["tool_choice"] = resolve_tool_choice(tool_choice, tool_required)
            prepared["parallel_tool_calls"] = allow_parallel_tool_calls
        elif tool_required or tool_choice_name(tool_choice) not in (None, "auto", "none"):
            raise InvalidRequestError(
                "a tool call is required (tool_required or tool_choice) but no tools are given; pass tools or drop it"
            )
        return prepared

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The calls of ``response`` (its ``ToolCallBlock`` blocks, else ``additional_kwargs["tool_calls"]``).

        Raises :class:`~llama_index.llms.specprefill._tools.NoToolCallError` (a ``ValueError``) when there is
        none and ``error_on_no_tool_call``.
        """
        if kwargs:
            raise InvalidRequestError(
                f"unknown options {sorted(kwargs)} for get_tool_calls_from_response; pass only error_on_no_tool_call"
            )
        return _tool_selections(response, error_on_no_tool_call)

    # -- LlamaIndex interface --------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return _last(self._completions(self._prompt_request(prompt, kwargs)))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._completions(self._prompt_request(prompt, kwargs))

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _last(self._chats(self._chat_request(messages, kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._chats(self._chat_request(messages, kwargs))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await _alast(self._acompletions(self._prompt_request(prompt, kwargs)))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return self._acompletions(self._prompt_request(prompt, kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await _alast(self._achats(self._chat_request(messages, kwargs)))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return self._achats(self._chat_request(messages, kwargs))


def _last(responses: Iterator[Answer]) -> Answer:
    response = None
    for response in responses:  # noqa: B007 (the last one is the answer)
        pass
    assert response is not None  # the engine always yields a final chunk
    return response


async def _alast(responses: AsyncGenerator[Answer, None]) -> Answer:
    response = None
    async with aclosing(responses):
        async for response in responses:  # noqa: B007 (the last one is the answer)
            pass
    assert response is not None  # the engine always yields a final chunk
    return response
