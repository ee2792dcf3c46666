"""Admission-time checks of SpecPrefill arguments (entry point ``vllm.logits_processors``).

vLLM runs ``validate_params`` of installed logits-processor plugins when a request arrives; a
``ValueError`` there becomes an HTTP 400 for that request only, so a malformed request never reaches
the model runner and the engine keeps serving the others. The processor itself changes no logits.
A request carrying ``specprefill_probe`` is always refused with a marker message: that is how a
client detects that a server has the plugin. The message also names
:data:`~specprefill_rag.positions.POSITION_KEYED_BLOCKS` when this process keys prefix-cache blocks by
position (:mod:`.block_keys`); a client then sends no whole-request ``cache_salt``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from ..errors import InvalidRequestError
from ..positions import POSITION_KEYED_BLOCKS, PROBE_KEY, PROBE_MARKER, PROMPT_LENGTH_KEY, RUNS_KEY, check_runs
from .block_keys import position_keyed_blocks_installed


def probe_answer() -> str:
    """The refusal a probe gets: the plugin's marker, and its capabilities."""
    capabilities = f"; capabilities: {POSITION_KEYED_BLOCKS}" if position_keyed_blocks_installed() else ""
    return f"{PROBE_MARKER}: probe request refused on purpose{capabilities}"


def check_arguments(extra_args: dict[str, Any] | None) -> None:
    """Raise ``ValueError`` naming the problem for malformed SpecPrefill arguments."""
    args = extra_args or {}
    if not isinstance(args, Mapping):
        raise ValueError(f"extra_args must be a mapping of names to values, got {type(args).__name__}")
    if PROBE_KEY in args:
        raise ValueError(probe_answer())
    if RUNS_KEY not in args and PROMPT_LENGTH_KEY not in args:
        return
    if RUNS_KEY not in args or PROMPT_LENGTH_KEY not in args:
        raise ValueError(f"SpecPrefill requests need both {PROMPT_LENGTH_KEY} and {RUNS_KEY}")
    length = args[PROMPT_LENGTH_KEY]
    if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
        raise ValueError(f"{PROMPT_LENGTH_KEY} must be a positive integer, got {length!r}")
    try:
        runs = check_runs(args[RUNS_KEY])  # no expansion: a request's claimed lengths are not allocated here
    except InvalidRequestError as error:
        raise ValueError(str(error)) from None
    if runs.numel() == 0 or int(runs[-1].sum()) != length:
        raise ValueError(f"kept positions must end at the last prompt position {length - 1} (and not exceed it)")


class SpecPrefillArgumentsValidator(LogitsProcessor):
    """Validates SpecPrefill ``extra_args`` at admission; leaves logits unchanged."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        check_arguments(getattr(sampling_params, "extra_args", None))

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: Any) -> None:
        pass
