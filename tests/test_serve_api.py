"""The gateway's OpenAI API, driven by the real ``openai`` client against a gateway on 127.0.0.1
(tiny random models): answers equal the in-process engine's, stats ride along, bad requests get 400s
that name the field, the key is checked, metrics count what happened."""

import asyncio
import json

import httpx
import openai
import pytest

from specprefill_rag import GenerationParams, SpecPrefillEngine
from specprefill_rag.prompt.chat import ChatMessage, chat_layout
from specprefill_rag.testing import random_documents
from tests.serve_helpers import MODEL, QUESTION, SYSTEM, chat_messages, reference_text, running_gateway, tiny_engine

DOCUMENTS = random_documents(3, 60)


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=60)


def ask(client, documents=DOCUMENTS, **options):
    extra = {"spec_prefill": {"documents": documents, **options}}
    return client.chat.completions.create(
        model=MODEL, messages=chat_messages(), max_tokens=8, temperature=0, extra_body=extra
    )


def test_chat_answer_equals_the_in_process_engine(client, engine):
    response = ask(client)
    stats = response.model_extra["spec_prefill"]
    assert response.choices[0].message.content == reference_text(engine, DOCUMENTS)
    assert stats["compressed"] and stats["document_source"] == "argument-inserted" and stats["n_documents"] == 3
    assert response.usage.prompt_tokens == stats["prompt_tokens"] > stats["kept_tokens"]  # the full prompt counts
    assert response.usage.completion_tokens == stats["completion_tokens"]


def test_a_contiguous_positions_engine_answers_through_the_gateway_as_in_process(
    tokenizer, tiny_draft, position_sensitive_model
):
    original = tiny_engine(tokenizer, position_sensitive_model, tiny_draft)
    contiguous_config = original.config.model_copy(update={"positions": "contiguous"})
    contiguous = SpecPrefillEngine.from_models(
        position_sensitive_model, tokenizer, tiny_draft, config=contiguous_config
    )
    expected = reference_text(contiguous, DOCUMENTS)
    assert expected != reference_text(original, DOCUMENTS), "the positions must matter for this check"
    with running_gateway(contiguous) as url:
        renumbered = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert ask(renumbered).choices[0].message.content == expected


def test_streamed_and_async_answers_equal_the_whole_one(client, gateway, engine):
    expected = reference_text(engine, DOCUMENTS)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages(),
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"spec_prefill": {"documents": DOCUMENTS}},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.prompt_tokens == chunks[-1].model_extra["spec_prefill"]["prompt_tokens"]
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason in ("stop", "length")

    async def async_answer():
        async with openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=60) as aclient:
            response = await aclient.chat.completions.create(
                model=MODEL,
                messages=chat_messages(),
                max_tokens=8,
                temperature=0,
                extra_body={"spec_prefill": {"documents": DOCUMENTS}},
            )
            return response.choices[0].message.content

    assert asyncio.run(async_answer()) == expected


def test_per_request_options(client, engine):
    whole = ask(client, enabled=False).model_extra["spec_prefill"]
    assert not whole["compressed"] and whole["draft_ms"] == 0
    tighter = ask(client, keep_rate=0.1).model_extra["spec_prefill"]
    assert tighter["kept_document_tokens"] < ask(client).model_extra["spec_prefill"]["kept_document_tokens"]
    capped = ask(client, max_document_tokens=32).model_extra["spec_prefill"]
    assert capped["kept_document_tokens"] <= 32
    assert ask(client, keep_rate=0.1).choices[0].message.content == reference_text(engine, DOCUMENTS, keep_rate=0.1)


def _engine_auto(engine, documents, keep_rate="auto"):
    """The in-process engine's stats for the tests' chat over ``documents``."""
    messages = [ChatMessage("system", [SYSTEM]), ChatMessage("user", [QUESTION])]
    layout = chat_layout(engine.tokenizer, messages, documents).layout
    return engine.generate_layout(layout, GenerationParams(max_new_tokens=8), keep_rate).stats


@pytest.fixture(scope="module")
def auto_engine(tokenizer, tiny_model, tiny_draft):
    """keep_rate 0.3, but "auto" keeps 60-70%: a gateway that ignored "auto" could not pass for it."""
    return SpecPrefillEngine.from_models(
        tiny_model,
        tokenizer,
        tiny_draft,
        keep_rate=0.3,
        min_prompt_tokens=0,
        look_ahead=2,
        auto_keep_floor=0.6,
        auto_keep_ceiling=0.7,
    )


def test_keep_rate_auto_per_request_is_the_engines_choice(auto_engine):
    with running_gateway(auto_engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        auto, fixed = ask(client, keep_rate="auto"), ask(client).model_extra["spec_prefill"]
    stats, expected = auto.model_extra["spec_prefill"], _engine_auto(auto_engine, DOCUMENTS)
    assert stats["keep_policy"] == "auto" and stats["compressed"] and stats["keep_rate"] >= 0.6
    assert stats["kept_document_tokens"] == expected.kept_document_tokens and stats["keep_rate"] == expected.keep_rate
    assert auto.choices[0].message.content == reference_text(auto_engine, DOCUMENTS, keep_rate="auto")
    assert fixed["keep_policy"] == "fixed" and fixed["keep_rate"] < 0.6


def test_batched_drafts_choose_auto_budgets_like_the_engine(auto_engine):
    requests = [random_documents(3, 50 + 10 * i, seed=40 + i) for i in range(4)]
    with running_gateway(auto_engine, keep_rate="auto", draft_batch_size=4, batch_window_ms=300) as url:

        async def concurrent():
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as aclient:
                asks = [
                    aclient.chat.completions.create(
                        model=MODEL,
                        messages=chat_messages(),
                        max_tokens=2,
                        temperature=0,
                        extra_body={"spec_prefill": {"documents": documents}},
                    )
                    for documents in requests
                ]
                return await asyncio.wait_for(asyncio.gather(*asks), 120)

        answers = [a.model_extra["spec_prefill"] for a in asyncio.run(concurrent())]
    assert max(stats["draft_batch_size"] for stats in answers) > 1, "the requests should share a draft batch"
    for stats, documents in zip(answers, requests):
        expected = _engine_auto(auto_engine, documents)
        assert stats["keep_policy"] == "auto" and stats["kept_document_tokens"] == expected.kept_document_tokens


def test_document_content_parts_are_candidates(client):
    content = [{"type": "document", "text": d, "title": f"doc {i}"} for i, d in enumerate(DOCUMENTS)]
    content.append({"type": "text", "text": QUESTION})
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0
    )
    stats = response.model_extra["spec_prefill"]
    assert stats["document_source"] == "blocks" and stats["n_documents"] == 3 and stats["compressed"]


def test_text_completion_locates_documents_in_the_prompt(client, engine):
    prompt = "Context:\n" + "\n\n".join(DOCUMENTS) + "\nQuestion: " + QUESTION + "\nAnswer:"
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"spec_prefill": {"documents": DOCUMENTS}}
    )
    stats = response.model_extra["spec_prefill"]
    assert stats["document_source"] == "argument-located" and stats["compressed"]
    assert stats["prompt_tokens"] == len(engine.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    fallback = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert fallback.model_extra["spec_prefill"]["document_source"] == "fallback"  # every token a candidate
    assert fallback.choices[0].text == engine.generate_text(prompt, max_new_tokens=6).text
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == fallback.choices[0].text


@pytest.mark.parametrize(
    ("extra", "field", "says"),
    [
        ({"logit_bias": {"5": 1}}, "logit_bias", "unsupported field 'logit_bias'"),
        ({"n": 2}, "n", "n=2 is not supported"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ({"spec_prefill": {"keep_rate": 1.5}}, "spec_prefill.keep_rate", "keep_rate must be in (0, 1], got 1.5"),
        ({"spec_prefill": {"keep_rate": "Auto"}}, "spec_prefill.keep_rate", "a number or 'auto', got 'Auto'"),
        ({"spec_prefill": {"keep_ratio": 0.2}}, "spec_prefill.keep_ratio", "unsupported field"),
        ({"messages": [{"role": "narrator", "content": "x"}]}, "messages.0.role", "'system', 'developer', 'user'"),
        (
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]},
            "messages.0.tool_call_id",
            "which no earlier assistant message's tool_calls made",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Q?"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
                    {"role": "user", "content": "Q?"},
                ]
            },
            "messages.1.tool_calls.0.function",
            "is required",
        ),
        ({"tools": [{"type": "function", "function": {"name": "web search"}}]}, "tools.0.function.name", "1-64"),
        ({"tool_choice": "required"}, "tool_choice", "no tools are given"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs json_schema"),
        ({"functions": [{"name": "search"}]}, "functions", "use the modern fields: tools and tool_choice"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content.0",
            "'image_url'",
        ),
        ({"spec_prefill": {"documents": []}}, "spec_prefill.documents", "at least 1 item"),
        ({"messages": [{"role": "assistant", "content": "Hi"}]}, "messages", "end with one"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"max_tokens": 5000}, "max_tokens", "exceeds the main model's context of 1024"),
    ],
)
def test_bad_requests_get_a_400_naming_the_field(client, extra, field, says):
    body = {"model": MODEL, "messages": chat_messages(), "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/chat/completions", body=body, cast_to=object)
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == field and says in error["message"]


def test_unknown_model_is_404_and_the_next_request_succeeds(client):
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.chat.completions.create(model="gpt-4o", messages=chat_messages(), max_tokens=2)
    assert ask(client).choices[0].message.content


def test_models_health_tokenize_and_metrics(gateway, client, engine):
    card = client.models.list().data[0]
    assert card.id == MODEL and card.model_extra["spec_prefill"]["gateway"] is True
    assert card.model_extra["max_model_len"] == engine.backend.context_length
    assert httpx.get(gateway + "/health", timeout=10).json()["status"] == "ok"
    tokens = httpx.post(gateway + "/tokenize", json={"model": MODEL, "prompt": QUESTION}, timeout=10).json()
    assert tokens["tokens"] == engine.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    ask(client)
    metrics = httpx.get(gateway + "/metrics", timeout=10).text
    assert 'specprefill_requests_total{endpoint="chat",outcome="ok"}' in metrics
    assert "specprefill_queue_depth 0.0" in metrics and "specprefill_draft_ms_count" in metrics
    assert "specprefill_ttft_ms_count" in metrics and "specprefill_kept_share_count" in metrics
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
    cache = engine.draft.prefix_cache
    assert float(values["specprefill_draft_cache_bytes"]) == cache.nbytes > 0
    assert float(values["specprefill_draft_cache_entries"]) == len(cache) > 0


def test_api_key_is_required_on_v1_but_not_on_health(engine):
    with running_gateway(engine, api_key="s3cret") as url:
        anonymous = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.list()
        with pytest.raises(openai.AuthenticationError):
            ask(anonymous)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0, timeout=30)
        assert ask(keyed).choices[0].message.content


def test_an_open_gateway_on_a_public_address_warns_at_start(engine, caplog):
    from fastapi.testclient import TestClient

    from specprefill_rag.serve import GatewaySettings, create_app

    with caplog.at_level("WARNING", logger="specprefill_rag.serve"):
        with TestClient(create_app(GatewaySettings(host="0.0.0.0", served_model_name=MODEL), engine)) as local:
            assert local.get("/health").status_code == 200
    assert "no --api-key" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="specprefill_rag.serve"):
        with TestClient(create_app(GatewaySettings(host="127.0.0.1", served_model_name=MODEL), engine)):
            pass
    assert "no --api-key" not in caplog.text


def test_the_selection_stats_are_response_headers_too(client, gateway):
    """Known before the first token, so a stream carries them too; equal to the body's ``spec_prefill``."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_tokens=8,
        extra_body={"spec_prefill": {"documents": DOCUMENTS}},
    )
    stats = raw.parse().model_extra["spec_prefill"]
    assert raw.headers["x-specprefill-compressed"] == "true" and "x-specprefill-uncompressed-reason" not in raw.headers
    for name in ("prompt_tokens", "document_tokens", "kept_tokens", "kept_document_tokens", "n_documents"):
        assert int(raw.headers["x-specprefill-" + name.replace("_", "-")]) == stats[name]
    assert float(raw.headers["x-specprefill-keep-rate"]) == pytest.approx(stats["keep_rate"], rel=1e-3)
    assert raw.headers["x-specprefill-draft-path"] == stats["draft_path"] == "direct"
    assert raw.headers["x-specprefill-document-source"] == stats["document_source"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", gateway + "/v1/chat/completions", json=body, timeout=60) as streamed:
        assert streamed.headers["x-specprefill-compressed"] == "false"
        assert streamed.headers["x-specprefill-uncompressed-reason"] == "no_documents"
        assert streamed.headers["x-specprefill-keep-rate"] == "1"
        events = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    assert json.loads(events[-1][6:])["spec_prefill"]["uncompressed_reason"] == "no_documents"


def test_penalties_reach_the_decoder_and_out_of_range_ones_are_a_400(client):
    body = {"model": MODEL, "messages": chat_messages(), "max_tokens": 8, "temperature": 0}
    plain = client.post("/chat/completions", body=body, cast_to=object)
    penalised = client.post(
        "/chat/completions", body={**body, "presence_penalty": 2.0, "frequency_penalty": 2.0}, cast_to=object
    )
    assert plain["choices"][0]["message"]["content"] != penalised["choices"][0]["message"]["content"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/chat/completions", body={**body, "frequency_penalty": 2.5}, cast_to=object)
    assert refused.value.body["param"] == "frequency_penalty"
