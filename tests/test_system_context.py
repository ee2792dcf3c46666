"""Retrieved context in a system message -> documents and instructions (issue 29): pure splitting.

Each known template is rendered exactly as its framework renders it (the frameworks' own template objects
where they export them), then split; the parts must concatenate to the message and the documents must be
the retrieved texts.
"""

from __future__ import annotations

import pytest
from langchain_core.documents import Document as LCDocument
from langchain_core.prompts import ChatPromptTemplate
from llama_index.core.chat_engine.condense_plus_context import (
    DEFAULT_CONTEXT_PROMPT_TEMPLATE,
    DEFAULT_CONTEXT_REFINE_PROMPT_TEMPLATE,
)
from llama_index.core.chat_engine.context import DEFAULT_CONTEXT_TEMPLATE, DEFAULT_REFINE_TEMPLATE

from specprefill_rag.prompt.context import SYSTEM_CONTEXT_MODES, split_system_context
from specprefill_rag.testing import LANGCHAIN_RETRIEVAL_CHAIN, LANGCHAIN_TUTORIAL

DOCS = [
    "The Brooklyn Bridge opened to traffic on May 24, 1883.",
    "Its main span is 486 m long; Washington Roebling directed the work.",
    "Paris is the capital of France.",
]
# LangChain hub langchain-ai/retrieval-qa-chat (create_retrieval_chain's docstring)
LANGCHAIN_HUB_RETRIEVAL_QA = (
    "Answer any use questions based solely on the context below:\n\n<context>\n{context}\n</context>"
)


def langchain_system(template: str, docs: list[str]) -> str:
    """The system message LangChain renders: format_docs / create_stuff_documents_chain join with "\\n\\n"."""
    context = "\n\n".join(LCDocument(page_content=d).page_content for d in docs)
    prompt = ChatPromptTemplate.from_messages([("system", template), ("human", "{input}")])
    return str(prompt.invoke({"context": context, "input": "When?"}).to_messages()[0].content)


def llama_system(template: str, docs: list[str], variable: str = "context_str", system_prompt: str = "") -> str:
    """The system message LlamaIndex chat engines render: template + system prompt, nodes joined by "\\n\\n"."""
    filled = {variable: "\n\n".join(docs), "existing_answer": "It opened in 1883."}
    return (template + system_prompt.strip()).format(**{k: v for k, v in filled.items() if "{" + k + "}" in template})


def documents(parts):
    return [text for text, is_document in parts if is_document]


def instructions(parts):
    return "".join(text for text, is_document in parts if not is_document)


def check(text, mode, expected_docs):
    parts = split_system_context(text, mode)
    assert "".join(t for t, _ in parts) == text
    assert documents(parts) == expected_docs
    return parts


@pytest.mark.parametrize("mode", ["delimited", "after_instructions"])
@pytest.mark.parametrize("template", [LANGCHAIN_TUTORIAL, LANGCHAIN_RETRIEVAL_CHAIN])
def test_langchain_qa_prompts(template, mode):
    text = langchain_system(template, DOCS)
    parts = check(text, mode, DOCS)
    assert instructions(parts).replace("\n", "") == template.replace("{context}", "").replace("\n", "")


def test_langchain_hub_retrieval_qa_prompt():
    text = langchain_system(LANGCHAIN_HUB_RETRIEVAL_QA, DOCS)
    parts = check(text, "delimited", DOCS)
    assert instructions(parts) == (
        "Answer any use questions based solely on the context below:\n\n<context>\n\n\n\n\n\n</context>"
    )


@pytest.mark.parametrize("system_prompt", ["", "You are a bridge historian."])
def test_llama_index_context_engine(system_prompt):
    text = llama_system(DEFAULT_CONTEXT_TEMPLATE, DOCS, system_prompt=system_prompt)
    parts = check(text, "delimited", DOCS)
    assert instructions(parts).endswith("\n--------------------\n" + system_prompt)
    assert instructions(parts).startswith("Use the context information below to assist the user.")


def test_llama_index_context_engine_refine_keeps_the_existing_answer():
    text = llama_system(DEFAULT_REFINE_TEMPLATE, DOCS, "context_msg")
    parts = check(text, "delimited", DOCS)
    assert "Existing Answer:\nIt opened in 1883." in instructions(parts)


@pytest.mark.parametrize("system_prompt", ["", "Answer in English."])
def test_llama_index_condense_plus_context(system_prompt):
    text = llama_system(DEFAULT_CONTEXT_PROMPT_TEMPLATE, DOCS, system_prompt=system_prompt)
    parts = check(text, "delimited", DOCS)
    kept = instructions(parts)
    assert "Here are the relevant documents for the context:\n\n  " in kept
    assert "Instruction: Based on the above documents, provide a detailed answer" in kept
    assert kept.endswith(system_prompt)


def test_llama_index_condense_plus_context_refine_keeps_the_existing_answer():
    text = llama_system(DEFAULT_CONTEXT_REFINE_PROMPT_TEMPLATE, DOCS, "context_msg")
    parts = check(text, "delimited", DOCS)
    assert "Existing Answer:\n  It opened in 1883." in instructions(parts)


@pytest.mark.parametrize("mode", SYSTEM_CONTEXT_MODES)
def test_no_context_found_leaves_the_message_whole(mode):
    for text in ["Answer the question using the documents. Be brief.", "One line.\nAnother line."]:
        assert split_system_context(text, mode) == [(text, False)]
    assert split_system_context("", mode) == []


def test_off_never_splits():
    text = langchain_system(LANGCHAIN_HUB_RETRIEVAL_QA, DOCS)
    assert split_system_context(text, "off") == [(text, False)]


def test_delimited_needs_a_known_template():
    text = "Be brief.\n\nSome paragraph.\n\nAnother paragraph."
    assert split_system_context(text, "delimited") == [(text, False)]
    assert documents(split_system_context(text, "after_instructions")) == ["Some paragraph.", "Another paragraph."]


def test_after_instructions_label_line():
    text = "You answer questions about bridges.\nBe brief.\nContext:\nDoc A.\n\nDoc B."
    parts = check(text, "after_instructions", ["Doc A.", "Doc B."])
    assert instructions(parts).startswith("You answer questions about bridges.\nBe brief.\nContext:\n")


def test_a_label_at_the_start_is_not_context():
    text = "Context: you are a support bot.\n\nDoc A."
    assert documents(split_system_context(text, "delimited")) == []
    assert documents(split_system_context(text, "after_instructions")) == ["Doc A."]


@pytest.mark.parametrize(
    ("template", "variable"),
    [(LANGCHAIN_TUTORIAL, "context"), (LANGCHAIN_RETRIEVAL_CHAIN, "context"), (LANGCHAIN_HUB_RETRIEVAL_QA, "context")],
)
def test_empty_context_is_no_documents(template, variable):
    text = langchain_system(template, [])
    assert split_system_context(text, "delimited") == [(text, False)]


def test_empty_llama_index_context_is_no_documents():
    for template in (DEFAULT_CONTEXT_TEMPLATE, DEFAULT_CONTEXT_PROMPT_TEMPLATE):
        text = llama_system(template, [])
        assert split_system_context(text, "delimited") == [(text, False)]


def test_a_document_quoting_the_closing_tag_stays_inside():
    docs = ["Markup: <context> and </context> are tags.", "Second document."]
    text = langchain_system(LANGCHAIN_HUB_RETRIEVAL_QA, docs)
    check(text, "delimited", docs)


def test_a_document_holding_a_dash_line_ends_the_span_early_and_the_rest_stays_whole():
    docs = ["First.", "A table\n--------------------\nrow", "Third."]
    text = llama_system(DEFAULT_CONTEXT_TEMPLATE, docs, system_prompt="Be brief.")
    parts = check(text, "delimited", ["First.", "A table"])
    assert instructions(parts).endswith("row\n\nThird.\n--------------------\nBe brief.")


def test_a_document_holding_the_llama_instruction_line_stays_inside():
    docs = ["Manual.\n\nInstruction: press the button.", "Second."]
    text = llama_system(DEFAULT_CONTEXT_PROMPT_TEMPLATE, docs)
    check(text, "delimited", ["Manual.", "Instruction: press the button.", "Second."])


def test_a_document_holding_a_context_label_stays_a_document():
    docs = ["Glossary. Context: the words around a passage.", "Second."]
    text = langchain_system(LANGCHAIN_RETRIEVAL_CHAIN, docs)
    check(text, "delimited", docs)


def test_documents_keep_their_own_whitespace_outside():
    text = langchain_system(LANGCHAIN_TUTORIAL, ["  indented doc  ", "next"])
    parts = check(text, "delimited", ["indented doc", "next"])
    assert all(t == t.strip() for t, d in parts if d)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="use one of off, after_instructions, delimited"):
        split_system_context("x", "on")  # type: ignore[arg-type]


def test_dash_lines_pair_with_the_same_line():
    dashes = "-" * 21  # LlamaIndex's 'Context information is below.' QA prompts use 21 dashes
    text = f"Context information is below.\n{dashes}\nDoc.\n{'-' * 20}\nx\n{dashes}\nGiven the context, answer."
    check(text, "delimited", [f"Doc.\n{'-' * 20}\nx"])


def test_many_dash_lines_are_one_pass():
    lines = "\n".join("-" * (10 + i) for i in range(2000))
    text = f"Intro.\n{lines}\nDoc.\n{'-' * 10}\nEnd."
    parts = split_system_context(text, "delimited")
    assert "".join(t for t, _ in parts) == text and documents(parts)
