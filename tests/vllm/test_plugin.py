"""Plugin registration, the V1 remap hook and admission checks, without starting an engine."""

import pytest
from vllm import ModelRegistry

from specprefill_rag.positions import POSITION_KEYED_BLOCKS
from specprefill_rag.vllm_plugin import ARCHITECTURES, check_vllm_version, register
from specprefill_rag.vllm_plugin.runner_v1 import (
    install_position_remap,
    position_remap_installed,
    remove_position_remap,
)
from specprefill_rag.vllm_plugin.validation import PROBE_MARKER, check_arguments, probe_answer


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


def test_position_keyed_blocks_install_and_remove_restore_vllms_function_exactly():
    import vllm.v1.core.block_pool as block_pool
    import vllm.v1.core.kv_cache_utils as kv_cache_utils

    from specprefill_rag.vllm_plugin.block_keys import (
        install_position_keyed_blocks,
        position_keyed_blocks,
        position_keyed_blocks_installed,
        remove_position_keyed_blocks,
    )

    register()
    assert position_keyed_blocks_installed()
    wrapper = kv_cache_utils.generate_block_hash_extra_keys
    original = wrapper.__specprefill_original__
    assert block_pool.generate_block_hash_extra_keys is wrapper  # KV events' extra keys match the hashes
    try:
        remove_position_keyed_blocks()
        assert kv_cache_utils.generate_block_hash_extra_keys is original is block_pool.generate_block_hash_extra_keys
        assert not position_keyed_blocks_installed()
        remove_position_keyed_blocks()  # no-op
        assert kv_cache_utils.generate_block_hash_extra_keys is original
        with position_keyed_blocks() as installed:
            assert installed and position_keyed_blocks_installed()
            assert install_position_keyed_blocks()  # idempotent: no wrapper of the wrapper
            assert kv_cache_utils.generate_block_hash_extra_keys.__specprefill_original__ is original
        assert kv_cache_utils.generate_block_hash_extra_keys is original is block_pool.generate_block_hash_extra_keys
    finally:
        install_position_keyed_blocks()
    assert position_keyed_blocks_installed()
    with position_keyed_blocks():  # installed before: still installed after
        pass
    assert position_keyed_blocks_installed()


def test_the_guard_refuses_a_vllm_whose_function_does_not_fit(monkeypatch, caplog):
    import vllm.v1.core.kv_cache_utils as kv_cache_utils

    from specprefill_rag.vllm_plugin import block_keys

    block_keys.remove_position_keyed_blocks()
    try:
        original = kv_cache_utils.generate_block_hash_extra_keys
        monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", lambda req, first, last, mm: (None, mm))
        assert not block_keys.install_position_keyed_blocks() and "takes ['req', 'first', 'last']" in caplog.text
        monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", original)
        monkeypatch.setattr(kv_cache_utils, "get_request_block_hasher", lambda size, fn: None)
        assert not block_keys.install_position_keyed_blocks() and "does not look" in caplog.text
        assert not block_keys.position_keyed_blocks_installed()
        assert POSITION_KEYED_BLOCKS not in probe_answer()  # clients then keep sending a cache_salt
    finally:
        monkeypatch.undo()
        block_keys.install_position_keyed_blocks()
    assert block_keys.position_keyed_blocks_installed() and POSITION_KEYED_BLOCKS in probe_answer()
