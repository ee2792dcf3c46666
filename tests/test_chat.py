"""Finding documents in chat messages, as framework adapters deliver them."""

import pytest

from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.prompt.chat import DOCUMENT_START, ChatMessage, chat_layout, mark_document
from specprefill_rag.prompt.layout import Document, Role

DOCS = ["Paris is the capital of France.", "The bridge opened in 1883 after thirteen years of work."]


def texts_of(tokenizer, layout, role):
    return tokenizer.decode(layout.input_ids[layout.roles == role])


def document_texts(tokenizer, layout):
    indices = sorted({int(i) for i in layout.document_index.unique() if i >= 0})
    return [tokenizer.decode(layout.input_ids[layout.document_index == i]) for i in indices]


def test_documents_argument_located_in_stuffed_prompt(tokenizer):
    system = "Answer using the context:\n\n" + "\n\n".join(DOCS)
    messages = [ChatMessage("system", [system]), ChatMessage("user", ["When did the bridge open?"])]
    result = chat_layout(tokenizer, messages, documents=DOCS)
    assert result.document_source == "argument-located" and result.n_documents == 2
    assert document_texts(tokenizer, result.layout) == DOCS
    assert texts_of(tokenizer, result.layout, Role.QUESTION) == "When did the bridge open?"
    assert "Answer using the context:" in texts_of(tokenizer, result.layout, Role.INSTRUCTION)


def test_documents_argument_inserted_when_absent(tokenizer):
    messages = [ChatMessage("user", ["When did the bridge open?"])]
    result = chat_layout(tokenizer, messages, documents=[{"text": DOCS[1], "title": "Bridge"}])
    assert result.document_source == "argument-inserted"
    assert document_texts(tokenizer, result.layout) == [DOCS[1]]
    assert texts_of(tokenizer, result.layout, Role.QUESTION) == "When did the bridge open?"


def test_documents_not_found_and_not_inserted_fall_back(tokenizer):
    messages = [ChatMessage("user", [" ".join(DOCS * 5) + " When?"])]
    result = chat_layout(
        tokenizer, messages, documents=["text that is not there"], insert_missing=False, question="When?"
    )
    assert result.document_source == "fallback" and result.n_documents == 1
    assert texts_of(tokenizer, result.layout, Role.QUESTION) == "When?"


def test_document_blocks(tokenizer):
    messages = [ChatMessage("user", [Document(DOCS[0], title="France"), Document(DOCS[1]), "When?"])]
    result = chat_layout(tokenizer, messages)
    assert result.document_source == "blocks" and document_texts(tokenizer, result.layout) == DOCS
    assert texts_of(tokenizer, result.layout, Role.QUESTION) == "When?"


def test_marked_documents_lose_their_markers(tokenizer):
    context = "\n\n".join(mark_document(d) for d in DOCS)
    messages = [ChatMessage("user", [f"Context:\n{context}\n\nQuestion: When?"])]
    result = chat_layout(tokenizer, messages)
    assert result.document_source == "markers" and document_texts(tokenizer, result.layout) == DOCS
    assert "\x02" not in result.layout.text and "\x03" not in result.layout.text
    assert texts_of(tokenizer, result.layout, Role.QUESTION) == "Context:\n" + "\n\n" + "\n\nQuestion: When?"


def test_fallback_protects_system_and_tail(tokenizer):
    long_text = " ".join(DOCS * 6) + " When did the bridge open?"
    messages = [ChatMessage("system", ["Be brief."]), ChatMessage("user", [long_text])]
    result = chat_layout(tokenizer, messages, protect_tail_tokens=8)
    layout = result.layout
    assert result.document_source == "fallback" and result.n_documents == 1
    assert texts_of(tokenizer, layout, Role.INSTRUCTION) == "Be brief."
    assert int((layout.roles == Role.QUESTION).sum()) == 8
    assert layout.n_document_tokens > 50


def test_given_question_is_kept_in_fallback(tokenizer):
    text = " ".join(DOCS * 4) + " When did the bridge open? Answer in one word."
    result = chat_layout(tokenizer, [ChatMessage("user", [text])], question="When did the bridge open?")
    assert texts_of(tokenizer, result.layout, Role.QUESTION).strip() == "When did the bridge open? Answer in one word."
    appended = chat_layout(tokenizer, [ChatMessage("user", [" ".join(DOCS)])], question="Which city?")
    assert texts_of(tokenizer, appended.layout, Role.QUESTION) == "Which city?"


@pytest.mark.parametrize(
    "messages, documents, match",
    [
        ([], None, "no messages"),
        ([ChatMessage("user", ["hi"]), ChatMessage("assistant", ["hello"])], None, "last message is from 'assistant'"),
        ([ChatMessage("user", ["  "])], None, "last user message is empty"),
        ([ChatMessage("user", [Document("x"), "q"])], ["y"], "documents were given twice"),
        ([ChatMessage("user", [mark_document("x") + "q"])], ["y"], "documents were given twice"),
        ([ChatMessage("user", ["q"])], [], "documents=\\[\\] is empty"),
        ([ChatMessage("user", [DOCUMENT_START + " unbalanced q"])], None, "unbalanced document markers"),
        ([ChatMessage("user", ["q"])], [3], "document 0 has type int"),
    ],
)
def test_bad_chat_input(tokenizer, messages, documents, match):
    with pytest.raises(InvalidRequestError, match=match):
        chat_layout(tokenizer, messages, documents=documents)


def test_a_short_question_alone_leaves_nothing_to_drop(tokenizer):
    result = chat_layout(tokenizer, [ChatMessage("system", ["Be brief."]), ChatMessage("user", ["When?"])])
    assert (result.document_source, result.n_documents, result.layout.n_document_tokens) == ("none", 0, 0)


AGENT_TUTORIAL = "You are a helpful assistant. Use the following context in your response:\n\n{}"


@pytest.mark.parametrize("mode", ["delimited", "after_instructions"])
def test_system_context_finds_the_agent_tutorials_context(tokenizer, mode):
    # LangChain's RAG agent tutorial: a @dynamic_prompt middleware joins vector_store.similarity_search()
    # results into the system message (no retriever run, no marker)
    system = ChatMessage("system", [AGENT_TUTORIAL.format("\n\n".join(DOCS))])
    result = chat_layout(tokenizer, [system, ChatMessage("user", ["When?"])], system_context=mode)
    assert (result.document_source, result.n_documents) == ("system-context", 2)
    assert document_texts(tokenizer, result.layout) == DOCS
    instructions = texts_of(tokenizer, result.layout, Role.INSTRUCTION)
    assert "Use the following context in your response:" in instructions and DOCS[0] not in instructions


def test_system_context_off_and_explicit_documents_leave_the_system_message_whole(tokenizer):
    system = ChatMessage("system", [AGENT_TUTORIAL.format("\n\n".join(DOCS))])
    question = ChatMessage("user", ["When?"])
    assert chat_layout(tokenizer, [system, question], system_context="off").document_source == "none"
    given = chat_layout(tokenizer, [system, question], documents=["Rome is in Italy."], system_context="delimited")
    assert given.document_source == "argument-inserted" and document_texts(tokenizer, given.layout) == [
        "Rome is in Italy."
    ]
    blocks = [ChatMessage("user", [Document("Rome is in Italy."), "When?"])]
    assert chat_layout(tokenizer, [system, *blocks], system_context="delimited").document_source == "blocks"


def test_an_agents_first_step_awaits_its_tool_results(tokenizer):
    tool = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}
    first = chat_layout(tokenizer, [ChatMessage("user", ["When did the bridge open?"])], tools=[tool])
    assert first.layout.awaits_tool_results and first.layout.n_document_tokens == 0
    plain = chat_layout(tokenizer, [ChatMessage("user", ["When did the bridge open?"])])
    assert not plain.layout.awaits_tool_results


def test_an_agents_first_step_keeps_a_long_question_whole(tokenizer):
    # the fallback protects a prompt's last 64 tokens; a longer question's head became a pseudo-document (#45's
    # agentic study, question 95); with tools offered and no tool result yet nothing is retrieved text
    tool = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}
    question = [ChatMessage("user", [" ".join(["Which bridge over the river opened first?"] * 20)])]
    first = chat_layout(tokenizer, question, tools=[tool])
    assert first.document_source == "none" and first.layout.n_document_tokens == 0
    assert first.layout.awaits_tool_results
    assert chat_layout(tokenizer, question).layout.n_document_tokens > 0  # without tools: the fallback, as before
