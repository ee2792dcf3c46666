"""LongLLMLingua baseline through the real ``llmlingua`` package, with our small model as compressor.

Two compatibility shims, both local to the benchmarks and both removable:

* ``llmlingua`` 0.2.2 builds ``tiktoken.encoding_for_model("gpt-3.5-turbo")`` at construction (it
  counts the rate in GPT tokens). Offline, ``TIKTOKEN_CACHE_DIR`` points at the copy of that encoding
  which ``llama-index-core`` ships, set only for the construction.
* ``llmlingua`` was written for transformers 4.x, whose models took and returned the key/value cache
  as nested lists ``[[key, value] per layer]``; it slices and concatenates those lists itself.
  transformers 5 uses ``Cache`` objects only, so :class:`LegacyCacheModel` translates at the
  boundary. The model computes the same thing; only the container changes.

LongLLMLingua settings are the ones its README recommends for RAG: question-aware coarse ranking
(``rank_method="longllmlingua"``), documents reordered by relevance, dynamic compression ratio 0.3,
contrastive perplexity (``condition_compare``), ``context_budget="+100"``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


class LegacyCacheModel(torch.nn.Module):
    """A causal LM that accepts and returns the KV cache as ``[[key, value], ...]`` lists.

    key/value tensors: ``[batch, kv_heads, cached_tokens, head_dim]``.
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: list | None = None,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> Any:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for layer, (key, value) in enumerate(past_key_values or []):
            cache.update(key, value, layer)
        output = self.model(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True, **kwargs
        )
        output.past_key_values = [[layer.keys, layer.values] for layer in output.past_key_values.layers]
        return output


@contextlib.contextmanager
def offline_tiktoken() -> Iterator[None]:
    """Point tiktoken at llama-index-core's bundled encodings while the block runs."""
    from importlib.util import find_spec

    spec = find_spec("llama_index.core")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("LongLLMLingua needs tiktoken's cl100k_base offline: install llama-index-core")
    cache = Path(next(iter(spec.submodule_search_locations))) / "_static" / "tiktoken_cache"
    previous = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = previous


class LongLLMLingua:
    """``compress(documents, question, rate) -> compressed context text`` with ``llmlingua``."""

    def __init__(self, model_folder: str | Path, dtype: torch.dtype = torch.float32) -> None:
        try:
            from llmlingua import PromptCompressor
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise RuntimeError("LongLLMLingua needs the bench extra: pip install -e '.[bench]'") from error
        with offline_tiktoken():
            # the same dtype as our draft, so both compressors cost the same per token
            self.compressor = PromptCompressor(
                model_name=str(model_folder), device_map="cpu", model_config={"torch_dtype": dtype}
            )
        self.compressor.model = LegacyCacheModel(self.compressor.model)

    def compress(self, documents: list[str], question: str, rate: float) -> str:
        """The documents compressed to about ``rate`` of their tokens (question and instructions excluded)."""
        result = self.compressor.compress_prompt(
            documents,
            instruction="",
            question=question,
            rate=rate,
            concate_question=False,
            condition_in_question="after_condition",
            reorder_context="sort",
            dynamic_context_compression_ratio=0.3,
            condition_compare=True,
            context_budget="+100",
            rank_method="longllmlingua",
        )
        return result["compressed_prompt"]
