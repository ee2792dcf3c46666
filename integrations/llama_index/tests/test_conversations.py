"""With reselect=False a conversation's later turn keeps the documents' tokens chosen in turn 1 (stable
selection); a call can still reselect."""

from llama_index.core.llms import ChatMessage
from llama_index.llms.specprefill import SpecPrefillLLM

from specprefill_rag.testing import random_documents


def history(documents):
    return [
        ChatMessage(role="system", content="Answer from the documents."),
        ChatMessage(role="user", content="\n\n".join(documents) + "\n\nWhen did the bridge open?"),
    ]


def test_second_turn_reuses_the_first_turns_selection(tiny_engine):
    llm = SpecPrefillLLM.from_engine(tiny_engine, keep_rate=0.3, max_new_tokens=4, reselect=False)
    documents = random_documents(2, 70, seed=31)
    turn_1 = history(documents)
    first = llm.chat(turn_1, documents=documents)
    assert first.raw["spec_prefill"]["reused_spans"] == 0
    answer = first.message.content or ""
    turn_2 = [*turn_1, ChatMessage(role="assistant", content=answer), ChatMessage(role="user", content="Who?")]
    stats = llm.chat(turn_2, documents=documents).raw["spec_prefill"]
    assert stats["reused_spans"] == 2 and stats["draft_ms"] == 0 and stats["main_cached_tokens"] > 0
    assert llm.chat(turn_2, documents=documents, reselect=True).raw["spec_prefill"]["reused_spans"] == 0
