"""One request path: the same chats through the engine (its chat path, the draft run inline) and through the
gateway (its draft queue as the scorer) keep the same tokens, go whole for the same reasons and fail with the
same errors (tiny random models; each path has its own engine, so their selection memos stay apart).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from specprefill_rag import DraftLimitError, DraftScoringError, GenerationParams, InvalidRequestError
from specprefill_rag.engine import ChatRequest, SpecPrefillEngine
from specprefill_rag.prompt.chat import ChatMessage
from specprefill_rag.results import GenerationResult
from specprefill_rag.serve import GatewaySettings, create_app
from specprefill_rag.serve.errors import GatewayError, as_gateway_error
from specprefill_rag.serve.gateway import Plan
from specprefill_rag.serve.schema import SpecPrefillOptions
from specprefill_rag.testing import build_model, random_documents
from tests.serve_helpers import MODEL, SYSTEM, running_gateway

DOCUMENTS = random_documents(3, 60, seed=4201)
CONFIG = {"keep_rate": 0.3, "min_prompt_tokens": 0, "look_ahead": 2, "draft_cache_mb": 0}
PARAMS = GenerationParams(max_new_tokens=2)


def turn(question: str = "When did the bridge open?") -> list[ChatMessage]:
    return [ChatMessage("system", [SYSTEM]), ChatMessage("user", [question])]


def pair(tokenizer, main, draft, **config) -> tuple[SpecPrefillEngine, SpecPrefillEngine]:
    """Two engines over the same models and config: one answers in-process, the other behind the gateway."""
    settings = {**CONFIG, **config}
    return tuple(SpecPrefillEngine.from_models(main, tokenizer, draft, **settings) for _ in range(2))  # type: ignore[return-value]


def request(engine: SpecPrefillEngine, messages=None, documents=DOCUMENTS) -> ChatRequest:
    return engine.chat_request(messages or turn(), documents, params=PARAMS)


def through_engine(engine: SpecPrefillEngine, chat: ChatRequest, **options) -> GenerationResult | Exception:
    chunks = []
    try:
        chunks = list(engine.stream_layout(chat.chat.layout, chat.params, **options))
    except Exception as error:
        return error
    assert chunks[-1].result is not None
    return chunks[-1].result


def through_gateway(engine: SpecPrefillEngine, chat: ChatRequest, settings=None, **options) -> dict | Exception:
    """The final result of :meth:`Gateway.answer` (its selection's kept tokens, its stats), or its error."""
    gateway = create_app(GatewaySettings(served_model_name=MODEL, **CONFIG, **(settings or {})), engine).state.gateway
    plan = Plan(chat.chat, chat.params, SpecPrefillOptions(**options))

    async def answer():
        try:
            answers = [answer async for answer in gateway.answer(plan)]
        except Exception as error:
            return error
        finally:
            await gateway.queue.stop()
        return {"result": answers[-1].chunk.result, "spec_prefill": answers[-1].spec_prefill(plan)}

    return asyncio.run(answer())


def assert_same_selection(local: GenerationResult, served: dict) -> None:
    assert torch.equal(local.kept_positions, served["result"].kept_positions)
    for name in ("compressed", "uncompressed_reason", "reused_spans", "draft_documents_cached", "keep_policy"):
        assert getattr(local.stats, name) == served["spec_prefill"][name], name


@pytest.mark.parametrize(
    ("documents", "config", "options", "reason"),
    [
        (DOCUMENTS, {}, {}, None),
        (DOCUMENTS, {}, {"keep_rate": "auto"}, None),
        (DOCUMENTS, {"max_document_tokens": 20}, {}, None),
        (DOCUMENTS, {}, {"keep_rate": 1.0}, "keep_all"),
        (None, {}, {}, "no_documents"),
        (DOCUMENTS, {"min_prompt_tokens": 100_000}, {}, "short_prompt"),
    ],
    ids=["compressed", "auto", "capped", "keep-all", "no-documents", "short-prompt"],
)
def test_both_paths_keep_the_same_tokens_for_the_same_reason(
    tokenizer, tiny_model, tiny_draft, documents, config, options, reason
):
    local_engine, served_engine = pair(tokenizer, tiny_model, tiny_draft, **config)
    chat = request(local_engine, documents=documents)
    local = through_engine(local_engine, chat, **options)
    served = through_gateway(served_engine, chat, **options)
    assert_same_selection(local, served)
    assert local.stats.uncompressed_reason == reason
    assert (len(local.kept_positions) < len(chat.chat.layout)) == (reason is None)


def test_a_second_turn_recalls_the_same_spans_on_both_paths(tokenizer, tiny_model, tiny_draft):
    local_engine, served_engine = pair(tokenizer, tiny_model, tiny_draft)
    asked = ChatMessage("user", ["\n\n".join(DOCUMENTS) + "\n\nWhen did the bridge open?"])
    first = [ChatMessage("system", [SYSTEM]), asked]
    second = [*first, ChatMessage("assistant", ["In 1890."]), ChatMessage("user", ["Who built it?"])]
    for messages in (first, second):
        chat = request(local_engine, messages)
        local = through_engine(local_engine, chat, reselect=False)
        served = through_gateway(served_engine, chat, reselect=False)
        assert_same_selection(local, served)
    assert local.stats.reused_spans == len(DOCUMENTS) and local.stats.draft_ms == 0


def test_documents_from_the_document_cache_are_the_same_on_both_paths(tokenizer, tiny_model, tiny_draft):
    local_engine, served_engine = pair(tokenizer, tiny_model, tiny_draft)
    documents = random_documents(3, 50, seed=4202)
    chat = request(local_engine, documents=documents)
    assert local_engine.warm_documents(documents, SYSTEM) == 3  # both engines' drafts share the process's cache
    local = through_engine(local_engine, chat, draft_document_cache=True)
    served = through_gateway(served_engine, chat, draft_document_cache=True)
    assert_same_selection(local, served)
    assert local.stats.draft_documents_cached == 3


def test_a_document_cache_that_is_off_is_refused_alike(tokenizer, tiny_model, tiny_draft):
    local_engine, served_engine = pair(tokenizer, tiny_model, tiny_draft, document_cache_mb=0)
    chat = request(local_engine)
    local = through_engine(local_engine, chat, draft_document_cache=True)
    served = through_gateway(served_engine, chat, {"document_cache_mb": 0}, draft_document_cache=True)
    assert isinstance(local, InvalidRequestError) and isinstance(served, GatewayError)
    assert (served.status, served.param, served.message) == (400, "spec_prefill.draft_document_cache", str(local))


def test_a_prompt_too_long_for_the_draft_is_a_client_error_on_both_paths(tokenizer, tiny_model, tiny_draft):
    """Not sent whole in the gateway (a full-cost request the client did not ask for): both refuse it, naming the
    limit, and ``keep_rate=1.0`` (no draft) is the way to send it whole on both.
    """
    local_engine, served_engine = pair(tokenizer, tiny_model, tiny_draft, max_draft_tokens=64)
    chat = request(local_engine)
    local = through_engine(local_engine, chat)
    for policy in ("full", "fail"):
        served = through_gateway(served_engine, chat, {"max_draft_tokens": 64, "on_draft_error": policy})
        assert isinstance(local, DraftLimitError) and type(served) is DraftLimitError
        assert str(served) == str(local)  # the same refusal; the app words it for the wire:
        answer = as_gateway_error(served, False)
        assert (answer.status, answer.param) == (400, "messages")
        assert '"spec_prefill": {"keep_rate": 1.0}' in answer.message and "--max-draft-tokens" in answer.message
    assert_same_selection(
        through_engine(local_engine, chat, keep_rate=1.0), through_gateway(served_engine, chat, keep_rate=1.0)
    )


def test_too_long_is_a_400_over_http(tokenizer, tiny_model, tiny_draft):
    _, served_engine = pair(tokenizer, tiny_model, tiny_draft, max_draft_tokens=64)
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When?"}],
        "max_tokens": 2,
        "spec_prefill": {"documents": DOCUMENTS},
    }
    with running_gateway(served_engine, max_draft_tokens=64, draft_cache_mb=0) as url:
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "the draft may score at most 64" in error["message"]


@pytest.fixture(scope="module")
def broken_draft(tokenizer):
    """A draft whose attention gives NaN: every prompt it scores fails with non-finite scores."""
    draft = build_model(tokenizer, layers=1, seed=1)
    with torch.no_grad():
        draft.model.layers[0].self_attn.k_proj.weight.fill_(float("nan"))
    return draft


def test_a_failed_draft_raises_in_the_engine_and_follows_the_policy_in_the_gateway(tokenizer, tiny_model, broken_draft):
    local_engine, served_engine = pair(tokenizer, tiny_model, broken_draft)
    chat = request(local_engine)
    local = through_engine(local_engine, chat)
    assert isinstance(local, DraftScoringError)
    whole = through_gateway(served_engine, chat, {"on_draft_error": "full"})
    stats = whole["spec_prefill"]
    assert stats["uncompressed_reason"] == "draft_error" and stats["draft_error"] == f"DraftScoringError: {local}"
    assert len(whole["result"].kept_positions) == len(chat.chat.layout)
    failed = through_gateway(served_engine, chat, {"on_draft_error": "fail"})
    assert isinstance(failed, GatewayError) and failed.status == 500 and str(local) in failed.message
