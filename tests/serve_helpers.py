"""Shared pieces of the gateway tests: a tiny engine, a running gateway, the in-process reference."""

from __future__ import annotations

import time
from contextlib import contextmanager

from specprefill_rag import GenerationParams, SpecPrefillEngine
from specprefill_rag.prompt.chat import ChatMessage, chat_layout
from specprefill_rag.serve import GatewaySettings, create_app
from specprefill_rag.serve.server import BackgroundServer

MODEL = "tiny"
SETTINGS = {"served_model_name": MODEL, "keep_rate": 0.3, "min_prompt_tokens": 0, "look_ahead": 2}
SYSTEM = "Answer the question using the documents. Be brief."
QUESTION = "When did the bridge open?"


def tiny_engine(tokenizer, main, draft) -> SpecPrefillEngine:
    return SpecPrefillEngine.from_models(main, tokenizer, draft, keep_rate=0.3, min_prompt_tokens=0, look_ahead=2)


def wait_for(condition, seconds=60.0):
    """Poll ``condition()`` until it holds (the server's bookkeeping runs after the client's answer), at most
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


_APPS = {}


@contextmanager
def running_gateway(engine, **settings):
    """A gateway over ``engine`` on 127.0.0.1; yields its base URL."""
    app = create_app(GatewaySettings(**{**SETTINGS, **settings}), engine)
    with BackgroundServer(app) as url:
        _APPS[url] = app
        try:
            yield url
        finally:
            del _APPS[url]


def gateway_of(url):
    """The Gateway object behind a gateway :func:`running_gateway` runs in this process."""
    return _APPS[url].state.gateway


def reference_text(engine, documents, max_tokens=8, question=QUESTION, keep_rate=None) -> str:
    """What the in-process engine answers to the chat the tests send (system + question, documents given)."""
    messages = [ChatMessage("system", [SYSTEM]), ChatMessage("user", [question])]
    layout = chat_layout(engine.tokenizer, messages, documents)
    return engine.generate_layout(layout.layout, GenerationParams(max_new_tokens=max_tokens), keep_rate).text


def chat_messages(question=QUESTION) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
