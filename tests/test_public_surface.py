"""What users and clients depend on, listed: the package's names, the gateway's routes, request fields and
metric names. A refactor may add to these; removing one is a breaking change and fails here."""

import importlib

import specprefill_rag
import specprefill_rag.errors
from specprefill_rag.serve import GatewaySettings, create_app
from specprefill_rag.serve.schema import ChatCompletionRequest, CompletionRequest, SpecPrefillOptions
from tests.serve_helpers import tiny_engine

PUBLIC_NAMES = {
    "ContextLengthError",
    "DraftLimitError",
    "DraftOutOfMemoryError",
    "DraftContextLengthError",
    "DraftScoringError",
    "Document",
    "GenerationParams",
    "GenerationResult",
    "InvalidRequestError",
    "ModelLoadError",
    "PromptLayout",
    "Role",
    "Selection",
    "SpecPrefillConfig",
    "SpecPrefillEngine",
    "SpecPrefillError",
    "SpecPrefillStats",
    "StreamChunk",
    "TokenizerMismatchError",
    "__version__",
}
ROUTES = {
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("POST", "/tokenize"),
    ("POST", "/v1/spec_prefill/documents/warm"),
    ("GET", "/health"),
    ("GET", "/metrics"),
}
SAMPLING_FIELDS = {
    "model",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "spec_prefill",
    "max_tokens",
    "logprobs",
}
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "echo", "suffix"}
SPEC_PREFILL_FIELDS = {
    "enabled",
    "keep_rate",
    "max_document_tokens",
    "documents",
    "question",
    "insert_documents",
    "system_context",
    "reselect",
    "draft_document_cache",
}
# Errors that moved into specprefill_rag.errors: their old modules still export them.
MOVED_ERRORS = {
    "VLLMServerError": ("specprefill_rag.backends.vllm_wire", "specprefill_rag.backends.vllm"),
    "VLLMServerTimeout": ("specprefill_rag.backends.vllm_wire", "specprefill_rag.backends.vllm"),
    "GatewayClientError": ("specprefill_rag.gateway_client",),
}
METRICS = {
    "specprefill_requests",
    "specprefill_queue_depth",
    "specprefill_draft_ms",
    "specprefill_draft_batch_size",
    "specprefill_kept_share",
    "specprefill_ttft_ms",
    "specprefill_draft_errors",
    "specprefill_draft_cache_bytes",
    "specprefill_draft_cache_entries",
    "specprefill_document_cache_bytes",
    "specprefill_document_cache_entries",
}


def test_public_names_stay():
    assert PUBLIC_NAMES <= set(specprefill_rag.__all__)
    assert all(hasattr(specprefill_rag, name) for name in specprefill_rag.__all__)


def test_moved_errors_keep_their_old_import_paths():
    for name, modules in MOVED_ERRORS.items():
        error = getattr(specprefill_rag.errors, name)
        assert issubclass(error, specprefill_rag.SpecPrefillError)
        for module in modules:
            assert getattr(importlib.import_module(module), name) is error, f"{module}.{name}"


def test_request_fields_stay():
    assert CHAT_FIELDS <= set(ChatCompletionRequest.model_fields)
    assert COMPLETION_FIELDS <= set(CompletionRequest.model_fields)
    assert SPEC_PREFILL_FIELDS <= set(SpecPrefillOptions.model_fields)


def test_routes_and_metric_names_stay(tokenizer, tiny_model, tiny_draft):
    app = create_app(GatewaySettings(served_model_name="tiny"), tiny_engine(tokenizer, tiny_model, tiny_draft))
    routes = {(method, route.path) for route in app.routes for method in getattr(route, "methods", ())}
    assert ROUTES <= routes
    names = {metric.name for metric in app.state.gateway.metrics.registry.collect()}
    assert METRICS <= names
