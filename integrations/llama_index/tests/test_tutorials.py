"""LlamaIndex's chat engines as its tutorials build them (``index.as_chat_engine(chat_mode=...)`` over a
VectorStoreIndex), with SpecPrefillLLM: the retrieved nodes are compressed, the rest stays whole.
Tiny random models and a mock embedding: fast and offline.
"""

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.llms import ChatMessage
from llama_index.llms.specprefill import SpecPrefillLLM

from specprefill_rag.testing import random_documents

QUESTION = "When did the bridge open?"


class StatsLog(BaseEventHandler):
    calls: list = []

    def handle(self, event, **kwargs):
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.calls.append(event.response.raw.get("spec_prefill"))


@pytest.fixture
def stats_log():
    log = StatsLog()
    log.calls = []
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(log)
    yield log
    dispatcher.event_handlers.remove(log)


@pytest.fixture
def index():
    documents = [Document(text=t) for t in random_documents(4, 60)]
    return VectorStoreIndex.from_documents(documents, embed_model=MockEmbedding(embed_dim=8))


@pytest.fixture
def llm(tiny_engine):
    return SpecPrefillLLM.from_engine(tiny_engine, keep_rate=0.3, max_new_tokens=4)


def _assert_compressed(stats):
    assert stats["document_source"] == "argument-located" and stats["n_documents"] == 2
    assert stats["compressed"] and 0 < stats["kept_document_tokens"] < stats["document_tokens"]
    assert stats["kept_tokens"] - stats["kept_document_tokens"] == stats["prompt_tokens"] - stats["document_tokens"]


@pytest.mark.parametrize("chat_mode", ["context", "condense_plus_context"])
def test_chat_engine_compresses_the_retrieved_nodes(index, llm, stats_log, chat_mode):
    chat_engine = index.as_chat_engine(chat_mode=chat_mode, llm=llm, similarity_top_k=2)
    chat_engine.chat(QUESTION)
    _assert_compressed(stats_log.calls[-1])


@pytest.mark.parametrize("chat_mode", ["context", "condense_plus_context"])
def test_chat_engine_second_turn_with_history(index, llm, stats_log, chat_mode):
    chat_engine = index.as_chat_engine(chat_mode=chat_mode, llm=llm, similarity_top_k=2)
    history = [
        ChatMessage(role="user", content="What is the bridge?"),
        ChatMessage(role="assistant", content="A bridge."),
    ]
    chat_engine.chat(QUESTION, chat_history=history)
    _assert_compressed(stats_log.calls[-1])


@pytest.mark.parametrize("chat_mode", ["context", "condense_plus_context"])
async def test_chat_engine_async_and_stream(index, llm, stats_log, chat_mode):
    chat_engine = index.as_chat_engine(chat_mode=chat_mode, llm=llm, similarity_top_k=2)
    await chat_engine.achat(QUESTION)
    _assert_compressed(stats_log.calls[-1])
    response = chat_engine.stream_chat(QUESTION)
    for _ in response.response_gen:
        pass
    _assert_compressed(stats_log.calls[-1])
