"""Receiver-only statistics for the CTI: query second moments and attention concentration per layer and head.

Over calibration contexts, the receiver prefills ``prefix + context`` with its pre-RoPE queries and keys recorded
(:meth:`ModelHandle.capture_qk`). Per layer ``l`` and head ``h``:

- ``q2[l]`` ``[H, d]``: uncentred mean of ``q_c^2`` per channel over context tokens (the RoPE rotation average is
  taken when the index is computed, by pooling each frequency's two channels);
- ``conc[l]`` ``[H]``: mean over sampled query positions ``i`` of ``sum_{j in context} a_ij^2``, the attention
  weights recomputed from the recorded queries and keys with the layer's RoPE, scaling, causal mask and sliding
  window (the concentration of attention on context tokens: how strongly one token's error reaches the output).

They depend on the receiver alone, so one pass serves every sender. Saved as safetensors + JSON header.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from tqdm.auto import tqdm

from cachecert_agents import __version__
from cachecert_agents.artifacts import load_artifact, save_artifact
from cachecert_agents.kv.rope import apply_rope, rope_tables
from cachecert_agents.models.handle import ModelHandle, QKCapture

FORMAT = "cachecert-query-statistics/1"


@dataclass
class QueryStatistics:
    """``q2[l]`` ``[H, d]`` and ``conc[l]`` ``[H]`` per receiver layer (float64), ``n_tokens`` context tokens."""

    header: dict
    q2: list[torch.Tensor]
    conc: list[torch.Tensor]
    n_tokens: int

    def save(self, path: str | Path) -> Path:
        tensors = {f"q2/{i}": t for i, t in enumerate(self.q2)} | {f"conc/{i}": t for i, t in enumerate(self.conc)}
        return save_artifact(path, tensors, dict(self.header, n_tokens=self.n_tokens, layers=len(self.q2)))

    @classmethod
    def load(cls, path: str | Path, expect: dict | None = None) -> "QueryStatistics":
        header, t = load_artifact(path, FORMAT, expect, "query statistics")
        n = int(header["layers"])
        return cls(header, [t[f"q2/{i}"] for i in range(n)], [t[f"conc/{i}"] for i in range(n)],
                   int(header["n_tokens"]))


def context_attention(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                      ctx: tuple[int, int], scaling: float, window: int | None) -> torch.Tensor:
    """``[H, m, n_ctx]`` float64: the attention weights ``a_ij`` of the query rows ``rows`` ``[m]`` on the context
    tokens ``ctx = [start, end)``, normalised over every allowed key (causal, and ``window`` on sliding layers);
    ``q`` ``[H, n, d]`` and ``k`` ``[Hk, n, d]`` with RoPE applied, grouped-query heads expanded."""
    heads, kv_heads = q.shape[0], k.shape[0]
    kk = k.repeat_interleave(heads // kv_heads, 0)  # [H, n, d]
    logits = torch.einsum("hmd,hnd->hmn", q[:, rows].double(), kk.double()) * scaling
    j = positions[None, :]
    i = positions[rows][:, None]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    logits = logits.masked_fill(~allowed[None], float("-inf"))
    return torch.softmax(logits, dim=-1)[:, :, ctx[0]:ctx[1]]


def attention_concentration(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                            ctx: tuple[int, int], scaling: float, window: int | None) -> torch.Tensor:
    """``[H]``: mean over query rows of ``sum_{j in ctx} a_ij^2`` (:func:`context_attention`'s arguments)."""
    a = context_attention(q, k, positions, rows, ctx, scaling, window)
    return (a * a).sum(-1).mean(-1)


class QueryAccumulator:
    """Running sums of :class:`QueryStatistics` over calibration contexts, one :meth:`add` per context."""

    def __init__(self, receiver: ModelHandle, sample_queries: int = 32) -> None:
        geo = receiver.geometry
        self.receiver, self.sample_queries = receiver, sample_queries
        self.q2 = [torch.zeros(geo.num_heads, geo.head_dim, dtype=torch.float64) for _ in range(geo.num_layers)]
        self.conc = [torch.zeros(geo.num_heads, dtype=torch.float64) for _ in range(geo.num_layers)]
        self.n_tokens = self.n_contexts = 0

    def add(self, capture: QKCapture, start: int, end: int) -> None:
        """One context: ``capture`` holds the pre-RoPE queries and keys of the tokens ``[0, end)`` (template prefix
        included; tokens after ``end``, e.g. the suffix and a continuation the prefill also read, are ignored),
        the context being ``[start, end)``."""
        geo = self.receiver.geometry
        attn = self.receiver._attention_modules()
        positions = torch.arange(end)
        rows = torch.linspace(start, end - 1, min(self.sample_queries, end - start)).round().long().unique()
        for layer in range(geo.num_layers):
            # [H, end, d], [Hk, end, d]; float64 on the CPU, wherever the receiver runs (MPS has no float64)
            q, k = capture.query(layer)[0, :, :end].cpu().double(), capture.key(layer)[0, :, :end].cpu().double()
            self.q2[layer] += (q[:, start:end] ** 2).sum(1).cpu()
            cos, sin = rope_tables(geo.rope_for_layer(layer), positions.to(q.device))
            window = geo.sliding_window if layer in geo.sliding_layers else None
            self.conc[layer] += attention_concentration(apply_rope(q, cos, sin), apply_rope(k, cos, sin), positions,
                                                        rows, (start, end), float(attn[layer].scaling),
                                                        window).cpu()
        self.n_tokens += end - start
        self.n_contexts += 1

    def result(self, workload: str = "") -> QueryStatistics:
        if self.n_contexts == 0:
            raise ValueError("no calibration contexts given")
        geo = self.receiver.geometry
        header = {"format": FORMAT, "version": __version__, "receiver": self.receiver.name,
                  "receiver_kv": geo.kv_fingerprint(), "workload": workload, "n_contexts": self.n_contexts,
                  "sample_queries": self.sample_queries}
        return QueryStatistics(header, [t / self.n_tokens for t in self.q2], [c / self.n_contexts for c in self.conc],
                               self.n_tokens)


@torch.inference_mode()
def collect_query_statistics(receiver: ModelHandle, contexts: Iterable[tuple[str, str]], workload: str = "",
                             sample_queries: int = 32, progress: bool = True, total: int | None = None
                             ) -> QueryStatistics:
    """One receiver prefill per ``(context, instruction)``; see the module docstring. (The CTI's single pass,
    :func:`cachecert_agents.cti.single_pass.cti_inputs`, takes the same sums from the statistics pass instead.)"""
    acc = QueryAccumulator(receiver, sample_queries)
    for context, instruction in tqdm(contexts, desc=f"queries {receiver.name}", unit="ctx", disable=not progress,
                                     total=total):
        prompt = receiver.format_prompt(context, instruction)
        start, end = prompt.context_span
        with receiver.capture_qk(queries=True, keys=True) as cap:
            receiver.forward(prompt.input_ids[:end], logits_to_keep=1)
        acc.add(cap, start, end)
    return acc.result(workload)
