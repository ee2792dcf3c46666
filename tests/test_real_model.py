"""Real-model tier: the embedded SmolLM2-135M-Instruct as draft and main, on real prose.

Needles are hidden in ~1,900 tokens of five short expository texts shipped with the tests
(tests/fixtures/haystack, written for this repository and dedicated to the public domain), one
document each. Nothing outside the repository is read, so a fresh clone runs this tier.
"""

from pathlib import Path

import pytest
import torch

from specprefill_rag import GenerationParams, SpecPrefillEngine
from specprefill_rag.draft.model import ModelDraft
from specprefill_rag.kvcache.prefix_cache import PrefixKVCache, common_prefix_length
from specprefill_rag.models.loading import embedded_gguf, gguf_folder, shared_model
from specprefill_rag.selection import select_kept

HAYSTACK = sorted((Path(__file__).parent / "fixtures" / "haystack").glob("*.txt"))
pytestmark = pytest.mark.real_model
INSTRUCTIONS = "Answer the question using the documents. Be brief."
# Documents in file-name order: bees, bridges, clocks, lighthouses, tides. Over all 15 placements
# (5 documents x depths 0.2/0.5/0.8) the first needle is answered at keep 0.1 in 13; the two misses
# (clocks 0.5, bridges 0.8) are needles cut by a 32-token chunk boundary, so under 40% of their tokens
# are kept. The placements below are answered; BENCHMARKS.md measures the rate over many samples.
NEEDLES = [
    # (needle, question, accepted answers, document holding it, depth in that document)
    (
        "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
        "What is the best thing to do in San Francisco?",
        ("sandwich", "dolores"),
        3,
        0.5,
    ),
    (
        "The secret ingredient of Grandma Rosa's soup is smoked paprika.",
        "What is the secret ingredient of Grandma Rosa's soup?",
        ("paprika",),
        0,
        0.5,
    ),
    (
        "The access code for the Halvorsen vault is 4417.",
        "What is the access code for the Halvorsen vault?",
        ("4417",),
        4,
        0.2,
    ),
]


@pytest.fixture(scope="module")
def engine():
    return SpecPrefillEngine(
        draft="smollm2-135m", keep_rate=0.1, min_prompt_tokens=0
    )  # the paper's setting: a separate draft


def haystack(needle: str, needle_document: int, depth: float) -> list[str]:
    """The five fixture texts as documents, ``needle`` inserted as a sentence at ``depth`` of one of them."""
    documents = [path.read_text().strip() for path in HAYSTACK]
    sentences = documents[needle_document].split(". ")
    cut = int(len(sentences) * depth)
    documents[needle_document] = ". ".join(sentences[:cut] + [needle.rstrip(".")] + sentences[cut:])
    return documents


@pytest.mark.parametrize("needle, question, answers, needle_document, depth", NEEDLES)
def test_needle_answered_at_keep_ten_percent(engine, needle, question, answers, needle_document, depth):
    documents = haystack(needle, needle_document, depth)
    layout = engine.layout(question, documents, INSTRUCTIONS)
    assert len(HAYSTACK) == 5 and 1800 < len(layout) < 2300
    result = engine.generate_layout(layout, GenerationParams(max_new_tokens=32))  # the answer comes first
    assert any(answer in result.text.lower() for answer in answers), result.text
    stats = result.stats
    assert stats.compressed and 0.1 <= stats.keep_rate < 0.15
    # the needle's own tokens were kept: its document survived, where it matters
    needle_start = layout.text.index(needle.rstrip("."))
    encoded = engine.tokenizer(layout.text, add_special_tokens=False, return_offsets_mapping=True)
    spans = torch.tensor(encoded["offset_mapping"])
    inside = (spans[:, 0] >= needle_start) & (spans[:, 1] <= needle_start + len(needle) - 1)
    needle_tokens = torch.nonzero(inside).flatten()
    assert torch.isin(needle_tokens, result.kept_positions).float().mean() >= 0.8


def test_gguf_is_converted_once(engine):
    folder = gguf_folder(embedded_gguf("smollm2-135m"))
    weights = next(Path(folder).glob("*.safetensors"))
    before = weights.stat().st_mtime_ns
    assert gguf_folder(embedded_gguf("smollm2-135m")) == folder
    assert weights.stat().st_mtime_ns == before


def test_self_draft_on_real_model(engine):
    self_engine = SpecPrefillEngine.from_models(
        engine.main.model, engine.tokenizer, draft="self:12", keep_rate=0.3, min_prompt_tokens=0
    )
    needle, question, answers, document, depth = NEEDLES[0]
    result = self_engine.generate(question, haystack(needle, document, depth), INSTRUCTIONS, max_new_tokens=8)
    assert result.stats.compressed
    assert result.stats.draft_ms > 0


def cold_and_hit(model, first, second):
    """A cold draft's importance for ``second``, and a cached draft's after it scored ``first``."""
    cached = ModelDraft(model, look_ahead=8, prefix_cache=PrefixKVCache(2**31))
    cached.score_prompt(first)
    return ModelDraft(model, look_ahead=8).score(second), cached.score_prompt(second)


def test_draft_prefix_cache_hit_scores_as_a_cold_draft(engine):
    """A second question over the same ~2,000 tokens of fixture texts: the draft prefills only the question.

    In float32 the hit's importance is the cold one's to float tolerance. In bfloat16 (the default on
    CPUs that compute it natively) the masked and causal SDPA kernels round differently: importance
    moves by a few percent, less than bfloat16 itself moves it from float32, and the kept tokens agree.
    """
    needle, question, _, document, depth = NEEDLES[0]
    documents = haystack(needle, document, depth)
    first, second = (engine.layout(q, documents, INSTRUCTIONS) for q in (question, NEEDLES[1][1]))
    cold, hit = cold_and_hit(shared_model("smollm2-135m", "cpu", "float32").model, first.input_ids, second.input_ids)
    assert hit.cached_tokens == common_prefix_length(first.input_ids, second.input_ids) > 0.95 * len(second)
    torch.testing.assert_close(hit.importance, cold, rtol=1e-4, atol=1e-7)
    cold, hit = cold_and_hit(engine.draft.model, first.input_ids, second.input_ids)
    index = second.document_index
    kept = [select_kept(scores, index, keep_rate=0.1, chunk_size=32) for scores in (cold, hit.importance)]
    assert torch.equal(kept[0], kept[1])
