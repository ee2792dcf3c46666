"""The tool-call requests read by vLLM 0.33 (tests/vllm/test_structural_tag_request.py)."""

from tests.vllm.test_structural_tag_request import (  # noqa: F401  (collected here too)
    test_vllm_keeps_the_tool_result_markup_out_of_an_auto_reply,
    test_vllm_reads_the_structural_tag_of_a_forced_call,
)
