"""Load: 64 concurrent streaming requests with different documents; each answer equals its sequential
answer (no cross-talk between batched drafts or interleaved streams). Tiny model, few tokens."""

import asyncio

import openai
import pytest

from specprefill_rag.testing import random_documents
from tests.serve_helpers import MODEL, chat_messages, gateway_of, running_gateway, tiny_engine

STREAMS = 64


@pytest.fixture(scope="module")
def engine(tokenizer, tiny_model, tiny_draft):
    return tiny_engine(tokenizer, tiny_model, tiny_draft)


def request(index):
    documents = random_documents(2, 30 + index % 7 * 5, seed=100 + index)  # different lengths: padded batches
    return {
        "model": MODEL,
        "messages": chat_messages(),
        "max_tokens": 4,
        "temperature": 0,
        "extra_body": {"spec_prefill": {"documents": documents}},
    }


async def streamed_answer(client, index):
    stream = await client.chat.completions.create(stream=True, **request(index))
    text, stats = "", None
    async for chunk in stream:
        text += "".join(choice.delta.content or "" for choice in chunk.choices)
        stats = chunk.model_extra.get("spec_prefill") or stats
    return text, stats


def test_64_concurrent_streams_equal_their_sequential_answers(engine):
    with running_gateway(engine, draft_batch_size=8, queue_size=STREAMS) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        sequential = [client.chat.completions.create(**request(i)).choices[0].message.content for i in range(STREAMS)]

        async def concurrent():
            async with openai.AsyncOpenAI(
                base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120
            ) as aclient:
                return await asyncio.wait_for(
                    asyncio.gather(*(streamed_answer(aclient, i) for i in range(STREAMS))), 300
                )

        answers = asyncio.run(concurrent())
        assert [text for text, _ in answers] == sequential
        assert all(stats["compressed"] for _, stats in answers)
        assert max(stats["draft_batch_size"] for _, stats in answers) > 1, "concurrent drafts should share batches"
        assert gateway_of(url).queue.depth == 0
