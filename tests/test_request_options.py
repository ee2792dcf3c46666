"""A request's options are one typed object, checked once at the door and resolved in layers (the request's, a
gateway's settings, the engine's config); the pipeline plans a request from it and applies the caller's error
policy (tiny random models)."""

from __future__ import annotations

import pytest
import torch

import specprefill_rag.request as request_module
from specprefill_rag import DraftLimitError, DraftScoringError, InvalidRequestError, SpecPrefillEngine
from specprefill_rag.pipeline import DocumentCacheOff
from specprefill_rag.prompt.chat import ChatMessage, chat_layout
from specprefill_rag.request import RequestOptions
from specprefill_rag.testing import random_documents

DOCUMENTS = random_documents(3, 60, seed=4203)
SETTINGS = {"keep_rate": 0.3, "min_prompt_tokens": 0, "look_ahead": 2}


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"keep_rate": 2.0}, "keep_rate"),
        ({"max_document_tokens": -1}, "max_document_tokens"),
        ({"max_document_tokens": True}, "max_document_tokens"),
        ({"reselect": "yes"}, "reselect"),
        ({"draft_document_cache": 1}, "draft_document_cache"),
        ({"enabled": None}, "enabled"),
        ({"tenant": "  "}, "tenant"),
    ],
)
def test_a_bad_option_is_refused_naming_it(options, names):
    with pytest.raises(InvalidRequestError, match=names):
        RequestOptions.checked(**options)


def test_unset_options_take_the_defaults_and_set_ones_stay():
    asked = RequestOptions(keep_rate=0.5, reselect=False)
    defaults = RequestOptions(keep_rate=0.2, max_document_tokens=30, reselect=True, draft_document_cache=True)
    assert asked.over(defaults) == RequestOptions(0.5, 30, False, True)
    assert RequestOptions(enabled=False).over(defaults).enabled is False


def test_the_keep_rate_is_checked_once_per_request(tokenizer, tiny_model, tiny_draft, monkeypatch):
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, **SETTINGS)
    calls = []
    checked = request_module.check_keep_rate
    monkeypatch.setattr(request_module, "check_keep_rate", lambda rate: calls.append(rate) or checked(rate))
    engine.generate("When?", DOCUMENTS, keep_rate=0.4, max_new_tokens=1)
    assert calls == [0.4]


def _layout(engine):
    return chat_layout(engine.tokenizer, [ChatMessage("user", ["When?"])], DOCUMENTS).layout


def test_a_prompt_too_long_for_the_draft_is_refused_whatever_the_policy(tokenizer, tiny_model, tiny_draft):
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, max_draft_tokens=64, **SETTINGS)
    policy_calls = []
    with pytest.raises(DraftLimitError, match="at most 64"):
        engine.pipeline.plan(_layout(engine), RequestOptions(), on_draft_error=policy_calls.append)
    assert policy_calls == []  # not a draft failure: the client's to fix
    whole = engine.pipeline.plan(_layout(engine), RequestOptions(keep_rate=1.0))  # no draft: nothing to refuse
    assert whole.prepared is None and whole.budget.skipped == "keep_all"


class FailingScorer:
    def score(self, prepared, documents, options):
        raise DraftScoringError("non-finite scores")


def test_a_failed_draft_follows_the_callers_policy(tokenizer, tiny_model, tiny_draft):
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, **SETTINGS)
    plan = engine.pipeline.plan(_layout(engine), RequestOptions())
    with pytest.raises(DraftScoringError):
        engine.pipeline.choose(plan, FailingScorer())  # the engine's policy: raise
    whole = engine.pipeline.choose(plan, FailingScorer(), on_draft_error=lambda error: f"failed: {error}")
    assert whole.draft_error == "failed: non-finite scores" and whole.uncompressed_reason == "draft_error"
    assert torch.equal(whole.kept, torch.arange(len(plan.layout)))


def test_the_document_cache_flag_is_checked_where_options_are_resolved(tokenizer, tiny_model, tiny_draft):
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, document_cache_mb=0, **SETTINGS)
    with pytest.raises(DocumentCacheOff, match="document_cache_mb=0"):
        engine.pipeline.resolve(RequestOptions(draft_document_cache=True))
    assert engine.pipeline.resolve(RequestOptions()).draft_document_cache is False
