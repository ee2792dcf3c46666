"""SpecPrefill for RAG: a small draft picks the document tokens that matter; the main model
prefills only those, each at its original position (Liu, Chen, Zhang, ICML 2025, arXiv 2502.02789)."""

from importlib.metadata import PackageNotFoundError, version

from .config import GenerationParams, SpecPrefillConfig
from .engine import SpecPrefillEngine
from .errors import (
    ContextLengthError,
    DraftContextLengthError,
    DraftScoringError,
    InvalidRequestError,
    ModelLoadError,
    SpecPrefillError,
    TokenizerMismatchError,
)
from .prompt import Document, PromptLayout, Role
from .results import GenerationResult, Selection, SpecPrefillStats, StreamChunk

try:
    __version__ = version("specprefill-rag")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "ContextLengthError",
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
]
