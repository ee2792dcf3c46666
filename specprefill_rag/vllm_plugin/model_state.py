"""Model Runner V2: original RoPE positions through the model's own ``ModelState``.

MRV2 computes compact positions (computed tokens + offset), derives the KV slot mapping and the
attention metadata from them, and only then asks ``model_state.prepare_inputs`` for tensors that
override the model's inputs. :class:`SpecPrefillModelState` answers with a position buffer of its
own, so slots stay compact and the runner's buffer, which slot mappings and speculators read, is
never written. The buffer is allocated once: CUDA graphs captured on it (``prepare_dummy_inputs``)
stay valid.

Per request slot the state holds ``K`` (kept prompt tokens), ``L - K`` and an offset into one flat
pool of kept positions; an ordinary request has ``K = 0`` and shift 0, which maps every position to
itself. The map is evaluated per token on the device with no host synchronisation, so chunked
prefill, prefix-cache hits and resumed requests (all of which start at ``num_computed_tokens > 0``)
and decode need no special case.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from ..positions import PROMPT_LENGTH_KEY, RUNS_KEY, decode_runs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotPositions:
    """Decoded SpecPrefill arguments of the request in one slot."""

    req_id: str
    kept: torch.Tensor  # [K] int32 original positions of the prompt tokens, on the state's device
    prompt_length: int  # L


def requested_positions(new_req_data: Any, device: torch.device) -> SlotPositions | None:
    """The request's SpecPrefill positions from ``sampling_params.extra_args``, or None."""
    params = new_req_data.sampling_params
    args = (params.extra_args or {}) if params is not None else {}
    if RUNS_KEY not in args or PROMPT_LENGTH_KEY not in args:
        return None
    kept = decode_runs(list(args[RUNS_KEY])).to(torch.int32)
    if device.type == "cuda":
        kept = kept.pin_memory()
    return SlotPositions(new_req_data.req_id, kept.to(device, non_blocking=True), int(args[PROMPT_LENGTH_KEY]))


def warn_if_inconsistent(slot: SlotPositions, new_req_data: Any, max_model_len: int) -> None:
    """Log a prompt length unlike ``K`` and requests whose positions will be clamped at ``max_model_len - 1``."""
    n_kept = slot.kept.numel()
    if new_req_data.prompt_len != n_kept:
        logger.warning(
            "request %s: %d prompt tokens but %d kept positions", slot.req_id, new_req_data.prompt_len, n_kept
        )
    max_tokens = new_req_data.sampling_params.max_tokens
    if max_tokens is not None and slot.prompt_length + max_tokens > max_model_len:
        logger.warning(
            "request %s: original length %d + max_tokens %d exceeds max_model_len %d; positions clamped",
            slot.req_id,
            slot.prompt_length,
            max_tokens,
            max_model_len,
        )


def map_positions(
    compact: torch.Tensor,
    token_slots: torch.Tensor,
    pool: torch.Tensor,
    offsets: torch.Tensor,
    counts: torch.Tensor,
    shifts: torch.Tensor,
) -> torch.Tensor:
    """Original positions of a batch of tokens.

    Args:
        compact: ``[n]`` int64 compact positions (vLLM's).
        token_slots: ``[n]`` int64 request slot of each token.
        pool: ``[P + 1]`` int32 kept positions of all SpecPrefill slots, one trailing pad entry.
        offsets, counts, shifts: ``[max_num_reqs]`` int64 per slot: start in ``pool``, ``K`` and ``L - K``
            (all 0 for ordinary requests).

    Returns:
        ``[n]`` int64: ``pool[offset + p]`` where ``p < K``, else ``p + (L - K)``.
    """
    count = counts[token_slots]
    inside = compact < count
    index = offsets[token_slots] + torch.minimum(compact, (count - 1).clamp(min=0))
    return torch.where(inside, pool[index].long(), compact + shifts[token_slots])


def token_slots(input_batch: Any, num_tokens: int) -> torch.Tensor:
    """``[num_tokens]`` int64 request slot of each token; -1 for tokens past the batch (padding)."""
    device = input_batch.positions.device
    ends = input_batch.query_start_loc[1 : input_batch.num_reqs + 1].contiguous()
    rows = torch.searchsorted(ends, torch.arange(num_tokens, dtype=ends.dtype, device=device), right=True)
    in_batch = rows < input_batch.num_reqs
    slots = input_batch.idx_mapping[rows.clamp(max=input_batch.num_reqs - 1)].long()
    return torch.where(in_batch, slots, torch.full_like(slots, -1))


class SpecPrefillModelState(DefaultModelState):
    """``DefaultModelState`` that feeds SpecPrefill requests their original RoPE positions."""

    def __init__(self, vllm_config: Any, model: Any, encoder_cache: Any, device: torch.device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        if self.rope_state is not None:
            raise RuntimeError("specprefill-rag maps 1-D RoPE positions; M-RoPE models are not supported")
        self.rope_positions = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=device)
        self.slots: dict[int, SlotPositions] = {}
        # one extra row: tokens past the batch use slot -1, which stays an identity entry
        self.offsets = torch.zeros(self.max_num_reqs + 1, dtype=torch.int64, device=device)
        self.counts = torch.zeros_like(self.offsets)
        self.shifts = torch.zeros_like(self.offsets)
        self.pool = torch.zeros(1, dtype=torch.int32, device=device)
        self.stale = False

    def add_request(self, req_index: int, new_req_data: Any) -> None:
        super().add_request(req_index, new_req_data)
        slot = requested_positions(new_req_data, self.device)
        if self.slots.pop(req_index, None) is not None:  # a slot is reused only after remove_request; be safe
            self.stale = True
        if slot is not None:
            warn_if_inconsistent(slot, new_req_data, self.max_model_len)
            self.slots[req_index] = slot
            self.stale = True

    def remove_request(self, req_id: str) -> None:
        super().remove_request(req_id)
        for index in [i for i, slot in self.slots.items() if slot.req_id == req_id]:
            del self.slots[index]
            self.stale = True

    def rebuild_tables(self) -> None:
        """Pack the kept positions of all SpecPrefill slots into ``pool`` and refresh the per-slot rows."""
        order = sorted(self.slots)
        kept = [self.slots[i].kept for i in order]
        self.pool = torch.cat([*kept, torch.zeros(1, dtype=torch.int32, device=self.device)])
        counts = torch.zeros(self.max_num_reqs + 1, dtype=torch.int64)
        shifts = torch.zeros_like(counts)
        for index in order:
            counts[index] = self.slots[index].kept.numel()
            shifts[index] = self.slots[index].prompt_length - counts[index]
        offsets = torch.cumsum(counts, 0) - counts
        for host, device in ((offsets, self.offsets), (counts, self.counts), (shifts, self.shifts)):
            device.copy_(host.pin_memory() if device.is_cuda else host, non_blocking=True)
        self.stale = False

    def prepare_inputs(self, input_batch: Any, req_states: Any) -> dict[str, Any]:
        """``{"positions": [num_tokens_after_padding] int64}`` view of the persistent buffer.

        Dummy batches (profiling, warm-up) use slots ``0..n-1``, which may belong to SpecPrefill
        requests; their positions then come out mapped, clamped, and unused.
        """
        model_inputs = super().prepare_inputs(input_batch, req_states)
        if self.stale:
            self.rebuild_tables()
        num_tokens = input_batch.num_tokens_after_padding
        compact = input_batch.positions[:num_tokens]
        if input_batch.num_reqs == 0 or not self.slots:
            self.rope_positions[:num_tokens].copy_(compact)
        else:
            mapped = map_positions(
                compact, token_slots(input_batch, num_tokens), self.pool, self.offsets, self.counts, self.shifts
            )
            torch.clamp(mapped, max=self.max_model_len - 1, out=self.rope_positions[:num_tokens])
        return {**model_inputs, "positions": self.rope_positions[:num_tokens]}

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, Any]:
        """The same buffer, so captured CUDA graphs read what ``prepare_inputs`` writes."""
        return {**super().prepare_dummy_inputs(num_reqs, num_tokens), "positions": self.rope_positions[:num_tokens]}
