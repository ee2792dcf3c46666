"""Fields and engine access shared by ChatSpecPrefill and SpecPrefillLLM."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from langchain_core.messages import BaseMessage
from pydantic import Field, PrivateAttr, model_validator

from langchain_specprefill._sessions import GatewaySession, LocalSession, Reply
from langchain_specprefill.retrievers import install_retriever_recorder, retrieved_documents
from specprefill_rag.adapters.settings import AdapterSettings
from specprefill_rag.arguments import generation_params
from specprefill_rag.config import GenerationParams, LogprobSettings, declared_field
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.gateway_client import engine_here, find_gateway
from specprefill_rag.results import GenerationResult

if TYPE_CHECKING:
    from specprefill_rag import SpecPrefillEngine

CALL_OPTIONS = (
    "documents",
    "question",
    "keep_rate",
    "reselect",
    "draft_document_cache",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
)


class SpecPrefillSettings(AdapterSettings):
    """SpecPrefill and decoding settings; nothing heavy is loaded until the first call. The engine's settings
    (``keep_rate``, ``look_ahead``, the caches...) are the engine's own fields, ``model`` and ``draft_model``
    its ``main`` and ``draft``; stop strings given here are merged with each call's.
    """

    max_tokens: int = declared_field(GenerationParams, "max_new_tokens", "adapters")
    streaming: bool = Field(False, description="LangChain's flag: invoke() runs through stream(); the same answer.")

    _call_option_names: ClassVar[tuple[str, ...]] = CALL_OPTIONS  # what a call (or a binding) may pass

    _engine: SpecPrefillEngine | None = PrivateAttr(default=None)
    _session: LocalSession | GatewaySession | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _validate_specprefill(self) -> SpecPrefillSettings:
        GenerationParams(
            max_new_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(self.stop or ()),
        )
        install_retriever_recorder()  # documents retrieved earlier in a run are then found in the prompt
        return self

    @classmethod
    def from_engine(cls, engine: SpecPrefillEngine, **fields: Any) -> Any:
        """Wrap an existing engine (models already in memory); ``fields`` set decoding options."""
        instance = cls(**fields)
        instance._engine = engine
        return instance

    @property
    def engine(self) -> SpecPrefillEngine:
        """The engine, loaded on first use and shared by every instance with the same settings."""
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

    def _call_options(
        self, stop: list[str] | None, kwargs: dict[str, Any], run_manager: Any = None
    ) -> tuple[GenerationParams, dict[str, Any]]:
        supported = self._call_option_names
        unknown = sorted(set(kwargs) - set(supported))
        if unknown:
            raise InvalidRequestError(f"unknown call options {unknown}; use the supported ones: {list(supported)}")
        params = generation_params(
            {
                "max_new_tokens": kwargs.get("max_tokens", self.max_tokens),
                "temperature": kwargs.get("temperature", self.temperature),
                "top_p": kwargs.get("top_p", self.top_p),
                "seed": kwargs.get("seed", self.seed),
                "stop": self._stops(stop),
                **self._decoding_fields(kwargs),
            },
            names={"max_new_tokens": "max_tokens"},
        )
        # not a call option: what the run's retrievers returned, to locate in the messages (see retrievers.py)
        return params, {**kwargs, "retrieved": retrieved_documents(run_manager)}

    def _decoding_fields(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """More :class:`GenerationParams` fields from the call's options (the chat model's ``output_format``)."""
        return {}

    def _stops(self, stop: Any) -> Any:
        """The constructor's stop strings then the call's (a str is one stop string), each once; anything
        else is passed on as given, for GenerationParams to refuse.
        """
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not isinstance(stop, (list, tuple)):
            return stop
        stops = [*(self.stop or []), *(stop or [])]
        return list(dict.fromkeys(stops)) if all(isinstance(s, str) for s in stops) else stops

    def _replies(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], run_manager: Any = None
    ) -> Iterator[Reply]:
        """One call's stream: ``(chunk, extra stats)`` pairs, from the engine here or from a gateway."""
        params, options = self._call_options(stop, kwargs, run_manager)
        return self.session.stream(messages, params, options)

    def _areplies(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], run_manager: Any = None
    ) -> AsyncGenerator[Reply, None]:
        params, options = self._call_options(stop, kwargs, run_manager)
        return self.session.astream(messages, params, options)

    def _response_metadata(self, result: GenerationResult, extras: dict[str, Any]) -> dict[str, Any]:
        stats = {**result.stats.as_dict(), "draft_model": self.draft_model, **extras}
        return {
            "model_name": self.model,
            "model_provider": "specprefill",
            "finish_reason": result.finish_reason,
            "spec_prefill": stats,
        }

    def _specprefill_params(self) -> dict[str, Any]:
        """LangChain's identifying params (tracing, its LLM cache's key): every setting but the API key."""
        names = [name for name in AdapterSettings.model_fields if name != "api_key"]
        return {name: getattr(self, name) for name in [*names, "max_tokens"]}


def logprob_fields(model: LogprobSettings, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``logprobs`` and ``top_logprobs``: the call's options, else the model's."""
    return {name: kwargs.get(name, getattr(model, name)) for name in LogprobSettings.model_fields}
