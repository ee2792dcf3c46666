"""Tenants of the gateway (issue #43 item 6): each API key's cached prefixes, documents, selections and their
counts are its own; a declared tenant only when the operator trusts the header; sharing only when asked;
/metrics behind a key."""

import httpx
import pytest
from pydantic import ValidationError

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.config import WARM_DOCUMENTS_PATH
from specprefill_rag.positions import namespace_salt
from specprefill_rag.serve import GatewaySettings
from specprefill_rag.serve.tenancy import Tenancy
from specprefill_rag.testing import random_documents

from .serve_helpers import MODEL, SYSTEM, gateway_of, running_gateway
from .test_vllm_client import handler_class, serve

pytestmark = pytest.mark.timeout(300)

KEY_A, KEY_B, OPERATOR = "key-of-a", "key-of-b", "metrics-reader"
HEADER = "X-SpecPrefill-Tenant"


def bearer(key, **headers):
    return {"Authorization": f"Bearer {key}", **headers}


def ask(url, headers, documents, question="When did the bridge open?", **options):
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 2,
        "spec_prefill": {"documents": documents, **options},
    }
    response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["spec_prefill"]


def cached(stats):
    """What this request was served from caches: main prefix, draft prefix, per-document (documents)."""
    return stats["main_cached_tokens"] or 0, stats["draft_cached_tokens"], stats["draft_documents_cached"]


def warm(url, headers, documents):
    body = {"documents": documents, "instructions": SYSTEM}
    response = httpx.post(url + WARM_DOCUMENTS_PATH, json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"# tenants of the gateway\n{KEY_B}\n\n")
    return path


@pytest.fixture(scope="module")
def two_keys(engine, key_file):
    """A gateway with two keys: ``api_key`` (tenant A) and one from ``api_key_file`` (tenant B)."""
    with running_gateway(engine, api_key=KEY_A, api_key_file=key_file) as url:
        yield url


def test_a_second_key_never_hits_the_first_keys_prompt(two_keys):
    documents = random_documents(2, 60, seed=4301)
    assert cached(ask(two_keys, bearer(KEY_A), documents)) == (0, 0, 0)
    assert cached(ask(two_keys, bearer(KEY_B), documents)) == (0, 0, 0)  # was: A's main and draft prefix
    main, draft, _ = cached(ask(two_keys, bearer(KEY_A), documents))  # the same tenant still does
    assert main > 0 and draft > 0


def test_a_second_key_never_gets_the_first_keys_documents(two_keys):
    documents = random_documents(2, 60, seed=4302)
    ask(two_keys, bearer(KEY_A), documents, draft_document_cache=True)
    other_order = documents[::-1]
    assert cached(ask(two_keys, bearer(KEY_B), other_order, "Who built it?", draft_document_cache=True))[2] == 0
    assert cached(ask(two_keys, bearer(KEY_A), other_order, "Why?", draft_document_cache=True))[2] == 2


def test_the_warm_up_counts_the_tenants_own_documents(engine, key_file):
    documents = random_documents(3, 40, seed=4303)
    with running_gateway(engine, api_key=KEY_A, api_key_file=key_file) as url:
        first = warm(url, bearer(KEY_A), documents[:2])
        assert first["warmed"] == 2 and first["held"] == 3  # two documents and their prefix
        second = warm(url, bearer(KEY_B), documents[2:])
        assert second["warmed"] == 1 and second["held"] == 2  # was 5: A's entries too
        again = warm(url, bearer(KEY_B), documents[:2])  # A warmed these; B drafts its own
        assert again["held"] == 4 and again["cache_bytes"] > second["cache_bytes"]
        store = gateway_of(url).engine.document_cache
        assert again["cache_bytes"] < store.nbytes and again["cache_max_bytes"] == store.max_bytes
        assert cached(ask(url, bearer(KEY_A), documents[1::-1], "Why?", draft_document_cache=True))[2] == 2


def test_metrics_need_the_key_or_their_own(engine, two_keys):
    assert httpx.get(two_keys + "/metrics", timeout=10).status_code == 401
    assert httpx.get(two_keys + "/metrics", headers=bearer("wrong"), timeout=10).status_code == 401
    for key in (KEY_A, KEY_B):
        assert httpx.get(two_keys + "/metrics", headers=bearer(key), timeout=10).status_code == 200
    with running_gateway(engine, api_key=KEY_A, metrics_key=OPERATOR) as url:
        assert httpx.get(url + "/metrics", headers=bearer(KEY_A), timeout=10).status_code == 401
        assert httpx.get(url + "/metrics", headers=bearer(OPERATOR), timeout=10).status_code == 200
        assert httpx.get(url + "/v1/models", headers=bearer(OPERATOR), timeout=10).status_code == 401
    with running_gateway(engine) as url:  # no key: open, as before
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200


def test_sharing_across_keys_is_an_opt_in(engine, key_file):
    documents = random_documents(2, 60, seed=4304)
    with running_gateway(engine, api_key=KEY_A, api_key_file=key_file, cache_scope="shared") as url:
        ask(url, bearer(KEY_A), documents)
        main, draft, _ = cached(ask(url, bearer(KEY_B), documents))
        assert main > 0 and draft > 0
        ask(url, bearer(KEY_A), documents, "Who?", draft_document_cache=True)
        assert cached(ask(url, bearer(KEY_B), documents[::-1], "Why?", draft_document_cache=True))[2] == 2


def test_an_open_gateway_is_one_tenant(engine):
    documents = random_documents(2, 60, seed=4305)
    with running_gateway(engine) as url:
        ask(url, bearer("anything"), documents)
        main, draft, _ = cached(ask(url, bearer("something else"), documents))
        assert main > 0 and draft > 0


def test_a_declared_tenant_is_its_own_within_the_key_when_the_operator_trusts_the_header(engine, key_file):
    documents = random_documents(2, 60, seed=4306)
    with running_gateway(engine, api_key=KEY_A, api_key_file=key_file, tenant_header=HEADER) as url:
        ask(url, bearer(KEY_A, **{HEADER: "alice"}), documents)
        assert cached(ask(url, bearer(KEY_A, **{HEADER: "bob"}), documents)) == (0, 0, 0)
        assert cached(ask(url, bearer(KEY_A), documents)) == (0, 0, 0)  # no header: the key's own tenant
        assert cached(ask(url, bearer(KEY_B, **{HEADER: "alice"}), documents)) == (0, 0, 0)  # another key's alice
        assert cached(ask(url, bearer(KEY_A, **{HEADER: "alice"}), documents))[0] > 0
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        refused = httpx.post(
            url + "/v1/chat/completions", json=body, headers=bearer(KEY_A, **{HEADER: "x" * 129}), timeout=60
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == HEADER.lower()
    with running_gateway(engine, api_key=KEY_A) as url:  # not trusted unless the operator says so
        ask(url, bearer(KEY_A, **{HEADER: "carol"}), documents)
        assert cached(ask(url, bearer(KEY_A, **{HEADER: "dave"}), documents))[0] > 0


def test_a_vllm_main_gets_each_tenants_cache_salt(tiny_model_dir, key_file):
    handler = handler_class(plugin=True)
    server, main = serve(handler)
    settings = {"draft": str(tiny_model_dir), "keep_rate": 0.3, "min_prompt_tokens": 0, "look_ahead": 2}
    engine = SpecPrefillEngine.for_vllm(main, **settings)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    try:
        with running_gateway(engine, api_key=KEY_A, api_key_file=key_file, cache_scope="tenant") as url:
            for key in (KEY_A, KEY_B, KEY_A):
                answer = httpx.post(url + "/v1/chat/completions", json=body, headers=bearer(key), timeout=60)
                assert answer.status_code == 200, answer.text
            tenant_a = gateway_of(url).tenancy.tenant({"authorization": f"Bearer {KEY_A}"})
        with running_gateway(engine) as url:  # one tenant: no salt, as before
            assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    finally:
        server.shutdown()
    first, second, third, open_gateway = (sent.get("cache_salt") for sent in handler.bodies[-4:])
    assert first == third == namespace_salt(tenant_a) and second not in (None, first) and open_gateway is None


def test_a_tenant_is_a_digest_never_the_key():
    tenancy = Tenancy(keyed=True, secret=b"s")
    tenant = tenancy.tenant({"authorization": f"Bearer {KEY_A}"})
    assert KEY_A not in tenant and tenant == tenancy.tenant({"authorization": f"bearer {KEY_A}"})
    assert tenant != tenancy.tenant({"authorization": f"Bearer {KEY_B}"})
    assert tenant != Tenancy(keyed=True).tenant({"authorization": f"Bearer {KEY_A}"})  # a random secret each start
    assert Tenancy(keyed=True, scope="shared").tenant({"authorization": f"Bearer {KEY_A}"}) is None
    assert Tenancy(keyed=False).tenant({"authorization": f"Bearer {KEY_A}"}) is None
    declared = Tenancy(keyed=False, header=HEADER, secret=b"s")  # behind a proxy that authenticates: no keys
    alice, bob = (declared.tenant({HEADER.lower(): name}) for name in ("alice", "bob"))
    assert None not in (alice, bob) and alice != bob and declared.tenant({}) is None


def test_bad_tenancy_settings_are_refused_naming_the_field(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    spaced = tmp_path / "spaced.txt"
    spaced.write_text("a key\n")
    cases = [
        ({"api_key_file": tmp_path / "missing.txt"}, "api_key_file"),
        ({"api_key_file": empty}, "holds no key"),
        ({"api_key_file": spaced}, "whitespace"),
        ({"tenant_header": "X Tenant"}, "tenant_header"),
        ({"tenant_header": HEADER, "cache_scope": "shared"}, "cache_scope"),
        ({"metrics_key": " "}, "metrics_key"),
        ({"cache_scope": "global"}, "cache_scope"),
    ]
    for fields, says in cases:
        with pytest.raises(ValidationError, match=says):
            GatewaySettings(**fields)
