"""No draft_model named: the model drafts with its own first layers ('self'), from a model folder."""

from langchain_specprefill import ChatSpecPrefill
from specprefill_rag.testing import build_model, build_tokenizer, random_documents


def test_no_draft_model_means_self(tmp_path):
    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = ChatSpecPrefill(model=str(tmp_path), keep_rate=0.3, min_prompt_tokens=0, max_tokens=4)
    message = llm.invoke("Which color?", documents=random_documents(3, 40))
    stats = message.response_metadata["spec_prefill"]
    assert stats["draft_path"] == "self" and stats["compressed"]
