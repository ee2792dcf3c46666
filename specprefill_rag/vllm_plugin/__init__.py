"""vLLM server plugin: original RoPE positions for SpecPrefill requests.

vLLM calls :func:`register` (entry point ``vllm.general_plugins``) in every process. It registers
thin subclasses of the supported architectures under their own names, so a request without
SpecPrefill arguments runs exactly as before. A request carrying ``extra_args``
``specprefill_prompt_length`` and ``specprefill_runs`` (the kept positions, run-length encoded; see
:mod:`specprefill_rag.positions`) gets RoPE position ``kept[p]`` for its compact prompt index ``p``
and ``p + (L - K)`` for generated tokens. KV cache, slot mapping and attention stay in compact
coordinates, so chunked prefill and prefix caching keep working: the prefix cache's block hashes
cover the original positions of their tokens (:mod:`.block_keys`), so requests share KV blocks exactly
where token ids and positions agree (across the turns of a conversation, and with ordinary requests
in leading blocks that kept every token). The probe answer advertises it, so clients send no
whole-request ``cache_salt`` (they do for a plugin without it).

Two model runners, one map:

* Model Runner V2 (GPU default in vLLM 0.33): the subclasses' ``get_model_state_cls`` returns
  :class:`~specprefill_rag.vllm_plugin.model_state.SpecPrefillModelState`, which hands the model
  the mapped positions in a persistent buffer of its own.
* Model Runner V1 (vLLM's CPU build; GPU with ``VLLM_USE_V2_MODEL_RUNNER=0``): ``register`` wraps
  ``GPUModelRunner._prepare_inputs`` (:mod:`.runner_v1`).

Admission: malformed SpecPrefill arguments (:mod:`.validation`), and requests whose generated tokens
would pass ``max_model_len`` at their original positions or whose kept positions do not number the
prompt's tokens (:mod:`.admission`), get HTTP 400.

Supported: vLLM 0.32-0.33. Unsupported configurations (sliding window, MRV1 without the wrapper)
fail at engine start.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = ((0, 32), (0, 34))  # [min, max)
ARCHITECTURES = {
    "LlamaForCausalLM": "specprefill_rag.vllm_plugin.models:SpecPrefillLlamaForCausalLM",
    "Qwen2ForCausalLM": "specprefill_rag.vllm_plugin.models:SpecPrefillQwen2ForCausalLM",
    "Qwen3ForCausalLM": "specprefill_rag.vllm_plugin.models:SpecPrefillQwen3ForCausalLM",
    "MistralForCausalLM": "specprefill_rag.vllm_plugin.models:SpecPrefillMistralForCausalLM",
}


def check_vllm_version(version: str) -> None:
    """Raise unless ``version`` is in the range this plugin was tested with."""
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    low, high = SUPPORTED_VLLM
    if not low <= parts < high:
        raise RuntimeError(
            f"specprefill-rag's vLLM plugin supports vLLM {low[0]}.{low[1]} to <{high[0]}.{high[1]}, found {version}; "
            "install a supported vLLM or uninstall specprefill-rag from the server environment"
        )


def register() -> None:
    """Entry point: register the architectures, the V1 position remap, the admission checks
    (``L + max_tokens <= max_model_len``, one kept position per prompt token: :mod:`.admission`) and
    the position-keyed prefix-cache blocks (:mod:`.block_keys`); idempotent.
    """
    import vllm
    from vllm import ModelRegistry

    from .admission import install_admission_checks
    from .block_keys import install_position_keyed_blocks
    from .runner_v1 import install_position_remap

    check_vllm_version(vllm.__version__)
    for architecture, target in ARCHITECTURES.items():
        ModelRegistry.register_model(architecture, target)
    install_position_remap()
    install_admission_checks()
    install_position_keyed_blocks()
    logger.debug("specprefill-rag vLLM plugin registered %s", sorted(ARCHITECTURES))
