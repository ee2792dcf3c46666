"""SpecPrefillEngine end to end on a tiny random Llama."""

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from specprefill_rag import GenerationParams, SpecPrefillEngine
from specprefill_rag.config import DEFAULT_SELF_LAYER_SHARE
from specprefill_rag.draft.model import LayerPrefixDraft
from specprefill_rag.errors import ContextLengthError, InvalidRequestError
from specprefill_rag.prompt.chat import ChatMessage
from specprefill_rag.prompt.layout import Role
from specprefill_rag.selection import select_kept
from specprefill_rag.testing import random_documents

QUESTION = "When did the bridge open?"


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_draft, tokenizer):
    return SpecPrefillEngine.from_models(
        tiny_model, tokenizer, tiny_draft, keep_rate=0.2, min_prompt_tokens=0, look_ahead=3
    )


def greedy_tokens(model, prompt_ids: torch.Tensor, max_new_tokens: int, eos: int) -> list[int]:
    """transformers' greedy ``generate`` on ``prompt_ids`` ``[L]``: the new tokens, up to end-of-sequence."""
    with torch.no_grad():
        generated = model.generate(prompt_ids[None], max_new_tokens=max_new_tokens, do_sample=False)
    tokens = generated[0, prompt_ids.numel() :].tolist()
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def test_keep_rate_one_equals_plain_greedy_generation(engine, tiny_model):
    layout = engine.layout(QUESTION, random_documents(3, 60))
    result = engine.generate_layout(layout, GenerationParams(max_new_tokens=16), keep_rate=1.0)
    assert result.token_ids == greedy_tokens(tiny_model, layout.input_ids, 16, engine.tokenizer.eos_token_id)
    assert not result.stats.compressed and result.stats.draft_ms == 0.0


def constant_per_document(layout, document_importance: list[float]) -> torch.Tensor:
    """``[L]`` importance: ``document_importance[d]`` on document ``d``'s tokens, 0 elsewhere."""
    by_document = torch.tensor(document_importance)
    on_document = layout.document_index >= 0
    return torch.where(on_document, by_document[layout.document_index.clamp(min=0)], torch.zeros(()))


def test_compressed_request_keeps_question_and_template(engine, monkeypatch):
    layout = engine.layout(QUESTION, random_documents(4, 80), instructions="Answer briefly.")
    # The draft runs, then its importance is replaced by one that disagrees with position: the second
    # document matters most, the first least, so keeping the earliest chunks would keep the wrong ones.
    importance = constant_per_document(layout, [1.0, 4.0, 2.0, 3.0])
    scored = engine.draft.score_prompt
    monkeypatch.setattr(
        engine.draft,
        "score_prompt",
        lambda ids, documents=None, namespace=None: replace(scored(ids, documents, namespace), importance=importance),
    )
    result = engine.generate_layout(layout, GenerationParams(max_new_tokens=8))
    stats = result.stats
    kept = result.kept_positions
    on_document = layout.document_index >= 0
    kept_mask = torch.zeros(len(layout), dtype=torch.bool)
    kept_mask[kept] = True
    assert importance[kept_mask & on_document].min() >= importance[~kept_mask & on_document].max()
    assert set(layout.document_index[kept_mask & on_document].tolist()) == {1}
    assert stats.compressed and stats.draft_ms > 0
    assert stats.prompt_tokens == len(layout) and stats.kept_tokens == kept.numel()
    assert stats.kept_document_tokens == stats.kept_tokens - (stats.prompt_tokens - stats.document_tokens)
    assert 0.2 <= stats.keep_rate < 0.2 + 32 * 4 / stats.document_tokens
    roles = layout.roles[kept]
    for role in (Role.QUESTION, Role.INSTRUCTION, Role.TEMPLATE):
        assert int((roles == role).sum()) == int((layout.roles == role).sum())
    assert stats.ttft_ms >= stats.draft_ms + stats.main_prefill_ms * 0.99
    assert isinstance(stats.decode_tokens_per_s, float)


def test_short_prompts_are_not_compressed(tiny_model, tokenizer):
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, keep_rate=0.1, min_prompt_tokens=10_000)
    result = engine.generate(QUESTION, random_documents(2, 50), max_new_tokens=4)
    assert not result.stats.compressed and result.stats.keep_rate == 1.0


def test_stream_chunks_add_up_to_result(engine):
    chunks = list(engine.stream(QUESTION, random_documents(3, 60), max_new_tokens=24, temperature=0.8, seed=3))
    final = chunks[-1]
    assert final.result is not None and final.stats is not None and final.finish_reason in ("stop", "length")
    assert "".join(c.text for c in chunks) == final.result.text
    assert [t for c in chunks for t in c.token_ids] == final.result.token_ids
    assert all(c.result is None for c in chunks[:-1])


def test_stop_string_ends_text_before_it(engine):
    documents = random_documents(3, 60)
    free = engine.generate(QUESTION, documents, max_new_tokens=30)
    assert len(free.text) > 6, "the random model must produce some text for this test"
    stop = free.text[3:6]
    stopped = engine.generate(QUESTION, documents, max_new_tokens=30, stop=[stop])
    assert stopped.text == free.text[: free.text.index(stop)]
    assert stopped.finish_reason == "stop"


@pytest.mark.parametrize("n_layers", [1, 2])
def test_self_draft_scores_with_main_layers(tiny_model, tokenizer, n_layers):
    # The tiny model has 2 layers and the default share rounds to 1, so n=1 tells n from "all layers" and
    # n=2 tells n from "the default share".
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, draft=f"self:{n_layers}", keep_rate=0.3, min_prompt_tokens=0
    )
    layout = engine.layout(QUESTION, random_documents(3, 80))
    window = engine.config.self_draft_window
    references = {
        n: LayerPrefixDraft(tiny_model, n, engine.config.pool_kernel, query_window=window).score(layout.input_ids)
        for n in (1, 2)
    }
    assert not torch.allclose(references[1], references[2], rtol=1e-3, atol=1e-6), "layer counts must score apart"
    torch.testing.assert_close(engine.draft.score(layout.input_ids), references[n_layers])
    result = engine.generate_layout(layout, GenerationParams(max_new_tokens=4))
    assert result.stats.compressed and 0.3 <= result.stats.keep_rate < 0.7
    chunk_size = engine.config.chunk_size
    expected = select_kept(references[n_layers], layout.document_index, keep_rate=0.3, chunk_size=chunk_size)
    assert torch.equal(result.kept_positions, expected)


def test_plain_self_draft_takes_the_default_share_of_layers_and_the_question_window(tiny_model, tokenizer):
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, draft="self", self_draft_window=5, min_prompt_tokens=0
    )
    layers = tiny_model.config.num_hidden_layers
    expected = LayerPrefixDraft(tiny_model, max(1, round(DEFAULT_SELF_LAYER_SHARE * layers)), 13, query_window=5)
    layout = engine.layout(QUESTION, random_documents(3, 80))
    torch.testing.assert_close(engine.draft.score(layout.input_ids), expected.score(layout.input_ids))
    assert engine.config.effective_look_ahead == 1


def test_concurrent_requests_match_sequential(engine):
    requests = [(f"Question {i}?", random_documents(2, 40 + 7 * i, seed=i)) for i in range(6)]
    sequential = [engine.generate(q, d, max_new_tokens=6).token_ids for q, d in requests]
    with ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(lambda r: engine.generate(r[0], r[1], max_new_tokens=6).token_ids, requests))
    assert concurrent == sequential


def test_raw_text_prompt_is_compressed_except_tail(engine):
    prompt = " ".join(random_documents(4, 60)) + " Question: when?"
    result = engine.generate_text(prompt, max_new_tokens=4)
    layout = engine.text_layout(prompt)
    tail = torch.arange(len(layout) - engine.config.protect_tail_tokens, len(layout))
    assert result.stats.compressed
    assert torch.isin(tail, result.kept_positions).all()


async def _chunks(stream):
    return [chunk async for chunk in stream]


@pytest.mark.parametrize("stop", [(), ("e",)], ids=["free", "stop-string"])
def test_async_stream_equals_stream(engine, stop):
    documents = random_documents(3, 60)
    settings = {"max_new_tokens": 24, "temperature": 0.8, "seed": 3, "stop": stop}
    expected = list(engine.stream(QUESTION, documents, **settings))
    chunks = asyncio.run(_chunks(engine.astream(QUESTION, documents, **settings)))
    assert [(c.text, c.token_ids, c.finish_reason) for c in chunks] == [
        (c.text, c.token_ids, c.finish_reason) for c in expected
    ]
    result, reference = chunks[-1].result, expected[-1].result
    assert result.text == reference.text and torch.equal(result.kept_positions, reference.kept_positions)
    assert result.stats.compressed and result.stats.draft_ms > 0


def test_async_generate_layout_and_early_close(engine):
    layout = engine.layout(QUESTION, random_documents(3, 60))
    params = GenerationParams(max_new_tokens=12)
    assert (
        asyncio.run(engine.agenerate_layout(layout, params)).token_ids
        == engine.generate_layout(layout, params).token_ids
    )

    async def first_then_close():
        stream = engine.astream_layout(layout, GenerationParams(max_new_tokens=200))
        first = await anext(stream)
        await stream.aclose()
        return first

    assert asyncio.run(first_then_close()).result is None
    assert engine.generate_layout(layout, params).token_ids  # the model is free again


def test_async_stream_checks_length_when_called(engine):
    layout = engine.layout(QUESTION, random_documents(3, 60))
    with pytest.raises(ContextLengthError):
        engine.astream_layout(layout, GenerationParams(max_new_tokens=10_000))


# -- chats: chat_request is the first step of every chat method ----------------------------------------


def _stuffed_chat(documents: list[str]) -> list[ChatMessage]:
    """A chat whose system message holds ``documents`` verbatim (as a framework's template renders them)."""
    system = "Answer from the context.\n\n" + "\n\n".join(documents)
    return [ChatMessage("system", [system]), ChatMessage("user", [QUESTION])]


def test_chat_request_locates_documents_without_inserting_them_when_asked(engine):
    documents = random_documents(2, 60)
    params = GenerationParams(max_new_tokens=3)
    located = engine.chat_request(_stuffed_chat(documents), documents, params=params, insert_missing=False)
    assert located.chat.document_source == "argument-located" and located.chat.n_documents == 2
    assert located.params is params  # no tools: the decoding as given
    elsewhere = [ChatMessage("user", [QUESTION])]
    fallback = engine.chat_request(elsewhere, documents, insert_missing=False, question="Which bridge?")
    assert fallback.chat.document_source == "fallback"  # not found verbatim, so not inserted
    assert engine.tokenizer.decode(fallback.chat.layout.input_ids).count("Which bridge?") == 1  # appended, kept
    inserted = engine.chat_request(elsewhere, documents)
    assert inserted.chat.document_source == "argument-inserted" and inserted.chat.n_documents == 2


def test_stream_chat_answers_the_chat_request_as_stream_layout_does(engine):
    documents = random_documents(2, 60)
    messages = _stuffed_chat(documents)
    params = GenerationParams(max_new_tokens=8)
    request = engine.chat_request(messages, documents, params=params, question=QUESTION, insert_missing=False)
    expected = engine.generate_layout(request.chat.layout, request.params)
    result = engine.chat(messages, documents, question=QUESTION, insert_missing=False, max_new_tokens=8)
    assert result.token_ids == expected.token_ids and torch.equal(result.kept_positions, expected.kept_positions)
    assert result.stats.compressed and result.stats.prompt_tokens == len(request.chat.layout)


def test_async_chat_equals_chat(engine):
    documents = random_documents(2, 60)
    messages, settings = _stuffed_chat(documents), {"max_new_tokens": 12, "temperature": 0.8, "seed": 5}
    expected = list(engine.stream_chat(messages, documents, **settings))
    chunks = asyncio.run(_chunks(engine.astream_chat(messages, documents, **settings)))
    assert [(c.text, c.token_ids, c.finish_reason) for c in chunks] == [
        (c.text, c.token_ids, c.finish_reason) for c in expected
    ]
    result = asyncio.run(engine.achat(messages, documents, **settings))
    assert result.token_ids == expected[-1].result.token_ids and result.stats.compressed


def test_chat_methods_refuse_a_non_bool_insert_missing_before_any_model_runs(engine):
    messages = [ChatMessage("user", [QUESTION])]
    for call in (engine.chat_request, engine.stream_chat, engine.astream_chat, engine.chat):
        with pytest.raises(InvalidRequestError, match="insert_missing must be True or False, got str"):
            call(messages, ["a document"], insert_missing="no")


# -- keep_rate="auto" ---------------------------------------------------------------------------------


def _auto_selection(engine, layout, share, floor, ceiling):
    """The kept indices ``[K]`` ImportanceMass chooses from the engine's own draft importance."""
    from specprefill_rag.selection import ImportanceMass

    importance = engine.draft_scoring.score(layout).importance
    budget = ImportanceMass(share, floor, ceiling)
    return select_kept(importance, layout.document_index, keep_rate=budget, chunk_size=engine.config.chunk_size)


@pytest.mark.parametrize(
    ("share", "floor", "ceiling"), [(0.999, 0.05, 0.25), (0.5, 0.6, 0.7)], ids=["ceiling", "floor"]
)
def test_auto_keeps_between_floor_and_ceiling_and_reports_the_chosen_share(
    tiny_model, tiny_draft, tokenizer, share, floor, ceiling
):
    engine = SpecPrefillEngine.from_models(
        tiny_model,
        tokenizer,
        tiny_draft,
        keep_rate="auto",
        auto_keep_share=share,
        auto_keep_floor=floor,
        auto_keep_ceiling=ceiling,
        min_prompt_tokens=0,
        look_ahead=3,
        draft_cache_mb=0,
    )
    layout = engine.layout(QUESTION, random_documents(4, 120))
    stats = engine.generate_layout(layout, GenerationParams(max_new_tokens=4)).stats
    chunk = engine.config.chunk_size
    assert stats.keep_policy == "auto" and stats.compressed
    assert floor * stats.document_tokens <= stats.kept_document_tokens < ceiling * stats.document_tokens + chunk
    assert stats.keep_rate == stats.kept_document_tokens / stats.document_tokens  # the chosen share
    expected = _auto_selection(engine, layout, share, floor, ceiling)
    assert stats.kept_tokens == expected.numel()


def test_per_call_auto_overrides_a_fixed_engine_rate_and_back(tiny_model, tiny_draft, tokenizer):
    settings = {
        "auto_keep_share": 0.8,
        "auto_keep_floor": 0.6,
        "auto_keep_ceiling": 0.7,
        "min_prompt_tokens": 0,
        "look_ahead": 3,
    }
    fixed_engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, keep_rate=0.2, **settings)
    auto_engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, keep_rate="auto", **settings)
    documents, params = random_documents(4, 120), GenerationParams(max_new_tokens=4)
    layout = fixed_engine.layout(QUESTION, documents)
    expected = _auto_selection(fixed_engine, layout, 0.8, 0.6, 0.7)
    fixed = fixed_engine.generate_layout(layout, params)
    auto = fixed_engine.generate_layout(layout, params, keep_rate="auto")
    assert fixed.stats.keep_policy == "fixed" and fixed.stats.keep_rate < 0.6
    assert auto.stats.keep_policy == "auto" and torch.equal(auto.kept_positions, expected)
    asynchronous = asyncio.run(fixed_engine.agenerate(QUESTION, documents, keep_rate="auto", max_new_tokens=4))
    assert asynchronous.stats.keep_policy == "auto" and torch.equal(asynchronous.kept_positions, expected)
    back = auto_engine.generate_layout(layout, params, keep_rate=0.2)
    assert back.stats.keep_policy == "fixed" and torch.equal(back.kept_positions, fixed.kept_positions)
    by_default = auto_engine.generate_layout(layout, params)
    assert by_default.stats.keep_policy == "auto" and torch.equal(by_default.kept_positions, expected)


def test_auto_compresses_and_short_prompts_still_go_whole(engine, tiny_model, tokenizer):
    layout = engine.layout(QUESTION, random_documents(2, 50))
    assert engine.compresses(layout, "auto", None) and not engine.compresses(layout, 1.0, None)
    short = SpecPrefillEngine.from_models(tiny_model, tokenizer, keep_rate="auto", min_prompt_tokens=10_000)
    stats = short.generate(QUESTION, random_documents(2, 50), max_new_tokens=2).stats
    assert not stats.compressed and stats.keep_rate == 1.0 and stats.keep_policy == "auto"


def test_contiguous_positions_prefill_the_same_kept_tokens_as_an_ordinary_prompt(
    position_sensitive_model, tiny_draft, tokenizer
):
    main = position_sensitive_model
    settings = {"keep_rate": 0.2, "min_prompt_tokens": 0, "look_ahead": 3}
    original = SpecPrefillEngine.from_models(main, tokenizer, tiny_draft, **settings)
    contiguous = SpecPrefillEngine.from_models(main, tokenizer, tiny_draft, positions="contiguous", **settings)
    layout = contiguous.layout(QUESTION, random_documents(4, 80))
    params = GenerationParams(max_new_tokens=12)
    result, at_original = contiguous.generate_layout(layout, params), original.generate_layout(layout, params)
    kept = result.kept_positions
    assert result.stats.compressed and torch.equal(kept, at_original.kept_positions)
    prompt = contiguous.sparse_prompt(layout, kept)
    assert torch.equal(prompt.position_ids, torch.arange(kept.numel())) and prompt.prompt_length == kept.numel()
    # the kept tokens alone, as transformers numbers any prompt: 0..K-1
    assert result.token_ids == greedy_tokens(main, layout.input_ids[kept], 12, tokenizer.eos_token_id)
    assert result.token_ids != at_original.token_ids
    at_original_positions = original.sparse_prompt(layout, kept)
    assert torch.equal(at_original_positions.position_ids, kept) and at_original_positions.prompt_length == len(layout)


def kept_document_runs(engine: SpecPrefillEngine, chunking: str) -> list[str]:
    """The text of each run of kept document tokens when the engine chunks by ``chunking``."""
    documents = [" ".join(f"Fact {d}.{i} is in document {d}." for i in range(14)) for d in range(3)]
    engine = SpecPrefillEngine.from_models(
        engine.main.model, engine.tokenizer, engine.draft.model, keep_rate=0.3, min_prompt_tokens=0,
        look_ahead=3, chunking=chunking,
    )  # fmt: skip
    layout = engine.layout(QUESTION, documents)
    kept = torch.zeros(len(layout), dtype=torch.bool)
    kept[engine.select(layout).kept] = True
    kept &= layout.document_index >= 0
    runs, current = [], []
    for position in range(len(layout)):
        if kept[position] and (not current or current[-1] == position - 1):
            current.append(position)
            continue
        if current:
            runs.append(engine.tokenizer.decode(layout.input_ids[current]))
        current = [position] if kept[position] else []
    return runs + ([engine.tokenizer.decode(layout.input_ids[current])] if current else [])


def test_sentence_chunking_keeps_whole_sentences_where_token_chunks_cut_them(engine):
    sentence = r"(\s*Fact \d\.\d+ is in document \d\.)+"
    by_sentences = kept_document_runs(engine, "sentences")
    assert by_sentences and all(re.fullmatch(sentence, run) for run in by_sentences)
    assert not all(re.fullmatch(sentence, run) for run in kept_document_runs(engine, "tokens"))
