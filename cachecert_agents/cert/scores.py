"""Per-request risk scores of a transferred cache, computed without a full prefill (DESIGN.md sections 4-5).

A score is a number where larger means riskier; a certificate accepts a transfer when ``score <= lambda``.
Every score here comes from one *scoring pass*: the receiver processes the request's suffix over the
transferred cache (it must do so anyway to answer), with its pre-RoPE queries and attention weights recorded.
The pass's last logits seed decoding (:meth:`ModelHandle.decode`), so scoring adds only the recording cost.

Scores (:data:`SCORES`):

- ``geometry``: the first-order output deviation of DESIGN.md section 4 evaluated on *this request's* queries
  and attention, per mapped layer ``l < s`` (keys/values predicted by the mapper)::

      D_l = mean_{h,i} c_ih [ q_ih^T Sbar_K q_ih / d * S_v  +  tr(G_h Sres_V) ] / E_l,   c_ih = sum_j a_ijh^2

  (``c_ih``: how concentrated the attention of query i, head h is on the context; both the key error, through
  the logits, and the value error reach the output weighted by it) with ``Sbar_K`` the mapper's key residual
  covariance averaged over RoPE rotations (each rotary frequency's
  two channels pooled, cross terms dropped), ``Sres_V`` the value residual covariance, ``G_h = W_O,h^T W_O,h``,
  ``S_v = tr(G Cov(v))`` the value spread and ``E_l = tr(G E[v v^T])`` the output energy. For a split transfer
  (``s < L``) the mapped residual stream at ``s`` adds ``relres_s * sum_j abar_j lev_j / dof_s``: the map's
  relative residual times the leverage of the sender's features (how far from the calibration distribution,
  ``lev_j = (x_j - mu)^T (Cxx + lam I)^-1 (x_j - mu)``, normalised by its calibration mean ``dof``) weighted by
  the attention ``abar_j`` the suffix pays to context token j in layers ``>= s``. The kv part is weighted by
  ``s / L`` and the stream part by ``1 - s / L``. The weights only change the score's power: the conformal
  guarantee holds for any score. Context tokens the receiver recomputed (selective recompute, ``+rP``) hold its
  own keys/values, so they carry no error: both sums run over the mapped tokens only (since v3).
- ``entropy``: entropy (nats) of the receiver's first-token distribution.
- ``margin``: ``1 - (p_top1 - p_top2)`` of that distribution.
- ``constant``: 0 for every request (a certificate then accepts all or nothing).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from cachecert_agents.kv.segment import context_attention
from cachecert_agents.models.handle import ForwardOutput, ModelHandle
from cachecert_agents.transfer.features import SenderFeatures
from cachecert_agents.transfer.mappers import RidgeMapper
from cachecert_agents.transfer.statistics import PairStatistics

SCORES = ("geometry", "entropy", "margin", "constant")
SCORE_VERSION = 3  # bump when a score's definition changes: labels and certificates of another version are refused
# v3 = v2 except the geometry score of a transfer repaired by selective recompute (v3: recomputed tokens carry no
# mapping error); so v2 scores of any other transfer, and v2 entropy/margin/constant, are still current.


def version_is_current(version: int | None, repaired: bool, score: str | None = None) -> bool:
    """Whether scores of definition ``version`` computed on a transfer that was (``repaired``) or was not repaired by
    selective recompute equal this library's, for ``score`` (None: every score, as a record holds them all). The
    one rule behind :func:`scores_are_current`, :func:`definition_is_current` and cert.json's stale rows."""
    return version == SCORE_VERSION or (version == 2 and not (repaired and score in (None, "geometry")))


def scores_are_current(record: dict) -> bool:
    """Whether a labelled request's recorded ``risk`` scores are this library's (:func:`version_is_current`; the
    record's transfer was repaired when it recomputed tokens, ``recomputed_tokens`` > 0)."""
    return version_is_current(record.get("risk", {}).get("version"), bool(record.get("recomputed_tokens")))


def definition_is_current(definition: str, score: str, repaired: bool) -> bool:
    """Whether a certificate's recorded ``definition`` (:func:`score_definition` of some version) of ``score`` is
    this library's on a transfer that is (``repaired``) or is not repaired (:func:`version_is_current`)."""
    prefix = f"cachecert_agents.cert.scores:{score}/v"
    version = definition[len(prefix):]
    return definition.startswith(prefix) and version.isdigit() and version_is_current(int(version), repaired, score)


def score_definition(score: str) -> str:
    """The identifier of a score's definition, recorded in labelled requests' certificates."""
    return f"cachecert_agents.cert.scores:{score}/v{SCORE_VERSION}"


def residual_covariance(stats: PairStatistics, name: str, w: torch.Tensor) -> torch.Tensor:
    """``[D, D]`` covariance of ``y - (x W + b)`` over the calibration tokens (float64), for the mapper's own
    ``W`` ``[F, D]`` and the intercept that centres it: ``Cyy - Cyx W - W^T Cxy + W^T Cxx W``."""
    _, _, cxx, cxy, cyy = stats.centred(name)
    w = w.double()
    cross = cxy.T @ w
    return cyy - cross - cross.T + w.T @ (cxx @ w)


def rotation_averaged_diagonal(cov: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """``[..., d]`` diagonal of a per-head covariance ``[..., d, d]`` averaged over RoPE rotations: channel i and
    ``i + rotary_dim/2`` share their mean variance (transformers' ``rotate_half`` pairing); the rest pass."""
    diag = torch.diagonal(cov, dim1=-2, dim2=-1).clone()
    half = rotary_dim // 2
    pooled = (diag[..., :half] + diag[..., half:rotary_dim]) / 2
    diag[..., :half], diag[..., half:rotary_dim] = pooled, pooled
    return diag


def kv_error_terms(res: torch.Tensor, cyy: torch.Tensor, mean_y: torch.Tensor, w_o: torch.Tensor, heads: int,
                   kv_heads: int, head_dim: int, rotary_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-head parts of DESIGN.md section 4 for one layer, from a residual covariance ``res`` and target
    moments ``cyy`` ``[2 Hk d, 2 Hk d]`` (keys then values, head-major), ``mean_y`` ``[2 Hk d]`` and the output
    projection ``w_o`` ``[hidden, H d]`` (float64). Returns ``key_var`` ``[Hk, d]`` (rotation-averaged key
    residual variance), and per query head ``[H]``: ``value_err = tr(G_h Sres_V)``, ``spread = tr(G_h Cov(v))``,
    ``energy = tr(G_h E[v v^T])`` with ``G_h = W_O,h^T W_O,h``."""
    half = kv_heads * head_dim
    group = heads // kv_heads

    def blocks(m: torch.Tensor) -> torch.Tensor:  # [Hk, d, d] diagonal blocks, one per KV head
        return torch.stack([m[g * head_dim:(g + 1) * head_dim, g * head_dim:(g + 1) * head_dim]
                            for g in range(kv_heads)])

    key_var = rotation_averaged_diagonal(blocks(res[:half, :half]), rotary_dim)
    res_v, cov_v = blocks(res[half:, half:]), blocks(cyy[half:, half:])
    mv = mean_y[half:].reshape(kv_heads, head_dim)
    value_err, spread, energy = [], [], []
    for h in range(heads):
        g = h // group
        w_h = w_o[:, h * head_dim:(h + 1) * head_dim]
        gram = w_h.T @ w_h
        value_err.append(torch.trace(gram @ res_v[g]))
        spread.append(torch.trace(gram @ cov_v[g]))
        energy.append(torch.trace(gram @ (cov_v[g] + torch.outer(mv[g], mv[g]))))
    return key_var, torch.stack(value_err), torch.stack(spread), torch.stack(energy)


def entropy_score(logits: torch.Tensor) -> float:
    """Entropy (nats) of ``softmax(logits)``, ``logits`` ``[vocab]``."""
    logp = torch.log_softmax(logits.detach().cpu().double(), -1)  # float64 on the CPU (MPS has none)
    return float(-(logp.exp() * logp).sum())


def margin_score(logits: torch.Tensor) -> float:
    """``1 - (p1 - p2)`` for the two most likely tokens: 0 = certain, 1 = a tie."""
    top = torch.softmax(logits.detach().cpu().double(), -1).topk(2).values
    return float(1 - (top[0] - top[1]))


@dataclass
class LayerGeometry:
    """Per mapped receiver layer: ``key_var`` ``[kv_heads, d]`` rotation-averaged key residual variance,
    ``value_err`` ``[heads]`` ``tr(G_h Sres_V)``, ``spread`` and ``energy`` (scalars, means over heads)."""

    key_var: torch.Tensor
    value_err: torch.Tensor
    spread: float
    energy: float


@dataclass
class StreamGeometry:
    """The residual-stream map at a split: relative residual, ``mean`` ``[F]`` and ``precision`` ``[F, F]`` of
    the (ridge-regularised) feature covariance, ``dof`` = the calibration mean of the leverage."""

    relres: float
    mean: torch.Tensor
    precision: torch.Tensor
    dof: float
    sender_layers: list[int]


class RiskScorer:
    """Scores transfers of one pair (receiver, mapper) from the pair's calibration statistics; see the module
    docstring. Build with :meth:`from_statistics`, then call :meth:`scoring_pass` per request."""

    def __init__(self, receiver: ModelHandle, layers: dict[int, LayerGeometry], streams: dict[int, StreamGeometry]):
        self.receiver, self.layers, self.streams = receiver, layers, streams

    @classmethod
    def from_statistics(cls, receiver: ModelHandle, mapper: RidgeMapper, stats: PairStatistics) -> "RiskScorer":
        geo = receiver.geometry
        kvh, hd, heads = geo.num_kv_heads, geo.head_dim, geo.num_heads
        layers: dict[int, LayerGeometry] = {}
        attn = receiver._attention_modules()
        for layer in range(geo.num_layers):
            name = f"kv:{layer}"
            if name not in mapper.weights or name not in stats.targets:
                continue
            res = residual_covariance(stats, name, mapper.weights[name])
            _, my, _, _, cyy = stats.centred(name)
            key_var, value_err, spread, energy = kv_error_terms(
                res, cyy, my, attn[layer].o_proj.weight.detach().double().cpu(), heads, kvh, hd,
                geo.rope_for_layer(layer).rotary_dim)
            layers[layer] = LayerGeometry(key_var.float(), value_err.float(), float(spread.mean()),
                                          float(energy.mean()))
        streams: dict[int, StreamGeometry] = {}
        for name in mapper.weights:
            if not name.startswith("hidden:") or name not in stats.targets:
                continue
            s = int(name.split(":")[1])
            mx, _, cxx, _, cyy = stats.centred(name)
            res = residual_covariance(stats, name, mapper.weights[name])
            rho = float(mapper.header["targets"][name].get("rho", 1e-2))
            lam = rho * torch.trace(cxx) / cxx.shape[0]
            precision = torch.linalg.inv(cxx + lam * torch.eye(cxx.shape[0], dtype=cxx.dtype))
            streams[s] = StreamGeometry(float(torch.trace(res) / torch.trace(cyy)), mx.float(), precision.float(),
                                        float(torch.trace(precision @ cxx)), mapper.sender_layers(name))
        return cls(receiver, layers, streams)

    @torch.inference_mode()
    def scoring_pass(self, cache: Any, suffix_ids: torch.Tensor, context_span: tuple[int, int], split: int,
                     features: SenderFeatures | None = None, geometry: bool = True,
                     exact: torch.Tensor | None = None) -> tuple[dict[str, float], ForwardOutput, dict]:
        """Process ``suffix_ids`` ``[m]`` over the transferred ``cache`` (updated in place) and score it.

        ``geometry=False`` skips the geometry score (no attention weights or queries are recorded, so the pass
        is a plain one: what an ``entropy``/``margin``/``constant`` certificate needs).

        ``features`` are the sender's features already on the receiver's context tokens (needed for the
        stream term when ``0 < split < L``). ``exact`` (``[r]`` context offsets, e.g. a transfer's
        ``recomputed_index``) are tokens whose keys/values are the receiver's own: they carry no mapping error, so
        the attention the suffix pays them adds nothing to the geometry score.

        Returns ``(scores, forward output, timings)``: ``pass_s`` is the whole recorded suffix pass (a plain pass
        is needed anyway to answer), ``score_s`` the score arithmetic after it. The forward output's last logits
        seed :meth:`ModelHandle.decode`.
        """
        mapped = [layer for layer in range(split) if layer in self.layers]
        t_pass = time.perf_counter()
        capture = (self.receiver.capture_qk(layers=mapped, queries=True, keys=False) if geometry
                   else contextlib.nullcontext())
        with capture as cap:
            out = self.receiver.forward(suffix_ids, cache, output_attentions=geometry, logits_to_keep=1)
        t0 = time.perf_counter()
        scores = {"entropy": entropy_score(out.logits[-1]), "margin": margin_score(out.logits[-1]),
                  "constant": 0.0}
        if geometry:
            total = context_span[1] + int(suffix_ids.numel())  # the cache held prefix + context before the pass
            scores["geometry"] = self._geometry(cap, out.attentions, mapped, split, context_span, total, features,
                                                exact)
        scores["version"] = SCORE_VERSION
        return scores, out, {"pass_s": t0 - t_pass, "score_s": time.perf_counter() - t0}

    def _geometry(self, cap: Any, attentions: tuple[torch.Tensor, ...], mapped: list[int], split: int,
                  context_span: tuple[int, int], total: int, features: SenderFeatures | None,
                  exact: torch.Tensor | None = None) -> float:
        """The geometry score from the suffix pass's recorded queries (``cap``) and attention weights
        (``attentions[l]`` ``[heads, m, k_l]`` over the ``k_l`` most recent of ``total`` positions); context tokens
        ``exact`` (offsets) count as error-free."""
        geo = self.receiver.geometry
        L = geo.num_layers
        group = geo.num_heads // geo.num_kv_heads
        mapped_tokens = None  # [n_context]: 1 = mapped, 0 = exact (the receiver's own keys/values); None: all mapped
        if exact is not None and exact.numel():
            mapped_tokens = torch.ones(context_span[1] - context_span[0], device=attentions[0].device)
            mapped_tokens[exact.to(mapped_tokens.device).long()] = 0.0
        kv_terms = []
        for layer in mapped:
            g = self.layers[layer]
            q = cap.query(layer)[0].float()  # [heads, m, d]
            key_var = g.key_var.repeat_interleave(group, 0)[:, None, :]  # [heads, 1, d]
            key_err = ((q * q) * key_var).sum(-1) / geo.head_dim  # [heads, m]: E[ds^2] per query
            a = context_attention(attentions[layer], context_span, total).float()  # [heads, m, n_context]
            if mapped_tokens is not None:
                a = a * mapped_tokens
            concentration = (a * a).sum(-1)  # [heads, m]
            per_query = concentration * (key_err * g.spread + g.value_err[:, None])
            kv_terms.append(float(per_query.mean()) / max(g.energy, 1e-12))
        score = (split / L) * (sum(kv_terms) / len(kv_terms)) if kv_terms else 0.0
        if 0 < split < L and split in self.streams and features is not None:
            st = self.streams[split]
            x = features.select(st.sender_layers).float().cpu() - st.mean  # [n_context, F]
            lev = ((x @ st.precision) * x).sum(-1) / st.dof  # [n_context]
            if mapped_tokens is not None:
                lev = lev * mapped_tokens.cpu()
            abar = torch.stack([context_attention(a, context_span, total).float().mean((0, 1))
                                for a in attentions[split:]]).mean(0)
            score += (1 - split / L) * st.relres * float((abar.cpu() * lev).sum())
        return score
