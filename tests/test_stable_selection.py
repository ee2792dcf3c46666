"""Stable selection across turns: a span compressed once keeps its kept tokens, so turn t's sparse prompt is a
prefix of turn t+1's and the main model's prefix cache serves it."""

import threading

import pytest
import torch

from specprefill_rag.config import GenerationParams
from specprefill_rag.engine import SpecPrefillEngine
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.prompt.chat import ChatMessage
from specprefill_rag.prompt.layout import document_runs
from specprefill_rag.results import ToolCall
from specprefill_rag.selection.memo import SelectionMemo
from specprefill_rag.testing import random_documents

PARAMS = {"max_new_tokens": 6}


def test_document_runs_split_documents_and_skip_the_rest():
    index = torch.tensor([-1, 0, 0, -1, 1, 1, 1, 2, -1])
    assert document_runs(index).tolist() == [[1, 3], [4, 7], [7, 8]]
    assert document_runs(torch.tensor([-1, -1])).shape == (0, 2)


def recall(memo, ids, index, settings="s"):
    return memo.recall(torch.tensor(ids), torch.tensor(index), settings)


def test_memo_recalls_spans_of_an_earlier_prompt_this_one_extends():
    memo = SelectionMemo()
    ids, index = [1, 2, 3, 4, 5, 6, 7], [-1, 0, 0, 0, -1, 1, 1]
    first = recall(memo, ids, index)
    assert first.reused == 0
    memo.remember(first, torch.tensor([0, 2, 4, 6]))
    again = recall(memo, ids + [8, 9], index + [-1, -1])  # a later turn: the whole earlier prompt and more
    assert again.complete and [k.tolist() for k in again.kept] == [[1], [1]]
    assert again.frozen_kept().tolist() == [2, 6]
    assert recall(memo, ids, index).reused == 0  # the same prompt again is drafted again
    assert recall(memo, ids + [8], index + [-1], settings="other").reused == 0
    assert recall(memo, [9] + ids[1:], index).reused == 0  # another token before the spans


def test_another_question_over_the_same_documents_is_selected_afresh():
    memo = SelectionMemo()
    question_1, question_2 = [50, 51], [60, 61]
    ids, index = [1, 2, 3, 4, 5, 6], [-1, 0, 0, 0, 1, 1]
    memo.remember(recall(memo, ids + question_1, index + [-1, -1]), torch.tensor([0, 1, 4, 6, 7]))
    assert recall(memo, ids + question_2, index + [-1, -1]).reused == 0


def test_a_long_history_is_found_through_its_blocks():
    memo = SelectionMemo()
    ids = list(range(100, 180))  # five full blocks of 16
    index = [-1] * 10 + [0] * 40 + [-1] * 30
    memo.remember(recall(memo, ids, index), torch.tensor([0, 12, 13, 79]))
    later = recall(memo, ids + list(range(200, 237)), index + [1] * 37)
    assert [k is not None for k in later.kept] == [True, False]
    assert later.frozen_kept().tolist() == [12, 13]


def test_memo_is_bounded_and_drops_the_least_recently_used():
    entry_bytes = 3 * 8 + 200 + 4
    memo = SelectionMemo(max_bytes=3 * entry_bytes)
    for first in range(5):
        memo.remember(recall(memo, [first, 1, 2], [-1, 0, -1]), torch.tensor([1, 2]))
        assert memo.nbytes <= memo.max_bytes
    assert len(memo) == 3
    assert recall(memo, [0, 1, 2, 3], [-1, 0, -1, -1]).reused == 0
    assert recall(memo, [4, 1, 2, 3], [-1, 0, -1, -1]).reused == 1


def test_memo_keeps_the_first_choice_under_concurrent_stores():
    memo = SelectionMemo()
    recalled = recall(memo, [1, 2, 3, 4], [-1, 0, 0, -1])

    def store(kept: list[int]) -> None:
        memo.remember(recalled, torch.tensor(kept))

    threads = [threading.Thread(target=store, args=([1, 3] if i % 2 else [2, 3],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(memo) == 1
    later = recall(memo, [1, 2, 3, 4, 5], [-1, 0, 0, -1, -1])
    assert later.kept[0] is not None and later.kept[0].tolist() in ([0], [1])


@pytest.fixture
def engine(tiny_model, tiny_draft, tokenizer):
    return SpecPrefillEngine.from_models(
        tiny_model, tokenizer, tiny_draft, keep_rate=0.3, min_prompt_tokens=0, look_ahead=2, reselect=False
    )


def conversation(documents):
    """Turn 1 as a chat history keeps it: the documents written into the first user message (``documents=``
    then locates them there; inserted ones would go before each turn's last user message, moving every turn).
    """
    return [
        ChatMessage("system", ["Answer from the documents."]),
        ChatMessage("user", ["\n\n".join(documents) + "\n\nWhen did the bridge open?"]),
    ]


def sparse_pairs(engine, result, layout):
    kept = result.kept_positions
    return list(zip(layout.input_ids[kept].tolist(), kept.tolist()))


def next_turn(messages, answer, question):
    return [*messages, ChatMessage("assistant", [answer]), ChatMessage("user", [question])]


def test_second_turn_keeps_the_first_turns_tokens_without_a_draft(engine):
    documents = random_documents(3, 70, seed=3)
    turn_1 = conversation(documents)
    first = engine.chat(turn_1, documents=documents, **PARAMS)
    assert first.stats.compressed and first.stats.reused_spans == 0 and first.stats.draft_ms > 0
    turn_2 = next_turn(turn_1, first.text, "And who built it?")
    second = engine.chat(turn_2, documents=documents, **PARAMS)
    stats = second.stats
    assert stats.reused_spans == 3 and stats.draft_ms == 0 and stats.draft_path is None and stats.compressed
    layout_1 = engine.chat_layout(turn_1, documents).layout
    layout_2 = engine.chat_layout(turn_2, documents).layout
    pairs_1, pairs_2 = sparse_pairs(engine, first, layout_1), sparse_pairs(engine, second, layout_2)
    assert pairs_2[: len(pairs_1)] == pairs_1  # turn 1's sparse prompt is a prefix of turn 2's
    assert stats.main_cached_tokens is not None and stats.main_cached_tokens >= len(pairs_1)


def test_reselect_scores_every_span_again(engine):
    documents = random_documents(3, 70, seed=4)
    turn_1 = conversation(documents)
    first = engine.chat(turn_1, documents=documents, **PARAMS)
    turn_2 = next_turn(turn_1, first.text, "Why?")
    again = engine.chat(turn_2, documents=documents, reselect=True, **PARAMS)
    assert again.stats.reused_spans == 0 and again.stats.draft_ms > 0
    reselecting = SpecPrefillEngine.from_models(
        engine.main.model, engine.tokenizer, engine.draft.model, keep_rate=0.3, min_prompt_tokens=0, reselect=True
    )
    assert reselecting.chat(turn_2, documents=documents, **PARAMS).stats.reused_spans == 0


def test_inserted_documents_move_each_turn_so_nothing_is_reused(engine):
    documents = random_documents(2, 70, seed=5)
    turn_1 = [ChatMessage("user", ["When did the bridge open?"])]
    first = engine.chat(turn_1, documents=documents, **PARAMS)
    second = engine.chat(next_turn(turn_1, first.text, "Who built it?"), documents=documents, **PARAMS)
    assert second.stats.reused_spans == 0 and second.stats.draft_ms > 0


def test_an_agent_step_drafts_the_new_tool_result_and_keeps_the_old_one(engine):
    call = ToolCall("search", {"query": "bridge"}, "call_1")
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    step_1 = [
        ChatMessage("user", ["When did the bridge open?"]),
        ChatMessage("assistant", [], tool_calls=[call]),
        ChatMessage("tool", [random_documents(1, 90, seed=8)[0]], tool_call_id="call_1"),
    ]
    first = engine.chat(step_1, tools=tools, **PARAMS)
    assert first.stats.compressed and first.stats.reused_spans == 0
    call_2 = ToolCall("search", {"query": "builder"}, "call_2")
    step_2 = [
        *step_1,
        ChatMessage("assistant", [], tool_calls=[call_2]),
        ChatMessage("tool", [random_documents(1, 90, seed=9)[0]], tool_call_id="call_2"),
    ]
    second = engine.chat(step_2, tools=tools, **PARAMS)
    assert second.stats.reused_spans == 1 and second.stats.draft_ms > 0
    layout_1, layout_2 = engine.chat_layout(step_1, tools=tools).layout, engine.chat_layout(step_2, tools=tools).layout
    old = layout_1.document_index >= 0
    kept_1 = set(first.kept_positions.tolist()) & set(torch.nonzero(old).flatten().tolist())
    kept_2 = set(second.kept_positions.tolist()) & set(torch.nonzero(old).flatten().tolist())
    assert torch.equal(layout_2.input_ids[: len(layout_1) - 8], layout_1.input_ids[: len(layout_1) - 8])
    assert kept_1 == kept_2


def test_frozen_spans_count_against_the_cap_and_new_spans_get_the_rest(engine):
    documents, more = random_documents(2, 96, seed=7), random_documents(1, 96, seed=8)
    turn_1 = conversation(documents)
    turn_2 = [*next_turn(turn_1, "In 1883.", "")[:-1], ChatMessage("user", [more[0] + "\n\nAnd this one?"])]
    layout_1 = engine.chat_layout(turn_1, documents).layout
    layout_2 = engine.chat_layout(turn_2, [*documents, *more]).layout
    pipeline, importance = engine.pipeline, torch.rand(len(layout_2), generator=torch.Generator().manual_seed(0))
    for cap in (128, 64):  # 64: the first turn's two chunks fill it
        pipeline.memo.clear()
        budget_1 = pipeline.budget(layout_1, 0.25, cap)
        recalled_1 = pipeline.recall(layout_1, budget_1)
        first = pipeline.select(layout_1, budget_1, importance[: len(layout_1)], recalled=recalled_1)
        old_kept = int((layout_1.document_index[first.kept] >= 0).sum())
        budget_2 = pipeline.budget(layout_2, 0.25, cap)
        recalled = pipeline.recall(layout_2, budget_2)
        assert recalled is not None and recalled.reused == 2 and not recalled.complete
        second = pipeline.select(layout_2, budget_2, importance, recalled=recalled)
        assert second.reused_spans == 2
        before = len(layout_1) - 8  # turn 1's spans and what follows them, up to its generation prompt
        assert torch.equal(second.kept[second.kept < before], first.kept[first.kept < before])
        new_kept = int((layout_2.document_index[second.kept] >= 0).sum()) - old_kept
        assert new_kept <= cap - old_kept  # the cap holds over both turns' spans
        assert (new_kept > 0) == (cap == 128)


def test_gateway_style_options_are_checked(engine):
    layout = engine.layout("When?", random_documents(2, 60))
    with pytest.raises(InvalidRequestError, match="reselect must be True or False"):
        engine.generate_layout(layout, GenerationParams(max_new_tokens=2), reselect="yes")  # type: ignore[arg-type]
