"""Real-model tier: the embedded SmolLM2-135M drafting for a main model of another vocabulary.

The main model is a tiny random Llama with the test tokenizer (400 tokens, other ids and merges):
its answers mean nothing, but which of its tokens are kept is decided by SmolLM2's attention,
carried through the documents' characters. A needle hidden in ~2,000 tokens of the fixture texts must survive
keep 0.1 on the main model's tokens.
"""

import pytest
import torch

from specprefill_rag import GenerationParams, SpecPrefillEngine
from specprefill_rag.models.loading import shared_model
from specprefill_rag.testing import build_model

from .test_real_model import INSTRUCTIONS, NEEDLES, haystack

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def engine(tokenizer):
    smollm2 = shared_model("smollm2-135m")
    main = build_model(tokenizer, layers=1, max_positions=16384)
    return SpecPrefillEngine.from_models(
        main, tokenizer, smollm2.model, draft_tokenizer=smollm2.tokenizer, keep_rate=0.1, min_prompt_tokens=0
    )


@pytest.mark.parametrize("needle, question, answers, needle_document, depth", NEEDLES[1:])
def test_smollm2_keeps_the_needle_among_another_tokenizers_tokens(
    engine, needle, question, answers, needle_document, depth
):
    documents = haystack(needle, needle_document, depth)
    layout = engine.layout(question, documents, INSTRUCTIONS)
    draft_layout = engine.draft_scoring.draft_layout(layout)
    assert 1900 < len(draft_layout) < 2300 and len(layout) > 1.5 * len(draft_layout)  # truly other tokens
    result = engine.generate_layout(layout, GenerationParams(max_new_tokens=1))
    stats = result.stats
    assert stats.draft_path == "mapped" and stats.compressed and 0.1 <= stats.keep_rate < 0.12
    needle_start = layout.text.index(needle.rstrip("."))
    inside = (layout.offsets[:, 0] >= needle_start) & (layout.offsets[:, 1] <= needle_start + len(needle) - 1)
    needle_tokens = torch.nonzero(inside).flatten()
    assert torch.isin(needle_tokens, result.kept_positions).float().mean() >= 0.8
