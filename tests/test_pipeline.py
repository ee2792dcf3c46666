"""The request path shared by the engine and the gateway: which requests are compressed, with which
policy, and what the main model then prefills (no model: a layout built by hand, importance given)."""

import logging
from dataclasses import replace

import pytest
import torch

from specprefill_rag.config import SpecPrefillConfig
from specprefill_rag.pipeline import DraftCost, Pipeline
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
    "reason, make, document_index, rate, cap, enabled",
    [
        ("keep_all", pipeline, DOCUMENT_INDEX, 1.0, None, True),
        ("disabled", pipeline, DOCUMENT_INDEX, 0.3, None, False),
        ("no_documents", pipeline, torch.full((80,), -1), 0.3, None, True),
        (
            "short_prompt",
            lambda: Pipeline(SpecPrefillConfig(), True, min_prompt_tokens=81),
            DOCUMENT_INDEX,
            0.3,
            None,
            True,
        ),
        ("no_plugin", lambda: pipeline(sparse_prefill=False), DOCUMENT_INDEX, 0.3, None, True),
    ],
)
def test_requests_that_are_not_compressed_say_why(reason, make, document_index, rate, cap, enabled):
    budget = make().budget(layout(document_index), rate, cap, enabled)
    assert not budget.compressed and budget.skipped == reason
    whole = make().whole(layout(document_index), budget)
    assert whole.kept.tolist() == list(range(80)) and whole.uncompressed_reason == reason


def test_auto_or_a_cap_always_may_compress_and_a_failed_draft_says_so():
    assert pipeline().budget(layout(), "auto", None).skipped is None
    assert pipeline().budget(layout(), 1.0, 16).compressed  # a cap below the documents' length
    assert pipeline(sparse_prefill=False, positions="contiguous").budget(layout(), 0.3, None).compressed
    budget = pipeline().budget(layout(), 0.3, None)
    assert pipeline().whole(layout(), budget, draft_error="DraftScoringError: x").uncompressed_reason == "draft_error"


def test_a_draft_that_keeps_everything_says_so():
    budget = pipeline().budget(layout(), 0.99, None)
    chosen = pipeline().select(layout(), budget, torch.ones(80), DraftCost(draft_ms=1.0))
    assert chosen.kept.numel() == 80 and chosen.uncompressed_reason == "all_kept"
    assert (
        pipeline()
        .select(layout(), pipeline().budget(layout(), 0.25, None), torch.ones(80), DraftCost(1.0))
        .uncompressed_reason
        is None
    )


def test_each_cause_that_was_not_asked_for_is_logged_once_with_its_fix(caplog):
    engine_pipeline = Pipeline(SpecPrefillConfig(), True, min_prompt_tokens=81)
    with caplog.at_level(logging.WARNING, logger="specprefill_rag"):
        for _ in range(3):
            engine_pipeline.whole(layout(), engine_pipeline.budget(layout(), 0.3, None))
            engine_pipeline.whole(layout(), engine_pipeline.budget(layout(), 1.0, None))  # asked for: no warning
            empty = layout(torch.full((80,), -1))
            engine_pipeline.whole(empty, engine_pipeline.budget(empty, 0.3, None))
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages
    assert (
        "prompt of 80 tokens was shorter than min_prompt_tokens=81" in messages[0]
        and "set min_prompt_tokens" in messages[0]
    )
    assert "no retrieved documents were found" in messages[1] and "documents=" in messages[1]


def test_an_agents_first_step_awaits_its_tool_results_without_a_warning(caplog):
    # tools offered, no tool result yet: its documents come later, so no advice to pass documents
    step = replace(layout(torch.full((80,), -1)), awaits_tool_results=True)
    engine_pipeline = pipeline()
    with caplog.at_level(logging.WARNING, logger="specprefill_rag"):
        budget = engine_pipeline.budget(step, 0.3, None)
        assert budget.skipped == "awaiting_tool_results"
        assert engine_pipeline.whole(step, budget).uncompressed_reason == "awaiting_tool_results"
    assert not caplog.records


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
        layout(), budget, importance, DraftCost(draft_ms=5.0, cached_tokens=3, queue_ms=2.0, batch_size=4)
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
