"""Batched draft scoring: several prompts in one forward pass of a draft model.

The gateway scores the prompts of requests that wait together in one batch. Rows are left padded to
the longest prompt, so every row's last prompt token sits in the last column; each row gets explicit
``position_ids`` ``0 .. L_b - 1`` (pads: 0) and a 4D attention mask that hides its pads, so its real
tokens see exactly what they would see alone. (The mask is built here: transformers builds none for
the private attention name the scoring runs under.) The look-ahead steps run in lockstep (one new column
per step, at position ``L_b + step - 1`` of each row); a row that reaches end-of-sequence stops
contributing queries, as :meth:`ModelDraft.score` stops, while the others go on. A draft that scores with a
window (:class:`~specprefill_rag.draft.model.LayerPrefixDraft`) decodes nothing: its queries are each row's last
``min(W, L_b)`` columns, all in the one prefill, which stops after its layers. Each row's importance therefore
equals its single-request importance within float tolerance (tested).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import DraftScoringError
from .hooks import StopForward, attention_dispatch, stop_after_layers
from .importance import DraftScore, ImportanceAccumulator, query_importance


class BatchedDraft(Protocol):
    """What a batch needs of a draft with a look-ahead (a :class:`~specprefill_rag.draft.model.ModelDraft`)."""

    model: Any
    look_ahead: int
    pool_kernel: int
    eos_token_ids: frozenset[int]


class BatchedWindowDraft(Protocol):
    """What a batch needs of a draft scoring with a window (:class:`~specprefill_rag.draft.model.LayerPrefixDraft`)."""

    model: Any
    n_layers: int
    pool_kernel: int
    query_window: int


@dataclass
class _Batch:
    """Left-padded rows and their per-row bookkeeping.

    Attributes:
        input_ids: ``[B, W]`` long, prompts right-aligned (``W`` = longest prompt).
        attention_mask: ``[B, W + steps]`` long key mask, 0 on pads; grows by one column per look-ahead step.
        lengths: ``[B]`` long prompt lengths ``L_b``.
        accumulators: one per row, over that row's ``L_b`` prompt keys, with a step per query (look-ahead step
            or window row).
        active: ``[B]`` bool, rows whose look-ahead has not reached end-of-sequence.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: torch.Tensor
    accumulators: list[ImportanceAccumulator]
    active: torch.Tensor

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])


def _left_padded(prompts: Sequence[torch.Tensor], steps: Sequence[int], device: torch.device) -> _Batch:
    """``steps``: per row, its queries (the look-ahead, or its window)."""
    lengths = torch.tensor([int(p.numel()) for p in prompts], device=device)
    width = int(lengths.max())
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - prompt.numel() :] = prompt.to(device)
        attention_mask[row, width - prompt.numel() :] = 1
    accumulators = [ImportanceAccumulator(int(n), count, device) for n, count in zip(lengths.tolist(), steps)]
    active = torch.ones(len(prompts), dtype=torch.bool)
    return _Batch(input_ids, attention_mask, lengths, accumulators, active)


@contextmanager
def _capture_rows(model: Any, batch: _Batch, pool_kernel: int, window: int = 0) -> Iterator[str]:
    """Score every attention call into each active row's accumulator; row ``b``'s prompt keys are columns
    ``W - L_b .. W - 1`` (look-ahead keys come after ``W``). ``window`` 0: the last query column, into the row's
    current step (the look-ahead); else the row's last ``min(window, L_b)`` prompt columns, each seeing the prompt
    up to itself, into its steps ``0 ..``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    width, lengths = batch.width, batch.lengths.tolist()

    def scoring_sdpa(module, query, key, value, attention_mask, scaling=None, **kwargs):
        output = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        for row in torch.nonzero(batch.active).flatten().tolist():
            keys = key[row, :, width - lengths[row] : width]
            if window:
                queries = query[row, :, width - min(window, lengths[row]) : width]  # [H, w_b, d]
                batch.accumulators[row].add_window(query_importance(queries, keys, scale, pool_kernel))
            else:
                batch.accumulators[row].add(query_importance(query[row, :, -1], keys, scale, pool_kernel))
        return output

    with attention_dispatch(model, scoring_sdpa) as name:
        yield name


def _mask_4d(key_mask: torch.Tensor, query_columns: torch.Tensor) -> torch.Tensor:
    """``[B, 1, q, kv]`` bool: a query column sees the real (unpadded) key columns up to itself. A pad
    query also sees itself, so no row is fully masked (its output is never read).
    """
    key_columns = torch.arange(key_mask.shape[1], device=key_mask.device)
    causal = key_columns[None, :] <= query_columns[:, None]  # [q, kv]
    visible = causal[None] & key_mask.bool()[:, None, :]
    itself = key_columns[None, :] == query_columns[:, None]
    return (visible | itself[None]).unsqueeze(1)


def _prefill_inputs(batch: _Batch) -> dict[str, torch.Tensor]:
    width = batch.width
    columns = torch.arange(width, device=batch.input_ids.device)
    positions = (columns[None, :] - (width - batch.lengths[:, None])).clamp(min=0)  # [B, W]; pads at 0
    return {
        "input_ids": batch.input_ids,
        "attention_mask": _mask_4d(batch.attention_mask, columns),
        "position_ids": positions,
        "cache_position": columns,
    }


def _step_inputs(batch: _Batch, tokens: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
    """Inputs of look-ahead step ``step`` >= 1: ``tokens`` ``[B]`` at positions ``L_b + step - 1``."""
    ones = torch.ones_like(batch.attention_mask[:, :1])
    batch.attention_mask = torch.cat([batch.attention_mask, ones], dim=1)
    column = torch.tensor([batch.width + step - 1], device=tokens.device)
    return {
        "input_ids": tokens.view(-1, 1),
        "attention_mask": _mask_4d(batch.attention_mask, column),
        "position_ids": (batch.lengths + step - 1).view(-1, 1),
        "cache_position": column,
    }


def _stop_rows_at_eos(batch: _Batch, tokens: torch.Tensor, eos_ids: frozenset[int]) -> None:
    for row, token in enumerate(tokens.tolist()):
        if token in eos_ids:
            batch.active[row] = False


@torch.inference_mode()
def score_model_batch(draft: BatchedDraft, prompts: Sequence[torch.Tensor]) -> list[DraftScore | DraftScoringError]:
    """``B`` prompts ``[L_b]`` -> per prompt its ``[L_b]`` float32 importance, or the
    :class:`DraftScoringError` of that prompt alone (e.g. non-finite scores); the others are unaffected.
    Batched rows neither read nor fill the prefix cache (their KV is padded).
    """
    from transformers import DynamicCache

    model = draft.model
    device = next(model.parameters()).device
    batch = _left_padded(prompts, [draft.look_ahead] * len(prompts), device)
    use_cache = draft.look_ahead > 1
    cache = DynamicCache(config=model.config) if use_cache else None
    with _capture_rows(model, batch, draft.pool_kernel):
        output = model(**_prefill_inputs(batch), past_key_values=cache, use_cache=use_cache, logits_to_keep=1)
        for step in range(1, draft.look_ahead):
            tokens = output.logits[:, -1].argmax(dim=-1)  # [B]
            _stop_rows_at_eos(batch, tokens, draft.eos_token_ids)
            if not bool(batch.active.any()):
                break
            for accumulator in batch.accumulators:
                accumulator.step = step
            output = model(**_step_inputs(batch, tokens, step), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return [_row_result(accumulator) for accumulator in batch.accumulators]


@torch.inference_mode()
def score_window_batch(
    draft: BatchedWindowDraft, prompts: Sequence[torch.Tensor]
) -> list[DraftScore | DraftScoringError]:
    """``B`` prompts ``[L_b]`` -> per prompt its ``[L_b]`` float32 importance from its last ``min(W, L_b)`` tokens
    as queries, or the :class:`DraftScoringError` of that prompt alone; one forward of the draft's first
    ``n_layers`` layers. Batched rows neither read nor fill a cache (their KV is padded).
    """
    model = draft.model
    device = next(model.parameters()).device
    batch = _left_padded(prompts, [min(draft.query_window, int(p.numel())) for p in prompts], device)
    with _capture_rows(model, batch, draft.pool_kernel, draft.query_window), stop_after_layers(model, draft.n_layers):
        try:
            model(**_prefill_inputs(batch), use_cache=False, logits_to_keep=1)
        except StopForward:
            pass
    return [_row_result(accumulator) for accumulator in batch.accumulators]


def _row_result(accumulator: ImportanceAccumulator) -> DraftScore | DraftScoringError:
    try:
        return DraftScore(accumulator.result())
    except DraftScoringError as error:
        return error
