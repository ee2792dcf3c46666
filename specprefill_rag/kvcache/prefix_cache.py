"""Draft prefix KV cache: the second question over the same documents is scored in the time of the question.

The draft's keys and values of a prompt's tokens depend only on the tokens before them (causal
attention), so the KV of a prefix computed for one prompt is the KV any later prompt starting with
the same token ids would compute. A :class:`PrefixKVCache` keeps the prompt KV of scored prompts
and hands a later prompt the longest common prefix with any of them: the draft then prefills only
the remainder, and its queries attend over cached + new keys exactly as in a cold run.

Entries are keyed by the draft (model object, layers run, dtype, device), a namespace (the tenant whose
requests stored them: a lookup in one namespace never finds another's entries; None is the namespace of an
engine used by one application) and the exact token ids; the cache is bounded by bytes (least recently used
entries go first, one budget for every namespace) and thread-safe. One cache per (device, size) is shared by
the engines of a process (:func:`shared_prefix_cache`).

Reuse shares memory: a hit builds a ``DynamicCache`` whose layers are slices (views) of the entry's
tensors; transformers' ``DynamicLayer`` grows by ``torch.cat`` into new tensors and never writes
into the ones it was given (tested), so the entry stays intact.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .prefix_index import BLOCK_TOKENS, PrefixIndex, block_hashes

# A hit covering less of the prompt is a miss. After cached keys the draft's prefill runs through SDPA's
# masked kernel, about 1.3x its causal kernel per score on CPU, so a short hit can cost more than it saves:
# SmolLM2-135M broke even at 10% of a 2k prompt and 30% of a 4k one (BENCHMARKS.md, "Draft prefix cache").
MIN_REUSE_SHARE = 0.5

_model_ids: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_next_model_id = itertools.count()
_model_ids_lock = threading.Lock()

KVLayers = tuple[tuple[torch.Tensor, torch.Tensor], ...]


def _model_id(model: nn.Module) -> int:
    """A process-unique id of a model object; never reused, unlike ``id()`` after garbage collection."""
    with _model_ids_lock:
        if model not in _model_ids:
            _model_ids[model] = next(_next_model_id)
        return _model_ids[model]


@dataclass(frozen=True)
class DraftIdentity:
    """What a cached KV is valid for: one model object run for ``layers`` layers in one dtype on one device."""

    model_id: int
    layers: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, model: nn.Module, layers: int) -> DraftIdentity:
        parameter = next(model.parameters())
        return cls(_model_id(model), layers, parameter.dtype, parameter.device)


@dataclass
class _Entry:
    draft: DraftIdentity
    namespace: str | None
    token_ids: torch.Tensor  # [T] long, CPU
    hashes: list[int]  # block_hashes((draft, namespace), token_ids)
    layers: KVLayers  # per layer: keys, values [1, H_kv, >= T, d]
    nbytes: int
    last_use: int = -1  # when it was last stored or hit (larger: more recent)


@dataclass(frozen=True)
class PrefixHit:
    """The first ``tokens`` prompt tokens' KV: per layer, keys and values ``[1, H_kv, tokens, d]`` (views)."""

    tokens: int
    layers: KVLayers


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of leading positions where the 1-D tensors ``a`` and ``b`` hold the same ids."""
    length = min(a.numel(), b.numel())
    differ = torch.nonzero(a[:length] != b[:length])
    return int(differ[0, 0]) if differ.numel() else length


def _starts(token_ids: torch.Tensor, prefix: torch.Tensor) -> bool:
    """Whether the 1-D ``token_ids`` begin with all of ``prefix``."""
    return prefix.numel() <= token_ids.numel() and common_prefix_length(prefix, token_ids) == prefix.numel()


def _storage_bytes(layers: KVLayers) -> int:
    """Bytes of the distinct storages behind ``layers`` (a view keeps its whole storage alive)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for layer in layers for t in layer}
    return sum(storages.values())


class PrefixKVCache:
    """Prompt-prefix KV of a draft, least recently used first out once ``max_bytes`` is exceeded.

    Args:
        max_bytes: budget for the tensors held (their storages' bytes); an entry larger than it is not kept.
        min_reuse_share: a common prefix shorter than this share of the prompt is a miss.
    """

    def __init__(self, max_bytes: int, min_reuse_share: float = MIN_REUSE_SHARE) -> None:
        self.max_bytes = max_bytes
        self.min_reuse_share = min_reuse_share
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._uses = itertools.count()
        self._index = PrefixIndex()
        self._next_entry = itertools.count()
        self._watched: set[int] = set()
        self._lock = threading.Lock()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self, draft: DraftIdentity, token_ids: torch.Tensor, max_tokens: int, namespace: str | None = None
    ) -> PrefixHit | None:
        """The longest cached prefix of ``token_ids`` ([L] long) for ``draft``, at most ``max_tokens`` long,
        among the entries stored in ``namespace``.
        """
        token_ids = token_ids.cpu()
        hashes = block_hashes((draft, namespace), token_ids)
        needed = max(1.0, self.min_reuse_share * token_ids.numel())
        with self._lock:
            blocks, numbers = self._index.deepest(hashes)
            within_reach = token_ids.numel() if blocks == len(hashes) - 1 else (blocks + 1) * BLOCK_TOKENS - 1
            if min(within_reach, max_tokens) < needed:
                return None  # no entry can share enough of the prompt: skip comparing ids
            best, best_length, best_use = None, 0, -1
            for number in numbers:
                entry = self._entries[number]
                if entry.draft == draft and entry.namespace == namespace:
                    length = min(common_prefix_length(entry.token_ids, token_ids), max_tokens)
                    recent = entry.last_use > best_use
                    if length > best_length or (length == best_length and recent):  # recent wins ties
                        best, best_length, best_use = number, length, entry.last_use
            if best is None or best_length < needed:
                return None
            self._touch(best)
            layers = tuple((k[:, :, :best_length], v[:, :, :best_length]) for k, v in self._entries[best].layers)
        return PrefixHit(best_length, layers)

    def store(
        self,
        model: nn.Module,
        draft: DraftIdentity,
        token_ids: torch.Tensor,
        layers: KVLayers,
        namespace: str | None = None,
    ) -> None:
        """Keep ``layers`` (per layer keys, values ``[1, H_kv, >= T, d]``) as the KV of ``token_ids`` ([T]) in
        ``namespace``.

        An entry of that namespace whose ids are a prefix of ``token_ids`` is replaced (the new one serves every
        lookup it would); if ``token_ids`` is a prefix of one of its entries, nothing is added.
        """
        token_ids = token_ids.cpu()
        hashes = block_hashes((draft, namespace), token_ids)
        entry = _Entry(draft, namespace, token_ids, hashes, layers, _storage_bytes(layers))
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            for number in list(self._index.extending(entry.hashes)):
                held = self._entries[number]
                if held.draft == draft and held.namespace == namespace and _starts(held.token_ids, token_ids):
                    self._touch(number)
                    return
            for number in list(self._index.ending_along(entry.hashes)):
                held = self._entries[number]
                if held.draft == draft and held.namespace == namespace and _starts(token_ids, held.token_ids):
                    self._remove(number)
            number = next(self._next_entry)
            self._entries[number] = entry
            self._index.add(number, entry.hashes)
            self._touch(number)
            self.nbytes += entry.nbytes
            while self.nbytes > self.max_bytes:
                self._remove(next(iter(self._entries)))
            self._watch(model, draft.model_id)

    def clear(self) -> None:
        """Drop every entry (e.g. after changing a draft's weights in place)."""
        with self._lock:
            self._entries.clear()
            self._index = PrefixIndex()
            self.nbytes = 0

    def _touch(self, number: int) -> None:
        """Mark entry ``number`` the most recently used."""
        self._entries.move_to_end(number)
        self._entries[number].last_use = next(self._uses)

    def _remove(self, number: int) -> None:
        entry = self._entries.pop(number)
        self._index.remove(number, entry.hashes)
        self.nbytes -= entry.nbytes

    def _watch(self, model: nn.Module, model_id: int) -> None:
        """Free a model's entries when the model is garbage collected (its id is never reused)."""
        if model_id not in self._watched:
            self._watched.add(model_id)
            weakref.finalize(model, self._forget_model, model_id)

    def _forget_model(self, model_id: int) -> None:
        with self._lock:
            for number in [n for n, e in self._entries.items() if e.draft.model_id == model_id]:
                self._remove(number)
            self._watched.discard(model_id)


_shared: dict[tuple[str, int, float], PrefixKVCache] = {}
_shared_lock = threading.Lock()


def shared_prefix_cache(
    device: torch.device | str, max_bytes: int, min_reuse_share: float = MIN_REUSE_SHARE
) -> PrefixKVCache | None:
    """The process's cache for models on ``device`` with budget ``max_bytes``; ``None`` when ``max_bytes`` is 0.

    Engines with the same settings share one cache (and its budget); entries are keyed by model, so
    sharing never mixes two models' KV. The main model's cache (:mod:`specprefill_rag.backends.hf`) is
    another instance: it reuses any hit (``min_reuse_share=0``).
    """
    if max_bytes <= 0:
        return None
    key = (str(torch.device(device)), max_bytes, min_reuse_share)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = PrefixKVCache(max_bytes, min_reuse_share)
        return _shared[key]


def _dynamic_layers_only(past: Any, layers: int) -> bool:
    """Whether the first ``layers`` layers of ``past`` grow by concatenation (full attention, no sliding window)."""
    from transformers.cache_utils import DynamicLayer

    return len(past.layers) >= layers and all(type(layer) is DynamicLayer for layer in past.layers[:layers])


def _start_from(past: Any, hit: PrefixHit) -> None:
    """Make ``past``'s first layers hold ``hit``'s KV without copying (views of the cached entry)."""
    for layer, (keys, values) in zip(past.layers, hit.layers):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values


@dataclass
class PrefixReuse:
    """One scoring call's use of a :class:`PrefixKVCache`.

    ``past`` is the ``DynamicCache`` the draft runs with (``None`` when it needs none), holding the first
    ``cached_tokens`` prompt tokens' KV on a hit; after scoring, :meth:`remember` stores the prompt's KV, in the
    same ``namespace`` it was looked up in.
    """

    past: Any
    cached_tokens: int = 0
    cache: PrefixKVCache | None = None
    model: Any = None  # the draft's PreTrainedModel, once begun
    draft: DraftIdentity | None = None
    namespace: str | None = None

    @classmethod
    def begin(
        cls,
        cache: PrefixKVCache | None,
        model: Any,
        layers: int,
        token_ids: torch.Tensor,
        max_reuse: int,
        needs_past: bool,
        namespace: str | None = None,
    ) -> PrefixReuse:
        """Look ``token_ids`` ([L]) up for ``model`` run for ``layers`` layers in ``namespace`` (the tenant's
        entries only), reusing at most ``max_reuse`` tokens.
        """
        from transformers import DynamicCache

        past = DynamicCache(config=model.config) if cache is not None or needs_past else None
        if cache is None or not _dynamic_layers_only(past, layers):
            return cls(past if needs_past else None)
        draft = DraftIdentity.of(model, layers)
        hit = cache.lookup(draft, token_ids, max_reuse, namespace)
        if hit is not None:
            _start_from(past, hit)
        return cls(past, hit.tokens if hit else 0, cache, model, draft, namespace)

    def remember(self, token_ids: torch.Tensor) -> None:
        """Store the KV of the prompt ``token_ids`` ([L]) in the cache (not of the look-ahead tokens after it)."""
        if self.cache is None or self.draft is None:
            return
        length = token_ids.numel()
        layers = self.past.layers[: self.draft.layers]
        if any(layer.get_seq_length() < length for layer in layers):
            return  # the forward pass did not reach every layer
        kv = tuple((layer.keys[:, :, :length], layer.values[:, :, :length]) for layer in layers)
        self.cache.store(self.model, self.draft, token_ids, kv, self.namespace)
