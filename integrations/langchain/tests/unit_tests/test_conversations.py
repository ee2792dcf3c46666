"""With reselect=False a conversation's later turn keeps the documents' tokens chosen in turn 1 (stable
selection); by default every turn reselects."""

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from langchain_specprefill import ChatSpecPrefill
from specprefill_rag.testing import random_documents


def history(documents):
    return [
        SystemMessage("Answer from the documents."),
        HumanMessage("\n\n".join(documents) + "\n\nWhen did the bridge open?"),
    ]


def test_second_turn_reuses_the_first_turns_selection(tiny_engine):
    chat = ChatSpecPrefill.from_engine(tiny_engine, keep_rate=0.3, max_tokens=4, reselect=False)
    documents = random_documents(2, 70, seed=21)
    turn_1 = history(documents)
    first = chat.invoke(turn_1, documents=documents)
    assert first.response_metadata["spec_prefill"]["reused_spans"] == 0
    turn_2 = [*turn_1, AIMessage(first.content), HumanMessage("Who built it?")]
    second = chat.invoke(turn_2, documents=documents)
    stats = second.response_metadata["spec_prefill"]
    assert stats["reused_spans"] == 2 and stats["draft_ms"] == 0 and stats["main_cached_tokens"] > 0
    again = chat.invoke(turn_2, documents=documents, reselect=True)
    assert again.response_metadata["spec_prefill"]["reused_spans"] == 0


def test_reselect_is_the_default(tiny_engine):
    chat = ChatSpecPrefill.from_engine(tiny_engine, keep_rate=0.3, max_tokens=4)
    documents = random_documents(2, 70, seed=22)
    first = chat.invoke(history(documents), documents=documents)
    turn_2 = [*history(documents), AIMessage(first.content), HumanMessage("Who built it?")]
    assert chat.invoke(turn_2, documents=documents).response_metadata["spec_prefill"]["reused_spans"] == 0
