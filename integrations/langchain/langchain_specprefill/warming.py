"""Warm the per-document draft cache at ingestion: a document transformer that drafts each document once.

With ``draft_document_cache`` on, the draft takes each document's KV from a cache instead of drafting it
again in every prompt that holds it (docs: Document cache). :class:`SpecPrefillDocumentWarmer` fills that
cache where documents are loaded or split, so even the first question over them finds them: in the engine of
this process, or in a gateway's (``POST /v1/spec_prefill/documents/warm``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from langchain_core.documents import BaseDocumentTransformer, Document

from langchain_specprefill._settings import SpecPrefillSettings
from langchain_specprefill.chat_models import ChatSpecPrefill
from specprefill_rag.arguments import check_optional_text
from specprefill_rag.errors import InvalidRequestError

log = logging.getLogger("langchain_specprefill")


class SpecPrefillDocumentWarmer(BaseDocumentTransformer):
    """Drafts documents into the per-document draft cache and returns them unchanged.

    Args:
        llm: a :class:`ChatSpecPrefill` or :class:`SpecPrefillLLM`: its engine in this process, or the gateway its
            ``backend`` URL names.
        instructions: the system message of the later requests. Entries are keyed by the prompt before the first
            document, so only requests with these instructions (and documents passed as ``documents=``, untitled)
            find them.

    Example:
        .. code-block:: python

            llm = ChatSpecPrefill(model="smollm2-135m", draft_document_cache=True)
            warmer = SpecPrefillDocumentWarmer(llm, instructions=SYSTEM)
            chunks = warmer.transform_documents(splitter.split_documents(loader.load()))
            llm.invoke([("system", SYSTEM), ("user", question)], documents=retriever.invoke(question))
    """

    def __init__(self, llm: SpecPrefillSettings, instructions: str | None = None) -> None:
        if not isinstance(llm, SpecPrefillSettings):
            raise InvalidRequestError(
                f"llm must be a ChatSpecPrefill or SpecPrefillLLM, got {type(llm).__name__}; pass the model the "
                "later requests go through (or use SpecPrefillDocumentWarmer.from_gateway(url))"
            )
        self.llm = llm
        self.instructions = check_optional_text(instructions, "instructions", "system instructions")

    @classmethod
    def from_gateway(
        cls, base_url: str, instructions: str | None = None, api_key: str | None = None, timeout: float = 60.0
    ) -> SpecPrefillDocumentWarmer:
        """A warmer of the gateway at ``base_url`` (``specprefill-rag serve``; torch-free); ``api_key``: its
        ``--api-key`` (default ``$SPECPREFILL_API_KEY``).
        """
        key: dict[str, Any] = {"api_key": api_key} if api_key is not None else {}
        llm = ChatSpecPrefill(backend=base_url, timeout=timeout, **key)
        if llm.session.runs_here:
            raise InvalidRequestError(
                f"{base_url} is not a SpecPrefill gateway (its /v1/models does not say so); pass a gateway's URL, or "
                "SpecPrefillDocumentWarmer(llm) for an engine in this process"
            )
        return cls(llm, instructions)

    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        """Warm the cache with ``documents`` (an empty list warms nothing); they are returned as given."""
        _no_options(kwargs)
        if documents:
            _reported(self.llm.session.warm(documents, self.instructions), len(documents))
        return documents

    async def atransform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        """:meth:`transform_documents` on the event loop (the draft runs in a worker thread, or over HTTP)."""
        _no_options(kwargs)
        if documents:
            _reported(await self.llm.session.awarm(documents, self.instructions), len(documents))
        return documents


def _no_options(kwargs: dict[str, Any]) -> None:
    if kwargs:
        raise InvalidRequestError(f"unknown options {sorted(kwargs)}; pass only the documents to warm")


def _reported(warmed: int, documents: int) -> None:
    """Say when the cache could not take every document (it stops before dropping entries)."""
    if warmed < documents:
        log.warning(
            "warmed %d of %d documents: the per-document draft cache is full or off; raise document_cache_mb "
            "(gateway: --document-cache-mb) to hold them all",
            warmed,
            documents,
        )
