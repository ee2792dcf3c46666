"""Answer-quality study: SpecPrefill and baselines at several keep rates, same main model.

Tasks (benchmarks/tasks.py, data read in place from ../shared/data):
  squad      a SQuAD v1.1 question's paragraph among distractor paragraphs of other articles
  hotpotqa   HotpotQA distractor setting: 10 paragraphs, 2 gold
  nq         NQ-open with its gold passage among passages of other questions
  niah       a needle sentence (five kinds) at depths 0-100% of Paul Graham essays
  longbench  LongBench v1 samples with the official prompts, contexts middle-truncated

Methods (all share one prompt layout and one main model):
  specprefill      draft = SmolLM2-135M (the paper's algorithm), look-ahead 8, 32-token chunks (the paper's;
                   the engine's default chunking is now ``sentences``: ``specprefill-sentences``)
  specprefill-la<N>  the same draft, look-ahead N (1 to 99; the engine's default is 8)
  specprefill-documents  the same draft from the per-document draft cache (issue #28): each document encoded
                   alone after the prompt's prefix first, then the prompt scored with every document a hit
                   (blend repair); specprefill-documents-naive: the same without repair;
                   specprefill-documents-blend05: blend recomputing 5% of the document tokens (not 15%);
                   specprefill-documents-in-context: each document first drafted in another prompt (the same
                   documents in reverse order) with document_first_sight="in_context", then a hit (issue #44)
  specprefill-layers<N>  the same draft run to its first N layers (``draft_layers``, issue #44): queries are its
                   last 16 prompt tokens, as self's, since it cannot decode look-ahead tokens (N its depth: the
                   whole draft without a look-ahead); specprefill-layers<N>-documents[-naive|-epic]: that draft from the
                   per-document draft cache, as specprefill-documents[-naive]
  specprefill-documents-query[<NN>]  the cache with the query-aware repair (issue #44: the tokens the
                   question attends to most recomputed in context), NN% of the document tokens (default 15)
  specprefill-auto the same draft's importance, budget chosen per sample by keep_rate="auto"
                   (ImportanceMass): its rows' "keep" is the mass share (--auto-shares), "kept share"
                   the average share it chose; with several --auto-floors/--auto-ceilings, one method
                   specprefill-auto-f<floor>-c<ceiling> each (a tuning grid); --match-auto runs the
                   fixed methods at auto's average kept share
  self-<n>[-w<W>]  the main model's first n layers as draft; queries: the last prompt token, or the
                   last W prompt tokens
  contiguous       specprefill's kept tokens, renumbered 0..K-1 (what original positions are worth)
  <draft>-sentences  that draft's importance (specprefill, self, self-<n>...), chunks of whole sentences up to
                   32 tokens (``chunking="sentences"``, the engine's default since issue #45)
  longllmlingua    LongLLMLingua (real ``llmlingua`` package, SmolLM2-135M as its compressor)
  embeddings-filter  the documents' sentences most similar to the question (all-MiniLM-L6-v2) that fit the
                   budget, as LangChain's EmbeddingsFilter at sentence grain (benchmarks/sentence_filter.py); the
                   main model prefills the shorter prompt whole
  embeddings-filter<NN>-specprefill  both (issue #44): the filter keeps NN% of the documents' tokens, the prompt
                   is laid out with what it kept, and specprefill keeps what brings the share prefilled to the
                   keep rate (keep 0.1 after a 50% filter: specprefill at 0.2 of the filtered documents)
  random           random chunks at the same budget (seeded)
  first            the first tokens of every document at the same budget

Metrics per answer: normalised containment of a gold answer, SQuAD EM and F1, the main model's
mean log-probability per token of the first gold answer given the prefilled prompt (teacher forced:
a continuous signal that still moves where a small model rarely answers right), whether any gold
document token was prefilled, and whether a gold answer string survives in the prefilled document
text. Retention = score / full-prefill score.

    python benchmarks/quality.py --task squad --samples 40 --keep-rates 0.1 0.3 0.5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import string
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import tasks
import torch
from sentence_filter import SentenceFilter, sparse_keep_rate
from tqdm import tqdm

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.backends.hf import eos_token_ids
from specprefill_rag.config import DEFAULT_SELF_LAYER_SHARE, SpecPrefillConfig
from specprefill_rag.decode.detokenize import IncrementalText
from specprefill_rag.draft.assembly import DocumentSpans
from specprefill_rag.draft.document_cache import DocumentKVCache, DocumentStore
from specprefill_rag.draft.model import LayerPrefixDraft, ModelDraft
from specprefill_rag.draft.paths import (
    DirectScoring,
    MappedScoring,
    document_spans,
    draft_score,
    draft_scoring,
    score_layout,
    warm_layout,
)
from specprefill_rag.draft.repair import DEFAULT_REPAIR, NAIVE, DocumentRepair
from specprefill_rag.models.loading import shared_model
from specprefill_rag.prompt.chat import ChatMessage, chat_layout
from specprefill_rag.prompt.layout import PromptLayout
from specprefill_rag.selection import ImportanceMass, select_kept

BLEND_5 = DocumentRepair("blend", share=0.05)  # a cheaper blend: a third of the default's recompute
# specprefill-documents-query, or -query<NN> for NN% of the document tokens (query05, query10, query20...)
QUERY_METHOD = re.compile(r"specprefill-documents-query(\d{2})?")


LAYERS_METHOD = re.compile(r"specprefill-layers([1-9][0-9]*)")  # the draft's first N layers (draft_layers=N)
# the same draft from the per-document draft cache, blend (or naive, or EPIC's first tokens) repair
LAYERS_DOCUMENTS_METHOD = re.compile(r"specprefill-layers([1-9][0-9]*)-documents(?:-(naive|epic))?")
LOOK_AHEAD_METHOD = re.compile(r"specprefill-la([1-9][0-9]?)")  # the engine's draft with look-ahead N


# The engine every method starts from. draft_cache_mb=0: every sample is scored cold, as in the earlier runs these
# tables merge with (samples that share a haystack prefix would otherwise start from each other's draft KV).
# draft_queries="look_ahead": `specprefill` is the paper's look-ahead in every recorded study, named so it stays so
# whatever the library's default (`specprefill-layers<N>` is the window, the whole draft at N = its depth).
STUDY_ENGINE = {"min_prompt_tokens": 0, "draft_cache_mb": 0, "draft_queries": "look_ahead"}


def look_ahead_draft(engine: SpecPrefillEngine, look_ahead: int) -> Callable[[PromptLayout], torch.Tensor]:
    """Importance from the engine's draft model with ``look_ahead`` queries (the last prompt token and
    ``look_ahead - 1`` decoded tokens, stopping at its end-of-sequence tokens); direct or mapped, as the engine's
    path."""
    draft = replace(engine.draft, look_ahead=look_ahead, prefix_cache=None, document_cache=None)
    return replace(engine.draft_scoring, draft=draft, look_ahead=look_ahead).importance


def layers_scoring(
    engine: SpecPrefillEngine, layers: int, store: DocumentStore | None = None, repair: DocumentRepair = DEFAULT_REPAIR
) -> DirectScoring | MappedScoring:
    """The engine's draft model run to its first ``layers`` layers, as ``draft_layers`` builds it: queries its last
    ``self_draft_window`` (16) prompt tokens; direct or mapped, as the engine's path; ``store``: its per-document
    draft cache, repaired by ``repair``."""
    window, kernel = engine.config.self_draft_window, engine.config.pool_kernel
    draft = LayerPrefixDraft(engine.draft.model, layers, kernel, window, document_cache=store, repair=repair)
    return replace(engine.draft_scoring, draft=draft, look_ahead=1)


def layers_draft(engine: SpecPrefillEngine, layers: int) -> Callable[[PromptLayout], torch.Tensor]:
    """Importance from :func:`layers_scoring`'s draft, scored jointly."""
    return layers_scoring(engine, layers).importance


def layers_document_draft(engine: SpecPrefillEngine, method: str) -> Callable[[PromptLayout], torch.Tensor]:
    """``specprefill-layers<N>-documents[-naive|-epic]``: :func:`layers_scoring`'s draft from the per-document draft
    cache (the engine's store) with blend repair (``-naive``: none; ``-epic``: each document's first tokens), each
    document a hit, as :func:`document_cache_draft` scores."""
    match = LAYERS_DOCUMENTS_METHOD.fullmatch(method)
    if match is None:
        raise ValueError(f"{method!r} is not specprefill-layers<N>-documents[-naive|-epic]")
    repair = DocumentRepair(match[2]) if match[2] else DEFAULT_REPAIR
    return cached_importance(layers_scoring(engine, int(match[1]), engine.draft.document_cache, repair))


def query_repair(method: str) -> DocumentRepair:
    """The query-aware repair a ``specprefill-documents-query[<NN>]`` method names (NN: percent recomputed)."""
    match = QUERY_METHOD.fullmatch(method)
    if match is None:
        raise ValueError(f"{method!r} is not specprefill-documents-query or specprefill-documents-query<NN>")
    return DocumentRepair("query", share=int(match[1]) / 100) if match[1] else DocumentRepair("query")


ROOT = tasks.ROOT
INSTRUCTIONS = "Answer the question using the documents. Answer with a short phrase."


# -- scoring (standard SQuAD normalisation) ---------------------------------------------------------


def normalise(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1(prediction: str, gold: str) -> float:
    predicted, expected = normalise(prediction).split(), normalise(gold).split()
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def scores(prediction: str, answers: list[str]) -> dict[str, float]:
    return {
        "contains": float(any(normalise(a) in normalise(prediction) for a in answers)),
        "em": float(any(normalise(a) == normalise(prediction) for a in answers)),
        "f1": max(f1(prediction, a) for a in answers),
    }


def load_samples(args: argparse.Namespace, tokenizer) -> list[dict]:
    tasks.require_data()
    if args.task == "squad":
        return tasks.squad(args.samples, args.documents, args.seed)
    if args.task == "hotpotqa":
        return tasks.hotpotqa(args.samples, args.seed)
    if args.task == "nq":
        return tasks.nq(args.samples, args.documents, args.seed)
    if args.task == "niah":
        return tasks.niah(args.samples, tokenizer, args.length, args.seed)
    return tasks.longbench(args.samples, tokenizer, args.length, args.seed)


def sample_layout(engine: SpecPrefillEngine, sample: dict, documents: list[str] | None = None) -> PromptLayout:
    """The sample's prompt: the official LongBench prompt with documents located in it, else our RAG layout."""
    documents = sample["documents"] if documents is None else documents
    if "prompt" not in sample:
        return engine.layout(sample["question"], documents, INSTRUCTIONS)
    message = ChatMessage("user", [sample["prompt"].replace("{context}", "".join(documents))])
    return chat_layout(engine.tokenizer, [message], documents=documents, insert_missing=False).layout


# -- methods: each maps (sample, layout, keep_rate) -> the tokens the main model prefills ------------


@dataclass
class Prefill:
    """What the main model prefills: ``layout.input_ids[kept]`` at ``positions`` (both ``[K]``)."""

    layout: PromptLayout
    kept: torch.Tensor
    positions: torch.Tensor

    @property
    def prompt_length(self) -> int:
        """Where generated tokens continue: L with original positions, K when renumbered."""
        return len(self.layout) if torch.equal(self.positions, self.kept) else int(self.kept.numel())

    @classmethod
    def whole(cls, layout: PromptLayout) -> Prefill:
        everything = torch.arange(len(layout))
        return cls(layout, everything, everything)


def first_tokens(document_index: torch.Tensor, keep_rate: float) -> torch.Tensor:
    """Keep every non-document token and the first ceil(keep_rate * n_d) tokens of each document d."""
    keep = document_index < 0
    for document in document_index[document_index >= 0].unique().tolist():
        positions = torch.nonzero(document_index == document).flatten()
        keep[positions[: math.ceil(keep_rate * positions.numel())]] = True
    keep[-1] = True
    return torch.nonzero(keep).flatten()


def self_name(n_layers: int, window: int) -> str:
    return f"self-{n_layers}" if window == 1 else f"self-{n_layers}-w{window}"


def default_self_layers(model) -> int:
    """What ``draft="self"`` uses for this main model: the first 40% of its layers."""
    return max(1, round(DEFAULT_SELF_LAYER_SHARE * model.config.num_hidden_layers))


def extra_draft(engine: SpecPrefillEngine, spec: str, look_ahead: int = 8) -> Callable[[PromptLayout], torch.Tensor]:
    """Importance from another draft model (``--extra-drafts``): direct when it shares the main model's
    vocabulary, mapped through the documents' characters when not (e.g. SmolLM2-135M for a Qwen main)."""
    draft = shared_model(spec, engine.config.device, engine.config.dtype)
    scorer = ModelDraft(draft.model, look_ahead, engine.config.pool_kernel, eos_token_ids(draft.model, draft.tokenizer))
    return draft_scoring(scorer, draft.tokenizer, engine.tokenizer, look_ahead).importance


def document_cache_draft(
    engine: SpecPrefillEngine, repair: DocumentRepair | None = None
) -> Callable[[PromptLayout], torch.Tensor]:
    """Importance from the per-document draft cache (``draft_document_cache``, issue #28): the layout's documents
    are encoded first, each alone after the prompt's prefix (as a corpus warmed at ingestion), then the prompt is
    scored with every document a cache hit, its keys moved to its position, with ``repair`` (default: the
    engine's). Every repair shares the engine's store: a document's cached KV does not depend on the repair."""
    scoring = engine.draft_scoring
    if repair is not None:
        scoring = replace(scoring, draft=replace(engine.draft, repair=repair))
    return cached_importance(scoring)


def cached_importance(scoring: DirectScoring | MappedScoring) -> Callable[[PromptLayout], torch.Tensor]:
    """Importance from ``scoring``'s draft with every document of the layout a hit of its per-document cache: the
    documents are encoded into it first, each alone after the prompt's prefix (as a corpus warmed at ingestion)."""

    def importance(layout: PromptLayout) -> torch.Tensor:
        warm_layout(scoring, layout)
        return score_layout(scoring, layout, documents=True).importance

    return importance


def reversed_documents(token_ids: torch.Tensor, documents: DocumentSpans) -> tuple[torch.Tensor, DocumentSpans]:
    """Another prompt over the same documents: ``[L]`` ``token_ids`` with its documents in reverse order and
    everything else (prefix, the labels and turn markers between documents, the tail) in place; the ``[L]`` ids
    and where its documents now are."""
    spans, prefix_length = documents.checked(token_ids.numel())
    bounds = spans.tolist()
    gap_starts = [prefix_length, *(end for _, end in bounds[:-1])]
    gaps = [token_ids[start:document_start] for start, (document_start, _) in zip(gap_starts, bounds)]
    texts = [token_ids[start:end] for start, end in reversed(bounds)]
    pieces, moved, position = [token_ids[:prefix_length]], [], prefix_length
    for gap, text in zip(gaps, texts):
        position += gap.numel()
        moved.append((position, position + text.numel()))
        position += text.numel()
        pieces += [gap, text]
    return torch.cat([*pieces, token_ids[bounds[-1][1] :]]), DocumentSpans(torch.tensor(moved), prefix_length)


def in_context_document_draft(engine: SpecPrefillEngine) -> Callable[[PromptLayout], torch.Tensor]:
    """Importance from the per-document draft cache with ``document_first_sight="in_context"`` (issue #44), on
    a store of its own: the layout's documents are first drafted in another prompt, the same documents in
    reverse order (:func:`reversed_documents`), so each is stored from that prompt's pass, having seen the
    documents that follow it in the layout and not those before it; then the layout is scored with every
    document a hit, with the engine's repair. A document a sample shares with an earlier one (NIAH's essays)
    is held as that earlier prompt stored it."""
    repair = replace(engine.draft.repair, first_sight="in_context")
    draft = replace(engine.draft, document_cache=DocumentKVCache(2**32), repair=repair)
    scoring = replace(engine.draft_scoring, draft=draft)

    def importance(layout: PromptLayout) -> torch.Tensor:
        prepared = scoring.prepare(layout)
        spans = document_spans(prepared)
        if spans is not None:
            draft_score(scoring.draft, *reversed_documents(prepared.token_ids, spans))
        return score_layout(scoring, layout, prepared, documents=True).importance

    return importance


def make_methods(engine: SpecPrefillEngine, args: argparse.Namespace) -> dict[str, Callable]:
    """The methods named in ``args.methods``; each call takes (sample, layout, keep_rate)."""
    model, kernel = engine.main.model, engine.config.pool_kernel

    def token_scorer(draft) -> Callable[[PromptLayout], torch.Tensor]:
        return lambda layout: draft.score(layout.input_ids)

    drafts = {
        "specprefill": lambda: engine.draft_scoring.importance,  # direct or mapped, as the engine chose
        **{
            name: (lambda name=name: look_ahead_draft(engine, int(LOOK_AHEAD_METHOD.fullmatch(name)[1])))  # type: ignore[index]
            for name in {"specprefill-la1", *(method.removesuffix(SENTENCES) for method in args.methods)}
            if LOOK_AHEAD_METHOD.fullmatch(name)
        },
        "specprefill-documents": lambda: document_cache_draft(engine),
        "specprefill-documents-naive": lambda: document_cache_draft(engine, NAIVE),
        "specprefill-documents-blend05": lambda: document_cache_draft(engine, BLEND_5),
        "specprefill-documents-in-context": lambda: in_context_document_draft(engine),
        **{
            name: (lambda name=name: document_cache_draft(engine, query_repair(name)))
            for name in args.methods
            if QUERY_METHOD.fullmatch(name)
        },
        **{
            name: (lambda name=name: layers_document_draft(engine, name))
            for name in args.methods
            if LAYERS_DOCUMENTS_METHOD.fullmatch(name)
        },
        **{
            name: (lambda name=name: layers_draft(engine, int(LAYERS_METHOD.fullmatch(name)[1])))  # type: ignore[index]
            for name in args.methods
            if LAYERS_METHOD.fullmatch(name)
        },
        "self": lambda: token_scorer(LayerPrefixDraft(model, default_self_layers(model), kernel, 16)),
        **{
            self_name(n, w): (lambda n=n, w=w: token_scorer(LayerPrefixDraft(model, n, kernel, w)))
            for n in args.self_layers
            for w in args.self_windows
        },
        **{f"specprefill-{spec}": (lambda spec=spec: extra_draft(engine, spec)) for spec in args.extra_drafts},
    }
    auto = auto_methods(args)
    drafts = {
        name: make()
        for name, make in drafts.items()
        if name in args.methods
        or name + SENTENCES in args.methods
        or (name == "specprefill" and ({"contiguous", AUTO} & set(args.methods)))
    }
    # draft -> {id(layout): (layout, importance [L])}; the layout is held, so its id() is not reused
    scored: dict[str, dict[int, tuple[PromptLayout, torch.Tensor]]] = {name: {} for name in drafts}

    def importance(name: str, layout: PromptLayout) -> torch.Tensor:
        if id(layout) not in scored[name]:
            scored[name][id(layout)] = (layout, drafts[name](layout))
        return scored[name][id(layout)][1]

    def draft_method(name: str, renumber: bool = False, sentences: bool = False) -> Callable:
        def run(sample: dict, layout: PromptLayout, keep_rate: float) -> Prefill:
            starts = layout.sentence_starts() if sentences else None
            scores = importance(name, layout)
            kept = select_kept(scores, layout.document_index, keep_rate=keep_rate, chunk_size=32, sentence_start=starts)
            return Prefill(layout, kept, torch.arange(kept.numel()) if renumber else kept)

        return run

    def random_chunks(sample: dict, layout: PromptLayout, keep_rate: float) -> Prefill:
        generator = torch.Generator().manual_seed(args.seed + len(layout))
        kept = select_kept(
            torch.rand(len(layout), generator=generator), layout.document_index, keep_rate=keep_rate, chunk_size=32
        )
        return Prefill(layout, kept, kept)

    def first(sample: dict, layout: PromptLayout, keep_rate: float) -> Prefill:
        kept = first_tokens(layout.document_index, keep_rate)
        return Prefill(layout, kept, kept)

    def auto_method(floor: float, ceiling: float) -> Callable:
        def run(sample: dict, layout: PromptLayout, share: float) -> Prefill:
            budget = ImportanceMass(share, floor, ceiling)
            scores = importance("specprefill", layout)
            kept = select_kept(scores, layout.document_index, keep_rate=budget, chunk_size=32)
            return Prefill(layout, kept, kept)

        return run

    methods = {name: draft_method(name) for name in drafts}
    methods.update({"contiguous": draft_method("specprefill", renumber=True), "random": random_chunks, "first": first})
    methods.update({name + SENTENCES: draft_method(name, sentences=True) for name in drafts})
    methods.update({name: auto_method(floor, ceiling) for name, (floor, ceiling) in auto.items()})
    if "longllmlingua" in args.methods:
        methods["longllmlingua"] = longllmlingua_method(engine, args.compressor or compressor_default(args))
    if EMBEDDINGS_FILTER in args.methods:
        methods[EMBEDDINGS_FILTER] = sentence_filter_method(engine)
    for name in args.methods:
        if match := FILTERED_METHOD.fullmatch(name):
            methods[name] = filtered_sparse_method(engine, int(match[1]) / 100)
    names = [n for method in args.methods for n in (auto if method == AUTO else [method])]
    return {name: methods[name] for name in names}


AUTO = "specprefill-auto"


def auto_methods(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """keep_rate="auto" methods: name -> (floor, ceiling); one per pair of --auto-floors x --auto-ceilings
    with floor <= ceiling, named ``specprefill-auto`` when there is one pair."""
    pairs = [(f, c) for f in args.auto_floors for c in args.auto_ceilings if f <= c]
    if len(pairs) == 1:
        return {AUTO: pairs[0]}
    return {f"{AUTO}-f{f:g}-c{c:g}": (f, c) for f, c in pairs}


def matched_keep_rate(auto: Callable, samples: list[dict], layouts: dict[int, PromptLayout], share: float) -> float:
    """Average share of document tokens ``auto`` keeps over the samples in ``layouts``, rounded to 0.01: the
    fixed rate of equal average kept share (``--match-auto``). The draft's scores stay cached for the run."""
    shares = []
    for index, layout in layouts.items():
        kept = auto(samples[index], layout, share).kept
        shares.append(int((layout.document_index[kept] >= 0).sum()) / layout.n_document_tokens)
    return round(sum(shares) / len(shares), 2)


def method_budgets(name: str, args: argparse.Namespace) -> list[float]:
    """What a method's rows vary: the mass share for keep_rate="auto" methods, else the keep rate."""
    return args.auto_shares if name.startswith(AUTO) else args.keep_rates


class MethodFailed(Exception):
    """A baseline could not process this sample; recorded as a failure, left out of its rows."""


def longllmlingua_method(engine: SpecPrefillEngine, compressor_spec: str) -> Callable:
    from longllmlingua import LongLLMLingua

    from specprefill_rag.models.loading import _dtype, resolve

    dtype = _dtype(engine.config.dtype, engine.config.device)
    compressor = LongLLMLingua(resolve(compressor_spec, dtype), dtype)

    def run(sample: dict, layout: PromptLayout, keep_rate: float) -> Prefill:
        try:
            compressed = compressor.compress(sample["documents"], sample["question"], keep_rate)
        except AssertionError as error:  # llmlingua asserts on some inputs (e.g. its get_prefix_length)
            where = traceback.extract_tb(error.__traceback__)[-1]
            raise MethodFailed(
                f"llmlingua: AssertionError in {where.name} ({Path(where.filename).name}:{where.lineno})"
            ) from None
        return Prefill.whole(sample_layout(engine, sample, [compressed]))

    return run


EMBEDDINGS_FILTER = "embeddings-filter"
SENTENCES = "-sentences"  # <draft>-sentences: that draft's importance, chunks of whole sentences (chunking="sentences")
# the sentence filter keeping NN% of the documents' tokens, then specprefill on what it kept
FILTERED_METHOD = re.compile(r"embeddings-filter(\d{2})-specprefill")
# methods that rewrite the documents' text: their prompt's documents are not the sample's, so no gold document
TEXT_METHODS = ("longllmlingua", EMBEDDINGS_FILTER)


def rewrites_text(method: str) -> bool:
    return method in TEXT_METHODS or FILTERED_METHOD.fullmatch(method) is not None


def sentence_filter_method(engine: SpecPrefillEngine) -> Callable:
    sentence_filter = SentenceFilter(engine.tokenizer)

    def run(sample: dict, layout: PromptLayout, keep_rate: float) -> Prefill:
        kept = sentence_filter.filter(sample["documents"], sample["question"], keep_rate)
        return Prefill.whole(sample_layout(engine, sample, kept))

    return run


def filtered_sparse_method(engine: SpecPrefillEngine, filter_share: float) -> Callable:
    """``embeddings-filter<NN>-specprefill``: the filter keeps ``filter_share`` of the documents (once per
    sample: it does not depend on the keep rate), then the engine's draft scores the filtered prompt and
    selection keeps what brings the share of the original documents prefilled to the keep rate."""
    sentence_filter = SentenceFilter(engine.tokenizer)
    # id(original layout) -> (original layout, filtered layout, its importance [L']); the layout is held
    filtered: dict[int, tuple[PromptLayout, PromptLayout, torch.Tensor]] = {}

    def run(sample: dict, layout: PromptLayout, keep_rate: float) -> Prefill:
        if id(layout) not in filtered:
            kept_text = sentence_filter.filter(sample["documents"], sample["question"], filter_share)
            shorter = sample_layout(engine, sample, kept_text)
            filtered[id(layout)] = (layout, shorter, engine.draft_scoring.importance(shorter))
        _, shorter, importance = filtered[id(layout)]
        rate = sparse_keep_rate(keep_rate, layout.n_document_tokens, shorter.n_document_tokens)
        kept = select_kept(importance, shorter.document_index, keep_rate=rate, chunk_size=32)
        return Prefill(shorter, kept, kept)

    return run


# -- one answer -------------------------------------------------------------------------------------


@torch.inference_mode()
def _forward(model, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """``[n]`` tokens at ``positions`` appended to ``cache``; ``[n, V]`` float32 logits."""
    slots = torch.arange(cache.get_seq_length(), cache.get_seq_length() + ids.numel())
    output = model(input_ids=ids[None], position_ids=positions[None], cache_position=slots, past_key_values=cache)
    return output.logits[0].float()


@torch.inference_mode()
def answer_and_logprob(
    engine: SpecPrefillEngine, prefill: Prefill, answer: str, max_new_tokens: int
) -> tuple[str, float]:
    """Greedy answer (up to a newline) and the mean log-probability per token of the gold ``answer``
    right after the prefilled prompt (teacher forced), from ONE prefill: the cache is cropped back to the
    prompt after decoding. An explicit cache and positions: transformers would otherwise read gaps in
    position_ids as packed sequences."""
    from transformers import DynamicCache

    model, n_kept = engine.main.model, prefill.kept.numel()
    cache = DynamicCache(config=model.config)
    logits = _forward(model, prefill.layout.input_ids[prefill.kept], prefill.positions, cache)[-1]
    first = logits.log_softmax(-1)
    text = IncrementalText(engine.tokenizer, ("\n",))
    for step in range(max_new_tokens):
        token = int(logits.argmax())
        if token in engine.backend.eos_ids:
            break
        text.push(token)
        if text.stopped or step + 1 == max_new_tokens:
            break
        logits = _forward(model, torch.tensor([token]), torch.tensor([prefill.prompt_length + step]), cache)[-1]
    text.finish()
    if decoded := cache.get_seq_length() - n_kept:
        cache.crop(-decoded)  # back to the prompt alone
    answer_ids = torch.tensor(engine.tokenizer(answer, add_special_tokens=False)["input_ids"])
    rest = (
        _forward(model, answer_ids[:-1], prefill.prompt_length + torch.arange(answer_ids.numel() - 1), cache)
        if answer_ids.numel() > 1
        else first.new_zeros(0, first.numel())
    )  # a one-token answer: nothing to feed
    predicted = torch.cat([first[None], rest.log_softmax(-1)])
    return text.emitted.strip(), float(predicted.gather(1, answer_ids[:, None]).mean())


def evaluate(
    engine: SpecPrefillEngine, sample: dict, prefill: Prefill, max_new_tokens: int, document_tokens: int
) -> dict:
    """Scores of one method's prefill on one sample (``document_tokens``: those of the uncompressed prompt)."""
    text, logprob = answer_and_logprob(engine, prefill, sample["answers"][0], max_new_tokens)
    generated = {"answer": text, **scores(text, sample["answers"])} if max_new_tokens else {}  # 0: logprob only
    document_index = prefill.layout.document_index[prefill.kept]
    document_ids = prefill.layout.input_ids[prefill.kept][document_index >= 0]
    kept_text = normalise(engine.tokenizer.decode(document_ids))
    return {
        **generated,
        "logprob": logprob,
        "answer_kept": float(any(normalise(a) in kept_text for a in sample["answers"])),
        "gold_document_kept": float(any(int(d) in sample["gold_documents"] for d in document_index.unique())),
        "kept_share": document_ids.numel() / document_tokens,
        "prefill_tokens": int(prefill.kept.numel()),
        "kept_document_runs": position_runs(prefill.kept[document_index >= 0]),
    }


def position_runs(positions: torch.Tensor) -> list[list[int]]:
    """``[K]`` sorted positions as ``[start, end)`` runs (compact: kept tokens come in chunks), for comparing two
    methods' kept tokens afterwards (Jaccard)."""
    runs: list[list[int]] = []
    for position in positions.tolist():
        if runs and runs[-1][1] == position:
            runs[-1][1] += 1
        else:
            runs.append([position, position + 1])
    return runs


# -- study ------------------------------------------------------------------------------------------


def _bootstrap(items: list, statistic: Callable[[list], float | None], seed: int, rounds: int) -> list[float]:
    """``statistic`` of ``rounds`` resamples of ``items`` (drawn with replacement), sorted; None dropped."""
    rng = random.Random(seed)
    results = (statistic([rng.choice(items) for _ in items]) for _ in range(rounds))
    return sorted(r for r in results if r is not None)


def bootstrap_interval(values: list[float], seed: int = 0, rounds: int = 2000) -> tuple[float, float]:
    if not values:
        return (float("nan"), float("nan"))
    means = _bootstrap(values, lambda drawn: sum(drawn) / len(drawn), seed, rounds)
    return means[int(0.025 * rounds)], means[int(0.975 * rounds)]


def bootstrap_ratio_interval(
    values: list[float], references: list[float], seed: int = 0, rounds: int = 2000
) -> tuple[float, float]:
    """95% interval of ``sum(values) / sum(references)`` over samples drawn in pairs, with replacement.

    Draws whose references sum to 0 have no ratio; if more than 5% do, the interval is unknown (nan).
    """

    def ratio(drawn: list[tuple[float, float]]) -> float | None:
        reference = sum(r for _, r in drawn)
        return sum(v for v, _ in drawn) / reference if reference else None

    ratios = _bootstrap(list(zip(values, references)), ratio, seed, rounds)
    if len(ratios) < 0.95 * rounds:
        return (float("nan"), float("nan"))
    return ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios))]


def resumed_report(args: argparse.Namespace, out: Path) -> dict | None:
    """An earlier run of the same study at ``out`` (``--resume``), or None; a run with other settings is refused.
    ``--samples`` may grow: ``run`` then checks that the earlier samples are the first ones drawn now."""
    path = Path(f"{out}.json")
    if not args.resume or not path.is_file():
        return None
    earlier = json.loads(path.read_text())
    study = ["task", "documents", "length", "seed", "main", "draft", "keep_rates", "methods", "max_new_tokens"]
    if AUTO in args.methods:  # auto's settings change no other method's records (runs before they existed lack them)
        study += ["auto_shares", "auto_floors", "auto_ceilings"]
    differing = [k for k in study if earlier["settings"].get(k) != vars(args).get(k)]
    if tasks.recorded_sampler(earlier["settings"]) != args.sampler:
        differing.append("sampler")
    if earlier["settings"].get("samples", math.inf) > args.samples:  # a merge of other studies keeps no count
        differing.append("samples")
    if differing:
        raise SystemExit(
            f"--resume: {path} was run with other settings ({differing}); use another --out"
            " (--samples may grow, not shrink)"
        )
    return earlier


def sample_digest(sample: dict) -> str:
    """A short fingerprint of one sample: its question, documents, answers and the rest, as drawn."""
    return hashlib.sha256(json.dumps(sample, sort_keys=True).encode()).hexdigest()[:16]


def drawn_digests(args: argparse.Namespace, count: int, tokenizer) -> list[str]:
    """The digests of the samples this task draws with ``args`` but ``count`` samples."""
    return [sample_digest(s) for s in load_samples(argparse.Namespace(**{**vars(args), "samples": count}), tokenizer)]


def check_resumed_samples(earlier: dict, digests: list[str], drawn_at: Callable[[int], list[str]]) -> None:
    """Refuse to resume unless the earlier run's samples are the first of ``digests`` (the samples drawn now).
    ``drawn_at(n)``: the digests this sampler draws for n samples, for runs saved before digests were kept."""
    saved = earlier.get("sample_digests") or drawn_at(earlier["settings"]["samples"])
    for index, (then, now) in enumerate(zip(saved, digests)):
        if then != now:
            raise SystemExit(
                f"--resume: sample {index} is not the one the earlier run evaluated (this task draws"
                f" other samples at --samples {len(digests)}); resume with --samples {len(saved)}"
                " or use another --out"
            )


def run(args: argparse.Namespace, save: Callable[[dict], None], earlier: dict | None = None) -> dict:
    """Evaluate every sample; ``save`` gets the report so far after each one (long runs can be stopped).
    ``earlier``: an earlier run's report, whose samples are not evaluated again."""
    engine = SpecPrefillEngine(main=args.main, draft=args.draft, dtype=args.dtype, **STUDY_ENGINE)
    samples = load_samples(args, engine.tokenizer)
    digests = [sample_digest(sample) for sample in samples]
    if earlier:
        check_resumed_samples(earlier, digests, lambda count: drawn_digests(args, count, engine.tokenizer))
    methods = make_methods(engine, args)
    records = list(earlier["records"] if earlier else [])
    done = {r["sample"] for r in records}
    chosen = [i for i in range(len(samples)) if not args.only_samples or i in args.only_samples]
    layouts = {i: sample_layout(engine, samples[i]) for i in chosen}
    if args.match_auto:
        args.keep_rates = [matched_keep_rate(methods[AUTO], samples, layouts, args.auto_shares[0])]
    budgets = {name: method_budgets(name, args) for name in methods}
    for index, sample in enumerate(tqdm(samples, desc=args.task, unit="sample")):
        if index not in layouts or index in done:
            continue
        layout = layouts[index]
        document_tokens = layout.n_document_tokens
        full = evaluate(engine, sample, Prefill.whole(layout), args.max_new_tokens, document_tokens)
        records.append({"sample": index, "method": "full", "keep_rate": 1.0, **full, "gold_document_kept": 1.0})
        evaluated: dict[tuple, dict] = {}  # (kept, positions) -> results: a tuning grid often keeps the same tokens
        for name, method in methods.items():
            for keep_rate in budgets[name]:
                method_started = time.perf_counter()
                try:
                    prefill = method(sample, layout, keep_rate)
                except MethodFailed as failure:
                    records.append({"sample": index, "method": name, "keep_rate": keep_rate, "failed": str(failure)})
                    continue
                # what is prefilled where: methods that rewrite the documents prefill other layouts
                key = (tuple(prefill.layout.input_ids[prefill.kept].tolist()), tuple(prefill.positions.tolist()))
                if key not in evaluated:
                    evaluated[key] = evaluate(engine, sample, prefill, args.max_new_tokens, document_tokens)
                result = evaluated[key]
                records.append(
                    {
                        "sample": index,
                        "method": name,
                        "keep_rate": keep_rate,
                        **result,
                        "seconds": time.perf_counter() - method_started,
                    }
                )
        save(make_report(args, digests[: index + 1], records))
    return make_report(args, digests, records)


def make_report(args: argparse.Namespace, digests: list[str], records: list[dict]) -> dict:
    """``digests``: the samples so far, as ``sample_digest``s (a resumed run checks its samples against them)."""
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {
        "task": args.task,
        "samples": len(digests),
        "sample_digests": digests,
        "records": records,
        "settings": settings,
    }


def summarise(report: dict, metric: str) -> list[dict]:
    """One row per (method, keep rate): mean, bootstrap CI, retention and the paired change vs full."""
    records = [r for r in report["records"] if "failed" not in r]
    full = {r["sample"]: r[metric] for r in records if r["method"] == "full"}
    rows = []
    for method in dict.fromkeys(r["method"] for r in records):
        for keep_rate in sorted({r["keep_rate"] for r in records if r["method"] == method}):
            chosen = [r for r in records if r["method"] == method and r["keep_rate"] == keep_rate]
            values = [r[metric] for r in chosen]
            mean = sum(values) / len(values)
            references = [full[r["sample"]] for r in chosen]  # full prefill on the same samples
            change = [v - f for v, f in zip(values, references)]
            rows.append(
                {
                    "method": method,
                    "keep_rate": keep_rate,
                    "n": len(chosen),
                    "score": mean,
                    "ci": bootstrap_interval(values),
                    "change_ci": bootstrap_interval(change),
                    "retention": sum(values) / sum(references) if sum(references) else float("nan"),
                    "retention_ci": bootstrap_ratio_interval(values, references),
                    "gold_kept": sum(r["gold_document_kept"] for r in chosen) / len(chosen),
                    "answer_kept": sum(r["answer_kept"] for r in chosen) / len(chosen),
                    "kept_share": sum(r["kept_share"] for r in chosen) / len(chosen),
                }
            )
    return rows


def retention_interval(row: dict) -> str:
    low, high = row["retention_ci"]
    # nan: in over 5% of resamples the full prompt scored 0, so the ratio has no interval
    return "full too rare" if math.isnan(low) else f"{low:.0%} to {high:.0%}"


def markdown(report: dict, metric: str) -> str:
    lines = [
        f"| method | keep | n | kept share | {metric} | 95% CI | retention (95% CI) | change vs full (95% CI) | "
        "answer logprob | gold doc kept | answer kept |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    logprob = {(r["method"], r["keep_rate"]): r for r in summarise(report, "logprob")}
    for row in summarise(report, metric):
        low, high = row["ci"]
        change_low, change_high = row["change_ci"]
        lp = logprob[(row["method"], row["keep_rate"])]
        retention = "n/a" if metric == "logprob" else f"{row['retention']:.0%} ({retention_interval(row)})"
        # LongLLMLingua merges and reorders the documents: which one was gold is no longer known
        gold = f"{row['gold_kept']:.0%}" if not rewrites_text(row["method"]) else "n/a"
        lines.append(
            f"| {row['method']} | {row['keep_rate']:g} | {row['n']} | {row['kept_share']:.2f} | {row['score']:.3f} | "
            f"{low:.2f} to {high:.2f} | "
            f"{retention} | {change_low:+.2f} to {change_high:+.2f} | {lp['score']:.2f} "
            f"({lp['change_ci'][0]:+.2f} to {lp['change_ci'][1]:+.2f}) | {gold} | {row['answer_kept']:.0%} |"
        )
    return "\n".join(lines + failures(report))


def failures(report: dict) -> list[str]:
    """One line per method, keep rate and reason that failed on some samples (left out of the rows)."""
    failed: dict[tuple, list[int]] = {}
    for r in report["records"]:
        if "failed" in r:
            failed.setdefault((r["method"], r["keep_rate"], r["failed"]), []).append(r["sample"])
    return ([""] if failed else []) + [
        f"Failed, not in the rows above: {method} at keep {rate:g} on sample(s) {', '.join(map(str, samples))}: {why}."
        for (method, rate, why), samples in failed.items()
    ]


def plot(report: dict, metrics: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4))
    for axes, metric in zip(panels if len(metrics) > 1 else [panels], metrics):
        rows = summarise(report, metric)
        for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "full"):
            # keep_rate="auto" rows: at the share they kept (their "keep" is the mass share)
            points = [
                (r["kept_share"] if method.startswith(AUTO) else r["keep_rate"], r["score"])
                for r in rows
                if r["method"] == method
            ]
            axes.plot(*zip(*points), marker="o", label=method)
        axes.axhline(rows[0]["score"], color="black", linestyle="--", label="full prefill")
        axes.set_xlabel("keep rate (share of document tokens)")
        axes.set_ylabel(metric)
        axes.set_title(
            f"{report['task']}: {report['samples']} samples, main {report['settings'].get('main', 'smollm2-135m')}"
        )
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def table_metrics(task: str, max_new_tokens: int) -> list[str]:
    """The tables' metrics, the main one first: log-probabilities only when nothing was generated."""
    if not max_new_tokens:
        return ["logprob"]
    return ["contains" if task != "longbench" else "f1", "logprob"]


def write_tables(report: dict, out: Path, metrics: list[str]) -> None:
    """``out``.json (every record) and ``out``.md (the table of the main metric)."""
    Path(f"{out}.json").write_text(json.dumps(report, indent=1))
    Path(f"{out}.md").write_text(markdown(report, metrics[0]) + "\n")


# self: what draft="self" means for the main model (40% of its layers, window 16: chosen on the --seed 1
# SQuAD split with SmolLM2-135M, where it is self-12-w16, the name earlier tables use)
ALL_METHODS = ["specprefill", "specprefill-la1", "self", "contiguous", "longllmlingua", "random", "first"]
OPTIONAL_METHODS = [  # run only when named
    "specprefill" + SENTENCES,
    "specprefill-documents",
    "specprefill-documents-naive",
    "specprefill-documents-blend05",
    "specprefill-documents-in-context",
    "specprefill-documents-query",
    EMBEDDINGS_FILTER,
]


def compressor_default(args: argparse.Namespace) -> str:
    """LongLLMLingua's compressor: the draft model, so both compressors cost the same."""
    return args.main if args.draft.startswith("self") else args.draft


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--task", choices=["squad", "hotpotqa", "nq", "niah", "longbench"], default="squad")
    options.add_argument("--main", default="smollm2-135m", help="main model spec, e.g. qwen2.5-coder-1.5b")
    options.add_argument(
        "--draft", default="smollm2-135m", help="draft of the specprefill methods, e.g. qwen2.5-coder-0.5b"
    )
    options.add_argument("--compressor", help="LongLLMLingua's compressor model (default: the draft)")
    options.add_argument(
        "--extra-drafts",
        nargs="*",
        default=[],
        metavar="SPEC",
        help="more drafts, run as methods specprefill-<SPEC> (another vocabulary goes through the mapped path)",
    )
    options.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    options.add_argument("--samples", type=int, default=40)
    options.add_argument("--documents", type=int, default=5, help="squad, nq: passages per prompt")
    options.add_argument("--length", type=int, default=2000, help="niah: haystack tokens; longbench: context budget")
    options.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5])
    options.add_argument("--methods", nargs="+", default=ALL_METHODS)
    auto_defaults = SpecPrefillConfig()
    options.add_argument(
        "--auto-shares",
        type=float,
        nargs="+",
        default=[auto_defaults.auto_keep_share],
        help="specprefill-auto: shares of the importance mass to keep",
    )
    options.add_argument("--auto-floors", type=float, nargs="+", default=[auto_defaults.auto_keep_floor])
    options.add_argument("--auto-ceilings", type=float, nargs="+", default=[auto_defaults.auto_keep_ceiling])
    options.add_argument(
        "--match-auto",
        action="store_true",
        help="fixed methods run at one rate: specprefill-auto's average kept share on these samples",
    )
    options.add_argument("--self-layers", type=int, nargs="*", default=[12])
    options.add_argument("--self-windows", type=int, nargs="*", default=[16], help="query window of self-<n> drafts")
    options.add_argument("--max-new-tokens", type=int, default=16, help="0: skip generation, log-probabilities only")
    options.add_argument("--seed", type=int, default=0)
    options.add_argument("--only-samples", type=int, nargs="*", help="evaluate these sample indices only (re-checks)")
    options.add_argument("--out", type=Path)
    options.add_argument(
        "--resume",
        action="store_true",
        help="keep the samples an earlier run saved at --out (a larger --samples adds some)",
    )
    args = options.parse_args()
    args.sampler = tasks.sampler_version(args.task)
    unknown = (
        {name.removesuffix(SENTENCES) for name in args.methods}
        - set(ALL_METHODS + OPTIONAL_METHODS)
        - {self_name(n, w) for n in args.self_layers for w in args.self_windows}
    )
    unknown -= {f"specprefill-{spec}" for spec in args.extra_drafts} | {AUTO}
    patterns = (QUERY_METHOD, LAYERS_METHOD, LAYERS_DOCUMENTS_METHOD, LOOK_AHEAD_METHOD, FILTERED_METHOD)
    unknown = {name for name in unknown if not any(pattern.fullmatch(name) for pattern in patterns)}
    if args.match_auto and (AUTO not in args.methods or len(auto_methods(args)) * len(args.auto_shares) != 1):
        options.error("--match-auto needs specprefill-auto among --methods with one share, floor and ceiling")
    if unknown:
        options.error(
            f"unknown methods {sorted(unknown)}; choose from {ALL_METHODS + OPTIONAL_METHODS}, "
            "specprefill-documents-query<NN>, specprefill-layers<N>[-documents[-naive|-epic]], specprefill-la<N>, "
            "embeddings-filter<NN>-specprefill "
            "or self-<n> with --self-layers, and <draft method>-sentences"
        )
    out = args.out or ROOT / "benchmarks" / "results" / "quality" / args.task
    out.parent.mkdir(parents=True, exist_ok=True)
    metrics = table_metrics(args.task, args.max_new_tokens)
    final = run(args, lambda partial: write_tables(partial, out, metrics), resumed_report(args, out))
    plot(final, metrics, Path(f"{out}.png"))
    print(markdown(final, metrics[0]))


if __name__ == "__main__":
    main()
