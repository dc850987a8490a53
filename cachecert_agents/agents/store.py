"""A memory-bounded, thread-safe store of context caches shared across the nodes of a graph run.

An entry is one model's exact cache of ``prefix + context`` (a ``DynamicCache``), optionally with the model's
normalised residual stream over the context (:class:`SenderFeatures`, what a transfer to another model reads).
Entries are keyed by model and a hash of the prompt's ``prefix + context`` token ids (exact reuse), and indexed by
a hash of the context *text* and system prompt (which models hold this context, whatever their tokenizer).

The bound is on bytes (cache tensors + features); inserting evicts least-recently-used entries until the total
fits, and an entry larger than the whole bound is not stored (with a log line). Every operation holds one lock,
so concurrent branches of a graph can share the store. Readers get the entry itself and must copy its cache
before extending it (:meth:`CachedContext.fresh_cache`).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from cachecert_agents.models.handle import PromptSegments
from cachecert_agents.transfer.features import SenderFeatures

logger = logging.getLogger(__name__)


def token_key(model: str, prompt: PromptSegments) -> str:
    """sha256 (24 hex) of the model name and its ``prefix + context`` token ids: the exact-reuse key."""
    h = hashlib.sha256(model.encode() + b"\0")
    h.update(torch.cat([prompt.prefix_ids, prompt.context_ids]).to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:24]


def text_key(context: str, system: str | None = None) -> str:
    """sha256 (24 hex) of the system prompt and context text: the same shared context across tokenizers."""
    return hashlib.sha256(f"{system or ''}\0{context}".encode()).hexdigest()[:24]


def cache_nbytes(cache: Any) -> int:
    """Bytes held by a transformers cache's key/value tensors."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


@dataclass
class CachedContext:
    """One model's exact cache over ``prompt.prefix + prompt.context`` and, when kept, its sender features."""

    model: str
    key: str
    text_key: str
    prompt: PromptSegments
    cache: Any
    features: SenderFeatures | None
    prefill_s: float
    created: float = field(default_factory=time.time)

    @property
    def nbytes(self) -> int:
        feats = 0 if self.features is None else self.features.hidden.numel() * self.features.hidden.element_size()
        return cache_nbytes(self.cache) + feats

    @property
    def context_tokens(self) -> int:
        return int(self.prompt.context_ids.numel())

    def fresh_cache(self) -> Any:
        """A private copy of the cache, safe to extend with a suffix (the stored one is never modified)."""
        return copy.deepcopy(self.cache)


class KVCacheStore:
    """LRU store of :class:`CachedContext` under a byte bound (see the module docstring)."""

    def __init__(self, max_bytes: int = 2 << 30):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[str, CachedContext] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._lock = threading.RLock()
        self.evictions = 0
        self.rejected = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, key: str) -> CachedContext | None:
        """The entry under an exact-reuse key (marked most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def holders(self, text: str, exclude_model: str | None = None) -> list[CachedContext]:
        """Entries of other models holding the same context text (most recent first) that kept features."""
        with self._lock:
            found = [e for e in reversed(self._entries.values())
                     if e.text_key == text and e.model != exclude_model and e.features is not None]
            for e in found:
                self._entries.move_to_end(e.key)
            return found

    def put(self, entry: CachedContext) -> bool:
        """Insert (or replace) an entry, evicting least-recently-used ones to stay under the bound. Returns
        False, storing nothing, when the entry alone exceeds the bound."""
        size = entry.nbytes
        with self._lock:
            if size > self.max_bytes:
                self.rejected += 1
                logger.warning("cache of %s (%d context tokens, %.1f MB) exceeds the store bound (%.1f MB); not "
                               "stored", entry.model, entry.context_tokens, size / 1e6, self.max_bytes / 1e6)
                return False
            if entry.key in self._entries:
                del self._entries[entry.key]
                del self._sizes[entry.key]
            while self._entries and sum(self._sizes.values()) + size > self.max_bytes:
                old_key, old = self._entries.popitem(last=False)
                del self._sizes[old_key]
                self.evictions += 1
                logger.info("store full: evicted %s's cache of %d context tokens", old.model, old.context_tokens)
            self._entries[entry.key] = entry
            self._sizes[entry.key] = size
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._sizes.clear()
