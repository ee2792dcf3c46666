"""A prompt's draft KV assembled from per-document KV (:mod:`.document_cache`), before the scored queries run.

For a prompt ``[L]`` with document spans ``[S, 2]``, the KV of its first ``until`` tokens (``L - 1`` for a
model draft, ``L - W`` for a layer-prefix draft's query window) is put together from:

- the prefix (the instructions before the documents: :attr:`DocumentSpans.prefix_length`), from the store or
  computed and stored;
- each document's KV as encoded right after that prefix (from the store, or encoded and stored), its keys
  rotated from positions ``P ..`` to the span's own (:mod:`.rotation`);
- fresh KV, computed in context by one forward pass, for every other token before ``until`` (labels,
  separators, turn markers, the question) and for the document tokens the repair recomputes
  (:mod:`.repair`). Those tokens attend to every key before their position, cached or fresh, through an
  explicit mask (their cache slots come after the cached ones), and their KV is then written back into
  position order.

The result is a ``DynamicCache`` whose slot ``i`` holds position ``i``, exactly what a cold prefill of the
first ``until`` tokens leaves, up to the approximation that cached documents did not see each other.

Which document tokens are recomputed (:mod:`.repair`) is decided before that forward pass. ``blend`` runs its
joint probe over the first layers. ``query`` reads what the question attends to: one forward pass over the
tokens that are not cached (labels, the question, and the tokens the draft will score: the last prompt token
or a layer-prefix draft's window) against the placed cached KV, recording, layer by layer, the attention of
the rows after the last cached document onto every key. Those tokens are a few dozen against the documents'
thousands, so this costs a small share of the fresh forward and no pass over the documents; its KV is thrown
away, and the fresh forward then computes the question again over the repaired documents (so a share of 1
gives the joint KV). The alternative, the look-ahead's own attention, comes only after the KV is assembled:
using it would mean a second look-ahead over the repaired KV, which costs more than this pass (the scored
look-ahead is the largest fixed cost of a warm draft: docs, Document cache).

A document the store does not hold is, by default (``first_sight="alone"``), encoded alone after the prefix,
stored, and then assembled like a hit: a prompt scores the same whether its documents were held or not, at
the cost of those documents' own passes on top of the assembly. With ``first_sight="in_context"`` it is
instead computed in the one fresh forward, in context, like a label (with no prefix held, the whole prompt
goes through one joint pass: a cold draft's prefill), and stored from it with its keys moved back to the
positions after the prefix. A miss then costs what a cold draft does and a partial hit the tokens not held
(the repair covers the documents held, whose KV came from the store); the stored KV saw the documents before
it in the prompt that drafted it, as chunk KV stored by CacheBlend-style caches does.
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidRequestError
from ..kvcache.prefix_cache import DraftIdentity, KVLayers
from .document_cache import PREFIX_ENTRY, DocumentKey, DocumentStore
from .hooks import QueryObserver, StopForward, attention_dispatch, observed_attention, stop_after_layers
from .repair import (
    NAIVE,
    DocumentRepair,
    first_tokens_of,
    kv_deviation,
    most_attended,
    most_deviating,
    question_attention,
    recompute_count,
)
from .rotation import rotary_inv_freq, rotate_keys


@dataclass(frozen=True)
class AssembledKV:
    """A prompt's draft KV for its first ``until`` tokens.

    Attributes:
        past: a ``DynamicCache`` whose first ``layers`` layers hold ``[1, H_kv, until, d]``, slot ``i`` holding
            position ``i``.
        cached_tokens: document tokens whose KV the store served (rotated), not recomputed.
        documents_cached: documents the store served.
        recomputed: ``[R]`` sorted long positions of the document tokens the repair computed in context.
    """

    past: Any
    cached_tokens: int
    documents_cached: int
    recomputed: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))


@dataclass(frozen=True)
class DocumentSpans:
    """Where a draft prompt's documents are, for the per-document draft cache.

    Attributes:
        spans: ``[S, 2]`` long ``(start, end)`` token offsets of each document, sorted and apart.
        prefix_length: the leading tokens each document is encoded after, once (the instructions: part of every
            cache key). Tokens between them and the documents (labels, turn markers) are computed fresh in each
            prompt, so a document's title or number never enters the key. None: every token before the first
            document.
    """

    spans: torch.Tensor
    prefix_length: int | None = None

    def checked(self, length: int) -> tuple[torch.Tensor, int]:
        """The ``[S, 2]`` spans and the prefix length, checked against a ``[length]`` prompt: documents sorted,
        non-empty and apart, after at least one prefix token and before the last prompt token (always scored
        fresh), the prefix ending at or before the first document; raises :class:`InvalidRequestError` otherwise.
        """
        spans = torch.as_tensor(self.spans).reshape(-1, 2)
        if spans.is_floating_point() or spans.is_complex():
            raise InvalidRequestError(f"document spans must be integer token offsets, not {spans.dtype}")
        spans = spans.long().cpu()
        starts, ends = spans[:, 0], spans[:, 1]
        ordered = bool((starts[1:] >= ends[:-1]).all()) and bool((ends > starts).all())
        if not spans.numel() or not ordered or int(starts[0]) < 1 or int(ends[-1]) > length - 1:
            raise InvalidRequestError(
                f"document spans {spans.tolist()} must be sorted, non-empty and apart, within tokens 1..{length - 2} "
                "of the draft's prompt (a prefix before them, the last token after)"
            )
        prefix_length = int(starts[0]) if self.prefix_length is None else self.prefix_length
        if not 1 <= prefix_length <= int(starts[0]):
            raise InvalidRequestError(
                f"the documents' prefix ({prefix_length} tokens) must hold at least one token and end at or before "
                f"the first document (token {int(starts[0])})"
            )
        return spans, prefix_length


def _digest(token_ids: torch.Tensor) -> bytes:
    return hashlib.blake2b(token_ids.cpu().numpy().tobytes(), digest_size=16).digest()


def _forward(model: Any, layers: int, token_ids: torch.Tensor, positions: torch.Tensor, past: Any) -> None:
    """Append to ``past``'s first ``layers`` layers the KV of ``[n]`` ids at ``[n]`` long ``positions``
    (cache slots follow those already held).
    """
    held = past.get_seq_length()
    slots = torch.arange(held, held + token_ids.numel(), device=token_ids.device)
    with stop_after_layers(model, layers):
        try:
            model(
                input_ids=token_ids.view(1, -1),
                position_ids=positions.to(token_ids.device).view(1, -1),
                cache_position=slots,
                past_key_values=past,
                use_cache=True,
                logits_to_keep=1,
            )
        except StopForward:
            pass


def _kv_of(past: Any, layers: int, start: int, end: int) -> KVLayers:
    return tuple((layer.keys[:, :, start:end], layer.values[:, :, start:end]) for layer in past.layers[:layers])


def _start_from(past: Any, layers: KVLayers) -> None:
    """Make ``past``'s first layers hold ``layers`` (per layer keys, values ``[1, H_kv, T, d]``)."""
    for layer, (keys, values) in zip(past.layers, layers):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values


def _new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _encoded(
    model: Any,
    draft: DraftIdentity,
    key: DocumentKey,
    token_ids: torch.Tensor,
    store: DocumentStore,
    before: KVLayers,
    evict: bool = True,
) -> tuple[KVLayers, bool]:
    """The KV of ``[T]`` ``token_ids`` encoded right after ``before`` (``[1, H_kv, P, d]`` per layer; P may be 0),
    from ``store`` when it holds them (True), else computed and stored (False; with ``evict=False`` only where
    that drops no entry).
    """
    layers = store.lookup(key, token_ids.cpu())
    if layers is not None:
        return tuple((k.to(token_ids.device), v.to(token_ids.device)) for k, v in layers), True
    past = _new_cache(model)
    held = before[0][0].shape[2] if before else 0
    if held:
        _start_from(past, before)
    positions = torch.arange(held, held + token_ids.numel(), device=token_ids.device)
    _forward(model, draft.layers, token_ids, positions, past)
    layers = _kv_of(past, draft.layers, held, held + token_ids.numel())
    store.store(model, key, token_ids.cpu(), layers, evict=evict)
    return layers, False


def encode_documents(
    model: Any,
    draft: DraftIdentity,
    input_ids: torch.Tensor,
    prefix_length: int,
    spans: torch.Tensor,
    store: DocumentStore,
    namespace: str | None = None,
    evict: bool = True,
) -> tuple[KVLayers, list[tuple[KVLayers, bool]]]:
    """The KV of the prefix ``input_ids[:prefix_length]`` and of each ``[S, 2]`` span's document (encoded right
    after the prefix, positions ``P ..``), each from ``store``'s entries in ``namespace`` or computed and stored
    there (with ``evict=False`` only where storing drops no entry), with whether the store held it.
    """
    prefix_ids = input_ids[:prefix_length]
    digest = _digest(prefix_ids)
    prefix_key = DocumentKey(draft, namespace, digest, PREFIX_ENTRY)
    prefix, _ = _encoded(model, draft, prefix_key, prefix_ids, store, (), evict)
    documents = []
    for start, end in spans.tolist():
        token_ids = input_ids[start:end]
        key = _document_key(draft, namespace, digest, token_ids)
        documents.append(_encoded(model, draft, key, token_ids, store, prefix, evict))
    return prefix, documents


def _document_key(draft: DraftIdentity, namespace: str | None, prefix: bytes, token_ids: torch.Tensor) -> DocumentKey:
    return DocumentKey(draft, namespace, prefix, _digest(token_ids))


def held_documents(
    draft: DraftIdentity,
    input_ids: torch.Tensor,
    prefix_length: int,
    spans: torch.Tensor,
    store: DocumentStore,
    namespace: str | None = None,
) -> int:
    """How many of the ``[S, 2]`` spans' documents ``store`` holds in ``namespace`` after the prefix
    ``input_ids[:prefix_length]``.
    """
    digest = _digest(input_ids[:prefix_length])
    keys = [_document_key(draft, namespace, digest, input_ids[start:end]) for start, end in spans.tolist()]
    return sum(
        store.lookup(key, input_ids[start:end].cpu()) is not None for key, (start, end) in zip(keys, spans.tolist())
    )


QUERY_GROUPS = 8  # groups of fresh queries, each reading only the keys up to its last position


def _masked_attention(
    key_positions: torch.Tensor, query_positions: torch.Tensor, observe: QueryObserver | None = None
) -> Any:
    """An SDPA attention whose ``[F]`` queries at ``query_positions`` see the keys at ``key_positions``
    ``[C + F]`` (cache slot order) up to their own position; transformers' mask is ignored. ``observe`` (if
    given) sees each layer's queries and its keys in position order.

    The keys are put in position order and the queries cut into up to :data:`QUERY_GROUPS` groups, each
    attending only to the keys at or before its latest position, through an additive mask: where fresh tokens
    are spread over the prompt, this skips about ``(G - 1) / 2G`` of the ``F x (C + F)`` scores one mask would
    compute, and SDPA on CPU runs faster with a float mask than with a bool one.
    """
    order = torch.argsort(key_positions)
    by_position = key_positions[order]
    groups = []
    for queries in torch.tensor_split(
        torch.arange(query_positions.numel()), min(QUERY_GROUPS, query_positions.numel())
    ):
        seen = query_positions[queries]
        visible = int(torch.searchsorted(by_position, seen.max(), right=True))
        groups.append((int(queries[0]), int(queries[-1]) + 1, visible, by_position[None, :visible] <= seen[:, None]))
    masks: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def additive(dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        if (dtype, device) not in masks:
            masks[(dtype, device)] = [
                torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask.to(device), float("-inf"))
                for *_, mask in groups
            ]
        return masks[(dtype, device)]

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        index = order.to(key.device)
        key, value = key[:, :, index], value[:, :, index]
        if observe is not None:
            observe(query, key, scaling)
        outputs = [
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, start:end],
                key[:, :, :visible],
                value[:, :, :visible],
                attn_mask=mask,
                scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1],
            )
            for (start, end, visible, _), mask in zip(groups, additive(query.dtype, query.device))
        ]
        return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None

    return attention


def _keys_then_stop(last_layer: int) -> Any:
    """An SDPA attention that ends the forward pass (:class:`StopForward`) when layer ``last_layer`` calls it:
    its keys and values are in the cache by then, and its attention and MLP would only feed the layers after.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if getattr(module, "layer_idx", None) == last_layer:  # without one, stop_after_layers ends the pass
            raise StopForward
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    return attention


def _probe(model: Any, input_ids: torch.Tensor, layers: int) -> KVLayers:
    """Joint KV ``[1, H_kv, n, d]`` of the ``[n]`` ids in the first ``layers`` layers (a causal prefill that
    stops once the last of them has written its keys and values).
    """
    past = _new_cache(model)
    with attention_dispatch(model, _keys_then_stop(layers - 1)):
        _forward(model, layers, input_ids, torch.arange(input_ids.numel(), device=input_ids.device), past)
    return _kv_of(past, layers, 0, input_ids.numel())


@torch.inference_mode()
def assemble_prompt_kv(
    model: Any,
    draft: DraftIdentity,
    input_ids: torch.Tensor,
    documents: DocumentSpans,
    store: DocumentStore,
    repair: DocumentRepair = NAIVE,
    until: int | None = None,
    namespace: str | None = None,
    observe: QueryObserver | None = None,
) -> AssembledKV:
    """The draft KV of ``input_ids[:until]`` (``[L]`` prompt; default ``until = L - 1``) with the ``documents``
    taken from ``store``'s entries in ``namespace`` (stored there when missing), each encoded after the
    documents' prefix (see the module). Documents reaching past ``until`` are computed fresh.

    ``observe``: the tokens from ``until`` on (the queries a layer-prefix draft scores) are computed in the same
    fresh forward, after the others, and ``observe`` sees each layer's fresh queries (those tokens the last rows)
    with all ``L`` keys in position order; the KV then holds all ``L`` tokens, and no second pass is needed.

    Raises :class:`InvalidRequestError` for bad spans, ``DraftScoringError`` for a draft whose keys cannot be
    moved.
    """
    length = input_ids.numel()
    until = length - 1 if until is None else until
    spans, prefix_length = documents.checked(length)
    inv_freq = rotary_inv_freq(model)
    served = spans[spans[:, 1] <= until]
    if prefix_length > until:
        raise InvalidRequestError(f"the prefix ({prefix_length} tokens) reaches past the assembled {until} tokens")
    covered = until if observe is None else length  # the prompt tokens the returned KV holds
    if repair.first_sight == "in_context":
        return _assembled_in_context(
            model, draft, input_ids, prefix_length, served, covered, store, repair, namespace, observe
        )
    prefix, encoded = encode_documents(model, draft, input_ids, prefix_length, served, store, namespace)
    full, cached = _placed(prefix, served, [layers for layers, _ in encoded], covered, inv_freq)
    recomputed = _recomputed(model, draft.layers, input_ids, served, full, cached, repair)
    cached[recomputed] = False
    hits = [hit for _, hit in encoded]
    hit_tokens = sum(int(cached[start:end].sum()) for (start, end), hit in zip(served.tolist(), hits) if hit)
    past = _with_fresh(model, draft.layers, input_ids, full, cached, observe)
    return AssembledKV(past, hit_tokens, sum(hits), recomputed)


def _assembled_in_context(
    model: Any,
    draft: DraftIdentity,
    input_ids: torch.Tensor,
    prefix_length: int,
    spans: torch.Tensor,
    until: int,
    store: DocumentStore,
    repair: DocumentRepair,
    namespace: str | None,
    observe: QueryObserver | None,
) -> AssembledKV:
    """:func:`assemble_prompt_kv` with ``first_sight="in_context"`` (see the module): the ``[S, 2]`` ``spans``'
    documents the store holds are placed and repaired, the others computed in the one fresh forward and then
    stored, as the prefix is when the store lacks it (the prompt's first ``until`` tokens then go through one
    joint pass, which ``observe`` sees).
    """
    inv_freq = rotary_inv_freq(model)
    digest = _digest(input_ids[:prefix_length])
    prefix_key = DocumentKey(draft, namespace, digest, PREFIX_ENTRY)
    keys = [_document_key(draft, namespace, digest, input_ids[start:end]) for start, end in spans.tolist()]
    prefix = store.lookup(prefix_key, input_ids[:prefix_length].cpu())
    if prefix is None:
        past = _new_cache(model)
        with nullcontext() if observe is None else attention_dispatch(model, observed_attention(observe)):
            _forward(model, draft.layers, input_ids[:until], torch.arange(until, device=input_ids.device), past)
        full = [(layer.keys, layer.values) for layer in past.layers[: draft.layers]]
        _store_seen(model, store, full, prefix_key, input_ids, prefix_length, list(zip(keys, spans.tolist())), inv_freq)
        return AssembledKV(past, 0, 0)
    device = input_ids.device
    held = [store.lookup(key, input_ids[start:end].cpu()) for key, (start, end) in zip(keys, spans.tolist())]
    hits = [layers for layers in held if layers is not None]
    hit_spans = spans[torch.tensor([layers is not None for layers in held], dtype=torch.bool)].reshape(-1, 2)
    moved = [tuple((k.to(device), v.to(device)) for k, v in layers) for layers in (prefix, *hits)]
    full, cached = _placed(moved[0], hit_spans, moved[1:], until, inv_freq)
    unseen = torch.zeros(until, dtype=torch.bool)
    missed = [(key, (start, end)) for key, (start, end), layers in zip(keys, spans.tolist(), held) if layers is None]
    for _, (start, end) in missed:
        unseen[start:end] = True
    recomputed = _recomputed(model, draft.layers, input_ids, hit_spans, full, cached, repair, unseen)
    cached[recomputed] = False
    hit_tokens = sum(int(cached[start:end].sum()) for start, end in hit_spans.tolist())
    past = _with_fresh(model, draft.layers, input_ids, full, cached, observe)
    _store_seen(model, store, full, None, input_ids, prefix_length, missed, inv_freq)
    return AssembledKV(past, hit_tokens, len(hits), recomputed)


def _store_seen(
    model: Any,
    store: DocumentStore,
    full: list[tuple[torch.Tensor, torch.Tensor]],
    prefix_key: DocumentKey | None,
    input_ids: torch.Tensor,
    prefix_length: int,
    documents: list[tuple[DocumentKey, tuple[int, int]]],
    inv_freq: torch.Tensor,
) -> None:
    """Store, from a prompt's KV ``full`` (per layer ``[1, H_kv, n, d]``, position order), the prefix's (under
    ``prefix_key``; None: held already) and each ``(key, (start, end))`` document's, its keys moved back to the
    positions right after the prefix.
    """
    if prefix_key is not None:
        prefix = tuple((keys[:, :, :prefix_length], values[:, :, :prefix_length]) for keys, values in full)
        store.store(model, prefix_key, input_ids[:prefix_length].cpu(), prefix)
    for key, (start, end) in documents:
        shift = prefix_length - start
        layers = tuple(
            (rotate_keys(keys[:, :, start:end], shift, inv_freq), values[:, :, start:end]) for keys, values in full
        )
        store.store(model, key, input_ids[start:end].cpu(), layers)


def _placed(
    prefix: KVLayers, spans: torch.Tensor, documents: list[KVLayers], until: int, inv_freq: torch.Tensor
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Per layer keys and values ``[1, H_kv, until, d]`` in position order: the prefix's, and each ``[S, 2]``
    span's document KV with its keys moved from positions ``P ..`` to the span's (zeros elsewhere); and the
    ``[until]`` bool mask of the positions so filled.
    """
    prefix_length = prefix[0][0].shape[2]
    full = [
        (
            keys.new_zeros(*keys.shape[:2], until, keys.shape[3]),
            values.new_zeros(*values.shape[:2], until, values.shape[3]),
        )
        for keys, values in prefix
    ]
    cached = torch.zeros(until, dtype=torch.bool)
    cached[:prefix_length] = True
    for (keys, values), (prefix_keys, prefix_values) in zip(full, prefix):
        keys[:, :, :prefix_length], values[:, :, :prefix_length] = prefix_keys, prefix_values
    for (start, end), layers in zip(spans.tolist(), documents):
        cached[start:end] = True
        for (keys, values), (document_keys, document_values) in zip(full, layers):
            keys[:, :, start:end] = rotate_keys(document_keys, start - prefix_length, inv_freq)
            values[:, :, start:end] = document_values
    return full, cached


def _with_fresh(
    model: Any,
    layers: int,
    input_ids: torch.Tensor,
    full: list[tuple[torch.Tensor, torch.Tensor]],
    cached: torch.Tensor,
    observe: QueryObserver | None = None,
) -> Any:
    """A ``DynamicCache`` of ``full`` (per layer ``[1, H_kv, until, d]``), the positions not ``cached`` (``[until]``
    bool) computed in context by one forward pass: their cache slots follow the cached ones while it runs, an
    explicit mask shows each of them the keys before its position, and their KV is then written into ``full``.
    ``observe`` sees each layer's queries of that pass.
    """
    past = _new_cache(model)
    kept = torch.nonzero(cached).flatten().to(input_ids.device)
    fresh = torch.nonzero(~cached).flatten().to(input_ids.device)
    _start_from(past, tuple((keys[:, :, kept], values[:, :, kept]) for keys, values in full))
    if fresh.numel():
        with attention_dispatch(model, _masked_attention(torch.cat([kept, fresh]), fresh, observe)):
            _forward(model, layers, input_ids[fresh], fresh, past)
        for layer, (keys, values) in zip(past.layers[:layers], full):
            keys[:, :, fresh] = layer.keys[:, :, kept.numel() :]
            values[:, :, fresh] = layer.values[:, :, kept.numel() :]
    for layer, (keys, values) in zip(past.layers[:layers], full):
        layer.keys, layer.values = keys, values
    return past


def _recomputed(
    model: Any,
    layers: int,
    input_ids: torch.Tensor,
    spans: torch.Tensor,
    full: list[tuple[torch.Tensor, torch.Tensor]],
    cached: torch.Tensor,
    repair: DocumentRepair,
    unseen: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[R]`` sorted long positions of document tokens to compute in context, for the ``[L]`` prompt whose first
    ``until`` positions ``full`` holds (per layer ``[1, H_kv, until, d]``, position order; ``cached``: the
    ``[until]`` bool mask of those filled). For ``blend``, also overwrites the first ``probe_layers`` layers of
    ``full`` with the joint KV. ``unseen``: ``[until]`` bool, documents the store did not hold (computed in the
    fresh forward later; ``query``'s pass leaves them out rather than read them twice).
    """
    if repair.kind == "naive" or not spans.numel():
        return torch.zeros(0, dtype=torch.long)
    if repair.kind == "epic":
        return first_tokens_of(spans, repair.first_tokens)
    positions = torch.cat([torch.arange(start, end) for start, end in spans.tolist()])
    if repair.kind == "query":
        if not recompute_count(positions.numel(), repair.share):
            return torch.zeros(0, dtype=torch.long)
        unseen = torch.zeros_like(cached) if unseen is None else unseen
        after = int(torch.nonzero(unseen).max()) + 1 if bool(unseen.any()) else 0
        question = max(int(spans[-1, 1]), after)
        attention = _question_attention(model, layers, input_ids, full, cached, question, unseen)
        return most_attended(positions, attention[positions], repair.share)
    until = cached.numel()
    probe_layers = min(repair.probe_layers, len(full))
    joint = _probe(model, input_ids[:until], probe_layers)
    index = positions.to(input_ids.device)
    last = probe_layers - 1
    cached_layer = (full[last][0][:, :, index], full[last][1][:, :, index])
    deviation = kv_deviation(cached_layer, (joint[last][0][:, :, index], joint[last][1][:, :, index]))
    for (keys, values), (joint_keys, joint_values) in zip(full, joint):
        keys.copy_(joint_keys)
        values.copy_(joint_values)
    return most_deviating(positions, deviation.cpu(), repair.share)


def _question_attention(
    model: Any,
    layers: int,
    input_ids: torch.Tensor,
    full: list[tuple[torch.Tensor, torch.Tensor]],
    cached: torch.Tensor,
    first_question: int,
    unseen: torch.Tensor,
) -> torch.Tensor:
    """``[L]`` float32 attention of the question onto each prompt position over the placed cached KV: one forward
    pass (the first ``layers`` layers) of the ``[L]`` prompt's tokens neither ``cached`` nor ``unseen`` (``[until]``
    bool each; unseen tokens are left out, keys and queries alike) and those from ``until`` on, each seeing the keys
    before its position; per key, the max over layers and heads of the attention of each row at or after
    ``first_question``, averaged over those rows (SpecPrefill's aggregation, without pooling). The pass's KV is
    discarded.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    until = cached.numel()
    device = input_ids.device
    kept = torch.nonzero(cached).flatten().to(device)
    scored = torch.arange(until, input_ids.numel(), device=device)  # what the draft scores after the assembly
    fresh = torch.cat([torch.nonzero(~cached & ~unseen).flatten().to(device), scored])
    key_positions = torch.cat([kept, fresh])
    visible = key_positions[None, :] <= fresh[:, None]  # [F, C + F]
    rows = fresh >= first_question
    attended = torch.zeros(int(rows.sum()), key_positions.numel(), device=device)

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        layer = question_attention(query[0][:, rows], key[0], visible[rows], scale)
        torch.maximum(attended, layer.to(device), out=attended)
        return sdpa_attention_forward(module, query, key, value, visible[None, None], scaling=scaling, **kwargs)

    past = _new_cache(model)
    _start_from(past, tuple((keys[:, :, kept], values[:, :, kept]) for keys, values in full))
    with attention_dispatch(model, attention):
        _forward(model, layers, input_ids[fresh], fresh, past)
    per_position = torch.zeros(input_ids.numel(), device=device)
    per_position[key_positions] = attended.mean(dim=0)
    return per_position.cpu()
