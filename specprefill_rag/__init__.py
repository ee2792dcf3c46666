"""SpecPrefill for RAG: a small draft picks the document tokens that matter; the main model
prefills only those, each at its original position (Liu, Chen, Zhang, ICML 2025, arXiv 2502.02789).
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from .config import GenerationParams, SpecPrefillConfig
from .errors import (
    ContextLengthError,
    DraftContextLengthError,
    DraftLimitError,
    DraftOutOfMemoryError,
    DraftScoringError,
    InvalidRequestError,
    ModelLoadError,
    OutputFormatError,
    SpecPrefillError,
    TokenizerMismatchError,
)
from .results import GenerationResult, Selection, SpecPrefillStats, StreamChunk, TokenLogprob, TopLogprob

try:
    __version__ = version("specprefill-rag")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

# Imported on first use: they need torch, and an application that only talks to a gateway has none.
_LAZY = {"SpecPrefillEngine": ".engine", "Document": ".prompt", "PromptLayout": ".prompt", "Role": ".prompt"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
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
    "OutputFormatError",
    "PromptLayout",
    "Role",
    "Selection",
    "SpecPrefillConfig",
    "SpecPrefillEngine",
    "SpecPrefillError",
    "SpecPrefillStats",
    "StreamChunk",
    "TokenLogprob",
    "TokenizerMismatchError",
    "TopLogprob",
    "__version__",
]
