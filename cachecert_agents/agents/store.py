"""A memory-bounded, thread-safe store of context caches shared across the nodes of a graph run.

An entry is one model's exact cache of ``prefix + context`` (a ``DynamicCache``), optionally with the model's
normalised residual stream over the context (:class:`SenderFeatures`, what a transfer to another model reads).
Entries are keyed by model and a hash of the prompt's ``prefix + context`` token ids (exact reuse), and indexed by
a hash of the context *text* and system prompt (which models hold this context, whatever their tokenizer).

The bound is on bytes (cache tensors + features); inserting evicts least-recently-used entries until the total
fits, and an entry larger than the whole bound is not stored (with a log line). Every operation holds one lock,
so concurrent branches of a graph can share the store. Readers get the entry itself and must copy its cache
before extending it (:meth:`CachedContext.fresh_cache`).

With ``persist_dir`` the store also keeps every entry on disk (one safetensors + JSON artifact per entry, written
atomically in a background thread, never pickled) and finds them again in a later run: a memory miss looks in the
directory's index. Keys include the model's weights fingerprint (:attr:`ModelHandle.identity`), so a cache is only
reused by the model that computed it. The directory has its own byte bound (least recently used files go first);
a file that cannot be read is skipped with a warning and left in place.
"""

from __future__ import annotations

import concurrent.futures
import copy
import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cachecert_agents.artifacts import artifact_paths, load_artifact, read_artifact_header, save_artifact
from cachecert_agents.kv.segment import build_dynamic_cache
from cachecert_agents.models.handle import PromptSegments
from cachecert_agents.transfer.features import SenderFeatures

logger = logging.getLogger(__name__)


CONTEXT_CACHE_FORMAT = "cachecert-context-cache/1"


def token_key(model: str, prompt: PromptSegments) -> str:
    """sha256 (24 hex) of the model (its :attr:`~ModelHandle.identity`, or a name) and its ``prefix + context``
    token ids: the exact-reuse key."""
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
    model_id: str = ""  # ModelHandle.identity of the model that computed it ("" when not recorded)

    @property
    def nbytes(self) -> int:
        feats = 0 if self.features is None else self.features.hidden.numel() * self.features.hidden.element_size()
        return cache_nbytes(self.cache) + feats

    @property
    def context_tokens(self) -> int:
        return int(self.prompt.context_ids.numel())

    def fresh_cache(self, device: torch.device | str | None = None) -> Any:
        """A private copy of the cache on ``device`` (None: where it is held), safe to extend with a suffix (the
        stored one is never modified)."""
        cache = copy.deepcopy(self.cache)
        if device is not None:
            for layer in cache.layers:
                if getattr(layer, "is_initialized", True) and isinstance(getattr(layer, "keys", None), torch.Tensor):
                    layer.keys, layer.values = layer.keys.to(device), layer.values.to(device)
                    layer.device = layer.keys.device
        return cache


def save_cached_context(entry: CachedContext, stem: str | Path) -> dict:
    """Write an entry as ``<stem>.safetensors`` + ``<stem>.json`` (atomic; tensors moved to CPU); returns the
    header written."""
    layers = entry.cache.layers
    tensors = {"prefix_ids": entry.prompt.prefix_ids, "context_ids": entry.prompt.context_ids,
               "suffix_ids": entry.prompt.suffix_ids, "context_offsets": entry.prompt.context_offsets}
    windows = []
    for i, layer in enumerate(layers):
        tensors[f"keys.{i}"], tensors[f"values.{i}"] = layer.keys.cpu(), layer.values.cpu()
        windows.append(int(layer.sliding_window) if getattr(layer, "is_sliding", False) else None)
    if entry.features is not None:
        tensors["features.hidden"] = entry.features.hidden.cpu()
        tensors["features.offsets"] = entry.features.offsets.clone()  # may share memory with the prompt's
    header = {"format": CONTEXT_CACHE_FORMAT, "model": entry.model, "model_id": entry.model_id, "key": entry.key,
              "text_key": entry.text_key, "windows": windows, "length": int(entry.cache.get_seq_length()),
              "prefill_s": entry.prefill_s, "created": entry.created, "context_text": entry.prompt.context_text,
              "features_prefill_s": None if entry.features is None else entry.features.prefill_s,
              "nbytes": entry.nbytes}
    save_artifact(stem, tensors, header)
    return header


def load_cached_context(stem: str | Path, device: str | None = None) -> CachedContext:
    """Read an entry written by :func:`save_cached_context` (raises on a missing, corrupt or foreign file)."""
    header, t = load_artifact(stem, CONTEXT_CACHE_FORMAT, what="cached context")
    n_layers = len(header["windows"])
    layers = [(t[f"keys.{i}"].to(device or "cpu"), t[f"values.{i}"].to(device or "cpu")) for i in range(n_layers)]
    cache = build_dynamic_cache(layers, header["windows"], header["length"])
    prompt = PromptSegments(t["prefix_ids"], t["context_ids"], t["suffix_ids"], t["context_offsets"],
                            header["context_text"])
    if prompt.prefix_ids.numel() + prompt.context_ids.numel() != header["length"]:
        raise ValueError(f"{stem}: cache length {header['length']} does not match its prompt")
    feats = None
    if "features.hidden" in t:
        feats = SenderFeatures(t["features.hidden"].to(device or "cpu"), t["features.offsets"],
                               header["features_prefill_s"], header["context_text"])
    return CachedContext(header["model"], header["key"], header["text_key"], prompt, cache, feats,
                         header["prefill_s"], header["created"], header.get("model_id", ""))


class KVCacheStore:
    """LRU store of :class:`CachedContext` under a byte bound (see the module docstring)."""

    def __init__(self, max_bytes: int = 2 << 30, persist_dir: str | Path | None = None,
                 persist_max_bytes: int = 8 << 30, device: str | None = None):
        if max_bytes <= 0 or persist_max_bytes <= 0:
            raise ValueError(f"store bounds must be positive, got {max_bytes} and {persist_max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[str, CachedContext] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._lock = threading.RLock()
        self.evictions = 0
        self.rejected = 0
        self.persist_dir = Path(persist_dir).expanduser() if persist_dir else None
        self.persist_max_bytes = int(persist_max_bytes)
        self._disk: dict[str, dict] = {}  # key -> header of a persisted entry
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future] = []
        self.loaded_from_disk = 0
        self.device = device  # where caches read back from disk are placed (the models' device)
        if self.persist_dir is not None:
            self.persist_dir.mkdir(parents=True, exist_ok=True)
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cachecert-store")
            self._scan()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, key: str) -> CachedContext | None:
        """The entry under an exact-reuse key (marked most recently used; read from disk when persisted and
        not in memory), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry
            return self._from_disk(key)

    def holders(self, text: str, exclude_model: str | None = None) -> list[CachedContext]:
        """Entries of other models holding the same context text (most recent first) that kept features."""
        with self._lock:
            for key, h in list(self._disk.items()):
                if (key not in self._entries and h["text_key"] == text and h["model"] != exclude_model
                        and h.get("features_prefill_s") is not None):
                    self._from_disk(key)
            found = [e for e in reversed(self._entries.values())
                     if e.text_key == text and e.model != exclude_model and e.features is not None]
            for e in found:
                self._entries.move_to_end(e.key)
            return found

    def models_without_features(self, text: str, exclude_model: str | None = None) -> list[str]:
        """Models (sorted) holding the same context text, in memory or on disk, whose entries kept no sender
        features: they were prefilled while no route had them as its sender, so no transfer can read them."""
        with self._lock:
            found = {e.model for e in self._entries.values()
                     if e.text_key == text and e.model != exclude_model and e.features is None}
            found |= {h["model"] for key, h in self._disk.items()
                      if key not in self._entries and h["text_key"] == text and h["model"] != exclude_model
                      and h.get("features_prefill_s") is None}
            return sorted(found)

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
            self._insert(entry, size)
            if self._writer is not None and entry.key not in self._disk:
                self._disk[entry.key] = {"key": entry.key, "model": entry.model, "text_key": entry.text_key,
                                         "nbytes": size, "features_prefill_s": None if entry.features is None
                                         else entry.features.prefill_s, "pending": True}
                self._pending = [f for f in self._pending if not f.done()]
                self._pending.append(self._writer.submit(self._persist, entry))
            return True

    def _insert(self, entry: CachedContext, size: int) -> None:
        """Evict least-recently-used entries until ``size`` more bytes fit, then insert (lock held; the entry
        alone fits the bound)."""
        while self._entries and sum(self._sizes.values()) + size > self.max_bytes:
            old_key, old = self._entries.popitem(last=False)
            del self._sizes[old_key]
            self.evictions += 1
            logger.info("store full: evicted %s's cache of %d context tokens", old.model, old.context_tokens)
        self._entries[entry.key] = entry
        self._sizes[entry.key] = size

    def discard(self, key: str) -> None:
        """Forget one entry (memory tier and disk index; a persisted file stays until a new entry of that key
        replaces it), e.g. one that failed to serve."""
        with self._lock:
            self._entries.pop(key, None)
            self._sizes.pop(key, None)
            self._disk.pop(key, None)

    def clear(self) -> None:
        """Empty the memory tier (persisted files stay)."""
        with self._lock:
            self._entries.clear()
            self._sizes.clear()

    # ------------------------------------------------------------------ the disk tier
    def _stem(self, key: str) -> Path:
        assert self.persist_dir is not None
        return self.persist_dir / key

    def _scan(self) -> None:
        for js in sorted(self.persist_dir.glob("*.json")):
            try:
                header = read_artifact_header(js.with_suffix(""))
                if header.get("format") != CONTEXT_CACHE_FORMAT or js.stem != header.get("key"):
                    continue
                missing = [k for k in ("model", "text_key", "windows", "length") if k not in header]
                if missing:
                    raise ValueError(f"its header lacks {', '.join(missing)}")
                if not artifact_paths(js.with_suffix(""))[0].exists():
                    raise FileNotFoundError("its tensors file is missing")
            except Exception as exc:  # fail safe: an unreadable file is skipped, never deleted
                logger.warning("skipping %s in the persisted cache store: %s", js, exc)
                continue
            self._disk[header["key"]] = header
        if self._disk:
            logger.info("persisted cache store %s: %d contexts", self.persist_dir, len(self._disk))

    def _from_disk(self, key: str) -> CachedContext | None:
        header = self._disk.get(key)
        if header is None or header.get("pending"):
            return None
        try:
            entry = load_cached_context(self._stem(key), device=self.device)
            os.utime(artifact_paths(self._stem(key))[0])  # most recently used on disk too
        except Exception as exc:  # fail safe: a corrupt file means a prefill, said once, the file left alone
            logger.warning("cannot read persisted cache %s (%s); it is ignored", self._stem(key), exc)
            del self._disk[key]
            return None
        self.loaded_from_disk += 1
        size = entry.nbytes
        if size <= self.max_bytes:
            self._insert(entry, size)
        return entry

    def _persist(self, entry: CachedContext) -> None:
        try:
            header = save_cached_context(entry, self._stem(entry.key))
            with self._lock:
                self._disk[entry.key] = header
            self._bound_disk()
        except Exception:  # a failed write loses only the persisted copy; serving is unaffected
            logger.exception("could not persist the cache of %s", entry.model)
            with self._lock:
                self._disk.pop(entry.key, None)

    def _bound_disk(self) -> None:
        """Delete least recently used persisted entries (files this store wrote) beyond the disk bound."""
        with self._lock:
            files = []
            for key, h in self._disk.items():
                st = artifact_paths(self._stem(key))[0]
                if not h.get("pending") and st.exists():
                    files.append((st.stat().st_mtime, key, st.stat().st_size))
            total = sum(size for _, _, size in files)
            for _, key, size in sorted(files):
                if total <= self.persist_max_bytes:
                    break
                for path in artifact_paths(self._stem(key)):
                    path.unlink(missing_ok=True)
                del self._disk[key]
                total -= size
                logger.info("persisted cache store over %.1f MB: removed %s", self.persist_max_bytes / 1e6, key)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for pending disk writes."""
        with self._lock:
            pending, self._pending = self._pending, []
        concurrent.futures.wait(pending, timeout=timeout)

    def close(self) -> None:
        """Finish pending disk writes and stop the writer; later entries are kept in memory only."""
        self.flush()
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)
