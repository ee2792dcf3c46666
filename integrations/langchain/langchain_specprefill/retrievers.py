"""The documents retrievers returned earlier in the same run, so ChatSpecPrefill finds them in the prompt.

LangChain's tutorials join the retrieved documents into a prompt template (``format_docs``, the
default ``create_stuff_documents_chain`` prompt) and put them in the system or human message. A
callback handler, added to every run through LangChain's ``register_configure_hook`` (installed when a
ChatSpecPrefill or SpecPrefillLLM is built, or with :func:`install_retriever_recorder`; removed with
:func:`remove_retriever_recorder`), records each retriever's documents under the root of its run.
The chat model's run (its ``run_manager``) looks up the documents of its own root; those found
verbatim in the messages become the compressible spans, the rest of each message stays whole. A
document that was reformatted is not found and is simply not used.

Bounded: a root's records are dropped when the root run ends, and at most :data:`MAX_ROOTS` roots,
:data:`MAX_RUNS_PER_ROOT` runs and :data:`MAX_DOCUMENTS_PER_ROOT` documents are kept. Thread-safe
(one lock), and it never raises into the user's chain.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler

logger = logging.getLogger(__name__)

MAX_ROOTS = 1024
MAX_RUNS_PER_ROOT = 10_000
MAX_DOCUMENTS_PER_ROOT = 1024
MIN_DOCUMENT_CHARS = 16  # shorter retrieved text could match a question's words by chance: never located


# The chat model or LLM run starting in this context: LangChain's stream() calls _stream() without its
# run manager, so the run is taken from here (set inline by on_chat_model_start / on_llm_start).
_model_run: ContextVar[tuple[UUID, UUID | None] | None] = ContextVar("specprefill_model_run", default=None)


class _Root:
    __slots__ = ("documents", "runs")

    def __init__(self) -> None:
        self.runs: set[UUID] = set()
        self.documents: dict[str, None] = {}  # ordered, each text once


class RetrievedDocumentRecorder(BaseCallbackHandler):
    """Records ``on_retriever_end`` documents per root run (see the module docstring)."""

    run_inline = True  # cheap and order-preserving, also under the async callback manager
    raise_error = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._roots: OrderedDict[UUID, _Root] = OrderedDict()
        self._run_root: dict[UUID, UUID] = {}
        self.active = True

    # -- bookkeeping (under the lock) --------------------------------------------------------------

    def _start(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        if not self.active:
            return
        with self._lock:
            if run_id in self._run_root:
                return
            root_id = run_id if parent_run_id is None else self._run_root.get(parent_run_id, parent_run_id)
            root = self._roots.get(root_id)
            if root is None:
                root = self._roots[root_id] = _Root()
                root.runs.add(root_id)
                self._run_root[root_id] = root_id
                while len(self._roots) > MAX_ROOTS:
                    self._forget(next(iter(self._roots)))
            if len(root.runs) < MAX_RUNS_PER_ROOT:
                root.runs.add(run_id)
                self._run_root[run_id] = root_id

    def _forget(self, root_id: UUID) -> None:
        root = self._roots.pop(root_id, None)
        if root is not None:
            for run in root.runs:
                self._run_root.pop(run, None)

    def _end(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        if parent_run_id is None:
            with self._lock:
                self._forget(run_id)

    def _record(self, run_id: UUID, parent_run_id: UUID | None, documents: Sequence[Any]) -> None:
        if not self.active:
            return
        with self._lock:
            root_id = self._run_root.get(run_id) or (self._run_root.get(parent_run_id) if parent_run_id else None)
            root = self._roots.get(root_id) if root_id is not None else None
            if root is None:
                return
            for document in documents:
                text = getattr(document, "page_content", None)
                if isinstance(text, str) and len(text.strip()) >= MIN_DOCUMENT_CHARS:
                    if len(root.documents) >= MAX_DOCUMENTS_PER_ROOT:
                        break
                    root.documents.setdefault(text, None)

    def documents(self, run_id: UUID | None, parent_run_id: UUID | None) -> tuple[str, ...]:
        """The texts retrieved so far under the root of ``run_id`` (or of ``parent_run_id``), in order."""
        if not self.active:
            return ()
        with self._lock:
            root_id = None
            for run in (parent_run_id, run_id):
                if run is not None and run in self._run_root:
                    root_id = self._run_root[run]
                    break
            root = self._roots.get(root_id) if root_id is not None else None
            return tuple(root.documents) if root is not None else ()

    def tracked_roots(self) -> int:
        """How many root runs are tracked now (for tests and monitoring; no ``__len__``: LangChain tests
        the handler for truth).
        """
        with self._lock:
            return len(self._roots)

    # -- callbacks: none of them raises ----------------------------------------------------------

    def _safely(self, method: Any, *args: Any) -> None:
        try:
            method(*args)
        except Exception:  # a bookkeeping failure must never break the user's chain
            logger.debug("SpecPrefill retriever recorder failed", exc_info=True)

    def on_chain_start(
        self, serialized: Any, inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._safely(self._start, run_id, parent_run_id)

    def on_retriever_start(
        self, serialized: Any, query: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._safely(self._start, run_id, parent_run_id)

    def on_tool_start(
        self, serialized: Any, input_str: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._safely(self._start, run_id, parent_run_id)

    def _model_start(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        self._start(run_id, parent_run_id)
        if self.active:
            _model_run.set((run_id, parent_run_id))

    def on_chat_model_start(
        self, serialized: Any, messages: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._safely(self._model_start, run_id, parent_run_id)

    def on_llm_start(
        self, serialized: Any, prompts: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._safely(self._model_start, run_id, parent_run_id)

    def on_retriever_end(
        self, documents: Sequence[Any], *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._safely(self._record, run_id, parent_run_id, documents)
        self._safely(self._end, run_id, parent_run_id)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._safely(self._end, run_id, parent_run_id)

    def on_chain_error(self, error: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._safely(self._end, run_id, parent_run_id)

    def on_retriever_error(self, error: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._safely(self._end, run_id, parent_run_id)

    def on_tool_end(self, output: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._safely(self._end, run_id, parent_run_id)

    def on_tool_error(self, error: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._safely(self._end, run_id, parent_run_id)

    def on_llm_end(self, response: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._safely(self._end, run_id, parent_run_id)

    def on_llm_error(self, error: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._safely(self._end, run_id, parent_run_id)


_install_lock = threading.Lock()
_installed: tuple[RetrievedDocumentRecorder, ContextVar[Any]] | None = None


def install_retriever_recorder() -> RetrievedDocumentRecorder:
    """Add the recorder to every LangChain run (once; idempotent). ChatSpecPrefill and SpecPrefillLLM
    call it when they are built. It uses ``register_configure_hook``: a context variable whose default
    is the recorder, so runs in every thread get it.
    """
    global _installed
    with _install_lock:
        if _installed is not None:
            return _installed[0]
        from langchain_core.tracers.context import register_configure_hook

        recorder = RetrievedDocumentRecorder()
        variable: ContextVar[Any] = ContextVar("specprefill_retriever_recorder", default=recorder)
        register_configure_hook(variable, True)
        _installed = (recorder, variable)
        return recorder


def remove_retriever_recorder() -> None:
    """Stop recording: runs no longer get the handler, and chat models find no retrieved documents
    (the helpers, ``documents=`` and content blocks keep working). Building a new ChatSpecPrefill or
    SpecPrefillLLM installs it again.
    """
    global _installed
    with _install_lock:
        if _installed is None:
            return
        recorder, variable = _installed
        _installed = None
        recorder.active = False  # a no-op from now on, even in runs that already hold it
        try:
            from langchain_core.tracers import context

            # LangChain has no public way to unregister a hook; drop ours from its list
            context._configure_hooks[:] = [hook for hook in context._configure_hooks if hook[0] is not variable]
        except Exception:  # the handler stays attached but inactive
            logger.debug("could not unregister the SpecPrefill retriever recorder", exc_info=True)


def active_recorder() -> RetrievedDocumentRecorder | None:
    """The installed recorder, or None."""
    installed = _installed
    return installed[0] if installed is not None else None


def retrieved_documents(run_manager: Any) -> tuple[str, ...]:
    """The documents retrieved earlier in the run of ``run_manager`` (a chat model's or LLM's; without
    one, as in LangChain's ``stream()``, the model run that started in this context); () when the
    recorder is not installed, the run is not known or nothing was retrieved.
    """
    recorder = active_recorder()
    if recorder is None:
        return ()
    try:
        if run_manager is not None:
            return recorder.documents(run_manager.run_id, run_manager.parent_run_id)
        run = _model_run.get()
        return recorder.documents(*run) if run is not None else ()
    except Exception:
        logger.debug("SpecPrefill retriever recorder lookup failed", exc_info=True)
        return ()


def located_documents(documents: Sequence[str], texts: Sequence[str]) -> list[str]:
    """The ``documents`` found verbatim in one of ``texts``, minus any that lie inside another found one
    (two spans cannot overlap). Nothing is guessed: a reformatted document is not found.
    """
    found = [d for d in documents if any(d in text for text in texts)]
    return [d for d in found if not any(d != other and d in other for other in found)]
