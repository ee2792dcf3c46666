"""Thin subclasses of vLLM's model classes: identical computation, plus a check at engine start
that the running model runner is one the plugin remaps positions for."""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from .runner_v1 import position_remap_installed


def check_supported(vllm_config: Any) -> None:
    """Fail loudly at engine start, never compute silently with compact positions."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise RuntimeError(
            "specprefill-rag's vLLM plugin does not support Model Runner V2 yet; "
            "start vLLM with VLLM_USE_V2_MODEL_RUNNER=0"
        )
    if not position_remap_installed():
        raise RuntimeError("specprefill-rag's position remap is not installed in this process; load the plugin")
    text_config = vllm_config.model_config.hf_text_config
    if getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True):
        raise RuntimeError(
            "sliding-window attention measures distance in compact KV slots, not original positions; "
            "SpecPrefill supports full-attention models only"
        )


def _guarded(base: type) -> type:
    """``base`` with :func:`check_supported` run before its constructor."""

    def __init__(self: Any, *, vllm_config: Any, prefix: str = "") -> None:
        check_supported(vllm_config)
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)

    return type(f"SpecPrefill{base.__name__}", (base,), {"__init__": __init__, "__module__": __name__})


SpecPrefillLlamaForCausalLM = _guarded(LlamaForCausalLM)
SpecPrefillQwen2ForCausalLM = _guarded(Qwen2ForCausalLM)
SpecPrefillQwen3ForCausalLM = _guarded(Qwen3ForCausalLM)
SpecPrefillMistralForCausalLM = _guarded(MistralForCausalLM)
