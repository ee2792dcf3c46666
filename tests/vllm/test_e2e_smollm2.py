"""vLLM end to end with the real SmolLM2-135M-Instruct (the embedded default model)."""

import pytest

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.backends.hf import HFBackend
from specprefill_rag.backends.vllm import VLLMOfflineBackend
from specprefill_rag.config import GenerationParams
from specprefill_rag.models.loading import embedded_gguf, gguf_folder, load_model

# room for the answer's sentence: sentence chunks keep "It opened to traffic on May 24, 1883, ..." whole, and the
# model answers with it ("The Brooklyn Bridge was opened to traffic on May 24, 1883"), 16 tokens cut it at "18"
GREEDY = GenerationParams(max_new_tokens=24)
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


def test_a_conversations_second_turn_reuses_the_first_turns_kv_on_vllm(llm):
    """The product path: turn 2 keeps turn 1's tokens (stable selection, opted into with reselect=False since
    the default reselects), so its sparse prompt extends turn 1's and vLLM's prefix cache serves turn 1's
    blocks; the tokens are those of the same request with the cache not read."""
    from vllm import SamplingParams

    from specprefill_rag.backends.vllm import request_fields
    from specprefill_rag.prompt.chat import ChatMessage

    engine = SpecPrefillEngine.for_vllm(
        llm, draft="smollm2-135m", keep_rate=0.3, min_prompt_tokens=0, dtype="float32", reselect=False
    )
    documents = [DOCUMENT, DOCUMENT.upper()]
    turn_1 = [
        ChatMessage("system", ["Answer from the documents."]),
        ChatMessage("user", ["\n\n".join(documents) + "\n\nWhen did the Brooklyn Bridge open?"]),
    ]
    first = engine.chat(turn_1, documents=documents, max_new_tokens=16)
    assert first.stats.compressed and first.stats.main_cached_tokens == 0
    turn_2 = [*turn_1, ChatMessage("assistant", [first.text]), ChatMessage("user", ["How long did it take to build?"])]
    second = engine.chat(turn_2, documents=documents, max_new_tokens=16)
    assert second.stats.reused_spans == 2
    kept_1 = first.kept_positions.numel()
    assert second.stats.main_cached_tokens >= (kept_1 // 128) * 128 > 0  # vLLM's CPU blocks: 128 tokens
    layout = engine.chat_layout(turn_2, documents).layout
    fields = request_fields(engine.sparse_prompt(layout, second.kept_positions), salt=False)
    spec = fields.pop("extra_args")
    params = SamplingParams(max_tokens=16, temperature=0, detokenize=False, extra_args=spec)
    params.skip_reading_prefix_cache = True  # as with prefix caching off
    output = llm.generate([fields], params, use_tqdm=False)[0]
    assert output.num_cached_tokens == 0
    assert list(output.outputs[0].token_ids)[: len(second.token_ids)] == second.token_ids
