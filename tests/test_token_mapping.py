"""Draft importance carried onto another tokenizer's tokens through the documents' characters.

Pure tensor functions, no model: hand-built spans first, then the layouts of two different
tokenizers (and chat templates) built in the test, against a brute-force reference."""

import pytest
import torch

from specprefill_rag.draft.mapping import fill_gaps, map_importance, ranges
from specprefill_rag.prompt.render import build_rag_layout, build_text_layout
from specprefill_rag.testing import build_family_tokenizer, build_tokenizer, random_documents

QUESTION = "When did the bridge open?"


def spans(*pairs):
    return torch.tensor(pairs, dtype=torch.long).view(-1, 2)


def test_ranges_concatenates_aranges_and_names_their_owner():
    positions, owner = ranges(torch.tensor([5, 0, 9]), torch.tensor([2, 0, 3]))
    assert positions.tolist() == [5, 6, 9, 10, 11] and owner.tolist() == [0, 0, 2, 2, 2]


# Main text "..hello world.." holds the document at [2, 13); the draft's text at [5, 16).
MAIN_OFFSETS = spans((0, 2), (2, 4), (4, 9), (9, 13), (13, 15))  # "he", "llo w", "orld" are document tokens
MAIN_DOCUMENTS = torch.tensor([-1, 0, 0, 0, -1])


@pytest.mark.parametrize("reduce, expected", [("max", [0, 1, 2, 3, 0]), ("mean", [0, 1, 1.4, 3, 0])])
def test_a_main_token_reduces_the_draft_tokens_it_overlaps(reduce, expected):
    draft_offsets = spans((0, 5), (5, 10), (10, 12), (12, 16), (16, 18))  # tmpl, "hello", " w", "orld", tmpl
    importance = torch.tensor([9.0, 1.0, 2.0, 3.0, 9.0])
    mapped = map_importance(
        importance, draft_offsets, spans((5, 16)), MAIN_OFFSETS, MAIN_DOCUMENTS, spans((2, 13)), reduce
    )
    torch.testing.assert_close(mapped, torch.tensor(expected, dtype=torch.float32))  # "llo w": 3 chars of 1.0, 2 of 2.0


def test_a_draft_token_straddling_the_document_edge_lands_on_the_document_characters_only():
    draft_offsets = spans((0, 6), (6, 10), (10, 16), (16, 18))  # the first token ends with the document's "h"
    importance = torch.tensor([5.0, 1.0, 2.0, 7.0])
    mapped = map_importance(importance, draft_offsets, spans((5, 16)), MAIN_OFFSETS, MAIN_DOCUMENTS, spans((2, 13)))
    assert mapped.tolist() == [0.0, 5.0, 2.0, 2.0, 0.0]  # the 7.0 after the document reaches nothing


def test_uncovered_characters_take_their_nearest_covered_neighbour_within_the_span():
    nan = float("nan")
    scores = torch.tensor([nan, 1.0, nan, nan, nan, 4.0, nan, nan, nan])
    filled = fill_gaps(scores, spans((0, 7), (20, 22)))  # second span: characters 7 and 8, none covered
    assert filled.tolist() == [1.0, 1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 0.0, 0.0]


def test_spans_of_other_lengths_are_refused():
    with pytest.raises(ValueError, match="document spans differ"):
        map_importance(torch.ones(1), spans((0, 3)), spans((0, 3)), spans((0, 4)), torch.tensor([0]), spans((0, 4)))


# -- real tokenizers: the same content laid out by two vocabularies and templates ----------------------


@pytest.fixture(scope="module")
def other_tokenizer():
    return build_tokenizer(vocab_size=300)  # other merges, other ids


@pytest.fixture(scope="module")
def llama3_tokenizer():
    return build_family_tokenizer("llama3")  # other template (trims content, BOS), other special ids


def layout_pairs(tokenizer, other_tokenizer, llama3_tokenizer):
    """(main layout, draft layout rendered from the main layout's source) for several prompt kinds."""
    documents = random_documents(4, 50, seed=3) + ["Ünïcödé text: 東京 and emoji 🙂 inside a document."]
    rag = build_rag_layout(tokenizer, QUESTION, documents, instructions="Answer briefly.")
    plain = build_rag_layout(tokenizer, QUESTION, documents, use_chat_template=False)
    raw = build_text_layout(tokenizer, rag.text, protect_tail_tokens=8, parse_special_tokens=True)
    pairs = [(rag, other_tokenizer), (rag, llama3_tokenizer), (plain, other_tokenizer), (raw, other_tokenizer)]
    return [(main, main.source.render(draft_tokenizer)) for main, draft_tokenizer in pairs]


def brute_force(importance, draft, main, reduce):
    """Per main document token: max or character-weighted mean of the overlapping draft tokens."""
    expected = torch.zeros(len(main))
    for token in torch.nonzero(main.document_index >= 0).flatten().tolist():
        start, end = main.offsets[token].tolist()
        span = next(s for s, (low, high) in enumerate(main.document_spans.tolist()) if low <= start < high)
        shift = int(draft.document_spans[span, 0] - main.document_spans[span, 0])
        weights = []
        for other, (draft_start, draft_end) in enumerate(draft.offsets.tolist()):
            shared = min(end + shift, draft_end) - max(start + shift, draft_start)
            if shared > 0:
                weights.append((shared, float(importance[other])))
        assert weights, f"main token {token} overlaps no draft token"
        if reduce == "max":
            expected[token] = max(value for _, value in weights)
        else:  # characters shared by several draft tokens (one emoji's bytes) count once, with their max
            expected[token] = sum(w * v for w, v in weights) / sum(w for w, _ in weights)
    return expected


def test_every_main_document_token_scores_the_draft_tokens_overlapping_it(tokenizer, other_tokenizer, llama3_tokenizer):
    for main, draft in layout_pairs(tokenizer, other_tokenizer, llama3_tokenizer):
        assert not torch.equal(main.input_ids[: len(draft)], draft.input_ids[: len(main)])  # truly other tokens
        importance = torch.rand(len(draft), generator=torch.Generator().manual_seed(len(draft)))
        mapped = map_importance(
            importance,
            draft.offsets,
            draft.document_spans,
            main.offsets,
            main.document_index,
            main.document_spans,
            "max",
        )
        torch.testing.assert_close(mapped, brute_force(importance, draft, main, "max"))
        assert (mapped[main.document_index >= 0] > 0).all() and (mapped[main.document_index < 0] == 0).all()


def test_mean_weights_the_overlapping_draft_tokens_by_shared_characters(tokenizer, other_tokenizer, llama3_tokenizer):
    main, draft = layout_pairs(tokenizer, other_tokenizer, llama3_tokenizer)[0]
    ascii_only = [
        t
        for t in torch.nonzero(main.document_index >= 0).flatten().tolist()
        if main.text[main.offsets[t, 0] : main.offsets[t, 1]].isascii()
    ]  # one draft token per character
    importance = torch.rand(len(draft), generator=torch.Generator().manual_seed(1))
    mapped = map_importance(
        importance, draft.offsets, draft.document_spans, main.offsets, main.document_index, main.document_spans, "mean"
    )
    torch.testing.assert_close(mapped[ascii_only], brute_force(importance, draft, main, "mean")[ascii_only])


def test_no_score_crosses_a_document_boundary(tokenizer, other_tokenizer, llama3_tokenizer):
    for main, draft in layout_pairs(tokenizer, other_tokenizer, llama3_tokenizer):
        importance = torch.rand(len(draft), generator=torch.Generator().manual_seed(2))
        before = map_importance(
            importance, draft.offsets, draft.document_spans, main.offsets, main.document_index, main.document_spans
        )
        for span in range(len(main.document_spans)):
            start, end = draft.document_spans[span].tolist()
            elsewhere = (draft.offsets[:, 1] <= start) | (draft.offsets[:, 0] >= end)  # draft tokens off this span
            louder = torch.where(elsewhere, importance + 100.0, importance)
            after = map_importance(
                louder, draft.offsets, draft.document_spans, main.offsets, main.document_index, main.document_spans
            )
            main_start, main_end = main.document_spans[span].tolist()
            inside = (main.document_index >= 0) & (main.offsets[:, 0] >= main_start) & (main.offsets[:, 1] <= main_end)
            assert inside.any()
            assert torch.equal(after[inside], before[inside]), f"span {span} took a score from outside it"
            assert (after[(main.document_index >= 0) & ~inside] >= 100).all()


@pytest.mark.parametrize("reduce", ["max", "mean"])
def test_same_tokenizer_on_both_sides_maps_each_token_onto_itself(tokenizer, reduce):
    layout = build_rag_layout(tokenizer, QUESTION, random_documents(3, 60), instructions="Be brief.")
    importance = torch.rand(len(layout), generator=torch.Generator().manual_seed(4))
    mapped = map_importance(
        importance,
        layout.offsets,
        layout.document_spans,
        layout.offsets,
        layout.document_index,
        layout.document_spans,
        reduce,
    )
    documents = layout.document_index >= 0
    if reduce == "max":
        assert torch.equal(mapped[documents], importance[documents])
    torch.testing.assert_close(mapped[documents], importance[documents])
