"""The gateway's one settings object, filled by ``specprefill-rag serve`` and validated at construction."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, SecretStr, ValidationInfo, field_validator, model_validator

from ..config import (
    EngineSettings,
    SpecPrefillConfig,
    SystemContext,
    check_tokenizer,
    declared_field,
    resolve_device,
)

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
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP field name (RFC 9110 token)


class GatewaySettings(EngineSettings):
    """Settings of ``specprefill-rag serve``. Raises ``pydantic.ValidationError`` naming the field.

    The engine's settings (``main``, ``draft``, ``tokenizer``, ``keep_rate``, the caches...) are the engine's own
    fields (:class:`~specprefill_rag.config.EngineSettings`), with the gateway's default device ('auto');
    ``specprefill-rag serve`` builds its options from these fields.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    device: str = declared_field(EngineSettings, "device", "gateway")
    host: str = Field("127.0.0.1", description="Address to bind; other than loopback, set api_key.")
    port: int = Field(8100, strict=True, ge=0, le=65535, description="Port to bind.")
    api_key: SecretStr | None = Field(
        None,
        description="Bearer key every request but /health must carry (the CLI's default: "
        "$SPECPREFILL_API_KEY); None = open (unless api_key_file names keys).",
    )
    api_key_file: Path | None = Field(
        None,
        description="A file of Bearer keys, one a line ('#' comments and blank lines skipped), accepted besides "
        "api_key; each key is its own tenant of the caches (docs: Tenants). Read at start.",
    )
    cache_scope: Literal["tenant", "shared"] = Field(
        "tenant",
        description="Who shares the caches that outlive a request (prefix KV, documents, selection memo): "
        "'tenant', each API key (and declared tenant) its own; 'shared', every client (another's cached "
        "prompts then show in stats and timing). Without keys the gateway has one tenant either way.",
    )
    tenant_header: str | None = Field(
        None,
        description="A request header naming the client's tenant within its key's (e.g. X-SpecPrefill-Tenant); "
        "it is trusted as sent, so set it only behind a proxy that authenticates clients and sets it. "
        "None: tenants are the API keys.",
    )
    tenant_secret: SecretStr | None = Field(
        None,
        description="Key of the digest that names a tenant from its API key (never the key itself; a vLLM main "
        "gets it as cache_salt). None: random at each start; give replicas the same one to share a vLLM "
        "server's prefix cache per tenant.",
    )
    metrics_key: SecretStr | None = Field(
        None,
        description="Bearer key of /metrics. None: any API key (open when the gateway has none).",
    )
    served_model_name: str | None = Field(None, description="Model name in /v1/models; default: the main model's.")
    on_draft_error: Literal["full", "fail"] = Field(
        "full", description="A failed draft: send the request uncompressed ('full') or answer 500 ('fail')."
    )
    on_missing_plugin: Literal["error", "full_prompt"] = Field(
        "error",
        description="A vLLM main without the plugin: refuse to start, or send every prompt whole "
        "(positions 'contiguous' needs no plugin: compressed prompts go as ordinary ones).",
    )
    system_context: SystemContext = declared_field(EngineSettings, "system_context", "gateway")
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
        600.0,
        strict=True,
        gt=0.0,
        description="Deadline of one request, from its arrival: output grammar, queue, draft and answer.",
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
    max_requests_per_key: int | None = Field(
        None,
        strict=True,
        ge=1,
        le=65536,
        description="Requests in flight from one API key at once (more get 429 with Retry-After), so that one key "
        "cannot hold every slot of max_concurrent_requests. None: no bound per key. Needs API keys: a gateway "
        "without them has one client.",
    )
    max_bodies_per_client: int = Field(
        64,
        strict=True,
        ge=1,
        le=65536,
        description="Request bodies one client address may be sending at once (more get 429). A request takes "
        "its slot only once its body is complete, so slow bodies cannot hold the slots; behind a proxy that "
        "forwards bodies unbuffered, raise it.",
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
    # Heavy work's own threads (issue #43): grammar compiles and warm-ups never hold the threads of other requests.
    grammar_workers: int = Field(
        2,
        strict=True,
        ge=1,
        le=64,
        description="Threads that compile output grammars (response_format, forced tool calls), apart from the "
        "threads of other requests; a compile cannot be interrupted, the schema limits bound it.",
    )
    grammar_queue: int = Field(
        8,
        strict=True,
        ge=0,
        le=4096,
        description="Requests waiting for a grammar thread at most; more get 503 with Retry-After.",
    )
    warm_workers: int = Field(
        1,
        strict=True,
        ge=1,
        le=64,
        description="Threads that run warm-up calls (they take turns on the draft anyway), apart from the threads "
        "of other requests.",
    )
    warm_queue: int = Field(
        4,
        strict=True,
        ge=0,
        le=4096,
        description="Warm-up calls waiting for a warm-up thread at most; more get 503 with Retry-After.",
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

    @field_validator("api_key", "metrics_key", "tenant_secret")
    @classmethod
    def _usable_key(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        key = value.get_secret_value() if value is not None else None
        if key is not None:
            _check_key(key, info.field_name or "api_key")
        return value

    @field_validator("tenant_header")
    @classmethod
    def _header_name(cls, value: str | None) -> str | None:
        if value is not None and not _HEADER_NAME.fullmatch(value):
            raise ValueError(
                f"tenant_header {value!r} is not an HTTP header name; pass one such as X-SpecPrefill-Tenant"
            )
        return value

    @model_validator(mode="after")
    def _tenancy(self) -> GatewaySettings:
        keys = self.api_keys()  # the key file is readable and its keys usable
        if self.max_requests_per_key is not None and not keys:
            raise ValueError(
                "max_requests_per_key bounds each API key's requests, but the gateway has no keys (one client); "
                "set api_key or api_key_file, or leave max_requests_per_key unset and bound max_concurrent_requests"
            )
        if (self.max_requests_per_key or 0) > self.max_concurrent_requests:
            raise ValueError(
                f"max_requests_per_key ({self.max_requests_per_key}) exceeds max_concurrent_requests "
                f"({self.max_concurrent_requests}), which bounds every key together; lower it or raise the other"
            )
        if self.cache_scope == "shared" and self.tenant_header is not None:
            raise ValueError(
                "tenant_header declares tenants, but cache_scope 'shared' shares the caches among all clients; "
                "leave tenant_header unset, or set cache_scope 'tenant'"
            )
        return self

    def api_keys(self) -> tuple[str, ...]:
        """Every accepted Bearer key: ``api_key`` and those of ``api_key_file`` (raises ``ValueError`` for a file
        that cannot be read or holds an unusable key).
        """
        keys = [self.api_key.get_secret_value()] if self.api_key is not None else []
        if self.api_key_file is not None:
            keys += _file_keys(self.api_key_file)
        return tuple(dict.fromkeys(keys))

    @field_validator("allowed_hosts")
    @classmethod
    def _host_patterns(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for pattern in value or ():
            wildcard = pattern == "*" or (pattern.startswith("*.") and "*" not in pattern[2:])
            if not pattern.strip() or ("*" in pattern and not wildcard):
                raise ValueError(f"allowed_hosts entry {pattern!r} is not a host name, '*.domain' or '*'")
        return value

    @model_validator(mode="after")
    def _remote_main_needs_a_draft(self) -> GatewaySettings:
        if self.main_is_remote and self.draft is None:
            raise ValueError(
                "a main model on vLLM needs a draft named: --draft <HF id, folder or .gguf> of a small model with "
                "the served model's tokenizer (its smaller sibling)"
            )
        check_tokenizer(self.tokenizer, self.main_is_remote)
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
        return resolve_device(self.device)

    def resolved_draft_batch_size(self) -> int:
        """``draft_batch_size``, or the default for the draft's device."""
        if self.draft_batch_size is not None:
            return self.draft_batch_size
        return DEFAULT_DRAFT_BATCH_SIZE["cuda" if self.resolved_device().startswith("cuda") else "cpu"]

    def engine_config(self) -> SpecPrefillConfig:
        """The core engine's config: the engine settings given here (and the gateway's device)."""
        return SpecPrefillConfig(**self.engine_settings())


def _check_key(key: str, field: str) -> None:
    if not key or key != key.strip():
        raise ValueError(
            f"{field} is empty or starts or ends with whitespace, so no client could send it; pass "
            "the key without surrounding spaces, or leave it unset"
        )


def _file_keys(path: Path) -> list[str]:
    """The keys of an ``api_key_file``: one a line, '#' comments and blank lines skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeError) as error:
        raise ValueError(f"api_key_file {str(path)!r} cannot be read ({error}); pass a UTF-8 file of keys") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"api_key_file {str(path)!r} holds no key; write one key a line")
    for number, key in enumerate(keys, 1):
        if any(character.isspace() for character in key):
            raise ValueError(f"key {number} of api_key_file {str(path)!r} holds whitespace; write one key a line")
    return keys
