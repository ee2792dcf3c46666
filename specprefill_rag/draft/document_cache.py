"""Per-document draft KV: each document drafted once, reused at any position, in any combination.

A document is encoded by the draft once, after the prompt's prefix (the tokens before its first
document: template and instructions, so the attention sink stays in the prefix), and its KV is kept
with its token ids. A later prompt's draft KV is then assembled (:func:`assemble_prompt_kv`): the
prefix's KV, each document's cached KV with its keys rotated to where the document sits now
(:mod:`.rotation`), and fresh KV for what lies between and after the documents, computed in context.
Only the last prompt token and the look-ahead then run as in a cold draft.

This is an approximation: a cached document did not attend to the documents before it. With one
document it is exact (the document was encoded right after the same prefix). ``recompute_first``
tokens of each document (EPIC's repair) are computed in context instead of taken from the cache.

Entries are keyed by the draft (:class:`~.prefix_cache.DraftIdentity`), a digest of the prefix's ids
and the document's ids (verified on a hit), bounded in bytes, least recently used first out,
thread-safe, and freed with their model. :class:`DocumentStore` is the interface a shared store could
implement in place of the in-memory :class:`DocumentKVCache`.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import InvalidRequestError
from .prefix_cache import DraftIdentity, KVLayers, PrefixHit, _start_from, _storage_bytes
from .rotation import rotary_inv_freq, rotate_keys

DocumentKey = tuple[DraftIdentity, bytes, bytes]  # draft, prefix digest, document-ids digest


class DocumentStore(Protocol):
    """Where per-document draft KV lives (in memory here; a shared store could implement this)."""

    def lookup(self, key: DocumentKey, token_ids: torch.Tensor) -> KVLayers | None:
        """The KV of document ``token_ids`` ``[T]`` under ``key`` (per layer ``[1, H_kv, T, d]``), or None."""
        ...

    def store(self, model: Any, key: DocumentKey, token_ids: torch.Tensor, layers: KVLayers) -> None:
        """Keep ``layers`` as the KV of document ``token_ids`` encoded after the prefix ``key`` names."""
        ...


@dataclass
class _Entry:
    token_ids: torch.Tensor
    layers: KVLayers
    nbytes: int


class DocumentKVCache:
    """Per-document draft KV, least recently used first out past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[DocumentKey, _Entry] = OrderedDict()
        self._watched: set[int] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: DocumentKey, token_ids: torch.Tensor) -> KVLayers | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not torch.equal(entry.token_ids, token_ids.cpu()):
                return None
            self._entries.move_to_end(key)
            return entry.layers

    def store(self, model: Any, key: DocumentKey, token_ids: torch.Tensor, layers: KVLayers) -> None:
        layers = tuple((k.clone(), v.clone()) for k, v in layers)  # own storage: a view would pin the prompt's
        entry = _Entry(token_ids.cpu().clone(), layers, _storage_bytes(layers))
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            self._entries[key] = entry
            self.nbytes += entry.nbytes
            while self.nbytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.nbytes -= dropped.nbytes
            if key[0].model_id not in self._watched:
                self._watched.add(key[0].model_id)
                weakref.finalize(model, self._forget_model, key[0].model_id)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def _forget_model(self, model_id: int) -> None:
        with self._lock:
            for key in [k for k in self._entries if k[0].model_id == model_id]:
                self.nbytes -= self._entries.pop(key).nbytes
            self._watched.discard(model_id)


_shared: dict[tuple[str, int], DocumentKVCache] = {}
_shared_lock = threading.Lock()


def shared_document_cache(device: torch.device | str, max_bytes: int) -> DocumentKVCache | None:
    """The process's per-document cache for drafts on ``device`` with budget ``max_bytes`` (None when 0)."""
    if max_bytes <= 0:
        return None
    key = (str(torch.device(device)), max_bytes)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = DocumentKVCache(max_bytes)
        return _shared[key]


@dataclass(frozen=True)
class AssembledKV:
    """A prompt's draft KV for all but its last token, assembled from the document cache.

    Attributes:
        past: a ``DynamicCache`` holding ``L - 1`` tokens' KV, slot ``i`` = position ``i``.
        cached_tokens: document tokens whose KV came from the cache (rotated).
        documents_cached: documents that hit.
    """

    past: Any
    cached_tokens: int
    documents_cached: int


def check_spans(spans: torch.Tensor, length: int) -> torch.Tensor:
    """``[S, 2]`` document ``(start, end)`` spans, sorted, apart, after at least one prefix token and before the
    last prompt token (which is always scored fresh); raises :class:`InvalidRequestError` otherwise.
    """
    spans = torch.as_tensor(spans, dtype=torch.long).reshape(-1, 2)
    starts, ends = spans[:, 0], spans[:, 1]
    ordered = bool((starts[1:] >= ends[:-1]).all()) and bool((ends > starts).all())
    if spans.numel() and (not ordered or int(starts[0]) < 1 or int(ends[-1]) > length - 1):
        raise InvalidRequestError(
            f"document spans {spans.tolist()} must be sorted, non-empty and apart, within tokens 1..{length - 2} "
            "of the draft's prompt (a prefix before them, the last token after)"
        )
    return spans


def _forward(model: Any, token_ids: torch.Tensor, first: int, past: Any) -> None:
    """Append the KV of ``[n]`` ids at positions (and cache slots) ``first ..`` to ``past``."""
    positions = torch.arange(first, first + token_ids.numel(), device=token_ids.device)
    model(
        input_ids=token_ids.view(1, -1),
        position_ids=positions.view(1, -1),
        cache_position=positions,
        past_key_values=past,
        use_cache=True,
        logits_to_keep=1,
    )


def _layers_of(past: Any, start: int, end: int, layers: int) -> KVLayers:
    return tuple((layer.keys[:, :, start:end], layer.values[:, :, start:end]) for layer in past.layers[:layers])


def _append(past: Any, layers: KVLayers) -> None:
    """Append per-layer keys and values ``[1, H_kv, T, d]`` to ``past``'s first layers."""
    for layer, (keys, values) in zip(past.layers, layers):
        layer.keys = torch.cat([layer.keys, keys], dim=2)
        layer.values = torch.cat([layer.values, values], dim=2)


@torch.inference_mode()
def assemble_prompt_kv(
    model: Any,
    draft: DraftIdentity,
    input_ids: torch.Tensor,
    spans: torch.Tensor,
    store: DocumentStore,
    recompute_first: int = 0,
) -> AssembledKV:
    """The draft KV of ``input_ids[:L - 1]`` ``[L]`` with each document span ``[S, 2]`` from ``store``
    (encoded after the prefix and stored first when missing), its keys rotated to the span's position.
    """
    from transformers import DynamicCache

    spans = check_spans(spans, input_ids.numel())
    inv_freq = rotary_inv_freq(model)
    prefix_length = int(spans[0, 0])
    prefix = DynamicCache(config=model.config)
    _forward(model, input_ids[:prefix_length], 0, prefix)
    prefix_kv = PrefixHit(prefix_length, _layers_of(prefix, 0, prefix_length, draft.layers))
    digest = hashlib.blake2b(input_ids[:prefix_length].cpu().numpy().tobytes(), digest_size=16).digest()
    past = DynamicCache(config=model.config)
    _start_from(past, prefix_kv)
    done, cached, hits = prefix_length, 0, 0
    for start, end in spans.tolist():
        fresh_until = min(start + recompute_first, end)
        if fresh_until > done:
            _forward(model, input_ids[done:fresh_until], done, past)
        document = input_ids[start:end]
        layers = _document_kv(model, draft, digest, document, prefix_kv, store)
        hits += layers[1]
        offset = fresh_until - start
        _append(
            past,
            tuple(
                (rotate_keys(k[:, :, offset:], start - prefix_length, inv_freq), v[:, :, offset:]) for k, v in layers[0]
            ),
        )
        cached += end - fresh_until
        done = end
    if input_ids.numel() - 1 > done:
        _forward(model, input_ids[done : input_ids.numel() - 1], done, past)
    return AssembledKV(past, cached, hits)


def _document_kv(
    model: Any, draft: DraftIdentity, digest: bytes, document: torch.Tensor, prefix: PrefixHit, store: DocumentStore
) -> tuple[KVLayers, int]:
    """A document's KV as encoded right after the prefix (positions ``P ..``), and 1 on a hit, 0 after encoding."""
    from transformers import DynamicCache

    ids = document.cpu()
    key = (draft, digest, hashlib.blake2b(ids.numpy().tobytes(), digest_size=16).digest())
    layers = store.lookup(key, ids)
    if layers is not None:
        return tuple((k.to(document.device), v.to(document.device)) for k, v in layers), 1
    past = DynamicCache(config=model.config)
    _start_from(past, prefix)
    _forward(model, document, prefix.tokens, past)
    layers = _layers_of(past, prefix.tokens, prefix.tokens + document.numel(), draft.layers)
    store.store(model, key, ids, layers)
    return layers, 0
