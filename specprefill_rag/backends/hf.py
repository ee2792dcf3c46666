"""Main model on Hugging Face transformers, in-process, CPU or GPU.

Prefill passes ``position_ids`` explicitly and a fresh cache, so transformers neither re-derives
positions nor mistakes non-contiguous positions for packed sequences. The KV cache holds only the
``K`` kept tokens; decode step ``t`` writes cache slot ``K + t`` at RoPE position ``L + t``.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator, Generator, Iterable
from contextlib import nullcontext
from typing import Any

import torch

from ..aio import iterate_in_thread
from ..config import GenerationParams
from ..decode.sampling import next_token
from .base import SparsePrompt


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids from the generation config (the chat template's end token) and the tokenizer."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids: Iterable[Any] = configured if isinstance(configured, (list, tuple)) else [configured]
    return frozenset(int(i) for i in [*ids, tokenizer.eos_token_id] if i is not None)


class HFBackend:
    """A transformers causal LM as a :class:`~specprefill_rag.backends.base.MainBackend`.

    Args:
        model: a causal LM loaded with SDPA or eager attention.
        eos_ids: token ids that end generation.
        lock: serialises forward passes when several requests share the model.
    """

    supports_sparse_prefill = True

    def __init__(self, model: Any, eos_ids: frozenset[int], lock: threading.RLock | None = None) -> None:
        self.model = model
        self.eos_ids = eos_ids
        self._lock = lock or nullcontext()

    @property
    def context_length(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def _forward(self, token_ids: torch.Tensor, positions: torch.Tensor, first_slot: int, cache: Any) -> torch.Tensor:
        """Run ``[n]`` tokens at RoPE ``positions`` into cache slots ``first_slot..``; ``[V]`` next-token logits."""
        slots = torch.arange(first_slot, first_slot + token_ids.numel(), device=self.device)
        with self._lock:
            output = self.model(
                input_ids=token_ids.view(1, -1).to(self.device),
                position_ids=positions.view(1, -1).to(self.device),
                cache_position=slots,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        return output.logits[0, -1]

    def generate(self, prompt: SparsePrompt, params: GenerationParams) -> Generator[int, None, None]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        kept = prompt.token_ids.numel()
        logits = self._forward(prompt.token_ids, prompt.position_ids, 0, cache)
        for step in range(params.max_new_tokens):
            token = next_token(logits, params.temperature, params.top_p, generator)
            if token in self.eos_ids:
                return
            yield token
            if step + 1 < params.max_new_tokens:
                position = torch.tensor([prompt.prompt_length + step])
                logits = self._forward(torch.tensor([token]), position, kept + step, cache)

    def agenerate(self, prompt: SparsePrompt, params: GenerationParams) -> AsyncGenerator[int, None]:
        """:meth:`generate` in a worker thread, its tokens yielded on the event loop."""
        return iterate_in_thread(lambda: self.generate(prompt, params))
