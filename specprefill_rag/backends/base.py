"""The one small interface every main-model backend implements.

A backend receives the kept prompt tokens with their original positions and yields generated
token ids, blocking (:meth:`MainBackend.generate`) or on an event loop (:meth:`MainBackend.agenerate`).
It never knows how the tokens were chosen.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator
from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import GenerationParams, OutputFormat
from ..results import PrefillReport


@dataclass(frozen=True)
class SparsePrompt:
    """Prompt tokens the main model prefills, each at an explicit position.

    Attributes:
        token_ids: ``[K]`` long, the kept tokens.
        position_ids: ``[K]`` long, strictly increasing positions, all ``< prompt_length``: the original ones
            (:meth:`kept`) or ``0..K-1`` (:meth:`renumbered`, where ``prompt_length`` is ``K``).
        prompt_length: ``L``, the length the positions count in; the first generated token sits at position ``L``.
        namespace: the tenant whose prefix-cache entries the main model may reuse and fills (an in-process
            cache's namespace, a vLLM server's ``cache_salt``); None: the namespace of an engine used by one
            application.
    """

    token_ids: torch.Tensor
    position_ids: torch.Tensor
    prompt_length: int
    namespace: str | None = None

    @classmethod
    def full(cls, token_ids: torch.Tensor, namespace: str | None = None) -> SparsePrompt:
        """The whole prompt, positions ``0..L-1``."""
        positions = torch.arange(token_ids.numel(), device=token_ids.device)
        return cls(token_ids, positions, int(token_ids.numel()), namespace)

    @classmethod
    def kept(cls, token_ids: torch.Tensor, kept: torch.Tensor, namespace: str | None = None) -> SparsePrompt:
        """The tokens of ``token_ids`` at the sorted indices ``kept``."""
        return cls(token_ids[kept], kept, int(token_ids.numel()), namespace)

    @classmethod
    def renumbered(cls, token_ids: torch.Tensor, kept: torch.Tensor, namespace: str | None = None) -> SparsePrompt:
        """The tokens of ``token_ids`` at the sorted indices ``kept`` as an ordinary prompt of their own:
        positions ``0..K-1``, generation from ``K`` (``positions="contiguous"``).
        """
        return cls.full(token_ids[kept], namespace)


class MainBackend(Protocol):
    """Runs the main model: sparse prefill, then decoding from position ``prompt_length``."""

    supports_sparse_prefill: bool
    """False for a server that can only prefill whole prompts (the engine then sends them whole)."""

    @property
    def context_length(self) -> int:
        """Largest position + 1 the main model supports."""
        ...

    def check_output_format(self, output_format: OutputFormat) -> None:
        """Raise :class:`~specprefill_rag.errors.InvalidRequestError` unless this backend can constrain its output
        to ``output_format`` (``params.output_format``); called before any model runs.
        """
        ...

    def generate(
        self, prompt: SparsePrompt, params: GenerationParams, report: PrefillReport | None = None
    ) -> Generator[int, None, None]:
        """Yield generated token ids, the first right after prefill; stop at end-of-sequence
        (not yielded) or after ``params.max_new_tokens``. ``report``, when given, is filled in by the
        time the generator ends (closed early included); with ``params.logprobs`` each token's
        :class:`~specprefill_rag.results.StepLogprobs` is in ``report.logprobs`` before the token is yielded.
        """
        ...

    def agenerate(
        self, prompt: SparsePrompt, params: GenerationParams, report: PrefillReport | None = None
    ) -> AsyncGenerator[int, None]:
        """:meth:`generate` for an event loop: the same tokens, without blocking the loop. Closing the
        generator early (``aclose``) releases the request. In-process backends run :meth:`generate`
        in a worker thread (:func:`specprefill_rag.backends.threads.iterate_in_thread`).
        """
        ...
