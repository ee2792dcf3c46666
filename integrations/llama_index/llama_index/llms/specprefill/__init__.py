"""LlamaIndex LLM integration of SpecPrefill-RAG."""

from llama_index.llms.specprefill._tools import NoToolCallError
from llama_index.llms.specprefill.base import SpecPrefillLLM, install_node_recorder, remove_node_recorder
from llama_index.llms.specprefill.warming import SpecPrefillDocumentWarmer

__all__ = [
    "NoToolCallError",
    "SpecPrefillDocumentWarmer",
    "SpecPrefillLLM",
    "install_node_recorder",
    "remove_node_recorder",
]
