"""How a split transfer's stream error reaches the layers the receiver recomputes (the CTI's split model).

A split transfer at ``s`` feeds the receiver a mapped residual stream entering layer ``s``; the receiver then
computes layers ``>= s`` itself. Their keys/values are exact *given* that input, so their error is the stream's
error carried through the receiver's own layers. The first-order split model (docs/cti.md) charged every
recomputed layer the stream's relative error unchanged; measured retention says the receiver's layers shrink it
(every measured pair keeps more from a split than from pure KV, which that model did not predict).

This module measures the propagation instead of assuming it, from the pair's statistics and the receiver alone
(no mapper is fitted and the sender never runs). Per calibration context and split ``s``:

1. the receiver prefills ``prefix + context`` (its exact keys/values ``y_l`` and stream ``h_s``);
2. the stream entering ``s`` is replaced by ``h_s + e`` with ``e ~ N(0, Sres_H)`` independently per token, where
   ``Sres_H`` is the Schur residual of the stream target ``hidden:s`` in the pair's statistics (the error of the
   best linear map from the sender's features, :func:`cachecert_agents.cti.index.schur_residual`);
3. the receiver recomputes layers ``>= s`` over the context from it, and the errors ``y'_l - y_l`` of their
   pre-RoPE keys/values are accumulated as an uncentred second moment ``E_l`` ``[2 Hk d, 2 Hk d]`` per token.

:func:`cachecert_agents.cti.index.compute_cti` uses ``E_l`` in place of the residual ``Sres`` of layer ``l >= s``
in the same first-order deviation formula as the mapped layers. Gaussian noise with the residual's covariance is
the linear model's error only to second order (real errors are correlated across tokens); docs/cti.md states
this assumption.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from tqdm.auto import tqdm

from cachecert_agents.kv.rope import apply_rope, rope_tables
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.transfer.apply import MappedLayer, replaced_layers
from cachecert_agents.transfer.features import ReceiverTargets, flatten_kv, receiver_targets, unflatten_kv


def gaussian_sampler(cov: torch.Tensor) -> torch.Tensor:
    """A factor ``F`` ``[D, D]`` with ``F F^T = cov`` (eigen-decomposition, negative eigenvalues clipped to 0), so
    ``z @ F.T`` for ``z ~ N(0, I)`` ``[n, D]`` has covariance ``cov``."""
    w, v = torch.linalg.eigh((cov + cov.T) / 2)
    return v * w.clamp(min=0).sqrt()


@torch.inference_mode()
def propagated_error_moments(receiver: ModelHandle, contexts: Iterable[tuple[str, str]],
                             stream_residuals: dict[int, torch.Tensor], seed: int = 0, progress: bool = True,
                             total: int | None = None, clean: Iterable[ReceiverTargets] | None = None
                             ) -> tuple[dict[int, dict[int, torch.Tensor]], int, float]:
    """``(moments, n_tokens, seconds)`` with ``moments[s][l]`` ``[2 Hk d, 2 Hk d]`` (float64, per context token)
    the second moment of the pre-RoPE key/value error at receiver layer ``l >= s`` when the stream entering
    ``s`` carries Gaussian noise of covariance ``stream_residuals[s]`` ``[hidden, hidden]`` (see the module
    docstring). One clean and one perturbed receiver prefill per context and split; ``clean``, when given, holds
    the clean prefills' targets of the same contexts (e.g. from the statistics pass, which computed them already:
    they need the stream at every split), so only the perturbed ones run."""
    geo = receiver.geometry
    splits = sorted(s for s in stream_residuals if 0 < s < geo.num_layers)
    if not splits:
        raise ValueError(f"no split layer in (0, {geo.num_layers}) among {sorted(stream_residuals)}")
    factors = {s: gaussian_sampler(stream_residuals[s].double()) for s in splits}
    width = 2 * geo.num_kv_heads * geo.head_dim
    moments = {s: {layer: torch.zeros(width, width, dtype=torch.float64) for layer in range(s, geo.num_layers)}
               for s in splits}
    gen = torch.Generator().manual_seed(seed)
    n_tokens = 0
    t0 = time.perf_counter()
    clean_targets = iter(clean) if clean is not None else None
    for context, instruction in tqdm(contexts, desc=f"propagation {receiver.name}", unit="ctx",
                                     disable=not progress, total=total):
        prompt = receiver.format_prompt(context, instruction)
        start, end = prompt.context_span
        truth = next(clean_targets) if clean_targets is not None else receiver_targets(receiver, prompt, splits)
        positions = torch.arange(start, end)
        n = end - start
        if truth.kv[0].shape[0] != n or any(s not in truth.hidden for s in splits):
            raise ValueError("the clean targets given do not match the contexts (token count or split layers)")
        for s in splits:
            noise = torch.randn(n, factors[s].shape[0], generator=gen, dtype=torch.float64) @ factors[s].T
            # float64 stays on the CPU (MPS has none); the receiver reads the stream in its own dtype
            stream = (truth.hidden[s].double() + noise).to(receiver.device, receiver.model.dtype)[None]
            stubs = {}
            for layer in range(s):  # exact keys/values below the split: only the recomputed layers are measured
                k, v = unflatten_kv(truth.kv[layer].to(receiver.device), geo.num_kv_heads, geo.head_dim)
                cos, sin = rope_tables(geo.rope_for_layer(layer), positions.to(k.device))
                stubs[layer] = MappedLayer(layer, apply_rope(k, cos, sin), v, stream if layer == s - 1 else None)
            cache = receiver.prefill(prompt.prefix_ids).cache
            with receiver.capture_qk(layers=list(range(s, geo.num_layers)), queries=False, keys=True,
                                     values=True) as cap, replaced_layers(receiver.model, stubs):
                receiver.forward(prompt.context_ids, cache, logits_to_keep=1)
            for layer in range(s, geo.num_layers):
                perturbed = flatten_kv(cap.key(layer), cap.value(layer))  # [n, 2 Hk d]
                err = perturbed.cpu().double() - truth.kv[layer].double()
                moments[s][layer] += err.T @ err
        n_tokens += n
    if n_tokens == 0:
        raise ValueError("no calibration contexts given")
    return ({s: {layer: m / n_tokens for layer, m in per.items()} for s, per in moments.items()}, n_tokens,
            time.perf_counter() - t0)
