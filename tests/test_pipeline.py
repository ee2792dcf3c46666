"""The request path shared by the engine and the gateway: which requests are compressed, with which
policy, and what the main model then prefills (no model: a layout built by hand, importance given)."""

import pytest
import torch

from specprefill_rag.config import SpecPrefillConfig
from specprefill_rag.pipeline import Pipeline
from specprefill_rag.prompt.layout import PromptLayout, Role

# 8 instruction tokens, a 64-token document, 8 question tokens
DOCUMENT_INDEX = torch.tensor([-1] * 8 + [0] * 64 + [-1] * 8)


def layout(document_index=DOCUMENT_INDEX) -> PromptLayout:
    n = document_index.numel()
    roles = torch.where(document_index >= 0, int(Role.DOCUMENT), int(Role.QUESTION))
    return PromptLayout(torch.arange(n) + 10, roles, document_index, "x" * n)


def pipeline(sparse_prefill=True, **settings) -> Pipeline:
    return Pipeline(SpecPrefillConfig(chunk_size=16, **settings), sparse_prefill, min_prompt_tokens=0)


@pytest.mark.parametrize(
    "why, make, rate, cap, enabled",
    [
        ("keep everything", pipeline, 1.0, None, True),
        ("disabled for this request", pipeline, 0.3, None, False),
        (
            "shorter than min_prompt_tokens",
            lambda: Pipeline(SpecPrefillConfig(), True, min_prompt_tokens=81),
            0.3,
            None,
            True,
        ),
        ("original positions on a server without the plugin", lambda: pipeline(sparse_prefill=False), 0.3, None, True),
    ],
)
def test_requests_that_are_not_compressed(why, make, rate, cap, enabled):
    budget = make().budget(layout(), rate, cap, enabled)
    assert not budget.compressed, why
    assert make().whole(layout(), budget).kept.tolist() == list(range(80))


def test_no_documents_is_not_compressed_and_auto_or_a_cap_always_may_be():
    assert not pipeline().budget(layout(torch.full((80,), -1)), 0.3, None).compressed
    assert pipeline().budget(layout(), "auto", None).compressed
    assert pipeline().budget(layout(), 1.0, 16).compressed  # a cap below the documents' length
    assert pipeline(sparse_prefill=False, positions="contiguous").budget(layout(), 0.3, None).compressed


def test_the_policy_is_the_requests_whatever_happens_to_it():
    for rate, policy in ((0.3, "fixed"), ("auto", "auto")):
        budget = pipeline().budget(layout(), rate, None)
        assert budget.policy == policy
        assert pipeline().whole(layout(), budget, draft_error="DraftScoringError: x").keep_policy == policy


def test_selection_keeps_the_best_chunks_and_everything_outside_documents():
    importance = torch.zeros(80)
    importance[40:56] = 1.0  # the document's third chunk of 16
    budget = pipeline().budget(layout(), 0.25, None)
    chosen = pipeline().select(
        layout(), budget, importance, draft_ms=5.0, draft_cached_tokens=3, queue_ms=2.0, batch_size=4
    )
    assert chosen.kept.tolist() == list(range(8)) + list(range(40, 56)) + list(range(72, 80))
    assert (chosen.draft_ms, chosen.draft_cached_tokens, chosen.queue_ms, chosen.batch_size) == (5.0, 3, 2.0, 4)


def test_sparse_prompt_positions_original_or_contiguous():
    kept = torch.tensor([0, 1, 40, 41, 79])
    original = pipeline().sparse_prompt(layout(), kept)
    assert original.position_ids.tolist() == [0, 1, 40, 41, 79] and original.prompt_length == 80
    renumbered = pipeline(positions="contiguous").sparse_prompt(layout(), kept)
    assert renumbered.position_ids.tolist() == [0, 1, 2, 3, 4] and renumbered.prompt_length == 5
    assert renumbered.token_ids.tolist() == original.token_ids.tolist() == [10, 11, 50, 51, 89]
