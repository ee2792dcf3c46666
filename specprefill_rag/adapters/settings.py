"""The settings both framework adapters (LangChain, LlamaIndex) share, declared from the engine's.

Each engine setting is offered under the adapters' name for it (:data:`ADAPTER_NAMES`: ``model`` for ``main``,
as LangChain's and LlamaIndex's models call it) with the declaration's type, check, default, bounds and
description (:func:`~specprefill_rag.config.declared_field`); so are the decoding defaults of
:class:`~specprefill_rag.config.GenerationParams`. tests/test_settings_parity.py keeps them equal.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr, SecretStr, model_validator
from typing_extensions import Self

from ..config import (
    Chunking,
    CompressionSettings,
    DraftQueries,
    EngineSettings,
    GenerationParams,
    GrammarLimits,
    SpecPrefillConfig,
    adapter_config,
    declared_field,
)
from ..gateway_client import api_key_from_environment

ADAPTER_NAMES = {"model": "main", "draft_model": "draft"}
"""The adapters' names of engine settings that their ecosystems name otherwise, to the engine's names."""


class AdapterSettings(CompressionSettings, GrammarLimits):
    """The engine settings (under :data:`ADAPTER_NAMES`), where the engine runs, and the decoding defaults.

    Builds the engine's :class:`~specprefill_rag.config.SpecPrefillConfig` at construction (``_config``), so a
    bad value is refused while the adapter is built.
    """

    model: str = declared_field(EngineSettings, "main", "adapters")
    draft_model: str | None = declared_field(EngineSettings, "draft", "adapters")
    tokenizer: str | None = declared_field(EngineSettings, "tokenizer", "adapters")
    device: str = declared_field(EngineSettings, "device", "adapters")
    max_draft_tokens: int | None = declared_field(EngineSettings, "max_draft_tokens", "adapters")
    draft_layers: int | None = declared_field(EngineSettings, "draft_layers", "adapters")
    self_draft_window: int = declared_field(EngineSettings, "self_draft_window", "adapters")
    draft_queries: DraftQueries = declared_field(EngineSettings, "draft_queries", "adapters")
    pool_kernel: int = declared_field(EngineSettings, "pool_kernel", "adapters")
    chunk_size: int = declared_field(EngineSettings, "chunk_size", "adapters")
    chunking: Chunking = declared_field(EngineSettings, "chunking", "adapters")
    draft_cache_mb: int = declared_field(EngineSettings, "draft_cache_mb", "adapters")
    main_cache_mb: int = declared_field(EngineSettings, "main_cache_mb", "adapters")
    document_cache_mb: int = declared_field(EngineSettings, "document_cache_mb", "adapters")
    backend: str = Field(
        "transformers",
        description="'transformers' (main model in-process), the URL of a vLLM server with the plugin (the draft runs "
        "here), or the URL of a SpecPrefill gateway (`specprefill-rag serve`: nothing runs here, no torch needed).",
    )
    timeout: float = Field(
        60.0, gt=0, allow_inf_nan=False, description="Seconds to wait for a server (connect and each read)."
    )
    api_key: SecretStr | None = Field(
        default_factory=api_key_from_environment,
        description="A gateway's --api-key (default $SPECPREFILL_API_KEY).",
    )
    temperature: float = declared_field(GenerationParams, "temperature", "adapters")
    top_p: float = declared_field(GenerationParams, "top_p", "adapters")
    seed: int | None = declared_field(GenerationParams, "seed", "adapters")
    stop: list[str] | None = declared_field(GenerationParams, "stop", "adapters")

    _config: SpecPrefillConfig = PrivateAttr()

    @model_validator(mode="after")
    def _engine_config(self) -> Self:
        settings = self.engine_settings()
        self._config = adapter_config(self.backend, settings.pop("draft", None), **settings)
        return self

    def engine_settings(self) -> dict[str, Any]:
        """The engine settings given to this adapter, by the engine's names (the others keep the engine's
        defaults, which are these fields' own).
        """
        # getattr, not model_dump: LlamaIndex's adds its class_name to whatever is included
        given = {ADAPTER_NAMES.get(name, name): getattr(self, name) for name in self.model_fields_set}
        return {name: value for name, value in given.items() if name in EngineSettings.model_fields}
