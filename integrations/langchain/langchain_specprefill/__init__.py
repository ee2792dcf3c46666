"""LangChain integration of SpecPrefill-RAG."""

from importlib.metadata import PackageNotFoundError, version

from langchain_specprefill.chat_models import ChatSpecPrefill
from langchain_specprefill.documents import document_prompt, format_docs
from langchain_specprefill.llms import SpecPrefillLLM
from langchain_specprefill.retrievers import install_retriever_recorder, remove_retriever_recorder
from langchain_specprefill.warming import SpecPrefillDocumentWarmer

try:
    __version__ = version("langchain-specprefill")
except PackageNotFoundError:
    __version__ = "0.0.0"

__all__ = [
    "ChatSpecPrefill",
    "SpecPrefillDocumentWarmer",
    "SpecPrefillLLM",
    "__version__",
    "document_prompt",
    "format_docs",
    "install_retriever_recorder",
    "remove_retriever_recorder",
]
