"""Draft scoring: run a draft over the prompt and turn its attention into token importance.

The draft prefill runs through transformers' SDPA kernel. Inside :func:`capture_attention`, the
model's attention dispatch points at a wrapper that calls SDPA unchanged and, for the last query
row of each call (the last prompt token at prefill, the new token at each look-ahead step), folds
its post-RoPE attention onto the prompt keys into an :class:`ImportanceAccumulator`. The wrapper
is registered under a private name and removed, with the models' previous settings restored, in
``finally``.

With a :class:`~specprefill_rag.draft_cache.DraftPrefixCache`, a prompt that starts like one scored
before starts from that prefix's cached keys and values: the draft prefills only the remainder, whose
queries still attend over every prompt key (:func:`attention_after_cached_keys`), so the scores are
those of a cold run.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .draft_cache import DraftIdentity, DraftPrefixCache, PrefixReuse
from .errors import DraftScoringError
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


@contextmanager
def capture_attention(
    model: nn.Module, accumulator: ImportanceAccumulator, pool_kernel: int, query_window: int = 1
) -> Iterator[str]:
    """Score every attention call of ``model`` (batch 1) into ``accumulator``, for the ``with`` body only.

    ``query_window`` = 1: the last query row of each call (the paper). ``W > 1``: the last ``W``
    prompt tokens of the prefill call, one accumulator step each.
    Yields the private attention-implementation name in use (tests check it is gone afterwards).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    prompt_length = accumulator.prompt_length

    def scoring_sdpa(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if attention_mask is None and 1 < query.shape[2] < key.shape[2]:
            output = attention_after_cached_keys(module, query, key, value, scaling, **kwargs)
        else:
            output = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if query_window == 1:
            accumulator.add(query_importance(query[0, :, -1], key[0, :, :prompt_length], scale, pool_kernel))
        else:
            window = query[0, :, -query_window:]  # [H, W, d], the prompt's last W tokens
            accumulator.add_window(query_importance(window, key[0, :, :prompt_length], scale, pool_kernel))
        return output

    with attention_dispatch(model, scoring_sdpa) as name:
        yield name


class _StopForward(Exception):
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
    """Make a forward pass of ``model`` raise :class:`_StopForward` before layer ``n_layers`` runs."""
    layers = decoder_layers(model)
    if n_layers >= len(layers):
        yield
        return

    def stop(_module: nn.Module, _args: Any) -> None:
        raise _StopForward

    handle = layers[n_layers].register_forward_pre_hook(stop)
    try:
        yield
    finally:
        handle.remove()


def _step_inputs(token_ids: torch.Tensor, first_position: int) -> dict[str, torch.Tensor]:
    positions = torch.arange(first_position, first_position + token_ids.numel(), device=token_ids.device)
    return {"input_ids": token_ids.view(1, -1), "position_ids": positions.view(1, -1), "cache_position": positions}


@dataclass(frozen=True)
class DraftScore:
    """What a draft computed for one prompt.

    Attributes:
        importance: ``[L]`` float32 importance of each prompt token.
        cached_tokens: leading prompt tokens whose draft KV came from the prefix cache (0 on a miss).
    """

    importance: torch.Tensor
    cached_tokens: int = 0


@dataclass
class ModelDraft:
    """A separate small draft model sharing the main model's tokenizer (the paper's setting).

    Queries are the last prompt token plus ``look_ahead - 1`` greedily decoded draft tokens; decoding
    stops early at an end-of-sequence token. With a ``prefix_cache``, a prompt that starts like one
    scored before prefills only its remainder (at least the last token, whose query is scored).
    """

    model: Any  # a transformers PreTrainedModel (nn.Module's attribute types hide its config)
    look_ahead: int = 8
    pool_kernel: int = 13
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    prefix_cache: DraftPrefixCache | None = None

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[L]`` long prompt ids -> ``[L]`` float32 importance."""
        return self.score_prompt(input_ids).importance

    @torch.inference_mode()
    def score_prompt(self, input_ids: torch.Tensor) -> DraftScore:
        """``[L]`` long prompt ids -> importance and how many prompt tokens the prefix cache supplied."""
        prompt_length = input_ids.numel()
        accumulator = ImportanceAccumulator(prompt_length, self.look_ahead, input_ids.device)
        layers = self.model.config.num_hidden_layers
        reuse = PrefixReuse.begin(
            self.prefix_cache, self.model, layers, input_ids, prompt_length - 1, needs_past=self.look_ahead > 1
        )
        cache, start = reuse.past, reuse.cached_tokens
        with capture_attention(self.model, accumulator, self.pool_kernel):
            inputs = _step_inputs(input_ids[start:], start)
            output = self.model(**inputs, past_key_values=cache, use_cache=cache is not None, logits_to_keep=1)
            for step in range(1, self.look_ahead):
                token = output.logits[0, -1].argmax()
                if int(token) in self.eos_token_ids:
                    break
                accumulator.step = step
                inputs = _step_inputs(token.view(1), prompt_length + step - 1)
                output = self.model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
        importance = accumulator.result()
        reuse.remember(input_ids)
        return DraftScore(importance, start)

    def score_batch(self, prompts: list[torch.Tensor]) -> list[DraftScore | DraftScoringError]:
        """Several ``[L_i]`` prompts in one batched forward (:mod:`specprefill_rag.batch_draft`); per prompt
        its ``[L_i]`` importance, equal to :meth:`score`'s within float tolerance, or its own error.

        Prompts the prefix cache can serve are scored alone (only their remainder is computed, which is
        cheaper than a padded row); the rest share one forward.
        """
        alone = [len(prompts) == 1 or self._has_cached_prefix(p) for p in prompts]
        batched = [p for p, single in zip(prompts, alone) if not single]
        from .batch_draft import score_model_batch

        together = iter(
            score_model_batch(self, batched)
            if len(batched) > 1
            else [_score_or_error(self.score_prompt, p) for p in batched]
        )
        return [
            _score_or_error(self.score_prompt, p) if single else next(together) for p, single in zip(prompts, alone)
        ]

    def _has_cached_prefix(self, input_ids: torch.Tensor) -> bool:
        if self.prefix_cache is None:
            return False
        draft = DraftIdentity.of(self.model, self.model.config.num_hidden_layers)
        return self.prefix_cache.lookup(draft, input_ids, input_ids.numel() - 1) is not None


@dataclass
class LayerPrefixDraft:
    """``self:<n>``: the first ``n_layers`` of the main model itself, weights shared.

    For users without a smaller sibling model. The forward pass stops after layer ``n_layers``, so no
    look-ahead token can be decoded; the queries are instead the last ``query_window`` prompt tokens
    (the question and the template around it), each seeing the prompt up to itself. With a
    ``prefix_cache``, at most ``L - query_window`` leading tokens are reused, so every query is computed.
    """

    model: Any  # a transformers PreTrainedModel (nn.Module's attribute types hide its config)
    n_layers: int
    pool_kernel: int = 13
    query_window: int = 1
    prefix_cache: DraftPrefixCache | None = None

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[L]`` long prompt ids -> ``[L]`` float32 importance."""
        return self.score_prompt(input_ids).importance

    @torch.inference_mode()
    def score_prompt(self, input_ids: torch.Tensor) -> DraftScore:
        """``[L]`` long prompt ids -> importance and how many prompt tokens the prefix cache supplied."""
        window = min(self.query_window, input_ids.numel())
        accumulator = ImportanceAccumulator(input_ids.numel(), window, input_ids.device)
        reuse = PrefixReuse.begin(
            self.prefix_cache, self.model, self.n_layers, input_ids, input_ids.numel() - window, needs_past=False
        )
        cache, start = reuse.past, reuse.cached_tokens
        capture = capture_attention(self.model, accumulator, self.pool_kernel, window)
        with capture, stop_after_layers(self.model, self.n_layers):
            try:
                inputs = _step_inputs(input_ids[start:], start)
                self.model(**inputs, past_key_values=cache, use_cache=cache is not None, logits_to_keep=1)
            except _StopForward:
                pass
        importance = accumulator.result()
        reuse.remember(input_ids)
        return DraftScore(importance, start)

    def score_batch(self, prompts: list[torch.Tensor]) -> list[DraftScore | DraftScoringError]:
        """One prompt after another (a layer-prefix draft is not batched); each its score or its error."""
        return [_score_or_error(self.score_prompt, prompt) for prompt in prompts]


def _score_or_error(score: Any, input_ids: torch.Tensor) -> DraftScore | DraftScoringError:
    try:
        return score(input_ids)
    except DraftScoringError as error:
        return error
