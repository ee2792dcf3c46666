"""The forced-tool-call request read by vLLM 0.33 (tests/vllm/test_structural_tag_request.py)."""

from tests.vllm.test_structural_tag_request import (  # noqa: F401  (collected here too)
    test_vllm_reads_the_structural_tag_of_a_forced_call,
)
