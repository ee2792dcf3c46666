"""Plugin registration, the V1 remap hook and admission checks, without starting an engine."""

import pytest
from vllm import ModelRegistry

from specprefill_rag.vllm_plugin import ARCHITECTURES, check_vllm_version, register
from specprefill_rag.vllm_plugin.runner_v1 import (
    install_position_remap,
    position_remap_installed,
    remove_position_remap,
)
from specprefill_rag.vllm_plugin.validation import PROBE_MARKER, check_arguments


def test_register_is_idempotent_and_registers_architectures():
    register()
    register()
    assert set(ARCHITECTURES) <= set(ModelRegistry.get_supported_archs())
    assert position_remap_installed()


def test_position_remap_is_removable():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    install_position_remap()
    patched = GPUModelRunner._prepare_inputs
    remove_position_remap()
    assert not position_remap_installed() and GPUModelRunner._prepare_inputs is not patched
    install_position_remap()
    assert position_remap_installed()


@pytest.mark.parametrize("version, ok", [("0.32.0", True), ("0.33.1+cpu", True), ("0.31.2", False), ("0.34.0", False)])
def test_version_range(version, ok):
    if ok:
        check_vllm_version(version)
    else:
        with pytest.raises(RuntimeError, match="supports vLLM 0.32"):
            check_vllm_version(version)


@pytest.mark.parametrize(
    "args, match",
    [
        ({"specprefill_probe": 1}, PROBE_MARKER),
        ({"specprefill_runs": [0, 4]}, "need both"),
        ({"specprefill_prompt_length": 0, "specprefill_runs": [0, 4]}, "positive integer"),
        ({"specprefill_prompt_length": 10, "specprefill_runs": [5, 2, 3, 1]}, "increasing"),
        ({"specprefill_prompt_length": 10, "specprefill_runs": [0, 4]}, "must end at the last prompt position 9"),
        ({"specprefill_prompt_length": 10, "specprefill_runs": [0, 4, 9, 3]}, "must end at the last prompt position 9"),
    ],
)
def test_admission_checks(args, match):
    with pytest.raises(ValueError, match=match):
        check_arguments(args)


def test_requests_without_arguments_pass():
    check_arguments(None)
    check_arguments({"other_plugin": 1})
    check_arguments({"specprefill_prompt_length": 10, "specprefill_runs": [0, 4, 9, 1]})


def _config(v2: bool, **text_config):
    from types import SimpleNamespace

    return SimpleNamespace(
        use_v2_model_runner=v2, model_config=SimpleNamespace(hf_text_config=SimpleNamespace(**text_config))
    )


def test_unsupported_runner_and_models_fail_loudly_at_engine_start():
    from specprefill_rag.vllm_plugin.models import check_supported

    install_position_remap()
    with pytest.raises(RuntimeError, match="full-attention models only"):
        check_supported(_config(False, sliding_window=4096))
    with pytest.raises(RuntimeError, match="full-attention models only"):
        check_supported(_config(True, sliding_window=4096))
    check_supported(_config(False, sliding_window=4096, use_sliding_window=False))  # Qwen2 style: window off
    check_supported(_config(False))
    remove_position_remap()
    try:
        with pytest.raises(RuntimeError, match="position remap is not installed"):
            check_supported(_config(False))
        check_supported(_config(True))  # Model Runner V2 maps positions through the model state instead
    finally:
        install_position_remap()
