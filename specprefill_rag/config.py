"""One typed configuration, validated at construction.

Defaults reproduce the paper (Liu, Chen, Zhang, ICML 2025, arXiv 2502.02789): look-ahead 8,
average-pooling kernel 13, chunks of 32 tokens, max over layers x heads, mean over look-ahead.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from typing_extensions import Self

# The device types torch runs this package on, with an optional index ("cuda:1").
_DEVICE = re.compile(r"(cpu|cuda|mps|xpu|hpu|npu)(:[0-9]+)?")

DEFAULT_MODEL = "smollm2-135m"
SELF_DRAFT = "self"
SELF_DRAFT_PREFIX = "self:"
# draft="self": the first 40% of the main model's layers (12 of SmolLM2-135M's 30), scoring with the
# last 16 prompt tokens as queries; both chosen on a SQuAD tuning split (BENCHMARKS.md).
DEFAULT_SELF_LAYER_SHARE = 0.4
# 2 GiB of draft KV: one 32k-token prompt of Llama-3.2-1B in bfloat16 (32 KiB a token; the draft of the
# GPU study), forty 4k-token prompts of Qwen2.5-0.5B in bfloat16 (12 KiB), eleven of SmolLM2-135M in
# float32 (45 KiB). It fills only with use, and only with prompts that were drafted.
DEFAULT_DRAFT_CACHE_MB = 2048
# 1 GiB of main-model KV (in-process): 36k tokens of Qwen2.5-1.5B in bfloat16 (28 KiB a token), 4.6k of
# SmolLM2-135M in float32 (225 KiB). Sparse prompts are short: a 4k-token prompt at keep 0.3 holds ~1.4k.
DEFAULT_MAIN_CACHE_MB = 1024
# Per-document draft KV: as much as the prefix cache, since it replaces it for the documents.
DEFAULT_DOCUMENT_CACHE_MB = 2048
# Documents one call of a gateway's warm-up endpoint drafts at most (each takes a turn of the draft's lock, the call
# one request slot): a corpus goes in several calls, each bounded in time. GatewayClient splits longer lists.
MAX_WARM_DOCUMENTS = 64
WARM_DOCUMENTS_PATH = "/v1/spec_prefill/documents/warm"  # that endpoint
AUTO: Literal["auto"] = "auto"
# keep_rate="auto" (ImportanceMass): tuned on the SQuAD --seed 1 split, SmolLM2-135M as draft and main
# (BENCHMARKS.md, "keep_rate='auto' (issue #17)").
DEFAULT_AUTO_KEEP_SHARE = 0.8
DEFAULT_AUTO_KEEP_FLOOR = 0.1
DEFAULT_AUTO_KEEP_CEILING = 0.5
# With no draft named, an in-process main model drafts with its own first layers ('self'): the one draft
# that pays on the embedded model and for any main model without a small sibling (docs: Drafts).
DRAFT_DESCRIPTION = (
    "Draft model spec (same forms as the main model), or 'self:<n>' to score with the main model's first n layers "
    "('self': the first 40%). None: 'self' with an in-process main model; a main model on vLLM needs one named."
)
# Position ids of the kept tokens. "original" (the paper's): each at its place in the full prompt.
# "contiguous": renumbered 0..K-1, an ordinary shorter prompt. On the Qwen2.5-Coder pair the two answer
# equally often; contiguous raised the answer's log-probability on held-out NIAH and HotpotQA at keep 0.1
# (BENCHMARKS.md, "Original or contiguous positions").
Positions = Literal["original", "contiguous"]
Chunking = Literal["tokens", "sentences"]
# Retrieved context sent as plain text in a system message: which of it is documents (prompt/context.py).
SystemContext = Literal["off", "after_instructions", "delimited"]
DocumentRepairKind = Literal["naive", "epic", "blend", "query"]
"""What the per-document draft cache computes again in context (:mod:`specprefill_rag.draft.repair`)."""
DEFAULT_BLEND_SHARE = 0.15  # CacheBlend's share; docs/guide/document-cache.md measures 0.05 against it
SHARED_REPAIRS = ("blend", "query")  # the repairs that recompute a share of the cached document tokens
DocumentFirstSight = Literal["alone", "in_context"]
"""How the per-document draft cache encodes a document it does not hold yet (:mod:`specprefill_rag.draft.assembly`)."""
DraftQueries = Literal["look_ahead", "window"]
"""What a draft scores with: its look-ahead (the last prompt token and decoded draft tokens) or a window of the
prompt's last tokens (:mod:`specprefill_rag.draft.model`)."""
# Sampling temperatures in (0, MIN_TEMPERATURE) are refused: dividing logits by them overflows float32 (1e-45 gives
# inf and then NaN probabilities), and below 0.01 sampling is greedy in all but name. vLLM raises such values to
# 0.01 with a warning; here nothing is changed silently, so they are refused with the fix (0 = greedy).
MIN_TEMPERATURE = 0.01


def check_temperature(value: float) -> float:
    """``value`` if it is 0 (greedy) or at least :data:`MIN_TEMPERATURE`; else ``ValueError`` with the fix."""
    if 0.0 < value < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature {value:g} is below {MIN_TEMPERATURE}, where sampling is numerically degenerate; "
            f"use 0 for greedy decoding or a temperature of at least {MIN_TEMPERATURE}"
        )
    return value


def _keep_rate_value(value: Any) -> Any:
    """A keep rate's one error (pydantic would report each member of the union separately)."""
    if isinstance(value, str) and value == AUTO:
        return value
    fix = "pass a fraction of document tokens in (0, 1], e.g. 0.3, or 'auto'"
    if isinstance(value, str):
        try:
            value = float(value)  # configuration is parsed leniently ('0.3' from a file or the environment)
        except ValueError:
            raise ValueError(f"keep_rate must be a number or 'auto', got {value!r}; {fix}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"keep_rate must be a number or 'auto', got {type(value).__name__}; {fix}")
    if not math.isfinite(value):
        raise ValueError(f"keep_rate must be a finite number, got {value}; {fix}")
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"keep_rate must be in (0, 1], got {value}; {fix}")
    return float(value)


# A keep rate: a fraction of document tokens in (0, 1], or "auto" (the engine chooses it per request).
KeepRate = Annotated[float | Literal["auto"], BeforeValidator(_keep_rate_value)]


def _min_prompt_tokens_value(value: Any) -> Any:
    """``min_prompt_tokens``' one error: a whole number of tokens >= 0, or 'auto'."""
    if isinstance(value, str) and value == AUTO:
        return value
    fix = "pass a number of prompt tokens >= 0, e.g. 512, or 'auto' (from the draft's cost)"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)  # configuration is parsed leniently ('512' from a file or the environment)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"min_prompt_tokens must be a whole number or 'auto', got {value!r}; {fix}")
    if value < 0:
        raise ValueError(f"min_prompt_tokens must be greater than or equal to 0, got {value}; {fix}")
    return value


# Prompts shorter than this are prefilled whole; "auto": from the draft's cost against the main model's.
MinPromptTokens = Annotated[int | Literal["auto"], BeforeValidator(_min_prompt_tokens_value)]


def _strict_keep_rate_value(value: Any) -> Any:
    if isinstance(value, str) and value != AUTO:
        raise ValueError(
            f"keep_rate must be a number or 'auto', got {value[:20]!r}; send a number as a JSON number "
            "(0.3, not \"0.3\"), or 'auto'"
        )
    return _keep_rate_value(value)


# A keep rate in a request: as KeepRate, but a number sent as a string ("0.3") is refused, not parsed.
StrictKeepRate = Annotated[float | Literal["auto"], BeforeValidator(_strict_keep_rate_value)]


def check_auto_bounds(floor: float, ceiling: float) -> None:
    """keep_rate="auto" keeps between ``floor`` and ``ceiling``: raise ``ValueError`` unless floor <= ceiling."""
    if floor > ceiling:
        raise ValueError(
            f"auto_keep_floor ({floor}) is above auto_keep_ceiling ({ceiling}); set the floor at or below the ceiling"
        )


def is_self_spec(draft: str) -> bool:
    """True for the draft specs 'self' and 'self:<n>': the main model scores with its own first layers."""
    return draft == SELF_DRAFT or draft.startswith(SELF_DRAFT_PREFIX)


def check_self_draft_look_ahead(settings: CompressionSettings, draft: str | None) -> None:
    """A 'self' draft cannot decode look-ahead tokens: ``ValueError`` if ``look_ahead`` was set above 1 for one."""
    if (
        draft is not None
        and is_self_spec(draft)
        and "look_ahead" in settings.model_fields_set
        and settings.look_ahead != 1
    ):
        raise ValueError(
            f"draft {draft!r} scores with part of the main model and cannot decode look-ahead tokens; leave "
            "look_ahead unset or set it to 1, or name a draft model (with no draft named, an in-process main model "
            "drafts with its own first layers)"
        )


def check_draft_layers(settings: CompressionSettings, draft: str | None, draft_layers: int | None) -> None:
    """``draft_layers`` truncates a separate draft model: ``ValueError`` for a 'self' draft (whose layers its spec
    names) and for a ``look_ahead`` set above 1 (a truncated draft has no output to decode look-ahead tokens from).
    """
    if draft_layers is None:
        return
    if draft is not None and is_self_spec(draft):
        raise ValueError(
            f"draft_layers applies to a separate draft model, not to {draft!r}; name the main model's layers as "
            "'self:<n>', or name a draft model (with no draft named, an in-process main model drafts with its own "
            "first layers)"
        )
    if "look_ahead" in settings.model_fields_set and settings.look_ahead != 1:
        raise ValueError(
            f"a draft of its first {draft_layers} layers has no output to decode look-ahead tokens from (it scores "
            "with its last self_draft_window prompt tokens); leave look_ahead unset or set it to 1, or leave "
            "draft_layers unset"
        )


def check_draft_queries(settings: CompressionSettings, draft_queries: str, window_only: bool) -> None:
    """``ValueError`` for ``draft_queries="window"`` with ``look_ahead`` set above 1 (a window decodes nothing), and
    for ``draft_queries="look_ahead"`` set for a draft that cannot decode (``window_only``: 'self', draft_layers).
    """
    if draft_queries == "window" and "look_ahead" in settings.model_fields_set and settings.look_ahead != 1:
        raise ValueError(
            "draft_queries='window' scores with the prompt's last self_draft_window tokens and decodes nothing; "
            "leave look_ahead unset or set it to 1, or set draft_queries='look_ahead'"
        )
    if draft_queries == "look_ahead" and window_only and "draft_queries" in settings.model_fields_set:
        raise ValueError(
            "a 'self' draft or a draft of its first draft_layers layers has no output to decode look-ahead tokens "
            "from; leave draft_queries unset or set it to 'window', or name a whole draft model"
        )


def check_document_cache(draft_document_cache: bool, document_cache_mb: int) -> None:
    """``draft_document_cache`` needs a per-document cache: ``ValueError`` when ``document_cache_mb`` is 0."""
    if draft_document_cache and document_cache_mb == 0:
        raise ValueError(
            "draft_document_cache is on but document_cache_mb is 0 (no per-document draft cache); raise "
            "document_cache_mb, or leave draft_document_cache off"
        )


def check_device(value: str) -> str:
    """``value`` if it names a torch device ('cpu', 'cuda', 'cuda:1'...) or is 'auto'; else ``ValueError``."""
    # Checked by pattern, not torch.device(): a gateway's clients build these settings without torch.
    if not isinstance(value, str) or not (value == AUTO or _DEVICE.fullmatch(value)):
        raise ValueError(f"device {value!r} is not a torch device; use e.g. 'cpu', 'cuda' or 'cuda:1' (or 'auto')")
    return value


def resolve_device(device: str) -> str:
    """``device`` with 'auto' resolved: the first GPU when torch sees one, else the CPU."""
    if device != AUTO:
        return device
    import torch  # only for 'auto': the settings themselves are built where torch may be absent

    return "cuda" if torch.cuda.is_available() else "cpu"


def _odd_kernel(value: int) -> int:
    if value % 2 == 0:
        raise ValueError(f"pool_kernel must be odd so pooling keeps the prompt length; got {value}, try {value + 1}")
    return value


def _draft_spec(value: str | None) -> str | None:
    if value is not None and value.startswith(SELF_DRAFT_PREFIX):
        layers = value[len(SELF_DRAFT_PREFIX) :]
        if not layers.isdigit() or int(layers) < 1:
            raise ValueError(f"draft {value!r}: use 'self:<n>' with n >= 1 layers of the main model, e.g. 'self:8'")
    return value


# Settings types that carry their own check, so every surface declaring the setting from EngineSettings checks it.
Device = Annotated[str, AfterValidator(check_device)]
PoolKernel = Annotated[int, AfterValidator(_odd_kernel)]
DraftSpec = Annotated[str | None, AfterValidator(_draft_spec)]


def check_tokenizer(tokenizer: str | None, main_on_vllm: bool) -> None:
    """``tokenizer`` names a vLLM main model's tokenizer: ``ValueError`` when it is set for an in-process main."""
    if tokenizer is not None and not main_on_vllm:
        raise ValueError(
            "tokenizer names the served model's tokenizer of a vLLM backend; in-process the main "
            "model's own is used: leave it unset"
        )


class CompressionSettings(BaseModel):
    """How prompts are compressed: the keep budget, the draft's queries, the prompt length below which
    nothing is compressed, the kept tokens' positions and the models' dtype.

    The one declaration of these fields (default, bounds, description): :class:`EngineSettings` extends it, and
    through it the engine's :class:`SpecPrefillConfig`, the gateway's settings and both framework adapters
    inherit them.
    """

    model_config = ConfigDict(allow_inf_nan=False)

    keep_rate: KeepRate = Field(
        0.3,
        description="Fraction of document tokens the main model prefills, in (0, 1]; or 'auto': per request, the "
        "fewest best chunks holding auto_keep_share of the draft's importance mass, within auto_keep_floor and "
        "auto_keep_ceiling.",
    )
    auto_keep_share: float = Field(
        DEFAULT_AUTO_KEEP_SHARE,
        strict=True,
        gt=0.0,
        le=1.0,
        description="keep_rate='auto': share of the documents' importance mass (above the median chunk) to keep. "
        "Default tuned on a SQuAD split with SmolLM2-135M (BENCHMARKS.md, \"keep_rate='auto' (issue #17)\").",
    )
    auto_keep_floor: float = Field(
        DEFAULT_AUTO_KEEP_FLOOR,
        strict=True,
        gt=0.0,
        le=1.0,
        description="keep_rate='auto': least share of document tokens kept (also for flat importance). Default tuned "
        "with auto_keep_share.",
    )
    auto_keep_ceiling: float = Field(
        DEFAULT_AUTO_KEEP_CEILING,
        strict=True,
        gt=0.0,
        le=1.0,
        description="keep_rate='auto': most share of document tokens kept. Default tuned with auto_keep_share.",
    )
    max_document_tokens: int | None = Field(
        None,
        strict=True,
        ge=0,
        description="Hard cap on kept document tokens; with keep_rate, the tighter budget wins.",
    )
    look_ahead: int = Field(
        8,
        strict=True,
        ge=1,
        le=64,
        description="Queries: last prompt token + look_ahead-1 draft tokens (not for 'self' drafts).",
    )
    min_prompt_tokens: MinPromptTokens = Field(
        AUTO,
        description="Prompts shorter than this many tokens are prefilled whole (compression would not pay). 'auto': "
        "the length from which the draft pays, from its cost against the main model's (docs: When SpecPrefill "
        "pays); 1,024 with a main model on vLLM.",
    )
    protect_tail_tokens: int = Field(
        64, strict=True, ge=1, description="For raw prompts without roles: the last tokens that are always kept."
    )
    positions: Positions = Field(
        "original",
        description="Position ids of the kept tokens: 'original' (each at its place in the full prompt, the paper's) "
        "or 'contiguous' (renumbered 0..K-1: an ordinary shorter prompt, so a vLLM server needs no plugin). "
        "BENCHMARKS.md compares them.",
    )
    reselect: bool = Field(
        True,
        strict=True,
        description="Score every compressed span (document, tool result) again against each request's question. "
        "False (stable selection): a span compressed earlier in the conversation keeps the tokens chosen then, so "
        "a later turn's sparse prompt extends the last one and the main model's prefix cache serves it: ~9x faster "
        "turns, but follow-ups about other parts of the documents lost 43 points on SQuAD (docs: Conversations).",
    )
    system_context: SystemContext = Field(
        "delimited",
        description="Retrieved context in a system message as plain text (LangChain/LlamaIndex RAG templates), used "
        "when a chat names no documents: 'off', 'delimited' (the context spans of known templates are documents) or "
        "'after_instructions' (after a 'Context:' label or the first paragraph); instructions stay whole (docs: "
        "Finding documents). A gateway's requests override it with spec_prefill.system_context.",
    )
    draft_document_cache: bool = Field(
        False,
        strict=True,
        description="Draft each document once and reuse its draft KV, moved to its position, in any later prompt "
        "that holds it, in any order or combination (docs: Document cache). An approximation: documents then "
        "do not attend to each other in the draft.",
    )
    document_repair: DocumentRepairKind = Field(
        "blend",
        description="With draft_document_cache: what of the cached documents the draft computes again in this "
        "prompt. 'blend': the 15% of cached document tokens whose KV deviates most (a 2-layer joint probe finds "
        "them); 'epic': each document's first 16 tokens; 'naive': nothing (the fastest: 4.7-5.8x faster than a "
        "full prefill at 4k tokens against blend's 3.5-3.7x, but 8 points under joint scoring at keep 0.1 over "
        "HotpotQA, NQ and NIAH, where blend was level with it; docs: Document cache); 'query' (not yet "
        "measured): the 15% of cached document tokens the question attends to most over the cached KV, "
        "ProphetKV-style.",
    )
    document_repair_share: float = Field(
        DEFAULT_BLEND_SHARE,
        strict=True,
        ge=0.0,
        le=1.0,
        description="document_repair='blend' or 'query': share of the prompt's cached document tokens computed "
        "again in context, in [0, 1]. The recompute is most of a warm draft's time, but on HotpotQA 0.05 scored 17 "
        "points under joint scoring at keep 0.1 where blend's 0.15 was level with it (docs: Document cache).",
    )
    document_first_sight: DocumentFirstSight = Field(
        "alone",
        description="With draft_document_cache: how a document the cache does not hold yet is drafted. 'alone': "
        "encoded alone after the prefix, stored, then assembled like a hit (a first sight costs 1.07-1.35 of a cold "
        "draft; docs: Document cache). 'in_context' (not yet measured): computed in the pass that scores the "
        "request, as a cold draft would, and stored from it, so a miss costs no more than a cold draft; the "
        "stored KV then saw the documents before it in that prompt.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="'auto' = bfloat16 on a CPU that computes it natively (AVX512-BF16 or AMX), float32 on other CPUs; "
        "bfloat16 on CUDA (float16 where the GPU lacks bfloat16).",
    )

    @model_validator(mode="after")
    def _auto_bounds(self) -> Self:
        check_auto_bounds(self.auto_keep_floor, self.auto_keep_ceiling)
        return self

    @model_validator(mode="after")
    def _share_needs_blend(self) -> Self:
        if "document_repair_share" in self.model_fields_set and self.document_repair not in SHARED_REPAIRS:
            raise ValueError(
                f"document_repair_share applies to document_repair='blend' or 'query' only, not "
                f"{self.document_repair!r}; leave it unset or use one of those"
            )
        return self


# Output-format limits (issue #43): xgrammar's compile time and memory grow with these, so they are checked before
# compiling. Measured with SmolLM2-135M's 49k-token vocabulary on a 2-core CPU (docs: Resource bounds): a pattern
# `[a-z]{2000}` compiles in 0.19 s, `{8000}` in 3.3 s, `{40000}` in ~116 s (quadratic); nested counts
# `([a-z]{1,4}){1,8}` in 0.36 s, `{1,16}` 1.1 s, `([a-z]{1,50}){1,50}` 42 s; an anyOf of 2,000 objects
# (140 KB) in 0.3 s and 12.7 MB, of 10,000 in 6.4 s and 64 MB.
DEFAULT_GRAMMAR_CACHE_MB = 256


class GrammarLimits(BaseModel):
    """Bounds on an output format (``response_format``, a forced call's tool ``parameters``), checked before its
    grammar is compiled, and on the compiled grammars kept. The defaults admit OpenAI's own structured-output
    limits (5,000 properties, 1,000 enum values, 10 levels) and keep one compile under about a second.
    """

    model_config = ConfigDict(allow_inf_nan=False)

    max_schema_bytes: int = Field(
        131072,
        strict=True,
        ge=1024,
        le=16 << 20,
        description="Largest output format in bytes of compact JSON: a response_format schema, or a forced call's "
        "tool parameters together (compile time and memory grow with it).",
    )
    max_schema_depth: int = Field(
        64,
        strict=True,
        ge=4,
        le=512,
        description="Deepest nesting of a schema's JSON objects and arrays (a schema level is about two).",
    )
    max_schema_branches: int = Field(
        512,
        strict=True,
        ge=2,
        le=100_000,
        description="Most alternatives in one anyOf, oneOf or allOf of a schema.",
    )
    max_enum_values: int = Field(
        1024, strict=True, ge=1, le=1_000_000, description="Most values in one enum of a schema."
    )
    max_pattern_chars: int = Field(
        1024, strict=True, ge=16, le=1 << 20, description="Longest regular expression (pattern) in a schema."
    )
    max_pattern_repeat: int = Field(
        1000,
        strict=True,
        ge=1,
        le=1_000_000,
        description="Largest repetition in a schema's pattern: the bound of a {n} or {n,m}, times the bounds of the "
        "groups around it ('([a-z]{1,50}){1,50}' repeats 2,500 times).",
    )
    max_pattern_nested_repeat: int = Field(
        32,
        strict=True,
        ge=1,
        le=1_000_000,
        description="Largest repetition of a counted repetition inside another in a schema's pattern, the bounds "
        "multiplied ('([a-z]{1,4}){1,8}' is 32; nested counts compile ~100x slower than flat ones).",
    )
    grammar_cache_mb: int = Field(
        DEFAULT_GRAMMAR_CACHE_MB,
        strict=True,
        ge=1,
        description="In-process main model: compiled output grammars kept, in MiB (least recently used dropped).",
    )
    lazy_tool_grammar: bool = Field(
        True,
        strict=True,
        description="With tool_choice='auto': free text until the answer starts like a call of an offered tool "
        '(the family\'s marker, or {"name": "<tool>"), then the call is constrained to that tool\'s schema '
        "(docs: Agents). False: calls are only parsed from the text, as written.",
    )

    def grammar_limits(self) -> dict[str, Any]:
        """These fields' values, for another settings class that has them."""
        return {name: getattr(self, name) for name in GrammarLimits.model_fields}


class EngineSettings(CompressionSettings, GrammarLimits):
    """The engine's settings: the compression settings, the models, where they run and the draft's bounds and caches.

    The one declaration of these fields (type and its check, default, bounds, description):
    :class:`SpecPrefillConfig` and the gateway's settings inherit them, the framework adapters declare theirs
    with :func:`declared_field` (under their ecosystems' names, ``model`` for ``main``), and every surface passes
    what was given on to the engine with :meth:`engine_settings`.
    """

    main: str = Field(
        DEFAULT_MODEL,
        description="Main model: HF id, local folder, .gguf file or 'smollm2-135m', run in-process with transformers; "
        "the gateway's may also be the http(s) URL of a vLLM server with this package's plugin.",
    )
    draft: DraftSpec = Field(None, description=DRAFT_DESCRIPTION)
    tokenizer: str | None = Field(
        None,
        description="Main model on vLLM only: the served model's tokenizer (HF id, folder, .gguf or 'smollm2-135m'); "
        "default the draft's. Needed for a draft of another vocabulary than the served model's (its scores are "
        "then mapped).",
    )
    device: Device = Field(
        "cpu",
        description="torch device of the models run in this process (both; the draft alone with a main model on "
        "vLLM): 'cpu', 'cuda', 'cuda:1'...; 'auto': the first GPU when torch sees one, else the CPU.",
    )
    max_draft_tokens: int | None = Field(
        None,
        strict=True,
        ge=1,
        description="Most prompt tokens one request may send through the draft (its memory grows with them; "
        "docs: Resource bounds); None = the draft's context. A longer prompt to compress gets a DraftLimitError (the "
        "gateway: a 400).",
    )
    self_draft_window: int = Field(
        16,
        strict=True,
        ge=1,
        le=512,
        description="Queries of a draft that scores with a window ('self', draft_layers, draft_queries='window'): "
        "the last this-many prompt tokens.",
    )
    draft_queries: DraftQueries = Field(
        "look_ahead",
        description="What a separate draft model scores with: 'look_ahead' (the last prompt token and look_ahead-1 "
        "decoded draft tokens, the paper's) or 'window' (the last self_draft_window prompt tokens, the question "
        "and the template's tail: no decoding, so a warm request from the document cache is one draft pass; docs: "
        "Drafts). 'self' drafts and draft_layers always use the window.",
    )
    draft_layers: int | None = Field(
        None,
        strict=True,
        ge=1,
        description="A separate draft model runs only its first this-many layers (None: all). Such a draft has no "
        "output to decode look-ahead tokens from, so it scores, as a 'self' draft does, with its last "
        "self_draft_window prompt tokens as queries (docs: Drafts). For 'self', name the layers as 'self:<n>'.",
    )
    pool_kernel: PoolKernel = Field(13, strict=True, ge=1, description="Average-pooling kernel along the prompt (odd).")
    chunk_size: int = Field(
        32, strict=True, ge=1, description="Document tokens are kept or dropped in chunks of this size."
    )
    chunking: Chunking = Field(
        "sentences",
        description="Where document chunks end: 'sentences' at sentence ends, whole sentences packed into chunks of "
        "at most chunk_size tokens (a longer sentence is cut every chunk_size), so the main model reads no sentence "
        "cut where a dropped chunk begins; 'tokens' every chunk_size tokens (the paper's chunks).",
    )
    draft_cache_mb: int = Field(
        DEFAULT_DRAFT_CACHE_MB,
        strict=True,
        ge=0,
        description="Draft prefix KV cache per device, in MiB (0 = off): a prompt that starts like one scored before "
        "(same documents, another question) has the draft prefill only the rest.",
    )
    main_cache_mb: int = Field(
        DEFAULT_MAIN_CACHE_MB,
        strict=True,
        ge=0,
        description="In-process main model only: prefix KV cache of sparse prompts, in MiB (0 = off), keyed by token "
        "ids and positions: a later turn of a conversation prefills only what is new. A main model on vLLM uses the "
        "server's prefix cache (the plugin keys its blocks by positions).",
    )
    document_cache_mb: int = Field(
        DEFAULT_DOCUMENT_CACHE_MB,
        strict=True,
        ge=0,
        description="Per-document draft KV cache per device, in MiB (0 = off), used by requests with "
        "draft_document_cache.",
    )

    @model_validator(mode="after")
    def _self_draft_look_ahead(self) -> Self:
        check_self_draft_look_ahead(self, self.draft)
        return self

    @model_validator(mode="after")
    def _truncated_draft(self) -> Self:
        check_draft_layers(self, self.draft, self.draft_layers)
        return self

    @model_validator(mode="after")
    def _window_queries(self) -> Self:
        window_only = self.draft_layers is not None or (self.draft is not None and is_self_spec(self.draft))
        check_draft_queries(self, self.draft_queries, window_only)
        return self

    @model_validator(mode="after")
    def _document_cache_on(self) -> Self:
        check_document_cache(self.draft_document_cache, self.document_cache_mb)
        return self

    def engine_settings(self) -> dict[str, Any]:
        """The engine settings given here, for :class:`SpecPrefillConfig` (the others keep the engine's defaults,
        which are these fields' own; so ``look_ahead`` reaches a 'self' draft only when set, and is refused),
        plus any whose default this surface deliberately changes (the gateway's ``device``).
        """
        fields = type(self).model_fields
        names = {
            name
            for name, declared in EngineSettings.model_fields.items()
            if name in self.model_fields_set or fields[name].default != declared.default
        }
        return self.model_dump(include=names)


# Where a surface's default deliberately differs from the declaration's, by surface and field: the one place
# (tests/test_settings_parity.py refuses any other difference).
SURFACE_DEFAULTS: dict[str, dict[str, Any]] = {
    # A server takes the GPU it finds; a library call (engine, CLI `ask`, adapters) stays on the CPU unless told.
    # A server cannot know its clients' system prompts: their context is documents only when they (or it) say so.
    "gateway": {"device": AUTO, "system_context": "off"},
    # Chat frameworks' answers are longer than `ask`'s short ones: LlamaIndex reserves 256 output tokens by default
    # (DEFAULT_NUM_OUTPUTS, its models' max_new_tokens); LangChain's stop strings are a list, None when unset.
    "adapters": {"max_new_tokens": 256, "stop": None},
}
Surface = Literal["gateway", "adapters"]


def declared_field(owner: type[BaseModel], name: str, surface: Surface | None = None) -> Any:
    """A copy of the field ``name`` of ``owner`` (its type's check, default, bounds, description), for a surface
    that offers the setting under its own name (a framework adapter's ``model`` for ``main``), with the
    surface's default from :data:`SURFACE_DEFAULTS` where it has one.
    """
    field = owner.model_fields[name]
    if surface is not None and name in SURFACE_DEFAULTS[surface]:
        return FieldInfo.merge_field_infos(field, default=SURFACE_DEFAULTS[surface][name])
    return FieldInfo.merge_field_infos(field)


# The decoding settings a surface may offer as its defaults (the framework adapters), declared by GenerationParams.
DECODING_DEFAULTS = ("max_new_tokens", "temperature", "top_p", "seed", "stop")


def declaration_drift(
    fields: Mapping[str, FieldInfo], surface: Surface | None = None, renamed: Mapping[str, str] | None = None
) -> list[str]:
    """How a surface's ``fields`` differ from the one declaration: a line per setting whose default (other than
    :data:`SURFACE_DEFAULTS` gives ``surface``), bounds, checks or description differ, or, for an engine setting,
    its type. ``renamed``: the surface's names of settings declared under another (``{"model": "main"}``).
    """
    decoding = {name: GenerationParams.model_fields[name] for name in DECODING_DEFAULTS}
    declared = {**decoding, **EngineSettings.model_fields}
    surface_defaults = SURFACE_DEFAULTS[surface] if surface is not None else {}
    problems = []
    for own, field in fields.items():
        name = (renamed or {}).get(own, own)
        if name not in declared:
            continue
        expected = declared[name]
        default = surface_defaults.get(name, expected.get_default(call_default_factory=True))
        if field.get_default(call_default_factory=True) != default:
            problems.append(f"{own}: default {field.get_default(call_default_factory=True)!r}, declared {default!r}")
        if field.metadata != expected.metadata:
            problems.append(f"{own}: bounds and checks {field.metadata}, declared {expected.metadata}")
        if field.description != expected.description:
            problems.append(f"{own}: description {field.description!r}, declared {expected.description!r}")
        if name in EngineSettings.model_fields and field.annotation != expected.annotation:
            problems.append(f"{own}: type {field.annotation}, declared {expected.annotation}")
    return problems


class SpecPrefillConfig(EngineSettings):
    """Settings of a :class:`~specprefill_rag.engine.SpecPrefillEngine`.

    Raises ``pydantic.ValidationError`` (a ``ValueError``) naming the field on bad values (NaN and
    infinities included). ``device='auto'`` is resolved here.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("device")
    @classmethod
    def _resolved_device(cls, value: str) -> str:
        return resolve_device(value)

    @property
    def is_self_draft(self) -> bool:
        """True for 'self' and 'self:<n>': the main model scores with its own first layers."""
        return self.draft is not None and is_self_spec(self.draft)

    def with_default_draft(self) -> SpecPrefillConfig:
        """This config, with 'self' as the draft when none is named (an in-process main model's default)."""
        if self.draft is not None:
            return self
        given = {name: getattr(self, name) for name in self.model_fields_set - {"draft"}}  # draft=None may be given
        return SpecPrefillConfig(**given, draft=SELF_DRAFT)

    @property
    def self_draft_layers(self) -> int | None:
        """n for a 'self:<n>' draft, else None (also for 'self', whose n depends on the main model)."""
        if self.draft is not None and self.draft.startswith(SELF_DRAFT_PREFIX):
            return int(self.draft[len(SELF_DRAFT_PREFIX) :])
        return None

    @property
    def queries(self) -> DraftQueries:
        """What the draft scores with: ``draft_queries``, except for 'self' drafts and ``draft_layers``, which always
        score with the window (they cannot decode).
        """
        window_only = self.is_self_draft or self.draft_layers is not None
        return "window" if window_only else self.draft_queries

    @property
    def scores_with_window(self) -> bool:
        """True where the draft's queries are the prompt's last ``self_draft_window`` tokens (:attr:`queries`)."""
        return self.queries == "window"

    @property
    def effective_look_ahead(self) -> int:
        """Look-ahead actually used: 1 (nothing decoded) for a draft that scores with a window."""
        return 1 if self.scores_with_window else self.look_ahead


MAX_PENALTY = 2.0  # OpenAI's bound of the presence and frequency penalties, either sign
ToolCallFormat = Literal["hermes", "llama3", "mistral"]
"""How a model family writes tool calls: ``<tool_call>`` JSON blocks (Qwen2.5, Hermes), a bare JSON object
(Llama 3.x), ``[TOOL_CALLS]`` and a JSON list (Mistral)."""


@dataclass(frozen=True)
class OutputFormat:
    r"""What the output must be.

    ``kind``:

    * ``"json_object"``: any JSON object.
    * ``"json_schema"``: a JSON value valid for ``schema``; ``strict`` (the default, as vLLM's xgrammar
      backend does) also forbids object keys and array items the schema does not declare.
    * ``"tool_call"``: one or more tool calls (exactly one when ``parallel`` is False) in the markup of
      ``tool_format``, each naming one of ``tools`` with arguments valid for its ``parameters``:

      - ``hermes`` (Qwen2.5, Hermes): ``<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>``,
        calls separated by ``"\n"``;
      - ``llama3``: ``{"name": "f", "parameters": {...}}``, calls separated by ``"; "``;
      - ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``.

    ``tools`` are OpenAI tool schemas, ``{"type": "function", "function": {"name", "description",
    "parameters"}}``; a tool without ``parameters`` (or with ``{}``) takes the empty object.

    ``lazy`` (``tool_call`` only; ``tool_choice="auto"``): the output is free text until it starts like a call
    (a trigger: the family's marker, or ``{"name": "<tool>"`` naming one of ``tools``); from there the call is
    constrained as above, and after it the text is free again
    (:func:`~specprefill_rag.decode.formats.tool_call_structural_tag`).
    """

    kind: Literal["json_object", "json_schema", "tool_call"]
    schema: Mapping[str, Any] | None = None
    tools: tuple[Mapping[str, Any], ...] = ()
    tool_format: ToolCallFormat | None = None
    parallel: bool = True
    strict: bool = True
    lazy: bool = False

    def canonical_json(self) -> str:
        """The format as compact JSON: equal for formats that compile to the same grammar (the cache key)."""
        fields = {
            "kind": self.kind,
            "schema": self.schema,
            "strict": self.strict,
            "tools": list(self.tools),
            "tool_format": self.tool_format,
            "parallel": self.parallel,
            "lazy": self.lazy,
        }
        return json.dumps(fields, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


MAX_TOP_LOGPROBS = 20  # OpenAI's bound of top_logprobs (and vLLM's default --max-logprobs)


class LogprobSettings(BaseModel):
    """Whether to return each generated token's log-probability, and how many most likely alternatives with it.

    The one declaration of these fields: :class:`GenerationParams` and the framework adapters inherit them.
    The log-probabilities are the main model's raw distribution: ``log_softmax`` of its logits over the whole
    vocabulary, in float32, before temperature, top-p, penalties and output constraints (vLLM's default
    ``raw_logprobs``), so they do not depend on how the token was sampled. A token's own log-probability is
    given even when it is not among the ``top_logprobs`` alternatives (a sampled or constrained token). One
    difference: with an ``output_format`` on a vLLM main, vLLM applies the grammar's mask before it computes
    them, so they are over the tokens the grammar allows (forbidden ones at -9999, as vLLM writes -inf).
    """

    logprobs: bool = Field(
        False,
        strict=True,
        description="Return each generated token's log-probability (the model's raw distribution, before "
        "temperature, top-p, penalties and constraints).",
    )
    top_logprobs: int = Field(
        0,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        strict=True,
        description=f"With logprobs: also the 0..{MAX_TOP_LOGPROBS} most likely tokens at each step, with theirs.",
    )

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int, info: ValidationInfo) -> int:
        if value and info.data.get("logprobs") is False:  # absent from data when logprobs itself was refused
            raise ValueError(f"top_logprobs={value} needs logprobs=True; set logprobs=True too, or top_logprobs=0")
        return value


class GenerationParams(LogprobSettings):
    """Per-request decoding settings.

    Numbers are strict (a string or a bool where a number belongs is refused, not parsed) and finite.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    max_new_tokens: int = Field(128, ge=1, strict=True, description="Most tokens to generate.")
    temperature: float = Field(0.0, ge=0.0, strict=True, description=f"0 = greedy; else at least {MIN_TEMPERATURE}.")
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, strict=True, description="Nucleus sampling: the most likely tokens holding this mass."
    )
    seed: int | None = Field(
        None, ge=0, lt=2**63, strict=True, description="Seed for sampling, 0 <= seed < 2**63; None = nondeterministic."
    )
    stop: tuple[str, ...] = Field((), description="Stop strings; the returned text ends before the first match.")
    presence_penalty: float = Field(
        0.0,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        strict=True,
        description="Subtracted from the logit of every token already generated.",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        strict=True,
        description="Subtracted from a token's logit once per time it was generated.",
    )
    tool_format: ToolCallFormat | None = Field(
        None, description="Parse tool calls written in this markup out of the answer (set when tools are offered)."
    )
    tool_names: tuple[str, ...] = Field(
        (),
        description="The names of the offered tools (needed with tool_format): a call naming any other stays "
        "content, never a tool call.",
    )
    parallel_tool_calls: bool = Field(True, strict=True, description="False: the answer makes at most one call.")
    output_format: OutputFormat | None = Field(
        None, description="Constrain the answer to a JSON object, a JSON schema or a tool call."
    )

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        return check_temperature(value)

    @model_validator(mode="after")
    def _calls_need_offered_tools(self) -> Self:
        if self.tool_format is not None and not self.tool_names:
            raise ValueError(
                f"tool_format={self.tool_format!r} needs tool_names, the names of the offered tools (a parsed call "
                "must name one of them); pass tool_names, or leave tool_format unset"
            )
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: object) -> object:
        if isinstance(value, str):
            value = (value,)
        if value is None:
            return ()
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {type(value).__name__}")
        for stop in value:
            if not isinstance(stop, str) or stop == "":
                raise ValueError(f"stop must be non-empty strings, got {stop!r}")
            try:
                stop.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"stop string {stop!r} is not valid Unicode (a lone surrogate)") from None
        return tuple(value)


def adapter_config(backend: str, draft: str | None, **fields: Any) -> SpecPrefillConfig:
    """The config behind a framework adapter's fields (LangChain, LlamaIndex).

    ``backend`` is ``"transformers"`` (main model in-process) or the URL of a vLLM server with this
    package's plugin; ``fields`` are the config's (the adapter's :meth:`CompressionSettings.compression`
    and its models). Raises ``ValueError`` on a bad backend, so pydantic reports it as a field error of
    the adapter.
    """
    if backend != "transformers" and not backend.startswith(("http://", "https://")):
        raise ValueError(
            f"backend {backend!r} is neither 'transformers' (in-process) nor the http(s) URL of a vLLM server"
        )
    if backend != "transformers" and draft is not None and is_self_spec(draft):
        raise ValueError(f"draft {draft!r} needs the main model in-process; with a vLLM server use a separate draft")
    check_tokenizer(fields.get("tokenizer"), main_on_vllm=backend != "transformers")
    return SpecPrefillConfig(draft=draft, **fields)
