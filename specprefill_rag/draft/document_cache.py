"""Per-document draft KV store: each document drafted once, reused at any position, in any combination.

A document is encoded by the draft once, after the prompt's prefix (the tokens before its first
document: template and instructions, so the attention sink stays in the prefix), and its KV is kept
with its token ids; the prefix's own KV is kept the same way. A later prompt's draft KV is assembled
from them (:mod:`.assembly`, keys rotated by :mod:`.rotation`, repaired by :mod:`.repair`).

Entries are keyed (:class:`DocumentKey`) by the draft (:class:`~.prefix_cache.DraftIdentity`), a namespace (the
tenant whose request drafted them: a lookup in one namespace never finds another's), a digest of the prefix's
ids and the document's ids (verified on a hit), bounded in bytes (one budget for every namespace), least
recently used first out, with frequency-based admission (a new document enters a full cache only if it was
looked up more often lately than each entry it would push out: :mod:`..kvcache.admission`), thread-safe, and
freed with their model. :class:`DocumentStore` is the interface a
shared store could implement in place of the in-memory :class:`DocumentKVCache`.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from ..kvcache.admission import KeptEntries
from ..kvcache.prefix_cache import DraftIdentity, KVLayers, _storage_bytes

PREFIX_ENTRY = b"prefix"  # a key's ``document`` part for a prefix's own KV


class DocumentKey(NamedTuple):
    """What one entry holds the KV of.

    Attributes:
        draft: the draft that encoded it.
        namespace: the tenant whose request drafted it (None: the namespace of an engine used by one application).
        prefix: digest of the prefix's ids (what the document was encoded after).
        document: digest of the document's ids, or :data:`PREFIX_ENTRY` for the prefix's own KV.
    """

    draft: DraftIdentity
    namespace: str | None
    prefix: bytes
    document: bytes


class Held(NamedTuple):
    """What a store holds in one namespace: ``entries`` (documents and their prefixes) and their ``nbytes``."""

    entries: int
    nbytes: int


class DocumentStore(Protocol):
    """Where per-document draft KV lives (in memory here; a shared store could implement this)."""

    @property
    def max_bytes(self) -> int:
        """Bytes it holds at most."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes it holds."""
        ...

    def __len__(self) -> int:
        """Entries it holds (documents, and the prefixes they were encoded after)."""
        ...

    def lookup(self, key: DocumentKey, token_ids: torch.Tensor) -> KVLayers | None:
        """The KV of document ``token_ids`` ``[T]`` under ``key`` (per layer ``[1, H_kv, T, d]``), or None."""
        ...

    def store(
        self, model: Any, key: DocumentKey, token_ids: torch.Tensor, layers: KVLayers, evict: bool = True
    ) -> None:
        """Keep ``layers`` as the KV of document ``token_ids`` encoded after the prefix ``key`` names; with
        ``evict=False`` only if that drops no entry (a warm-up never displaces what is held).
        """
        ...

    def free_bytes(self) -> int:
        """Bytes it can take before it drops an entry (what warming a corpus may fill)."""
        ...

    def held(self, namespace: str | None) -> Held:
        """The entries and bytes it holds in ``namespace`` (what one tenant may be told of)."""
        ...


@dataclass
class _Entry:
    token_ids: torch.Tensor
    layers: KVLayers
    nbytes: int


class DocumentKVCache:
    """Per-document draft KV within ``max_bytes``: least recently used first out, and with ``admission`` (the
    default) a new document enters a full cache only if it was looked up more often lately than what it would
    push out (:class:`~..kvcache.admission.KeptEntries`); a prefix's entry always enters.
    """

    def __init__(self, max_bytes: int, admission: bool = True) -> None:
        self._kept: KeptEntries[DocumentKey] = KeptEntries(max_bytes, admission)
        self._entries: dict[DocumentKey, _Entry] = {}
        self._watched: set[int] = set()
        self._lock = threading.Lock()

    @property
    def max_bytes(self) -> int:
        return self._kept.max_bytes

    @property
    def nbytes(self) -> int:
        return self._kept.nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: DocumentKey, token_ids: torch.Tensor) -> KVLayers | None:
        with self._lock:
            self._kept.looked_up(key)
            entry = self._entries.get(key)
            if entry is None or not torch.equal(entry.token_ids, token_ids.cpu()):
                return None
            return entry.layers

    def store(
        self, model: Any, key: DocumentKey, token_ids: torch.Tensor, layers: KVLayers, evict: bool = True
    ) -> None:
        layers = tuple((k.clone(), v.clone()) for k, v in layers)  # own storage: a view would pin the prompt's
        entry = _Entry(token_ids.cpu().clone(), layers, _storage_bytes(layers))
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                self._kept.admit(key, entry.nbytes)  # held: only the most recently used now
                return
            dropped = self._kept.admit(key, entry.nbytes, evict, always=key.document == PREFIX_ENTRY)
            if dropped is None:
                return
            for victim in dropped:
                del self._entries[victim]
            self._entries[key] = entry
            if key[0].model_id not in self._watched:
                self._watched.add(key[0].model_id)
                weakref.finalize(model, self._forget_model, key[0].model_id)

    def free_bytes(self) -> int:
        return max(self.max_bytes - self.nbytes, 0)

    def held(self, namespace: str | None) -> Held:
        with self._lock:
            mine = [entry.nbytes for key, entry in self._entries.items() if key.namespace == namespace]
        return Held(len(mine), sum(mine))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._kept.clear()

    def _forget_model(self, model_id: int) -> None:
        with self._lock:
            for key in [k for k in self._entries if k[0].model_id == model_id]:
                del self._entries[key]
                self._kept.remove(key)
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
