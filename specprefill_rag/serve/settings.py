"""The gateway's one settings object, filled by ``specprefill-rag serve`` and validated at construction."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator

from ..config import (
    DEFAULT_DOCUMENT_CACHE_MB,
    DEFAULT_DRAFT_CACHE_MB,
    DEFAULT_MAIN_CACHE_MB,
    DEFAULT_MODEL,
    DRAFT_DESCRIPTION,
    CompressionSettings,
    SpecPrefillConfig,
    check_document_cache,
    check_self_draft_look_ahead,
)
from ..prompt.context import SystemContext

# Prompts per batched draft forward when --draft-batch-size is not given. CPU: 1, measured (BENCHMARKS.md,
# "Gateway"): batching 4 SmolLM2-135M drafts saves 16% at 284 tokens but costs 9% at 1,012, and
# prompts under min_prompt_tokens (from ~450 tokens) are never drafted. GPU: 8, as a batch of short forwards
# normally costs little more than one there (not measured yet: no GPU lent).
DEFAULT_DRAFT_BATCH_SIZE = {"cpu": 1, "cuda": 8}
# The default body limit: 32 bytes per token of the main model's context, at least 1 MiB. English text is about
# 4-5 bytes a token and JSON-escaped CJK about 8, so a body past this cannot hold a prompt that fits the context.
BODY_BYTES_PER_CONTEXT_TOKEN = 32
MIN_DEFAULT_BODY_BYTES = 1 << 20
# The Host names a gateway bound to loopback answers by default (DNS rebinding sends another name).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


class GatewaySettings(CompressionSettings):
    """Settings of ``specprefill-rag serve``. Raises ``pydantic.ValidationError`` naming the field.

    The compression settings (``keep_rate``, ``look_ahead``, ``positions``...) are the engine's own
    (:class:`~specprefill_rag.config.CompressionSettings`); ``specprefill-rag serve`` builds its options
    from these fields.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    main: str = Field(
        DEFAULT_MODEL,
        description="The main model: the http(s) URL of a vLLM server with this package's plugin, or a model spec "
        "(HF id, folder, .gguf, 'smollm2-135m') run in-process with transformers.",
    )
    draft: str | None = Field(None, description=DRAFT_DESCRIPTION)
    host: str = Field("127.0.0.1", description="Address to bind; other than loopback, set api_key.")
    port: int = Field(8100, strict=True, ge=0, le=65535, description="Port to bind.")
    api_key: SecretStr | None = Field(
        None,
        description="Bearer key every request but /health and /metrics must carry (the CLI's default: "
        "$SPECPREFILL_API_KEY); None = open.",
    )
    served_model_name: str | None = Field(None, description="Model name in /v1/models; default: the main model's.")
    device: str = Field("auto", description="Draft device: 'auto' (cuda when present, else cpu), 'cpu', 'cuda:1'...")
    on_draft_error: Literal["full", "fail"] = Field(
        "full", description="A failed draft: send the request uncompressed ('full') or answer 500 ('fail')."
    )
    on_missing_plugin: Literal["error", "full_prompt"] = Field(
        "error",
        description="A vLLM main without the plugin: refuse to start, or send every prompt whole "
        "(positions 'contiguous' needs no plugin: compressed prompts go as ordinary ones).",
    )
    system_context: SystemContext = Field(
        "off",
        description="Retrieved context in a system message as plain text (LangChain/LlamaIndex RAG templates): "
        "'off', 'delimited' (the context spans of known templates are documents) or 'after_instructions' "
        "(after a 'Context:' label or the first paragraph); instructions stay whole. Requests override it "
        "with spec_prefill.system_context.",
    )
    max_draft_tokens: int | None = Field(
        None,
        strict=True,
        ge=1,
        description="Most prompt tokens one request may send through the draft (its memory; docs: "
        "Resource bounds); None: the draft's context. Longer prompts to compress are a 400 (as the engine's "
        "DraftLimitError).",
    )
    draft_cache_mb: int = Field(
        DEFAULT_DRAFT_CACHE_MB,
        strict=True,
        ge=0,
        description="Draft prefix KV cache, MiB (0 = off); budget it in the host's memory.",
    )
    document_cache_mb: int = Field(
        DEFAULT_DOCUMENT_CACHE_MB,
        strict=True,
        ge=0,
        description="Per-document draft KV cache, MiB (0 = off), for requests with draft_document_cache.",
    )
    main_cache_mb: int = Field(
        DEFAULT_MAIN_CACHE_MB,
        strict=True,
        ge=0,
        description="In-process main model only: prefix KV cache of sparse prompts, MiB (0 = off). A vLLM main uses "
        "its own prefix cache (the plugin keys its blocks by positions).",
    )
    queue_size: int = Field(256, strict=True, ge=1, description="Requests waiting for the draft at most; more get 429.")
    draft_batch_size: int | None = Field(
        None, strict=True, ge=1, description="Prompts per batched draft forward; None: 1 on CPU, 8 on a GPU."
    )
    draft_batch_tokens: int = Field(
        32768,
        strict=True,
        ge=1,
        description="Cap on batch rows x longest prompt in one draft forward (padding memory).",
    )
    batch_window_ms: float = Field(
        0.0, strict=True, ge=0.0, description="Wait this long for more requests before a draft batch."
    )
    request_timeout_s: float = Field(
        600.0, strict=True, gt=0.0, description="Deadline of one request: queue, draft and answer."
    )
    upstream_timeout_s: float = Field(
        60.0, strict=True, gt=0.0, description="Seconds to wait on the vLLM server per connect/read."
    )
    max_body_bytes: int | None = Field(
        None,
        strict=True,
        ge=1024,
        le=1 << 34,
        description="Largest request body, bytes (more: 413, read no further). None: 32 bytes per token of the main "
        "model's context, at least 1 MiB.",
    )
    max_concurrent_requests: int = Field(
        128,
        strict=True,
        ge=1,
        le=65536,
        description="Requests in flight at once, of every kind (drafted, short, /tokenize, /v1/models); more get 429 "
        "with a Retry-After from measured service times. /health and /metrics are not counted.",
    )
    max_connections: int = Field(
        1024,
        strict=True,
        ge=1,
        le=65536,
        description="Open connections plus running requests at most (uvicorn's "
        "limit_concurrency); past it new requests get 503.",
    )
    header_timeout_s: float = Field(
        10.0,
        strict=True,
        gt=0.0,
        le=3600.0,
        description="A client must send a request's headers within this many seconds of "
        "connecting (or of its previous answer); else the connection is closed.",
    )
    body_timeout_s: float = Field(
        30.0,
        strict=True,
        gt=0.0,
        le=3600.0,
        description="A client must send the whole body within this many seconds of its headers; else 408.",
    )
    allowed_hosts: tuple[str, ...] | None = Field(
        None,
        description="Host header values answered ('*.example.com' patterns, '*' = any); others get 400. None: "
        "the loopback names and the bound address when bound to loopback, else any.",
    )
    cors_origins: tuple[str, ...] = Field(
        (),
        description="Browser origins allowed to call the gateway (CORS); none by default, so web pages cannot "
        "read its answers.",
    )

    @field_validator("api_key")
    @classmethod
    def _usable_key(cls, value: SecretStr | None) -> SecretStr | None:
        key = value.get_secret_value() if value is not None else None
        if key is not None and (not key or key != key.strip()):
            raise ValueError(
                "api_key is empty or starts or ends with whitespace, so no client could send it; pass "
                "the key without surrounding spaces, or leave it unset for an open gateway"
            )
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _host_patterns(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for pattern in value or ():
            wildcard = pattern == "*" or (pattern.startswith("*.") and "*" not in pattern[2:])
            if not pattern.strip() or ("*" in pattern and not wildcard):
                raise ValueError(f"allowed_hosts entry {pattern!r} is not a host name, '*.domain' or '*'")
        return value

    @model_validator(mode="after")
    def _self_draft_look_ahead(self) -> GatewaySettings:
        if self.main_is_remote and self.draft is None:
            raise ValueError(
                "a main model on vLLM needs a draft named: --draft <HF id, folder or .gguf> of a small model with "
                "the served model's tokenizer (its smaller sibling)"
            )
        check_self_draft_look_ahead(self, self.draft)
        return self

    @model_validator(mode="after")
    def _document_cache_on(self) -> GatewaySettings:
        check_document_cache(self.draft_document_cache, self.document_cache_mb)
        return self

    @property
    def main_is_remote(self) -> bool:
        return self.main.startswith(("http://", "https://"))

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def resolved_allowed_hosts(self) -> tuple[str, ...]:
        """``allowed_hosts``, or the default for the bound address."""
        if self.allowed_hosts is not None:
            return self.allowed_hosts
        if not self.is_loopback:
            return ("*",)
        bound = f"[{self.host}]" if ":" in self.host else self.host
        return tuple(dict.fromkeys((*LOOPBACK_HOSTS, bound)))

    def resolved_max_body_bytes(self, context_length: int) -> int:
        """``max_body_bytes``, or the default for a main model of ``context_length`` tokens."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return max(MIN_DEFAULT_BODY_BYTES, BODY_BYTES_PER_CONTEXT_TOKEN * context_length)

    def resolved_device(self) -> str:
        """``device`` with 'auto' resolved: the first GPU when torch sees one, else the CPU."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_draft_batch_size(self) -> int:
        """``draft_batch_size``, or the default for the draft's device."""
        if self.draft_batch_size is not None:
            return self.draft_batch_size
        return DEFAULT_DRAFT_BATCH_SIZE["cuda" if self.resolved_device().startswith("cuda") else "cpu"]

    def engine_config(self) -> SpecPrefillConfig:
        """The core engine's config: the compression settings given here, the models, the draft's bounds."""
        main = (
            self.draft or self.main if self.main_is_remote else self.main
        )  # a remote main: the engine needs a tokenizer
        return SpecPrefillConfig(
            main=main,
            draft=self.draft,
            max_draft_tokens=self.max_draft_tokens,
            draft_cache_mb=self.draft_cache_mb,
            document_cache_mb=self.document_cache_mb,
            main_cache_mb=self.main_cache_mb,
            device=self.resolved_device(),
            **self.compression(),
        )
