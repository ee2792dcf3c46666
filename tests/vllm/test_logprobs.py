"""Log-probabilities through vLLM (issue #30): the offline backend and the server's completions stream give
the transformers backend's raw log-probabilities for a compressed prompt (kept tokens at original positions),
within float tolerance, with the same most likely tokens.
"""

import pytest
import torch

from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.backends.hf import HFBackend
from specprefill_rag.backends.vllm import VLLMOfflineBackend, VLLMServerBackend
from specprefill_rag.config import GenerationParams
from specprefill_rag.results import PrefillReport
from tests.vllm.server import openai_server

PROMPT_LENGTH = 96
KEPT = torch.tensor(list(range(0, 8)) + list(range(32, 48)) + list(range(80, 96)))
PARAMS = GenerationParams(max_new_tokens=6, logprobs=True, top_logprobs=4)
TOLERANCE = 1e-3  # vLLM's CPU kernels against transformers' SDPA, both float32


@pytest.fixture(scope="module")
def prompt():
    ids = torch.randint(3, 400, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(2))
    return SparsePrompt.kept(ids, KEPT)


@pytest.fixture(scope="module")
def expected(tiny_folder, prompt):
    """The transformers backend's tokens and log-probabilities for the compressed prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32, attn_implementation="sdpa")
    report = PrefillReport()
    tokens = list(HFBackend(model.eval(), frozenset()).generate(prompt, PARAMS, report))
    return tokens, report.logprobs


def assert_agree(tokens, report, expected):
    expected_tokens, expected_steps = expected
    assert tokens == expected_tokens and len(report.logprobs) == len(tokens)
    for got, want in zip(report.logprobs, expected_steps):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=TOLERANCE)
        assert got.top_ids == want.top_ids
        assert got.top_logprobs == pytest.approx(want.top_logprobs, abs=TOLERANCE)


def test_offline_backend_reports_the_transformers_logprobs_for_a_compressed_prompt(llm, prompt, expected):
    report = PrefillReport()
    tokens = list(VLLMOfflineBackend(llm, frozenset()).generate(prompt, PARAMS, report))
    assert prompt.token_ids.numel() < prompt.prompt_length
    assert_agree(tokens, report, expected)


def test_server_stream_reports_the_transformers_logprobs_for_a_compressed_prompt(tiny_folder, llm, prompt, expected):
    with openai_server(tiny_folder) as url:
        backend = VLLMServerBackend(url, frozenset())
        assert backend.supports_sparse_prefill
        report = PrefillReport()
        tokens = list(backend.generate(prompt, PARAMS, report))
    assert_agree(tokens, report, expected)
