"""Main-model backends behind one interface, :class:`MainBackend`."""

from .base import MainBackend, SparsePrompt

__all__ = ["MainBackend", "SparsePrompt"]
