"""Token alignment between two tokenizations of the same text, by character spans.

For each receiver token, the sender tokens whose character spans overlap it, with the overlap in characters as
weight. Same offsets give the identity. Vectorised with binary search over span boundaries (no Python loop over
tokens). Zero-width tokens (BOS, special tokens) overlap nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TokenAlignment:
    """Sparse receiver x sender overlap matrix in CSR form.

    ``indptr`` ``[n_receiver + 1]``, ``indices`` ``[nnz]`` (sender token index), ``overlap`` ``[nnz]`` (shared
    characters). Receiver token r overlaps sender tokens ``indices[indptr[r]:indptr[r+1]]``.
    """

    indptr: np.ndarray
    indices: np.ndarray
    overlap: np.ndarray
    n_receiver: int
    n_sender: int
    receiver_chars: np.ndarray  # [n_receiver] span length in characters

    @property
    def is_identity(self) -> bool:
        return (self.n_receiver == self.n_sender and np.array_equal(self.indptr, np.arange(self.n_receiver + 1))
                and np.array_equal(self.indices, np.arange(self.n_receiver)))

    def senders_of(self, r: int) -> np.ndarray:
        return self.indices[self.indptr[r]:self.indptr[r + 1]]

    def coverage(self) -> dict[str, float]:
        """How well the receiver's tokens are covered by the sender's.

        ``covered_fraction``: receiver tokens (with characters) overlapping at least one sender token;
        ``char_coverage``: fraction of receiver characters inside some sender token;
        ``mean_senders_per_receiver``; ``one_to_one_fraction``: receiver tokens matched by exactly one sender
        token with identical span.
        """
        counts = np.diff(self.indptr)
        has_chars = self.receiver_chars > 0
        n = max(int(has_chars.sum()), 1)
        covered = np.zeros(self.n_receiver)  # characters of each receiver token inside its sender tokens
        np.add.at(covered, np.repeat(np.arange(self.n_receiver), counts), self.overlap)
        nonempty = counts > 0
        exact = nonempty & (counts == 1) & (covered == self.receiver_chars)
        return {
            "covered_fraction": float((nonempty & has_chars).sum() / n),
            "char_coverage": float(covered[has_chars].sum() / max(self.receiver_chars[has_chars].sum(), 1)),
            "mean_senders_per_receiver": float(counts[has_chars].mean()) if has_chars.any() else 0.0,
            "one_to_one_fraction": float((exact & has_chars).sum() / n),
        }

    def _pool_weights(self) -> tuple[np.ndarray, np.ndarray]:
        rows = np.repeat(np.arange(self.n_receiver), np.diff(self.indptr))
        weights = self.overlap.astype(np.float64)
        sums = np.zeros(self.n_receiver)
        np.add.at(sums, rows, weights)
        return rows, weights / np.where(sums[rows] > 0, sums[rows], 1.0)

    def pool(self, sender_values: torch.Tensor) -> torch.Tensor:
        """``[n_sender, d]`` -> ``[n_receiver, d]``: each receiver row averages its overlapping sender rows
        (weights by shared characters); a gather and scatter-add, O(nnz * d)."""
        rows, weights = self._pool_weights()
        device, dtype = sender_values.device, sender_values.dtype
        gathered = sender_values[torch.from_numpy(self.indices).to(device)]
        gathered = gathered * torch.from_numpy(weights).to(device=device, dtype=dtype)[:, None]
        out = torch.zeros(self.n_receiver, sender_values.shape[1], dtype=dtype, device=device)
        return out.index_add_(0, torch.from_numpy(rows).to(device), gathered)

    def pooling_matrix(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense ``[n_receiver, n_sender]`` matrix whose rows average overlapping sender tokens (weights by
        overlapping characters, rows sum to 1; rows of uncovered receiver tokens are zero)."""
        rows, weights = self._pool_weights()
        out = torch.zeros(self.n_receiver, self.n_sender, dtype=dtype)
        out[torch.from_numpy(rows), torch.from_numpy(self.indices)] = torch.from_numpy(weights).to(dtype)
        return out


def align_tokens(receiver_offsets: np.ndarray | torch.Tensor | list, sender_offsets: np.ndarray | torch.Tensor | list
                 ) -> TokenAlignment:
    """Align receiver tokens to sender tokens of the same text by character spans.

    Offsets are ``[n, 2]`` (start, end) character spans, as from a fast tokenizer's ``return_offsets_mapping``,
    in increasing order. Returns the CSR overlap structure; identical offsets give the identity.
    """
    r = _as_spans(receiver_offsets, "receiver")
    s = _as_spans(sender_offsets, "sender")
    s_valid = s[:, 1] > s[:, 0]
    s_idx = np.nonzero(s_valid)[0]
    s_start, s_end = s[s_valid, 0], s[s_valid, 1]
    # Sender spans of a tokenizer may overlap slightly (byte-level pieces of one character); make the end array
    # monotone for the binary search, then filter exact overlaps below.
    s_end_mono = np.maximum.accumulate(s_end) if s_end.size else s_end
    lo = np.searchsorted(s_end_mono, r[:, 0], side="right")
    hi = np.searchsorted(s_start, r[:, 1], side="left")
    r_valid = r[:, 1] > r[:, 0]
    lo = np.where(r_valid, lo, 0)
    hi = np.where(r_valid, np.maximum(hi, lo), 0)
    counts = hi - lo
    rows = np.repeat(np.arange(len(r)), counts)
    starts = np.repeat(lo, counts)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    cand = starts + within
    overlap = (np.minimum(r[rows, 1], s_end[cand]) - np.maximum(r[rows, 0], s_start[cand])).astype(np.int64)
    keep = overlap > 0
    rows, cand, overlap = rows[keep], cand[keep], overlap[keep]
    indptr = np.zeros(len(r) + 1, dtype=np.int64)
    np.add.at(indptr, rows + 1, 1)
    indptr = np.cumsum(indptr)
    return TokenAlignment(indptr, s_idx[cand].astype(np.int64), overlap, len(r), len(s),
                          (r[:, 1] - r[:, 0]).clip(min=0))


def _as_spans(offsets, who: str) -> np.ndarray:
    arr = offsets.cpu().numpy() if isinstance(offsets, torch.Tensor) else np.asarray(offsets)
    if arr.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{who} offsets must be [n, 2] character spans, got shape {arr.shape}")
    arr = arr.astype(np.int64)
    if np.any(np.diff(arr[arr[:, 1] > arr[:, 0], 0]) < 0):
        raise ValueError(f"{who} offsets must be in increasing order of start character")
    return arr
