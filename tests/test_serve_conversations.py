"""The gateway's conversations: a later turn keeps the first turn's selection (stable selection), its stats
reach headers, body and /metrics, with spec_prefill.reselect false (the default reselects)."""

import httpx

from specprefill_rag.testing import random_documents

from .serve_helpers import MODEL, SYSTEM


def post(gateway, messages, documents, **options):
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 4,
        "spec_prefill": {"documents": documents, **options},
    }
    return httpx.post(gateway + "/v1/chat/completions", json=body, timeout=120)


def test_second_turn_reuses_the_selection_and_says_so(gateway):
    documents = random_documents(2, 70, seed=41)
    turn_1 = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "\n\n".join(documents) + "\n\nWhen did the bridge open?"},
    ]
    first = post(gateway, turn_1, documents, reselect=False)
    assert first.status_code == 200, first.text
    answer = first.json()["choices"][0]["message"]["content"]
    turn_2 = [*turn_1, {"role": "assistant", "content": answer}, {"role": "user", "content": "Who built it?"}]
    second = post(gateway, turn_2, documents, reselect=False)
    stats = second.json()["spec_prefill"]
    assert stats["reused_spans"] == 2 and stats["draft_ms"] == 0 and stats["main_cached_tokens"] > 0
    assert second.headers["x-specprefill-reused-spans"] == "2"
    again = post(gateway, turn_2, documents).json()["spec_prefill"]  # the default: reselect
    assert again["reused_spans"] == 0 and again["draft_ms"] > 0
    metrics = httpx.get(gateway + "/metrics", timeout=10).text
    assert "specprefill_reused_spans_total 2.0" in metrics
    assert 'specprefill_prompt_tokens_total{kind="main_cached"}' in metrics


def test_reselect_must_be_a_boolean(gateway):
    response = post(gateway, [{"role": "user", "content": "When?"}], ["a document"], reselect="yes")
    assert response.status_code == 400 and "reselect" in response.text
