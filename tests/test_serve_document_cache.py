"""The per-document draft cache through the gateway (issue #28): per request (spec_prefill.draft_document_cache),
as the gateway's default, on the mapped path, and warmed at ingestion (POST /v1/spec_prefill/documents/warm,
GatewayClient.warm_documents)."""

import asyncio
import json
import socket
import threading
import time
from contextlib import closing
from urllib.parse import urlsplit

import httpx
import pytest

from specprefill_rag import InvalidRequestError, SpecPrefillEngine
from specprefill_rag.config import MAX_WARM_DOCUMENTS, WARM_DOCUMENTS_PATH
from specprefill_rag.draft.document_cache import DocumentKVCache
from specprefill_rag.gateway_client import GatewayClient, gateway_card
from specprefill_rag.testing import build_model, build_tokenizer, random_documents

from .serve_helpers import MODEL, SYSTEM, gateway_of, running_gateway

pytestmark = pytest.mark.timeout(300)

FIELD = "spec_prefill.draft_document_cache"


def ask(url, documents, question="When did the bridge open?", headers=None, **options):
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 2,
        "spec_prefill": {"documents": documents, **options},
    }
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def warm(url, body, headers=None):
    return httpx.post(url + WARM_DOCUMENTS_PATH, json=body, headers=headers, timeout=120)


def cached(response):
    """``(documents, tokens)`` the per-document cache served, from the body; the headers must agree."""
    assert response.status_code == 200, response.text
    stats, headers = response.json()["spec_prefill"], response.headers
    assert headers["x-specprefill-draft-documents-cached"] == str(stats["draft_documents_cached"])
    assert headers["x-specprefill-draft-document-cached-tokens"] == str(stats["draft_document_cached_tokens"])
    return stats["draft_documents_cached"], stats["draft_document_cached_tokens"]


@pytest.fixture(scope="module")
def no_cache_engine(tokenizer, tiny_model, tiny_draft):
    return SpecPrefillEngine.from_models(
        tiny_model, tokenizer, tiny_draft, keep_rate=0.3, min_prompt_tokens=0, look_ahead=2, document_cache_mb=0
    )


def test_documents_in_another_order_come_from_the_cache_when_asked(gateway):
    documents = random_documents(3, 60, seed=281)
    assert cached(ask(gateway, documents, draft_document_cache=True)) == (0, 0)  # drafted now, stored
    documents_hit, tokens = cached(ask(gateway, documents[::-1], "Who built it?", draft_document_cache=True))
    assert documents_hit == 3 and tokens > 0
    assert cached(ask(gateway, documents[::-1], "Who built it?")) == (0, 0)  # the gateway's default: off
    assert cached(ask(gateway, documents[::-1], "Who built it?", draft_document_cache=False)) == (0, 0)
    metrics = httpx.get(gateway + "/metrics", timeout=10).text
    assert 'specprefill_prompt_tokens_total{kind="draft_document_cached"}' in metrics
    assert "specprefill_document_cache_entries " in metrics and "specprefill_document_cache_entries 0.0" not in metrics


def test_the_gateway_default_turns_it_on_and_a_request_off(engine):
    documents = random_documents(2, 60, seed=282)
    with running_gateway(engine, draft_document_cache=True) as url:
        cached(ask(url, documents))
        assert cached(ask(url, documents[::-1], "Why?"))[0] == 2
        assert cached(ask(url, documents[::-1], "Why?", draft_document_cache=False)) == (0, 0)


@pytest.mark.parametrize("value", ["yes", 1, [True]], ids=["str", "int", "list"])
def test_the_flag_must_be_a_boolean(gateway, value):
    response = ask(gateway, ["a document"], draft_document_cache=value)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == FIELD


def test_asking_a_gateway_without_the_cache_is_a_400_naming_the_flag(no_cache_engine):
    with running_gateway(no_cache_engine, document_cache_mb=0) as url:
        response = ask(url, random_documents(2, 40, seed=283), draft_document_cache=True)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == FIELD and "--document-cache-mb" in error["message"]
        assert cached(ask(url, random_documents(2, 40, seed=283), draft_document_cache=False)) == (0, 0)


def test_warmed_documents_serve_the_first_request(gateway):
    documents = random_documents(3, 50, seed=284)
    response = warm(
        gateway, {"documents": [documents[0], {"text": documents[1]}, documents[2]], "instructions": SYSTEM}
    )
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["warmed"] == 3 and reply["documents"] == 3
    assert reply["held"] >= 4 and 0 < reply["cache_bytes"] <= reply["cache_max_bytes"]  # 3 documents + the prefix
    hit, tokens = cached(ask(gateway, documents[::-1], draft_document_cache=True))
    assert hit == 3 and tokens > 0


def test_warming_with_other_instructions_finds_nothing(gateway):
    documents = random_documents(2, 50, seed=285)
    assert warm(gateway, {"documents": documents, "instructions": "Reply in French."}).json()["warmed"] == 2
    assert cached(ask(gateway, documents, draft_document_cache=True)) == (0, 0)  # another prefix: drafted now


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"documents": "one text"}, "documents", "valid list"),
        ({"documents": []}, "documents", "at least 1"),
        ({"documents": [{"text": "a", "score": 1}]}, "documents.0.score", "unsupported field"),
        ({"documents": ["a"] * (MAX_WARM_DOCUMENTS + 1)}, "documents", f"at most {MAX_WARM_DOCUMENTS} per call"),
        ({"documents": ["a", "  "]}, "documents", "document 1 is empty"),
        ({"documents": ["a"], "instructions": 5}, "instructions", "valid string"),
        ({"documents": ["a"], "instructions": " "}, "instructions", "empty or only whitespace"),
        ({"documents": ["a"], "model": MODEL}, "model", "unsupported field"),
        ({}, "documents", "required"),
    ],
    ids=[
        "str",
        "empty",
        "unknown-key",
        "too-many",
        "blank-document",
        "instructions-int",
        "blank-instructions",
        "extra-field",
        "missing",
    ],
)
def test_bad_warm_requests_are_400s_naming_the_field(gateway, body, param, says):
    response = warm(gateway, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_warming_without_the_cache_is_a_400_naming_the_flag(no_cache_engine):
    with running_gateway(no_cache_engine, document_cache_mb=0) as url:
        response = warm(url, {"documents": ["some text"]})
        assert response.status_code == 400 and "--document-cache-mb" in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "documents"
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'specprefill_requests_total{endpoint="warm",outcome="bad_request"} 1.0' in metrics


def test_the_warm_endpoint_is_behind_the_key_and_takes_json_only(engine):
    with running_gateway(engine, api_key="s3cret") as url:
        assert warm(url, {"documents": ["a"]}).status_code == 401
        key = {"Authorization": "Bearer s3cret"}
        as_text = httpx.post(url + WARM_DOCUMENTS_PATH, content=b'{"documents": ["a"]}', headers=key, timeout=30)
        assert as_text.status_code == 415
        assert warm(url, {"documents": random_documents(1, 20, seed=286)}, headers=key).json()["warmed"] == 1


def test_the_warm_endpoint_refuses_a_body_over_the_limit(engine):
    with running_gateway(engine, max_body_bytes=4096) as url:
        assert warm(url, {"documents": ["x" * 5000]}).status_code == 413


def test_the_client_warms_a_corpus_in_bounded_calls(gateway):
    client = GatewayClient(gateway, gateway_card(gateway, 30))
    documents = [f"Fact {i}: the bridge has {i} lamps." for i in range(MAX_WARM_DOCUMENTS + 3)]
    reply = client.warm_documents(documents, instructions=SYSTEM)
    assert reply["warmed"] == reply["documents"] == len(documents) and reply["held"] > len(documents)
    again = asyncio.run(client.awarm_documents([{"text": documents[0], "title": None}], SYSTEM))
    assert again["warmed"] == 1 and again["documents"] == 1
    with pytest.raises(InvalidRequestError, match="documents must be a non-empty list"):
        client.warm_documents("one text")


def test_the_client_raises_the_gateways_400(no_cache_engine):
    with running_gateway(no_cache_engine, document_cache_mb=0) as url:
        client = GatewayClient(url, gateway_card(url, 30))
        with pytest.raises(InvalidRequestError, match="document-cache-mb"):
            client.warm_documents(["text"])


def test_the_mapped_path_sends_the_drafts_own_spans(tokenizer, tiny_model):
    """A draft of another vocabulary: the spans the queue carries are those of its own rendering."""
    draft_tokenizer = build_tokenizer(vocab_size=300)
    other = build_model(draft_tokenizer, layers=1, max_positions=4096, seed=2)
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, other, draft_tokenizer=draft_tokenizer, keep_rate=0.3, min_prompt_tokens=0, look_ahead=2
    )
    assert engine.draft_path == "mapped"
    documents = random_documents(2, 50, seed=287)
    with running_gateway(engine) as url:
        assert warm(url, {"documents": documents, "instructions": SYSTEM}).json()["warmed"] == 2
        hit, tokens = cached(ask(url, documents[::-1], draft_document_cache=True))
        assert hit == 2 and tokens > 0


def test_a_warm_past_the_request_deadline_is_a_504_and_drafts_no_more(engine, monkeypatch):
    """The deadline, not the machine's speed, decides: the stand-in drafts only once the gateway has given up."""
    real_warm = engine.warm_report

    def after_the_deadline(documents, instructions=None, *, stop, tenant=None):
        assert stop.wait(timeout=60)  # set by the gateway when --request-timeout passes
        return real_warm(documents, instructions, stop=stop, tenant=tenant)

    monkeypatch.setattr(engine, "warm_report", after_the_deadline)
    held = len(engine.document_cache)
    with running_gateway(engine, request_timeout_s=0.2) as url:
        response = warm(url, {"documents": random_documents(2, 40, seed=288), "instructions": SYSTEM})
        assert response.status_code == 504, response.text
        message = response.json()["error"]["message"]
        assert "0 of 2 drafted and held" in message and "--request-timeout" in message
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'specprefill_requests_total{endpoint="warm",outcome="timeout"} 1.0' in metrics
    assert len(engine.document_cache) == held


def test_a_warm_up_stops_drafting_when_its_client_goes_away(engine, monkeypatch):
    """The client closes its connection mid warm-up: the worker is told to stop at once (not at the deadline),
    drafts nothing more, and the call counts as disconnected."""
    real_warm, stopped = engine.warm_report, threading.Event()

    def until_stopped(documents, instructions=None, *, stop, tenant=None):
        if stop.wait(timeout=60):  # set by the gateway when the client goes away
            stopped.set()
        return real_warm(documents, instructions, stop=stop, tenant=tenant)

    monkeypatch.setattr(engine, "warm_report", until_stopped)
    held = len(engine.document_cache)
    with running_gateway(engine) as url:
        body = json.dumps({"documents": random_documents(2, 40, seed=289), "instructions": SYSTEM}).encode()
        parts = urlsplit(url)
        head = (
            f"POST {WARM_DOCUMENTS_PATH} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        with closing(socket.create_connection((parts.hostname, parts.port), timeout=30)) as sock:
            sock.sendall(head + body)
            deadline = time.monotonic() + 30
            while not gateway_of(url).slots.in_flight:  # the warm-up is running
                assert time.monotonic() < deadline
                time.sleep(0.02)
        assert stopped.wait(timeout=30), "the warm-up kept drafting after its client left"
        deadline = time.monotonic() + 30
        line = 'specprefill_requests_total{endpoint="warm",outcome="disconnected"} 1.0'
        while line not in httpx.get(url + "/metrics", timeout=10).text:
            assert time.monotonic() < deadline, "the disconnect was never counted"
            time.sleep(0.05)
    assert len(engine.document_cache) == held  # stopped before the first document


@pytest.fixture
def small_cache_engine(tokenizer, tiny_model, tiny_draft):
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, tiny_draft, keep_rate=0.3, min_prompt_tokens=0, look_ahead=2
    )
    engine.draft.document_cache = DocumentKVCache(2 * 2 * 16 * 4 * 300)  # about 300 tokens of the draft's KV
    return engine


def test_a_warm_up_lists_each_document_it_could_not_hold(small_cache_engine):
    fits, too_big = random_documents(1, 40, seed=290)[0], random_documents(1, 400, seed=291)[0]
    with running_gateway(small_cache_engine) as url:
        reply = warm(url, {"documents": [fits, too_big, fits], "instructions": SYSTEM}).json()
        assert reply["warmed"] == 1 and reply["documents"] == 3
        assert reply["skipped"] == [{"index": 1, "reason": "cache_full"}, {"index": 2, "reason": "cache_full"}]
        assert reply["cache_bytes"] <= reply["cache_max_bytes"]
        client = GatewayClient(url, gateway_card(url, 30))
        documents = [fits] * MAX_WARM_DOCUMENTS + [too_big]  # two calls: the index counts in the whole list
        assert client.warm_documents(documents, SYSTEM)["skipped"] == [
            {"index": MAX_WARM_DOCUMENTS, "reason": "cache_full"}
        ]


def test_a_document_the_draft_cannot_read_is_a_400_alone_or_among_others(small_cache_engine):
    short, too_long = random_documents(1, 20, seed=292)[0], random_documents(1, 3000, seed=293)[0]
    with running_gateway(small_cache_engine) as url:
        for documents, index in [([too_long], 0), ([short, too_long], 1)]:
            response = warm(url, {"documents": documents})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "documents" and f"document {index} cannot be warmed" in error["message"]
        assert len(small_cache_engine.document_cache) == 0  # checked before any was drafted
