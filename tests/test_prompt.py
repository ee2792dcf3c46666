"""RAG prompt layout: roles located through tokenizer offsets."""

import pytest
import torch

from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.prompt.layout import Document, Role
from specprefill_rag.prompt.render import build_rag_layout, build_text_layout

DOCUMENTS = [
    "Paris is the capital of France. The quick brown fox jumps over the lazy dog.",
    Document("The bridge opened in 1883 after thirteen years of work.", title="Bridge", id="b1"),
    {"text": "Retrieval augmented generation feeds documents to a language model.", "title": "RAG"},
]


def decoded(tokenizer, layout, selector):
    return tokenizer.decode(layout.input_ids[selector])


def test_roles_of_chat_rendered_prompt(tokenizer):
    layout = build_rag_layout(tokenizer, "When did the bridge open?", DOCUMENTS, instructions="Answer briefly.")
    assert tokenizer.decode(layout.input_ids) == layout.text
    assert decoded(tokenizer, layout, layout.roles == Role.QUESTION) == "When did the bridge open?"
    assert decoded(tokenizer, layout, layout.roles == Role.INSTRUCTION) == "Answer briefly."
    texts = [d if isinstance(d, str) else d.text if isinstance(d, Document) else d["text"] for d in DOCUMENTS]
    for index, text in enumerate(texts):
        assert decoded(tokenizer, layout, layout.document_index == index) == text
    template = decoded(tokenizer, layout, layout.roles == Role.TEMPLATE)
    assert template.startswith("<|im_start|>system\n") and template.endswith("<|im_start|>assistant\n")
    assert "Document [2] Bridge" in template
    assert layout.n_document_tokens == int((layout.roles == Role.DOCUMENT).sum())
    assert torch.equal(layout.roles == Role.DOCUMENT, layout.document_index >= 0)


def test_question_comes_after_documents(tokenizer):
    layout = build_rag_layout(tokenizer, "When did the bridge open?", DOCUMENTS)
    question_start = int(torch.nonzero(layout.roles == Role.QUESTION)[0])
    assert question_start > int(torch.nonzero(layout.document_index >= 0)[-1])
    assert (layout.roles == Role.INSTRUCTION).sum() == 0


def test_plain_template_without_chat_template(tokenizer):
    layout = build_rag_layout(tokenizer, "When?", DOCUMENTS, instructions="Be brief.", use_chat_template=False)
    assert layout.text.endswith("Question: When?\nAnswer:")
    assert decoded(tokenizer, layout, layout.document_index == 0) == DOCUMENTS[0]


def test_template_that_alters_content_is_rejected(tokenizer):
    altering = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer)
    altering.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(InvalidRequestError, match="use_chat_template=False"):
        build_rag_layout(altering, "When?", DOCUMENTS)


def test_raw_prompt_protects_special_tokens_and_tail(tokenizer):
    prompt = (
        "<|im_start|>user\n"
        + "the quick brown fox jumps over the lazy dog " * 5
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    layout = build_text_layout(tokenizer, prompt, protect_tail_tokens=4, parse_special_tokens=True)
    special = torch.isin(layout.input_ids, torch.tensor(tokenizer.all_special_ids))
    assert (layout.roles[special] == Role.TEMPLATE).all()
    assert (layout.document_index[-4:] == -1).all()
    candidates = layout.document_index >= 0
    assert candidates.sum() == len(layout) - special.sum() - (~special[-4:]).sum()
    # runs between special tokens are separate pseudo-documents, so no chunk spans a special token
    specials_before = torch.cumsum(special.long(), 0)
    assert torch.equal(layout.document_index[candidates], specials_before[candidates])
