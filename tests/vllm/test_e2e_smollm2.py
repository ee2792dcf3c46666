"""vLLM end to end with the real SmolLM2-135M-Instruct (the embedded default model)."""

import pytest

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.backends.hf import HFBackend
from specprefill_rag.backends.vllm import VLLMOfflineBackend
from specprefill_rag.config import GenerationParams
from specprefill_rag.models.loading import embedded_gguf, gguf_folder, load_model

GREEDY = GenerationParams(max_new_tokens=16)
DOCUMENT = (
    "The Brooklyn Bridge is a hybrid cable-stayed suspension bridge in New York City. "
    "It opened to traffic on May 24, 1883, after thirteen years of construction. "
) * 6


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", dtype="float32")  # as the vLLM engine below


@pytest.fixture(scope="module")
def llm(smollm2):
    from vllm import LLM

    engine = LLM(
        model=str(gguf_folder(embedded_gguf("smollm2-135m"))),
        max_model_len=2048,
        dtype="float32",
        max_num_batched_tokens=64,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
    )
    yield engine
    del engine


def test_compressed_request_matches_transformers(llm, smollm2):
    engine = SpecPrefillEngine.from_models(smollm2.model, smollm2.tokenizer, keep_rate=0.3, min_prompt_tokens=0)
    layout = engine.layout("When did the Brooklyn Bridge open?", [DOCUMENT, DOCUMENT.upper()])
    kept = engine.select(layout).kept
    assert kept.numel() < len(layout)
    prompt = SparsePrompt.kept(layout.input_ids, kept)
    eos = engine.backend.eos_ids
    expected = list(HFBackend(smollm2.model, eos).generate(prompt, GREEDY))
    assert list(VLLMOfflineBackend(llm, eos).generate(prompt, GREEDY)) == expected
    full = SparsePrompt.full(layout.input_ids)
    assert list(VLLMOfflineBackend(llm, eos).generate(full, GREEDY)) == list(
        HFBackend(smollm2.model, eos).generate(full, GREEDY)
    )
    assert "1883" in smollm2.tokenizer.decode(expected)
