"""``draft_layers`` (issue #44 part 4): a separate draft runs only its first n layers, scoring with its last
``self_draft_window`` prompt tokens (it has no output to decode look-ahead tokens from), and the auto floor counts
only the parameters it runs."""

import pytest
from pydantic import ValidationError

from specprefill_rag.config import GenerationParams, SpecPrefillConfig
from specprefill_rag.draft.cost import draft_parameter_count, parameter_count, pays_from
from specprefill_rag.draft.model import LayerPrefixDraft, ModelDraft
from specprefill_rag.engine import SpecPrefillEngine
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.kvcache.prefix_cache import DraftIdentity
from specprefill_rag.testing import build_model, build_tokenizer, random_documents


@pytest.fixture(scope="module")
def deep_draft(tokenizer):
    return build_model(tokenizer, layers=4, seed=3, initializer_range=0.2)


@pytest.fixture(scope="module")
def two_layer_copy(tokenizer, deep_draft):
    """A 2-layer model holding the deep draft's embeddings, first two layers, norm and head: the reference run."""
    model = build_model(tokenizer, layers=2, seed=0, initializer_range=0.2)
    missing, unexpected = model.load_state_dict(deep_draft.state_dict(), strict=False)
    assert not missing and {key.split(".")[2] for key in unexpected} == {"2", "3"}
    return model


@pytest.fixture(scope="module")
def big_main(tokenizer):
    """A main model with more parameters than the draft, so that the draft pays from some prompt length."""
    return build_model(tokenizer, layers=8, seed=5)


def layout_of(engine, seed=1):
    return engine.layout("When did the bridge open?", random_documents(3, 40, seed=seed))


def test_n_layers_score_as_a_model_of_those_n_layers(tokenizer, big_main, deep_draft, two_layer_copy):
    engine = SpecPrefillEngine.from_models(big_main, tokenizer, deep_draft, draft_layers=2, min_prompt_tokens=0)
    assert isinstance(engine.draft, LayerPrefixDraft) and engine.draft.n_layers == 2
    assert engine.draft.query_window == SpecPrefillConfig().self_draft_window and engine.draft_path == "direct"
    layout = layout_of(engine)
    reference = LayerPrefixDraft(two_layer_copy, 2, 13, engine.config.self_draft_window).score(layout.input_ids)
    scored = engine.draft_scoring.importance(layout)
    assert scored.tolist() == pytest.approx(reference.tolist(), abs=1e-6)
    every_layer = LayerPrefixDraft(deep_draft, 4, 13, engine.config.self_draft_window).score(layout.input_ids)
    assert (scored - every_layer).abs().max() > 1e-3  # the two layers left out would have changed the scores


def test_the_window_setting_sets_the_queries(tokenizer, big_main, deep_draft):
    engine = SpecPrefillEngine.from_models(big_main, tokenizer, deep_draft, draft_layers=3, self_draft_window=4)
    assert (engine.draft.n_layers, engine.draft.query_window) == (3, 4)
    assert engine.config.effective_look_ahead == 1 and engine.draft_scoring.look_ahead == 1


def test_without_the_setting_the_draft_runs_whole_and_decodes(tokenizer, big_main, deep_draft):
    engine = SpecPrefillEngine.from_models(big_main, tokenizer, deep_draft, look_ahead=3)
    assert isinstance(engine.draft, ModelDraft) and engine.draft.look_ahead == 3


@pytest.mark.parametrize(
    ("settings", "queries"),
    [
        ({}, "look_ahead"),  # the default for a separate draft (the window lost answers after tool results)
        ({"look_ahead": 1}, "look_ahead"),  # the last prompt token alone: the paper's look-ahead of 1
        ({"draft_queries": "window"}, "window"),
        ({"draft_queries": "window", "look_ahead": 1}, "window"),
        ({"draft_layers": 2}, "window"),
    ],
)
def test_a_separate_draft_scores_with_the_look_ahead_unless_the_window_is_asked_for(
    tokenizer, big_main, deep_draft, settings, queries
):
    engine = SpecPrefillEngine.from_models(big_main, tokenizer, deep_draft, **settings)
    assert engine.config.queries == queries
    assert isinstance(engine.draft, ModelDraft if queries == "look_ahead" else LayerPrefixDraft)
    expected_look_ahead = settings.get("look_ahead", 8) if queries == "look_ahead" else 1
    assert engine.draft_scoring.look_ahead == engine.config.effective_look_ahead == expected_look_ahead


def test_a_self_draft_scores_with_the_window_whatever_look_ahead_says(tokenizer, big_main):
    engine = SpecPrefillEngine.from_models(big_main, tokenizer, None, draft="self:2", look_ahead=1)
    assert engine.config.queries == "window" and engine.draft_scoring.look_ahead == 1


def test_window_queries_run_the_whole_draft_without_a_look_ahead(tokenizer, big_main, deep_draft):
    """``draft_queries="window"``: every layer, the last self_draft_window prompt tokens as queries, nothing decoded;
    the auto floor counts no look-ahead steps."""
    engine = SpecPrefillEngine.from_models(big_main, tokenizer, deep_draft, draft_queries="window", min_prompt_tokens=0)
    assert isinstance(engine.draft, LayerPrefixDraft) and engine.draft.n_layers == 4
    assert engine.draft.query_window == 16 and engine.draft_scoring.look_ahead == 1
    layout = layout_of(engine)
    reference = LayerPrefixDraft(deep_draft, 4, 13, 16).score(layout.input_ids)
    assert engine.draft_scoring.importance(layout).tolist() == pytest.approx(reference.tolist(), abs=1e-6)
    decoding = ModelDraft(deep_draft, 8, 13, frozenset()).score(layout.input_ids)
    assert (reference - decoding).abs().max() > 1e-3  # the look-ahead's queries would have scored otherwise
    auto = SpecPrefillEngine.from_models(big_main, tokenizer, deep_draft, draft_queries="window")
    assert auto.min_prompt_tokens == pays_from(parameter_count(deep_draft) / parameter_count(big_main), 1)


def test_the_cost_counts_the_layers_the_draft_runs(tokenizer, big_main, deep_draft, two_layer_copy):
    assert draft_parameter_count(deep_draft, 2) == parameter_count(two_layer_copy)
    assert draft_parameter_count(deep_draft) == draft_parameter_count(deep_draft, 4) == parameter_count(deep_draft)
    main_parameters = parameter_count(big_main)
    whole = SpecPrefillEngine.from_models(big_main, tokenizer, deep_draft, draft_queries="look_ahead")
    short = SpecPrefillEngine.from_models(big_main, tokenizer, deep_draft, draft_layers=2)
    assert whole.min_prompt_tokens == pays_from(parameter_count(deep_draft) / main_parameters, 8)
    assert short.min_prompt_tokens == pays_from(parameter_count(two_layer_copy) / main_parameters, 1)
    assert short.min_prompt_tokens < whole.min_prompt_tokens


def test_more_layers_than_the_draft_has_are_refused(tokenizer, big_main, deep_draft):
    with pytest.raises(
        InvalidRequestError, match=r"draft_layers=5 asks for more layers than the draft model has \(4\)"
    ):
        SpecPrefillEngine.from_models(big_main, tokenizer, deep_draft, draft_layers=5)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"draft": "self:2", "draft_layers": 2}, "name the main model's layers as 'self:<n>'"),
        ({"draft": "smollm2-135m", "draft_layers": 2, "look_ahead": 8}, "no output to decode look-ahead tokens"),
        ({"draft": "smollm2-135m", "draft_layers": 0}, "greater than or equal to 1"),
        (
            {"draft": "smollm2-135m", "draft_queries": "window", "look_ahead": 4},
            "decodes nothing; leave look_ahead unset or set it to 1",
        ),
        ({"draft": "self:2", "draft_queries": "look_ahead"}, "leave draft_queries unset or set it to 'window'"),
        ({"draft": "smollm2-135m", "draft_layers": 2, "draft_queries": "look_ahead"}, "name a whole draft model"),
        ({"draft": "smollm2-135m", "draft_queries": "last"}, "draft_queries\n.*'look_ahead' or 'window'"),
    ],
)
def test_settings_that_cannot_hold_are_refused(settings, message):
    with pytest.raises(ValidationError, match=message):
        SpecPrefillConfig(**settings)


def test_a_truncated_draft_of_another_vocabulary_maps_and_caches_its_layers(tiny_model, tokenizer):
    draft_tokenizer = build_tokenizer(vocab_size=300)
    other = build_model(draft_tokenizer, layers=3, max_positions=4096, seed=1)
    engine = SpecPrefillEngine.from_models(
        tiny_model,
        tokenizer,
        other,
        draft_tokenizer=draft_tokenizer,
        draft_layers=1,
        min_prompt_tokens=0,
        draft_document_cache=True,
    )
    assert engine.draft_path == "mapped" and engine.draft.n_layers == 1
    documents = random_documents(2, 50, seed=14)
    assert engine.warm_documents(documents) == 2
    stats = engine.generate_layout(
        layout_of_documents(engine, documents[::-1]), GenerationParams(max_new_tokens=1)
    ).stats
    assert stats.draft_documents_cached == 2
    entries = engine.document_cache._entries  # the store is shared by the process's drafts: this one's entries
    mine = [key for key in entries if key.draft.model_id == DraftIdentity.of(other, 1).model_id]
    assert len(mine) == 3 and {key.draft.layers for key in mine} == {1}  # the prefix, two documents: one layer each


def layout_of_documents(engine, documents):
    return engine.layout("When did the bridge open?", documents)
