"""Attention hooks of a draft forward: capture the attention of the last query rows, stop after n layers.

The draft prefill runs through transformers' SDPA kernel. Inside :func:`capture_attention`, the
model's attention dispatch points at a wrapper that calls SDPA unchanged and, for the last query
row of each call (the last prompt token at prefill, the new token at each look-ahead step), folds
its post-RoPE attention onto the prompt keys into an
:class:`~specprefill_rag.draft.importance.ImportanceAccumulator`. The wrapper is registered under a
private name and removed, with the models' previous settings restored, in ``finally``.
After prefix-cached keys, :func:`attention_after_cached_keys` masks the remaining queries explicitly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .importance import ImportanceAccumulator, query_importance

_capture_ids = itertools.count()


def _attention_configs(model: nn.Module) -> list[Any]:
    """Distinct config objects that attention modules of ``model`` read their implementation from."""
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            configs.setdefault(id(config), config)
    return list(configs.values())


QUERY_BLOCK = 256  # queries per SDPA call after prefix-cached keys


def attention_after_cached_keys(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """Causal SDPA for queries that are the last ``q`` of ``k`` tokens (a prefill after prefix-cached keys).

    transformers builds no mask for an attention implementation registered only locally (as
    :func:`capture_attention` registers it), and SDPA's ``is_causal`` aligns queries top-left; so this
    masks explicitly, one block of :data:`QUERY_BLOCK` queries at a time: block ``[s, e)`` sees keys
    ``0 .. k - q + e`` through an ``[e - s, k - q + e]`` mask. Masks stay small (never ``[q, k]``) and the
    fully masked upper-right blocks are never computed.

    Args:
        query: ``[1, H, q, d]``; key, value: ``[1, H_kv, k, d]`` with ``k > q``.

    Returns:
        ``([1, q, H, d], None)``, as transformers' ``sdpa_attention_forward``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    n_queries, n_keys = query.shape[2], key.shape[2]
    cached = n_keys - n_queries
    outputs = []
    for start in range(0, n_queries, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, n_queries)
        mask = torch.ones(end - start, cached + end, dtype=torch.bool, device=query.device).tril(cached + start)
        keys, values = key[:, :, : cached + end], value[:, :, : cached + end]
        output, _ = sdpa_attention_forward(
            module, query[:, :, start:end], keys, values, mask[None, None], scaling=scaling, **kwargs
        )
        outputs.append(output)
    return torch.cat(outputs, dim=1), None


@contextmanager
def attention_dispatch(model: nn.Module, attention: Any) -> Iterator[str]:
    """Route every attention call of ``model`` through ``attention`` (the signature of transformers'
    SDPA function), for the ``with`` body only; the models' previous settings come back in ``finally``.
    Yields the private attention-implementation name in use (tests check it is gone afterwards).
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"specprefill_capture_{next(_capture_ids)}"
    configs = _attention_configs(model)
    previous = [config._attn_implementation for config in configs]
    ALL_ATTENTION_FUNCTIONS[name] = attention
    ALL_MASK_ATTENTION_FUNCTIONS[name] = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    try:
        for config in configs:
            config._attn_implementation = name
        yield name
    finally:
        for config, implementation in zip(configs, previous):
            config._attn_implementation = implementation
        del ALL_ATTENTION_FUNCTIONS[name]
        del ALL_MASK_ATTENTION_FUNCTIONS[name]


QueryObserver = Callable[[torch.Tensor, torch.Tensor, float | None], None]
"""Sees one layer's post-RoPE queries ``[1, H, q, d]`` and keys ``[1, H_kv, k, d]`` (position order) with the
softmax scale (None: ``d ** -0.5``)."""


def query_observer(accumulator: ImportanceAccumulator, pool_kernel: int, query_window: int = 1) -> QueryObserver:
    """Fold each layer's scored queries into ``accumulator``: the last query row (``query_window`` = 1: the last
    prompt token at prefill, the new token at each look-ahead step), or the last ``W`` rows, the prompt's last
    ``W`` tokens, one accumulator step each; always over the first ``accumulator.prompt_length`` keys.
    """
    prompt_length = accumulator.prompt_length

    def observe(query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        keys = key[0, :, :prompt_length]
        if query_window == 1:
            accumulator.add(query_importance(query[0, :, -1], keys, scale, pool_kernel))
        else:  # [H, W, d], row w seeing keys up to position L - W + w
            accumulator.add_window(query_importance(query[0, :, -query_window:], keys, scale, pool_kernel))

    return observe


def observed_attention(observe: QueryObserver) -> Any:
    """transformers' SDPA attention (explicitly masked after prefix-cached keys: :func:`attention_after_cached_keys`)
    that shows ``observe`` each layer's queries and keys; for :func:`attention_dispatch`.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if attention_mask is None and 1 < query.shape[2] < key.shape[2]:
            output = attention_after_cached_keys(module, query, key, value, scaling, **kwargs)
        else:
            output = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        observe(query, key, scaling)
        return output

    return attention


@contextmanager
def capture_attention(
    model: nn.Module, accumulator: ImportanceAccumulator, pool_kernel: int, query_window: int = 1
) -> Iterator[str]:
    """Score every attention call of ``model`` (batch 1) into ``accumulator`` (:func:`query_observer`), for the
    ``with`` body only. Yields the private attention-implementation name in use (tests check it is gone afterwards).
    """
    observe = query_observer(accumulator, pool_kernel, query_window)
    with attention_dispatch(model, observed_attention(observe)) as name:
        yield name


class StopForward(Exception):
    """Raised by a pre-hook to end a forward pass after the layers a layer-prefix draft needs."""


def decoder_layers(model: Any) -> nn.ModuleList:
    """The stack of decoder layers of a causal LM (the ModuleList as long as ``num_hidden_layers``)."""
    n_layers = model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n_layers:
            return module
    raise TypeError(f"cannot find the {n_layers} decoder layers of {type(model).__name__}")


@contextmanager
def stop_after_layers(model: nn.Module, n_layers: int) -> Iterator[None]:
    """Make a forward pass of ``model`` raise :class:`StopForward` before layer ``n_layers`` runs."""
    layers = decoder_layers(model)
    if n_layers >= len(layers):
        yield
        return

    def stop(_module: nn.Module, _args: Any) -> None:
        raise StopForward

    handle = layers[n_layers].register_forward_pre_hook(stop)
    try:
        yield
    finally:
        handle.remove()
