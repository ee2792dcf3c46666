"""The admission checks and their hook on vLLM's InputProcessor, without starting an engine."""

import pytest

from specprefill_rag.vllm_plugin import register
from specprefill_rag.vllm_plugin.admission import (
    admission_checks_installed,
    check_kept_count,
    check_length,
    install_admission_checks,
    remove_admission_checks,
)

SPEC = {"specprefill_prompt_length": 100, "specprefill_runs": [0, 10, 90, 10]}  # K = 20, L = 100


def test_register_installs_the_admission_checks():
    register()
    assert admission_checks_installed()


def test_install_is_idempotent_and_remove_restores_vllms_function():
    from vllm.v1.engine.input_processor import InputProcessor

    remove_admission_checks()
    original = InputProcessor.process_inputs
    try:
        install_admission_checks()
        patched = InputProcessor.process_inputs
        install_admission_checks()
        assert InputProcessor.process_inputs is patched is not original
        remove_admission_checks()
        assert InputProcessor.process_inputs is original and not admission_checks_installed()
    finally:
        install_admission_checks()


def test_length_check():
    check_length(SPEC, 24, 124)  # the last generated token takes position 123
    with pytest.raises(
        ValueError,
        match=r"L=100 \+ max_tokens=25 = 125 exceeds max_model_len=124.*at most 24 "
        r"or send fewer documents",
    ):
        check_length(SPEC, 25, 124)
    with pytest.raises(ValueError, match="max_tokens=104"):  # unset: vLLM's default max_model_len - K
        check_length(SPEC, None, 124)
    check_length({"specprefill_prompt_length": 20, "specprefill_runs": [0, 20]}, None, 124)  # nothing dropped


@pytest.mark.parametrize(
    "args",
    [
        None,
        {},
        {"other_plugin": 1},
        {"specprefill_runs": [0, 4]},
        {"specprefill_prompt_length": 9, "specprefill_runs": 4},
    ],
)
def test_ordinary_and_malformed_requests_pass_to_their_own_checks(args):
    check_length(args, 10**6, 124)


def test_kept_count_check():
    check_kept_count(SPEC, 20)
    with pytest.raises(ValueError, match="specprefill_runs cover 20 positions but the prompt has 19 tokens"):
        check_kept_count(SPEC, 19)
    check_kept_count({"other_plugin": 1}, 19)  # not a SpecPrefill request
