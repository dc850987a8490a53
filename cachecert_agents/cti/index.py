"""The Cache Transferability Index (DESIGN.md section 4; derivation in docs/cti.md): a pair's predicted output
deviation under the best linear transfer, from second moments alone (no mapper trained, no generation run).

Inputs: the pair's :class:`PairStatistics` (sender features vs receiver pre-RoPE keys/values, and the residual
stream at split layers) and the receiver's :class:`QueryStatistics` (rotation-averaged query second moments and
attention concentration per layer and head, receiver-only: shared by every sender), plus the receiver's output
projections ``W_O``.

Per receiver layer ``l`` (heads h, KV head g(h), head dim d)::

    Sres            = Syy - Syx (Sxx + lam I)^-1 Sxy                 (Schur complement: best linear map's residual)
                      * (1 - dof/n)^-2                                 (GCV: its error on unseen tokens, by default)
    E[ds^2]_h       = sum_c qbar2_hc * sbar_res,K,g(h),c / d          (query-weighted key residual, RoPE-averaged)
    D_l             = mean_h conc_h * (E[ds^2]_h * S_v,h + tr(G_h Sres_V,g(h))) / mean_h E_h
    S_v,h = tr(G_h Cov(v_g(h))),  E_h = tr(G_h E[v v^T]),  G_h = W_O,h^T W_O,h,  conc_h = E_i[sum_j a_ij^2]

The index of a pure KV transfer is ``CTI = -log10(mean_l D_l)`` (higher = more transferable); the profile
``D_l`` and the worst layer are reported. For a split transfer at ``s`` the layers ``l < s`` keep their mapped
``D_l``; the layers ``l >= s`` are recomputed by the receiver from a mapped residual stream. Its error is measured
as layer ``s`` sees it, through its input norm gain and key/value projections ``P = [W_k; W_v] diag(g)`` (the
``1/rms`` factor cancels in the ratio): ``r_s = tr(P Sres_H P^T) / tr(P Syy_H P^T)`` (the raw stream's trace would
be dominated by a few massive dimensions the norm removes). To first order each key and value of the recomputed
layers inherits that relative error,
``Sres_l ~ r_s Cov(y_l)``, so they contribute ``r_s U_l`` with ``U_l`` the deviation ``D_l`` computed with
``Sres = Cov(y_l)`` (linear in ``Sres``): the *first-order* split model (``cti_first_order``). It over-charges the
recomputed layers, which shrink the error they are fed. When the measured propagation is given
(:mod:`cachecert_agents.cti.propagation`: the stream's Schur residual as Gaussian noise, carried through the
receiver's own layers on calibration text), layer ``l >= s`` contributes ``D_l`` computed with that measured
key/value error in place of ``Sres``. The split prediction is ``mean_l`` over all layers, on the same scale as
the pure-KV index.

Baselines on the same statistics: ``r2`` (calibration R^2 of the best linear map, pooled over K and V: error
magnitude only) and ``residual_fraction`` (unweighted ``tr(Sres) / tr(Syy)`` per layer, averaged), both
oriented so that higher means more transferable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from cachecert_agents.cert.scores import kv_error_terms, rotation_averaged_diagonal
from cachecert_agents.cti.queries import QueryStatistics
from cachecert_agents.transfer.statistics import PairStatistics


def schur_residual(stats: PairStatistics, name: str, rho: float = 1e-2
                   ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(Sres [D, D], Syy [D, D], dof)`` of target ``name``: the residual covariance of the best (ridge, relative
    ``rho``) linear map from the features, ``Syy - Syx (Sxx + lam I)^-1 Sxy`` with ``lam = rho tr(Sxx)/F``, and the
    map's effective degrees of freedom ``dof = tr(Sxx (Sxx + lam I)^-1) = F - lam tr((Sxx + lam I)^-1)``.

    ``Sres`` is the *calibration* (in-sample) residual; :func:`gcv_inflation` turns it into an estimate of the
    residual on unseen tokens."""
    _, _, cxx, cxy, cyy = stats.centred(name)
    f = cxx.shape[0]
    lam = rho * torch.trace(cxx) / f
    eye = torch.eye(f, dtype=cxx.dtype)
    chol = torch.linalg.cholesky(cxx + lam * eye)
    sol = torch.cholesky_solve(cxy, chol)
    res = cyy - cxy.T @ sol
    # tr((Sxx + lam I)^-1) = ||L^-1||_F^2: one triangular solve, not the full inverse
    dof = float(f - lam * torch.linalg.solve_triangular(chol, eye, upper=False).square().sum())
    return (res + res.T) / 2, cyy, dof


def gcv_inflation(dof: float, n_tokens: int) -> float:
    """``(1 - dof / n)^-2``: the generalised cross-validation factor (Craven & Wahba 1979; Golub, Heath & Wahba
    1979) by which a linear smoother's prediction error on new data exceeds its calibration residual. With
    ``dof`` comparable to ``n`` (a few thousand features fitted on a few thousand tokens) the calibration residual
    is badly optimistic, and by a different amount for every pair (their feature counts differ); the factor
    removes most of that, so an index from 4 calibration contexts matches one from 20 (docs/cti.md). Tokens of a
    context are not independent, so this is a first-order correction, not an exact one."""
    if not 0 <= dof < 0.9 * n_tokens:
        raise ValueError(f"{dof:.0f} effective features on {n_tokens} tokens: too few calibration tokens for "
                         f"this pair's features (give more calibration contexts)")
    return (1 - dof / n_tokens) ** -2


def index_residual(stats: PairStatistics, name: str, rho: float = 1e-2, gcv: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Sres, Syy, calibration Sres)`` of target ``name`` as the index reads it: the Schur residual
    (:func:`schur_residual`), inflated by :func:`gcv_inflation` when ``gcv``, next to the calibration one."""
    res, cyy, dof = schur_residual(stats, name, rho)
    return (res * gcv_inflation(dof, stats.n_tokens) if gcv else res), cyy, res


def stream_residuals(stats: PairStatistics, rho: float = 1e-2, gcv: bool = True) -> dict[int, torch.Tensor]:
    """``{s: Sres_H [hidden, hidden]}``: the residual (:func:`index_residual`) of every residual-stream target
    ``hidden:s`` in the statistics (what :mod:`cachecert_agents.cti.propagation` propagates through the
    receiver)."""
    return {int(name.split(":")[1]): index_residual(stats, name, rho, gcv)[0] for name in stats.targets
            if name.startswith("hidden:")}


@dataclass
class LayerTerms:
    """Per receiver layer: key term, value term, normaliser and deviation ``D``; plus the baselines' parts."""

    layer: int
    key_term: float
    value_term: float
    energy: float
    deviation: float
    residual_fraction: float
    unit_deviation: float = float("nan")  # D_l if the residual were the whole covariance of y_l


def layer_terms(layer: int, res: torch.Tensor, cyy: torch.Tensor, mean_y: torch.Tensor, q2: torch.Tensor,
                conc: torch.Tensor, w_o: torch.Tensor, kv_heads: int, head_dim: int, rotary_dim: int,
                scaling: float | None = None) -> LayerTerms:
    """The deviation of one layer from its residual ``res`` and moments ``cyy`` ``[2 Hk d, 2 Hk d]`` (keys then
    values, head-major), ``mean_y`` ``[2 Hk d]``, query moments ``q2`` ``[H, d]`` (uncentred, per channel),
    attention concentration ``conc`` ``[H]`` and ``w_o`` ``[hidden, H d]`` (all float64). ``scaling``: the
    layer's softmax scale (default ``head_dim ** -0.5``), squared in the key term."""
    heads = q2.shape[0]
    key_var, value_err, spread, energy_h = kv_error_terms(res, cyy, mean_y, w_o, heads, kv_heads, head_dim,
                                                          rotary_dim)
    q2bar = rotation_averaged_diagonal(torch.diag_embed(q2), rotary_dim)  # [H, d]
    key_var = key_var.repeat_interleave(heads // kv_heads, 0)  # [H, d]
    # E[ds^2] with the layer's softmax scale (1/sqrt(head_dim) in the four embedded models: Gemma 3's
    # query_pre_attn_scalar equals head_dim)
    scale2 = 1.0 / head_dim if scaling is None else float(scaling) ** 2
    key_terms = ((q2bar * key_var).sum(-1) * scale2).tolist()
    value_terms, spreads, energies = value_err.tolist(), spread.tolist(), energy_h.tolist()
    c = conc.tolist()
    energy = sum(energies) / heads
    dev = sum(c[h] * (key_terms[h] * spreads[h] + value_terms[h]) for h in range(heads)) / heads / max(energy, 1e-30)
    return LayerTerms(layer, sum(key_terms) / heads, sum(c[h] * value_terms[h] for h in range(heads)) / heads,
                      energy, dev, float(torch.trace(res) / torch.trace(cyy)))


def _stream_relres_seen_by_layer(receiver: Any, s: int, res: torch.Tensor, cyy: torch.Tensor) -> float:
    """``tr(P res P^T) / tr(P cyy P^T)`` with ``P = [W_k; W_v] diag(g)`` of receiver layer ``s`` (float64)."""
    base = getattr(receiver.model, receiver.model.base_model_prefix, receiver.model)
    layer = base.layers[s]
    gain = layer.input_layernorm.weight.detach().double().cpu()
    if "Gemma" in type(layer.input_layernorm).__name__:  # Gemma's RMSNorm scales by (1 + weight)
        gain = 1 + gain
    p = torch.cat([layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight]).detach().double().cpu() * gain
    return float(torch.sum(p * (p @ res)) / torch.sum(p * (p @ cyy)))


def _index(deviation: float, what: str) -> float:
    """``-log10`` of a predicted deviation: the index (higher = more transferable). ``ValueError`` naming
    ``what`` unless the deviation is a finite positive number (NaN/inf or all-zero statistics would otherwise give
    a NaN or an unbounded, 'perfectly transferable' index)."""
    if not (math.isfinite(deviation) and deviation > 0):
        raise ValueError(f"{what} is {deviation!r}, not a finite positive number: the index would be undefined or "
                         "unbounded (statistics or query moments holding NaN/inf, or all zero: recollect them)")
    return -math.log10(deviation)


def compute_cti(stats: PairStatistics, queries: QueryStatistics, receiver: Any, rho: float = 1e-2,
                propagated: dict[int, dict[int, torch.Tensor]] | None = None, gcv: bool = True) -> dict[str, Any]:
    """The index, its per-layer profile, split-layer predictions and the baselines for one pair (see the module
    docstring). ``receiver`` is the receiver's :class:`ModelHandle` (geometry and ``W_O``).

    ``propagated[s][l]`` ``[2 Hk d, 2 Hk d]``, when given for a split ``s``, is the measured key/value error of
    recomputed layer ``l >= s`` (:func:`cachecert_agents.cti.propagation.propagated_error_moments`); it replaces
    the first-order charge ``r_s U_l`` there (which is still reported, as ``cti_first_order``).

    ``gcv``: every residual (keys/values and stream) is inflated by :func:`gcv_inflation`, an estimate of the
    map's error on unseen tokens instead of on its calibration tokens; the index, the split predictions and the
    residual-fraction baseline use it, while the ``r2`` baseline stays the calibration R^2 it is defined as. The
    propagation moments must come from :func:`stream_residuals` with the same setting."""
    geo = receiver.geometry
    attn = receiver._attention_modules()
    layers: list[LayerTerms] = []
    layer_args: dict[int, tuple] = {}
    cyys: dict[int, torch.Tensor] = {}
    r2_num = r2_den = 0.0
    missing = [layer for layer in range(geo.num_layers) if f"kv:{layer}" not in stats.targets]
    if stats.header.get("anchor") is not None or missing:
        raise ValueError("the index needs statistics of the default mapper: sender features only, every receiver "
                         f"layer's keys/values (anchor {stats.header.get('anchor')}, missing layers {missing})")
    for layer in range(geo.num_layers):
        name = f"kv:{layer}"
        res, cyy, calibration_res = index_residual(stats, name, rho, gcv)
        mean_y = stats.targets[name].sum_y / stats.n_tokens
        args = (mean_y, queries.q2[layer].double(), queries.conc[layer].double(),
                attn[layer].o_proj.weight.detach().double().cpu(), geo.num_kv_heads, geo.head_dim,
                geo.rope_for_layer(layer).rotary_dim, float(getattr(attn[layer], "scaling", geo.head_dim ** -0.5)))
        layer_args[layer], cyys[layer] = args, cyy
        terms = layer_terms(layer, res, cyy, *args)
        terms.unit_deviation = layer_terms(layer, cyy, cyy, *args).deviation
        layers.append(terms)
        r2_num += float(torch.trace(calibration_res))
        r2_den += float(torch.trace(cyy))
    bad = [t.layer for t in layers if not (math.isfinite(t.deviation) and t.deviation >= 0)]
    if bad:
        raise ValueError(f"the predicted deviation of receiver layer(s) {bad} is not a finite non-negative number: "
                         "the statistics or query moments hold NaN/inf (recollect them)")
    devs = [t.deviation for t in layers]
    mean_dev = sum(devs) / len(devs)
    cti = _index(mean_dev, "the mean predicted deviation over layers")
    worst = max(layers, key=lambda t: t.deviation)
    L = geo.num_layers
    splits = {}
    for name in stats.targets:
        if name.startswith("hidden:"):
            s = int(name.split(":")[1])
            res, cyy, _ = index_residual(stats, name, rho, gcv)
            raw_relres = float(torch.trace(res) / torch.trace(cyy))
            relres = _stream_relres_seen_by_layer(receiver, s, res, cyy) if s < L else raw_relres
            first_order = sum(t.deviation if t.layer < s else relres * t.unit_deviation for t in layers) / len(layers)
            frac = sum(t.residual_fraction if t.layer < s else relres for t in layers) / len(layers)
            first_cti = _index(first_order, f"the split-{s} prediction")
            splits[s] = {"predicted_deviation": first_order, "cti": first_cti, "cti_first_order": first_cti,
                         "stream_relres": relres, "stream_relres_raw": raw_relres, "residual_fraction": 1 - frac,
                         "propagated": False}
            measured = (propagated or {}).get(s)
            if measured:
                recomputed = {t.layer: layer_terms(t.layer, measured[t.layer].double(), cyys[t.layer],
                                                   *layer_args[t.layer]) for t in layers if t.layer >= s}
                pred = sum(t.deviation if t.layer < s else recomputed[t.layer].deviation for t in layers) / len(layers)
                splits[s].update(predicted_deviation=pred, cti=_index(pred, f"the propagated split-{s} prediction"),
                                 propagated=True,
                                 recomputed_relres=sum(r.residual_fraction for r in recomputed.values())
                                 / len(recomputed),
                                 recomputed_profile=[{"layer": r.layer, "deviation": r.deviation,
                                                      "residual_fraction": r.residual_fraction}
                                                     for r in recomputed.values()])
    splits[L] = {"predicted_deviation": mean_dev, "cti": cti,
                 "residual_fraction": 1 - sum(t.residual_fraction for t in layers) / len(layers)}
    return {
        "sender": stats.header.get("sender"), "receiver": stats.header.get("receiver"),
        "statistics_workload": stats.header.get("workload"), "n_tokens": stats.n_tokens,
        "query_tokens": queries.n_tokens, "rho": rho, "gcv": gcv,
        "cti": cti, "mean_deviation": mean_dev,
        "worst_layer": worst.layer, "worst_deviation": worst.deviation,
        "profile": [{"layer": t.layer, "deviation": t.deviation, "key_term": t.key_term,
                     "value_term": t.value_term, "residual_fraction": t.residual_fraction,
                     "unit_deviation": t.unit_deviation} for t in layers],
        "splits": {str(k): v for k, v in sorted(splits.items())},
        "baselines": {"r2": 1 - r2_num / r2_den,
                      "residual_fraction": 1 - sum(t.residual_fraction for t in layers) / len(layers)},
    }
