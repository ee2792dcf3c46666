"""Warm the per-document draft cache at ingestion: a transformation for an ``IngestionPipeline``.

With ``draft_document_cache`` on, the draft takes each document's KV from a cache instead of drafting it
again in every prompt that holds it (docs: Document cache). :class:`SpecPrefillDocumentWarmer` fills that
cache as nodes are ingested, in the engine of this process or in a gateway's
(``POST /v1/spec_prefill/documents/warm``), and passes the nodes on unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field, field_validator
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent
from llama_index.llms.specprefill.base import SpecPrefillLLM

from specprefill_rag.arguments import check_optional_text
from specprefill_rag.errors import InvalidRequestError

log = logging.getLogger("llama_index.llms.specprefill")


class SpecPrefillDocumentWarmer(TransformComponent):
    """Drafts each node's text (as the LLM reads it: ``MetadataMode.LLM``) into the per-document draft cache of
    ``llm`` (its engine here, or the gateway its ``backend`` URL names); returns the nodes unchanged.

    ``instructions``: the system message of the later requests. Entries are keyed by the prompt before the first
    document, so only requests with these instructions and the nodes passed as ``documents=`` find them.

    Example:
        .. code-block:: python

            llm = SpecPrefillLLM(model="smollm2-135m", draft_document_cache=True)
            pipeline = IngestionPipeline(transformations=[splitter, SpecPrefillDocumentWarmer(llm=llm)])
            nodes = pipeline.run(documents=documents)
    """

    llm: SpecPrefillLLM = Field(description="The LLM the later requests go through (an engine here or a gateway).")
    instructions: str | None = Field(default=None, description="The system message of the later requests.")

    @field_validator("instructions")
    @classmethod
    def _instructions(cls, value: str | None) -> str | None:
        try:
            return check_optional_text(value, "instructions", "system instructions")
        except InvalidRequestError as error:
            raise ValueError(str(error)) from None

    @classmethod
    def class_name(cls) -> str:
        return "SpecPrefillDocumentWarmer"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        texts = _texts(nodes)
        if texts:
            _reported(self.llm.session.warm(texts, self.instructions), len(texts))
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        texts = _texts(nodes)
        if texts:
            _reported(await self.llm.session.awarm(texts, self.instructions), len(texts))
        return nodes


def _texts(nodes: Sequence[BaseNode]) -> list[str]:
    """The nodes' texts as the LLM reads them; nodes without text (images, empty chunks) are never documents."""
    if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Sequence):
        raise InvalidRequestError(f"nodes must be a list of LlamaIndex nodes, got {type(nodes).__name__}; pass a list")
    texts = []
    for index, node in enumerate(nodes):
        if not isinstance(node, BaseNode):
            raise InvalidRequestError(
                f"node {index} is a {type(node).__name__}, not a LlamaIndex node; wrap text as TextNode(text=...)"
            )
        text = node.get_content(metadata_mode=MetadataMode.LLM)
        if text.strip():
            texts.append(text)
    return texts


def _reported(warmed: int, documents: int) -> None:
    """Say when the cache could not take every document (it stops before dropping entries)."""
    if warmed < documents:
        log.warning(
            "warmed %d of %d nodes: the per-document draft cache is full or off; raise document_cache_mb "
            "(gateway: --document-cache-mb) to hold them all",
            warmed,
            documents,
        )
