"""The composition root: an engine's models, draft, caches, backend and request path, assembled from a config.

:class:`~specprefill_rag.engine.SpecPrefillEngine` builds nothing itself: its three constructors (``SpecPrefillEngine(
config)``, ``from_models``, ``for_vllm``) call :func:`load`, :func:`over_models` or :func:`on_vllm` here, each
returning the :class:`EngineParts` the engine's one initialiser takes. A new kind of draft or backend is added here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from .backends.base import MainBackend
from .backends.hf import MAIN_MIN_REUSE_SHARE, HFBackend, eos_token_ids
from .config import AUTO, DEFAULT_SELF_LAYER_SHARE, SpecPrefillConfig
from .draft.cost import REMOTE_MAIN_MIN_PROMPT_TOKENS, draft_parameter_count, parameter_count, pays_from
from .draft.document_cache import DocumentKVCache, DocumentStore, shared_document_cache
from .draft.hooks import decoder_layers
from .draft.model import LayerPrefixDraft, ModelDraft, separate_draft
from .draft.paths import DirectScoring, DraftInput, MappedScoring, draft_scoring, warm_layout
from .draft.repair import DocumentRepair
from .errors import InvalidRequestError
from .kvcache.prefix_cache import PrefixKVCache, shared_prefix_cache
from .models.loading import LoadedModel, load_tokenizer, model_lock, shared_model
from .pipeline import Pipeline

# What the engine uses of the draft, named here so that the engine reaches draft/ through this module only.
__all__ = [
    "DocumentStore",
    "DraftInput",
    "EngineParts",
    "Scoring",
    "load",
    "make_config",
    "on_vllm",
    "over_models",
    "warm_layout",
]

Scoring = DirectScoring | MappedScoring
log = logging.getLogger("specprefill_rag")


@dataclass(frozen=True)
class EngineParts:
    """Everything an engine runs on.

    Attributes:
        config: the engine's settings.
        tokenizer: the main model's tokenizer (prompts are laid out with it).
        backend: the main model, in-process or on a vLLM server.
        scoring: how the draft reads a layout (direct, self or mapped path).
        main: the in-process main model; None when it runs elsewhere (vLLM).
        pipeline: the request path over ``config``, the backend and ``scoring``.
    """

    config: SpecPrefillConfig
    tokenizer: Any
    backend: MainBackend
    scoring: Scoring
    main: LoadedModel | None
    pipeline: Pipeline


def make_config(config: SpecPrefillConfig | None, settings: dict[str, Any]) -> SpecPrefillConfig:
    """``config``, or one built from its fields given as keyword arguments (not both)."""
    if config is not None and settings:
        raise InvalidRequestError("pass either a SpecPrefillConfig or its fields as keyword arguments, not both")
    return config if config is not None else SpecPrefillConfig(**settings)


def load(config: SpecPrefillConfig) -> EngineParts:
    """Load the main model and the draft ``config`` names (shared with other engines of this process); no draft
    named: the main model's first layers (``'self'``).
    """
    config = _with_default_draft(config)
    if config.tokenizer is not None:
        raise InvalidRequestError(
            "tokenizer= names the tokenizer of a main model on vLLM; in-process the main model's own is used"
        )
    main = shared_model(config.main, config.device, config.dtype)
    draft = None
    if config.draft is not None and not config.is_self_draft and config.draft != config.main:
        draft = shared_model(config.draft, config.device, config.dtype)
    return _in_process(config, main, draft)


def over_models(
    config: SpecPrefillConfig,
    main_model: Any,
    tokenizer: Any,
    draft_model: Any | None = None,
    draft_tokenizer: Any | None = None,
) -> EngineParts:
    """Parts over models already loaded; ``draft_model=None``: the main model drafts for itself."""
    draft = LoadedModel(draft_model, draft_tokenizer or tokenizer, "draft") if draft_model is not None else None
    return _in_process(config, LoadedModel(main_model, tokenizer, "main"), draft)


def on_vllm(config: SpecPrefillConfig, server: str | Any, on_missing_plugin: str, timeout: float) -> EngineParts:
    """Parts whose main model runs on vLLM (``server``: a URL or an in-process ``vllm.LLM``), the draft here."""
    from .backends.vllm import connect  # vLLM's client needs the optional dependencies: loaded only for it

    if config.draft is None:
        raise InvalidRequestError(
            "a main model on vLLM needs a draft named: pass draft='<HF id, folder or .gguf>' of a small model "
            "with the served model's tokenizer (its smaller sibling; another vocabulary also works, mapped)"
        )
    if config.is_self_draft:
        raise InvalidRequestError("a 'self:<n>' draft needs the main model in-process; pick a separate draft model")
    if config.positions == "contiguous" and on_missing_plugin == "error":
        on_missing_plugin = "full_prompt"  # its prompts are ordinary ones: without the plugin it still compresses
    backend = connect(server, timeout, on_missing_plugin)  # type: ignore[arg-type]
    draft = shared_model(config.draft, config.device, config.dtype)
    draft_eos = eos_token_ids(draft.model, draft.tokenizer)
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer is not None else draft.tokenizer
    main_eos = draft_eos if tokenizer is draft.tokenizer else eos_token_ids(None, tokenizer)
    backend.adopt_tokenizer(tokenizer, main_eos)
    backend.grammar_limits = config  # a SpecPrefillConfig is GrammarLimits
    scoring = draft_scoring(
        _model_draft(config, draft), draft.tokenizer, tokenizer, config.effective_look_ahead, config.max_draft_tokens
    )
    floor = REMOTE_MAIN_MIN_PROMPT_TOKENS if config.min_prompt_tokens == AUTO else config.min_prompt_tokens
    return _parts(config, tokenizer, backend, scoring, None, floor)


def _in_process(config: SpecPrefillConfig, main: LoadedModel, draft: LoadedModel | None) -> EngineParts:
    """Parts with the main model in this process: a separate draft (``draft``, else the main model whole) or the
    main model's first layers (``self``), the caches on their devices, the transformers backend.
    """
    scoring: Scoring
    if config.is_self_draft:
        scoring, share = _self_scoring(config, main)
    else:
        drafting = draft if draft is not None else main
        scorer = _model_draft(config, drafting)
        scoring = draft_scoring(
            scorer, drafting.tokenizer, main.tokenizer, config.effective_look_ahead, config.max_draft_tokens
        )
        share = draft_parameter_count(drafting.model, config.draft_layers) / parameter_count(main.model)
    floor = _prompt_floor(config, share, config.effective_look_ahead, main.context_length)
    device = next(main.model.parameters()).device
    main_cache = shared_prefix_cache(device, config.main_cache_mb * 2**20, MAIN_MIN_REUSE_SHARE)
    eos = eos_token_ids(main.model, main.tokenizer)
    backend = HFBackend(main.model, eos, model_lock(main.model), main.tokenizer, main_cache, config)
    return _parts(config, main.tokenizer, backend, scoring, main, floor)


def _parts(
    config: SpecPrefillConfig,
    tokenizer: Any,
    backend: MainBackend,
    scoring: Scoring,
    main: LoadedModel | None,
    min_prompt_tokens: int,
) -> EngineParts:
    pipeline = Pipeline(config, backend.supports_sparse_prefill, min_prompt_tokens, scoring)
    return EngineParts(config, tokenizer, backend, scoring, main, pipeline)


def _self_scoring(config: SpecPrefillConfig, main: LoadedModel) -> tuple[DirectScoring, float]:
    """The main model's first layers as the draft (``self`` / ``self:<n>``), and their share of its layers."""
    available = len(decoder_layers(main.model))
    n_layers = config.self_draft_layers or max(1, round(DEFAULT_SELF_LAYER_SHARE * available))
    if n_layers > available:
        raise InvalidRequestError(f"draft 'self:{n_layers}' asks for more layers than the main model has ({available})")
    scorer = LayerPrefixDraft(
        main.model,
        n_layers,
        config.pool_kernel,
        config.self_draft_window,
        _prefix_cache(config, main.model),
        _document_cache(config, main.model),
        DocumentRepair.of(config),
    )
    scoring = DirectScoring(scorer, main.context_length, 1, config.max_draft_tokens, path="self")
    return scoring, n_layers / available


def _model_draft(config: SpecPrefillConfig, draft: LoadedModel) -> ModelDraft | LayerPrefixDraft:
    """A separate draft model (whole with its look-ahead or its query window, or its first ``draft_layers``), its
    caches on its device and the document repair.
    """
    return separate_draft(
        draft.model,
        config.look_ahead,
        config.pool_kernel,
        eos_token_ids(draft.model, draft.tokenizer),
        _prefix_cache(config, draft.model),
        _document_cache(config, draft.model),
        DocumentRepair.of(config),
        config.draft_layers,
        config.self_draft_window,
        config.queries,
    )


def _prefix_cache(config: SpecPrefillConfig, draft_model: Any) -> PrefixKVCache | None:
    """The shared draft prefix cache for ``draft_model``'s device, or ``None`` when ``config`` turns it off."""
    return shared_prefix_cache(next(draft_model.parameters()).device, config.draft_cache_mb * 2**20)


def _document_cache(config: SpecPrefillConfig, draft_model: Any) -> DocumentKVCache | None:
    """The shared per-document draft cache for ``draft_model``'s device, or ``None`` when ``config`` turns it off."""
    return shared_document_cache(next(draft_model.parameters()).device, config.document_cache_mb * 2**20)


def _with_default_draft(config: SpecPrefillConfig) -> SpecPrefillConfig:
    """``config`` with 'self' as its draft when none is named; a set ``look_ahead`` then asks for a draft."""
    try:
        return config.with_default_draft()
    except ValidationError as error:  # look_ahead was set, and no draft model named
        raise InvalidRequestError(str(error.errors()[0]["msg"]).removeprefix("Value error, ")) from None


def _prompt_floor(config: SpecPrefillConfig, draft_share: float, look_ahead: int, context_length: int) -> int:
    """``config.min_prompt_tokens``, or for "auto" the length from which this draft pays
    (:func:`~specprefill_rag.draft.cost.pays_from`); past the context (nothing compressed) when it never does.
    """
    if config.min_prompt_tokens != AUTO:
        return config.min_prompt_tokens
    floor = pays_from(draft_share, look_ahead)
    if floor is None:
        log.warning(
            "the draft costs %.0f%% of the main model per prompt token, so it cannot save time and no prompt is "
            "compressed; use draft='self' or a smaller draft, or set min_prompt_tokens to compress anyway",
            100 * draft_share,
        )
        return context_length + 1
    return floor
