"""Prometheus metrics of one gateway (its own registry, so several gateways can live in one process)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import OUTCOMES

_MS_BUCKETS = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)
_TOKEN_KINDS = ("kept", "main_cached", "draft_cached", "draft_document_cached")
_SHARE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)


class GatewayMetrics:
    """Requests by outcome, queue depth, draft time and batch size, kept share, TTFT, draft errors, and
    the bytes and entries of the draft prefix cache (``draft_cache``: a ``PrefixKVCache``, or ``None``) and
    of the per-document draft cache (``document_cache``: a ``DocumentStore``, or ``None``).
    """

    def __init__(
        self, queue_depth: Callable[[], int], draft_cache: Any | None = None, document_cache: Any | None = None
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "specprefill_requests",
            "Requests answered, by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.queue_depth = Gauge("specprefill_queue_depth", "Requests waiting for the draft.", registry=self.registry)
        self.queue_depth.set_function(lambda: float(queue_depth()))
        self.draft_ms = Histogram(
            "specprefill_draft_ms", "Draft time of one batch, ms.", buckets=_MS_BUCKETS, registry=self.registry
        )
        self.draft_batch = Histogram(
            "specprefill_draft_batch_size",
            "Prompts per draft batch.",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.kept_share = Histogram(
            "specprefill_kept_share",
            "Kept share of document tokens per request.",
            buckets=_SHARE_BUCKETS,
            registry=self.registry,
        )
        self.ttft_ms = Histogram(
            "specprefill_ttft_ms", "Arrival to first token, ms.", buckets=_MS_BUCKETS, registry=self.registry
        )
        self.draft_errors = Counter(
            "specprefill_draft_errors",
            "Draft failures, by error type and policy.",
            ["error", "policy"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "specprefill_prompt_tokens",
            "Prompt tokens of answered requests, by what became of them: 'kept' (prefilled by the main model, "
            "its prefix cache included), 'main_cached' (kept tokens the main model's prefix cache served, where "
            "the backend reports it), 'draft_cached' (draft tokens the draft prefix cache served), "
            "'draft_document_cached' (draft tokens the per-document cache served).",
            ["kind"],
            registry=self.registry,
        )
        self.reused_spans = Counter(
            "specprefill_reused_spans",
            "Compressed spans that kept the tokens chosen for them by an earlier turn (stable selection).",
            registry=self.registry,
        )
        cache_bytes = Gauge(
            "specprefill_draft_cache_bytes", "Bytes held by the draft prefix cache.", registry=self.registry
        )
        cache_bytes.set_function(lambda: float(draft_cache.nbytes if draft_cache is not None else 0))
        cache_entries = Gauge(
            "specprefill_draft_cache_entries", "Prompts held by the draft prefix cache.", registry=self.registry
        )
        cache_entries.set_function(lambda: float(len(draft_cache) if draft_cache is not None else 0))
        document_bytes = Gauge(
            "specprefill_document_cache_bytes", "Bytes held by the per-document draft cache.", registry=self.registry
        )
        document_bytes.set_function(lambda: float(document_cache.nbytes if document_cache is not None else 0))
        document_entries = Gauge(
            "specprefill_document_cache_entries",
            "Entries held by the per-document draft cache (documents, and the prefixes they were drafted after).",
            registry=self.registry,
        )
        document_entries.set_function(lambda: float(len(document_cache) if document_cache is not None else 0))
        for endpoint in ("chat", "completions", "warm"):
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)  # every series exists from the start (0)
        for kind in _TOKEN_KINDS:
            self.prompt_tokens.labels(kind)

    def batch(self, size: int, seconds: float) -> None:
        self.draft_batch.observe(size)
        self.draft_ms.observe(seconds * 1000.0)

    def finished(self, endpoint: str, outcome: str, stats: Any | None = None) -> None:
        """Count one answered request; ``stats`` (:class:`SpecPrefillStats`) when it produced an answer."""
        self.requests.labels(endpoint, outcome).inc()
        if stats is not None:
            self.ttft_ms.observe(stats.ttft_ms)
            if stats.document_tokens:
                self.kept_share.observe(stats.keep_rate)
            self._count_tokens(stats)

    def _count_tokens(self, stats: Any) -> None:
        counts = {
            "kept": stats.kept_tokens,
            "main_cached": stats.main_cached_tokens or 0,
            "draft_cached": stats.draft_cached_tokens,
            "draft_document_cached": stats.draft_document_cached_tokens,
        }
        for kind, count in counts.items():
            if count:
                self.prompt_tokens.labels(kind).inc(count)
        if stats.reused_spans:
            self.reused_spans.inc(stats.reused_spans)

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
