"""SpecPrefillLLM with backend=<gateway URL>: a query engine gets the in-process answers, and the
application process never imports torch (a subprocess where importing torch fails)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.llms.specprefill import SpecPrefillLLM

from specprefill_rag.serve import GatewaySettings, create_app
from specprefill_rag.serve.server import BackgroundServer
from specprefill_rag.testing import random_documents

QUESTION = "When did the bridge open?"
TEXTS = random_documents(3, 60, seed=5)
ROOT = Path(__file__).resolve().parents[3]


class FixedRetriever(BaseRetriever):
    def _retrieve(self, query_bundle):
        return [NodeWithScore(node=TextNode(text=t), score=1.0) for t in TEXTS]


@pytest.fixture(scope="module")
def gateway(tiny_engine):
    settings = GatewaySettings(served_model_name="tiny", min_prompt_tokens=0, look_ahead=2)
    with BackgroundServer(create_app(settings, tiny_engine)) as url:
        yield url


def test_query_engine_through_the_gateway_equals_in_process(gateway, tiny_engine):
    remote = SpecPrefillLLM(backend=gateway, keep_rate=0.2, max_new_tokens=8)
    local = SpecPrefillLLM.from_engine(tiny_engine, keep_rate=0.2, max_new_tokens=8)
    answers = [RetrieverQueryEngine.from_args(FixedRetriever(), llm=llm).query(QUESTION) for llm in (remote, local)]
    assert answers[0].response == answers[1].response
    assert remote.metadata.context_window == tiny_engine.backend.context_length


def test_the_engine_of_a_gateway_backend_runs_there_not_here(gateway):
    from specprefill_rag.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="is a SpecPrefill gateway: the engine runs there"):
        _ = SpecPrefillLLM(backend=gateway).engine


def test_complete_with_documents_and_streaming(gateway, tiny_engine):
    remote = SpecPrefillLLM(backend=gateway, max_new_tokens=8)
    local = SpecPrefillLLM.from_engine(tiny_engine, max_new_tokens=8)
    got = remote.complete(QUESTION, documents=TEXTS)
    assert got.text == local.complete(QUESTION, documents=TEXTS).text
    assert got.raw["spec_prefill"]["document_source"] == "argument-inserted" and got.raw["spec_prefill"]["compressed"]
    assert list(remote.stream_complete(QUESTION, documents=TEXTS))[-1].text == got.text


def test_the_application_process_needs_no_torch(gateway, tiny_engine):
    script = textwrap.dedent(f"""
        import json, sys
        sys.modules["torch"] = None  # any import of torch now fails
        from llama_index.llms.specprefill import SpecPrefillLLM
        response = SpecPrefillLLM(backend={gateway!r}, max_new_tokens=8).complete({QUESTION!r}, documents={TEXTS!r})
        loaded = sorted(m for m in sys.modules if m.startswith(("transformers", "specprefill_rag.engine")))
        print(json.dumps({{"text": response.text, "loaded": loaded}}))
    """)
    path = f"{ROOT}:{ROOT / 'integrations' / 'llama_index'}"
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["loaded"] == []
    assert (
        answer["text"]
        == SpecPrefillLLM.from_engine(tiny_engine, max_new_tokens=8).complete(QUESTION, documents=TEXTS).text
    )


def test_keep_rate_auto_reaches_the_gateway(gateway, tiny_engine):
    expected = (
        SpecPrefillLLM.from_engine(tiny_engine, keep_rate="auto", max_new_tokens=4)
        .complete(QUESTION, documents=TEXTS)
        .raw["spec_prefill"]
    )
    for remote, call in (
        (SpecPrefillLLM(backend=gateway, keep_rate="auto", max_new_tokens=4), {}),
        (SpecPrefillLLM(backend=gateway, keep_rate=0.9, max_new_tokens=4), {"keep_rate": "auto"}),
    ):
        stats = remote.complete(QUESTION, documents=TEXTS, **call).raw["spec_prefill"]
        assert stats["keep_policy"] == "auto" and stats["kept_tokens"] == expected["kept_tokens"]
        assert stats["keep_rate"] == expected["keep_rate"] < 0.9
