"""Model Runner V1: rewrite each SpecPrefill request's RoPE positions after vLLM prepared its inputs.

vLLM computes positions as compact indices (computed tokens + offset) and derives the KV slot
mapping from them inside ``GPUModelRunner._prepare_inputs``. The wrapper below runs after it and
rewrites only the position buffer the model reads, so slots stay compact. The wrapper is installed by
the plugin's ``register()`` (one entry point) and removed by :func:`remove_position_remap`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..positions import PROMPT_LENGTH_KEY, RUNS_KEY, decode_runs, original_positions
from .patching import is_wrapped, restore_method, wrap_method

logger = logging.getLogger(__name__)
_ORIGINAL = "_specprefill_original_prepare_inputs"


@dataclass(frozen=True)
class RequestPositions:
    """Decoded SpecPrefill arguments of one request."""

    kept: torch.Tensor  # [K] original positions of the prompt tokens
    prompt_length: int  # L


def request_positions(request_state: Any) -> RequestPositions | None:
    """The request's SpecPrefill positions (decoded once, cached on the request state), or None."""
    if hasattr(request_state, "_specprefill_positions"):
        return request_state._specprefill_positions
    params = getattr(request_state, "sampling_params", None)
    args = (params.extra_args or {}) if params is not None else {}
    spec = None
    if RUNS_KEY in args and PROMPT_LENGTH_KEY in args:
        spec = RequestPositions(decode_runs(list(args[RUNS_KEY])), int(args[PROMPT_LENGTH_KEY]))
    request_state._specprefill_positions = spec
    return spec


def remap_positions(runner: Any) -> None:
    """Rewrite ``runner.positions`` for the SpecPrefill requests of the batch just prepared."""
    batch = runner.input_batch
    starts = runner.query_start_loc.np
    limit = runner.model_config.max_model_len - 1
    for index, request_id in enumerate(batch.req_ids[: batch.num_reqs]):
        spec = request_positions(runner.requests[request_id])
        if spec is None:
            continue
        low, high = int(starts[index]), int(starts[index + 1])
        compact = runner.positions[low:high]
        mapped = original_positions(compact, spec.kept.to(compact.device), spec.prompt_length)
        if int(mapped.max()) > limit:  # only reachable by clients that skip the length check
            logger.warning("request %s: positions beyond max_model_len %d clamped", request_id, limit + 1)
        runner.positions[low:high] = mapped.clamp(max=limit)


def install_position_remap() -> None:
    """Wrap ``GPUModelRunner._prepare_inputs`` (also inherited by the CPU runner); idempotent."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make_wrapper(original: Any) -> Any:
        def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
            prepared = original(self, scheduler_output, num_scheduled_tokens)
            remap_positions(self)
            return prepared

        return _prepare_inputs

    wrap_method(GPUModelRunner, "_prepare_inputs", _ORIGINAL, make_wrapper)


def remove_position_remap() -> None:
    """Restore vLLM's own ``_prepare_inputs``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    restore_method(GPUModelRunner, "_prepare_inputs", _ORIGINAL)


def position_remap_installed() -> bool:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return is_wrapped(GPUModelRunner, _ORIGINAL)
