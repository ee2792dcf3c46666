"""Thin subclasses of vLLM's model classes: identical computation, plus what the plugin needs at start.

That is a check at engine start that the running model runner is one the plugin remaps positions for,
and the Model Runner V2 hook ``get_model_state_cls`` (vLLM's ``resolve_model_state_cls`` asks the
model for it first).
"""

from __future__ import annotations

from typing import Any, cast

from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from .runner_v1 import position_remap_installed


def check_supported(vllm_config: Any) -> None:
    """Fail loudly at engine start, never compute silently with compact positions.

    Model Runner V2 maps positions through :func:`get_model_state_cls`; Model Runner V1 needs the
    remap that the plugin's ``register()`` installs.
    """
    if not getattr(vllm_config, "use_v2_model_runner", False) and not position_remap_installed():
        raise RuntimeError("specprefill-rag's position remap is not installed in this process; load the plugin")
    text_config = vllm_config.model_config.hf_text_config
    if getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True):
        raise RuntimeError(
            "sliding-window attention measures distance in compact KV slots, not original positions; "
            "SpecPrefill supports full-attention models only"
        )


def get_model_state_cls() -> type:
    """Model Runner V2's per-model state: the SpecPrefill position map (imported only under MRV2)."""
    from .model_state import SpecPrefillModelState

    return SpecPrefillModelState


def _guarded(base: type) -> type:
    """``base`` with :func:`check_supported` run before its constructor and the MRV2 model state."""

    def __init__(self: Any, *, vllm_config: Any, prefix: str = "") -> None:
        check_supported(vllm_config)
        cast(Any, base).__init__(self, vllm_config=vllm_config, prefix=prefix)

    namespace = {"__init__": __init__, "get_model_state_cls": staticmethod(get_model_state_cls), "__module__": __name__}
    return type(f"SpecPrefill{base.__name__}", (base,), namespace)


SpecPrefillLlamaForCausalLM = _guarded(LlamaForCausalLM)
SpecPrefillQwen2ForCausalLM = _guarded(Qwen2ForCausalLM)
SpecPrefillQwen3ForCausalLM = _guarded(Qwen3ForCausalLM)
SpecPrefillMistralForCausalLM = _guarded(MistralForCausalLM)
